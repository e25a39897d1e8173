"""Shared-lock edges driven through the scripts.

Nobody passes a writer in line, ended leases read as free, and the
exclusive-only paths need no command beyond the earlier ACL rules.
"""

from __future__ import annotations

import json
import uuid

import pytest
import redis

from django_redis_mutex import Mutex, held_locks, scripts
from django_redis_mutex.keys import LockKeys

TTL = 60_000
OWNER = json.dumps({"label": "edge"})


@pytest.fixture
def rc(redis_url: str):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def keys(mutex_prefix: str) -> LockKeys:
    return LockKeys.for_name(f"tests:{mutex_prefix}", "edge-" + uuid.uuid4().hex[:8])


def acquire(rc, keys, token, join):
    script = scripts.ACQUIRE_SHARED if token.startswith("s") else scripts.ACQUIRE
    return scripts.run(rc, script, keys.with_wake(token), [token, TTL, OWNER, int(join)])


def granted(reply) -> bool:
    return not isinstance(reply, list) or reply[0] == 1


def test_new_reader_does_not_pass_a_queued_writer_after_an_exclusive_lease_ends(rc, keys):
    """E holds; s1 then X queue; E dies (lease ends). A reader arriving now must not
    get in ahead of the queued writer X (nor of s1, who is never granted by it)."""
    e, s1, x, late = (
        uuid.uuid4().hex,
        "s" + uuid.uuid4().hex,
        uuid.uuid4().hex,
        "s" + uuid.uuid4().hex,
    )
    assert granted(acquire(rc, keys, e, True))
    assert not granted(acquire(rc, keys, s1, True))
    assert not granted(acquire(rc, keys, x, True))
    rc.delete(keys.lock)  # E's lease ended (a dead holder): nobody released, nobody was woken
    reply = acquire(rc, keys, late, False)  # a newcomer reader, try-once
    queue = rc.zrange(keys.queue, 0, -1)
    assert not granted(reply), (
        f"newcomer reader admitted ahead of queued writer {x}; queue still {queue}, "
        f"lock fields {sorted(rc.hgetall(keys.lock))}"
    )
    # The reader first in line went in, and is named for the caller to wake.
    assert rc.hexists(keys.lock, f"r:{s1}")
    assert reply[3] == s1
    assert queue == [x]


def test_queued_reader_behind_a_writer_does_not_pass_it(rc, keys):
    """Queue [s1, X, s2] on a lock whose exclusive holder's lease ended: s2's check-in
    must not grant s2 ahead of X (X is ahead of s2 in the FIFO line)."""
    e, s1, x, s2 = (
        uuid.uuid4().hex,
        "s" + uuid.uuid4().hex,
        uuid.uuid4().hex,
        "s" + uuid.uuid4().hex,
    )
    assert granted(acquire(rc, keys, e, True))
    for token in (s1, x, s2):
        assert not granted(acquire(rc, keys, token, True))
    rc.delete(keys.lock)  # E died
    reply = acquire(rc, keys, s2, True)  # s2 checks in before s1 does
    assert not granted(reply), (
        f"s2 granted ahead of writer {x}; s1 still waiting: {rc.zrange(keys.queue, 0, -1)}"
    )
    assert rc.hexists(keys.lock, f"r:{s1}")
    assert rc.zrange(keys.queue, 0, -1) == [x, s2]


def test_a_lock_reads_free_once_its_last_reader_lease_ended(rc, keys):
    """R1 and R2 hold shared; R2 releases while R1 is alive (the hash keeps R2's longer
    TTL); then R1 dies and its lease ends. Every script treats the lock as free, and so
    must held_locks(), locked() and owner(), though the hash lives on until its TTL."""
    name = keys.lock.split("{", 1)[1].rsplit("}", 1)[0]
    r1 = Mutex(name, shared=True, watchdog=False)
    assert r1.acquire()
    r2 = Mutex(name, shared=True, watchdog=False, timeout=None)
    assert r2.acquire()
    r2.release()
    [field] = [f for f in rc.hgetall(keys.lock) if f.startswith("r:")]
    record = rc.hget(keys.lock, field)
    rc.hset(keys.lock, field, "1|" + record.split("|", 1)[1])  # R1 died: its lease end is past
    assert not [lock for lock in held_locks() if lock.name == name]
    assert (Mutex(name).locked(), Mutex(name).owner()) == (False, None), (
        f"pttl {rc.pttl(keys.lock)} ms left on a hash with no live holder"
    )


def test_an_exclusive_only_check_in_runs_under_the_earlier_acl_rules():
    """A deployment that never takes a lock shared keeps working with the ACL rules it
    was given before shared locks existed (no +hgetall) for taking and waiting: E holds,
    X queues, E's lease ends, and X's check-in (ACQUIRE) reads no lock record it
    does not need."""
    from django_redis_mutex.testing import RedisServer, lock_acl_rules

    with RedisServer() as server:
        admin = redis.Redis(port=server.port, decode_responses=True)
        rules = [r for r in lock_acl_rules("acl:*") if r != "+hgetall"]
        admin.execute_command("ACL", "SETUSER", "old", "reset", "on", ">pw", *rules)
        user = redis.Redis(port=server.port, username="old", password="pw", decode_responses=True)
        keys = LockKeys.for_name("acl", "plain")
        e, x = uuid.uuid4().hex, uuid.uuid4().hex
        assert granted(acquire(user, keys, e, True))
        assert not granted(acquire(user, keys, x, True))
        admin.delete(keys.lock)  # E's lease ended
        try:
            assert granted(acquire(user, keys, x, True))
        finally:
            user.close()
            admin.close()
