"""Handing a released lock to the next waiter, and waking it.

A release hands the lock to the first waiter inside its script, and wakes it
there when that waiter is the successor the holder expected; anyone else is
woken by a second step of the releasing client (``WAKE``). These tests drive
the steps of an acquisition or a release one at a time on a real Redis, so
they can stop a client between two steps, or let another client act there:

* a waiter that is handed the lock gets the successor it should expect;
* a wake-up lost with a releasing client that died after its release script
  costs the waiter one check-in, not the lock;
* a wake-up of a hand-over that lapsed before the waiter took a new place in
  line is never taken for a new one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from django_redis_mutex import Mutex, held_locks, scripts
from django_redis_mutex.acquisition import start
from django_redis_mutex.driver import Pop, Steps, _do, run_steps
from django_redis_mutex.keys import LockKeys

from .helpers import wait_until


def queued(raw: redis.Redis, name: str) -> list[str]:
    return [token.decode() for token in raw.zrange(Mutex(name).keys.queue, 0, -1)]


def drive_until(steps: Steps[Any], stop: type) -> Any:
    """Run ``steps`` against Redis up to their first op of type ``stop``, and return that op."""
    op = next(steps)
    while not isinstance(op, stop):
        op = steps.send(_do(op))
    return op


def test_a_waiter_handed_the_lock_knows_who_is_next(raw: redis.Redis) -> None:
    holder = Mutex("chain", timeout=10)
    assert holder.acquire()
    got: dict[str, Mutex] = {}

    def wait(label: str) -> None:
        lock = Mutex("chain", timeout=10)
        if lock.acquire():
            got[label] = lock

    first = threading.Thread(target=wait, args=("first",))
    first.start()
    wait_until(lambda: len(queued(raw, "chain")) == 1, 5, "the first waiter to queue")
    second = threading.Thread(target=wait, args=("second",))
    second.start()
    wait_until(lambda: len(queued(raw, "chain")) == 2, 5, "the second waiter to queue")
    second_token = queued(raw, "chain")[1]

    holder.release()
    first.join(5)

    lock = got["first"]
    hold = lock._current()
    assert hold is not None and hold.successor == second_token
    lock.release()  # wakes the expected successor inside the release script
    second.join(5)
    assert "second" in got
    got["second"].release()


def test_a_wake_up_lost_with_its_client_costs_the_waiter_one_check_in(raw: redis.Redis) -> None:
    holder = Mutex("lost-wake", timeout=10, watchdog=False)
    assert holder.acquire()
    took: list[float] = []

    def wait() -> None:
        lock = Mutex("lost-wake", timeout=10)
        if lock.acquire():
            took.append(time.monotonic())
            lock.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    (waiter_token,) = wait_until(lambda: queued(raw, "lost-wake"), 5, "the waiter to queue")
    hold = holder._current()
    assert hold is not None and hold.successor is None  # taken uncontended: nobody expected

    # The release script hands the lock over but cannot wake the waiter; the
    # client dies before the WAKE that would.
    steps = holder._where.release_steps(hold)
    release = next(steps)
    assert release.script is scripts.RELEASE
    answer = _do(release)
    assert answer[1] == waiter_token.encode()
    wake = steps.send(answer)
    assert wake.script is scripts.WAKE
    steps.close()
    died_at = time.monotonic()

    waiter.join(10)
    assert took, "the waiter never got the lock it had been handed"
    # One check-in (waiters check in every second) and a margin for a busy machine.
    assert took[0] - died_at < 2.0


def test_a_lapsed_hand_over_is_not_taken_for_a_new_one(raw: redis.Redis) -> None:
    holder = Mutex("lapsed", timeout=10, ttl=0.5, watchdog=False)
    assert holder.acquire()
    waiter = Mutex("lapsed", timeout=10, ttl=0.5, watchdog=False)
    attempt = start(waiter, True, 10)
    token = attempt.token
    steps = waiter._where.acquire_steps(attempt)
    pop = drive_until(steps, Pop)  # queued behind the holder, about to block
    check_in = steps.send(None)  # the wait ran out with nothing popped: a check-in is next
    assert isinstance(pop, Pop) and check_in.script is scripts.ACQUIRE

    # The waiter's process stops here. Meanwhile the lock is handed to it and
    # its wake-up pushed, the hand-over lapses unused, and another takes the lock.
    holder.release()
    assert raw.llen(waiter.keys.wake(token)) == 1
    raw.pexpire(waiter.keys.lock, 1)
    wait_until(lambda: not raw.exists(waiter.keys.lock), 5, "the hand-over to lapse")
    other = Mutex("lapsed", timeout=10)
    assert other.acquire(blocking=False)

    # The waiter resumes: its check-in is refused and puts it back in line...
    pop = steps.send(_do(check_in))
    assert isinstance(pop, Pop)
    # ...and what it pops then must not be the lapsed hand-over.
    assert _do(pop._replace(wait=0.2)) is None
    steps.close()
    run_steps(waiter._where.abandon_steps(token))
    other.release()


def test_only_an_attempts_first_place_in_line_skips_clearing_its_wake_up_list(
    raw: redis.Redis,
) -> None:
    """A new token cannot have been handed anything; every later place of it may have been."""
    lock = Mutex("first-place", timeout=10)
    attempt = start(lock, True, 10)
    assert lock._acquire_args(attempt, False)[3] == 0  # trying once joins no line
    assert lock._acquire_args(attempt, True)[3] == 2
    assert lock._acquire_args(attempt, True)[3] == 1
    assert lock._acquire_args(start(lock, True, 10), True)[3] == 2  # a new attempt, a new token

    # The script: a first place leaves the (impossible) list alone, a later new place clears it.
    keys = lock.keys
    assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("h1"), ["h1", 10_000, "{}", "0"])
    for joining, left in (("2", 1), ("1", 0)):
        raw.rpush(keys.wake("w1"), "stale")
        args = ["w1", 9_000, "{}", joining]
        assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("w1"), args)[0] == 0
        assert raw.llen(keys.wake("w1")) == left
        scripts.run(raw, scripts.CANCEL, keys.with_wake("w1"), ["w1"])
        raw.delete(keys.wake("w1"))


def server_us(raw: redis.Redis) -> int:
    seconds, micros = raw.time()
    return seconds * 1_000_000 + micros


def join_line(raw: redis.Redis, keys: LockKeys, token: str) -> Any:
    """Run ACQUIRE for ``token`` (its owner record is the token), waiting in line when refused."""
    return scripts.run(raw, scripts.ACQUIRE, keys.with_wake(token), [token, 9_000, token, "1"])


def test_a_hand_over_leaves_nothing_of_the_last_holders_record(raw: redis.Redis) -> None:
    """The next holder's record is written over the last one's: none of its fields survive."""
    keys = Mutex("overwritten").keys
    # The counter runs ahead of the clock, so the first holder's fence is not
    # the clock and its record also keeps when it was taken ('acquired').
    ahead = server_us(raw) + 300_000
    raw.set(keys.fence, ahead)
    first = scripts.run(raw, scripts.ACQUIRE, keys.with_wake("a1"), ["a1", 10_000, '{"n": 1}', "1"])
    assert int(first) == ahead + 1
    assert raw.hget(keys.lock, "acquired") is not None
    for token in ("b2", "c3"):
        refused = join_line(raw, keys, token)
        assert refused[0] == 0
    assert raw.hget(keys.lock, "queued") == b"1"
    wait_until(lambda: server_us(raw) > ahead + 2, 5, "the server clock to pass the counter")

    # Handed to b2, with c3 behind it: b2's fence is the clock, so no 'acquired'.
    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["a1"]) == b"b2"
    assert raw.hgetall(keys.lock).keys() == {b"token", b"fence", b"owner", b"queued"}
    assert raw.hmget(keys.lock, "token", "owner") == [b"b2", b"b2"]
    assert int(raw.hget(keys.lock, "fence")) > ahead + 1

    # Handed to c3, last in line: nobody is queued behind it any more.
    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["b2"]) == b"c3"
    assert raw.hgetall(keys.lock).keys() == {b"token", b"fence", b"owner"}
    assert raw.hmget(keys.lock, "token", "owner") == [b"c3", b"c3"]
    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["c3"]) == 1
    assert not raw.exists(keys.lock, keys.queue, keys.waiting)


def test_a_release_with_only_lapsed_waiters_frees_the_lock(raw: redis.Redis) -> None:
    """Waiters that stopped checking in are skipped, and the lock is deleted, not kept."""
    keys = Mutex("lapsed-line").keys
    assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("h1"), ["h1", 10_000, "h", "1"])
    for token in ("d1", "d2"):
        refused = join_line(raw, keys, token)
        assert refused[0] == 0
        _ends, terms = raw.hget(keys.waiting, token).split(b"|", 1)
        raw.hset(keys.waiting, token, b"1|" + terms)  # its place lapsed long ago

    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["h1"]) == 1
    assert not raw.exists(keys.lock)
    assert raw.zcard(keys.queue) == 0 and raw.hlen(keys.waiting) == 0


def test_listings_count_only_the_places_in_line_still_held(raw: redis.Redis) -> None:
    """A waiter that stopped renewing its place is not listed as waiting, though still in line."""
    keys = Mutex("counted-line").keys
    assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("h1"), ["h1", 10_000, "{}", "1"])
    for token in ("live1", "gone2", "live3"):
        assert join_line(raw, keys, token)[0] == 0
    record = raw.hget(keys.waiting, "gone2")
    assert record is not None
    raw.hset(keys.waiting, "gone2", b"1|" + record.split(b"|", 1)[1])  # lapsed long ago
    raw.zadd(keys.queue, {"older4": 4})
    raw.hset(keys.waiting, "older4", '60000|{"host": "older"}')  # an older version's: live
    raw.zadd(keys.queue, {"odd5": 5})
    raw.hset(keys.waiting, "odd5", "x|y|z")  # unreadable: skipped by the scripts too

    assert raw.zcard(keys.queue) == 5
    [listed] = held_locks()
    assert listed.waiters == 3


def test_a_waiter_queued_by_an_older_version_is_handed_the_lock(raw: redis.Redis) -> None:
    """An older version kept a waiter's lease apart and its record as "<ttl>|<owner>"."""
    keys = Mutex("older-waiter").keys
    assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("h1"), ["h1", 10_000, "h", "1"])
    raw.zadd(keys.queue, {"old1": 1})
    raw.hset(keys.waiting, "old1", '60000|{"host": "older", "label": "a|b"}')
    raw.hset(keys.lock, "queued", "1")
    assert join_line(raw, keys, "new2")[0] == 0

    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["h1"]) == b"old1"
    assert raw.hmget(keys.lock, "token", "owner") == [b"old1", b'{"host": "older", "label": "a|b"}']
    # Its hand-over lease is capped as any waiter's is.
    assert 0 < raw.pttl(keys.lock) <= scripts.HANDOFF_LEASE * 1000
    assert raw.zrange(keys.queue, 0, -1) == [b"new2"]


def test_a_lock_an_older_version_handed_to_a_new_waiter_still_names_its_owner(
    raw: redis.Redis,
) -> None:
    """An older release read a new waiter's "<lease end>|<ttl>|<owner>" as "<ttl>|<owner>"."""
    keys = Mutex("older-release").keys
    owner = '{"host": "newer", "pid": 7, "thread": "t", "label": "a|b"}'
    raw.hset(keys.lock, mapping={"token": "w1", "fence": 3, "owner": f"60000|{owner}"})
    raw.pexpire(keys.lock, 10_000)

    [listed] = held_locks()
    assert (listed.owner.host, listed.owner.pid, listed.owner.label) == ("newer", 7, "a|b")
    seen = Mutex("older-release").owner()
    assert seen is not None and seen.label == "a|b"


def test_an_unreadable_waiter_record_is_skipped(raw: redis.Redis) -> None:
    keys = Mutex("unreadable-waiter").keys
    assert scripts.run(raw, scripts.ACQUIRE, keys.with_wake("h1"), ["h1", 10_000, "h", "1"])
    raw.zadd(keys.queue, {"odd1": 1, "odd2": 2})
    raw.hset(keys.waiting, mapping={"odd1": "no separator", "odd2": "x|y|z"})
    raw.hset(keys.lock, "queued", "1")
    assert join_line(raw, keys, "new3")[0] == 0

    assert scripts.run(raw, scripts.RELEASE, keys.script_keys, ["h1"]) == b"new3"
    assert raw.zrange(keys.queue, 0, -1) == []
