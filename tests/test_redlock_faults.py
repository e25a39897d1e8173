"""Quorum (Redlock) locks over three independent masters, under faults.

A quorum lock is held when two of the three masters granted it. These tests
take masters away (SIGKILL), give them back empty (a restart without
persistence), and "clog" them the way redsync's suite does: another owner's
lock already sits at the lock key on some masters. One dead or clogged master
must not matter; two must make acquisition fail clearly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from django_redis_mutex import (
    LockBackendUnavailable,
    LockContended,
    LockLost,
    Mutex,
    Owner,
    mutex,
)
from django_redis_mutex.client import namespace
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisServer

from .helpers import wait_until
from .topologies import (
    LOADED_QUORUM_TIMEOUT,
    SectionWorkers,
    extra_caches,
    master_entries,
    redis_servers,
)

ALIASES = ["q1", "q2", "q3"]
FOREIGN_OWNER = {"host": "elsewhere", "pid": 4242, "thread": "MainThread", "label": "foreign"}


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(ALIASES)) as servers:
        yield servers


@pytest.fixture
def quorum(masters: list[RedisServer], mutex_prefix: str) -> Iterator[list[RedisServer]]:
    """Three master aliases q1..q3 in this test's namespace; dead masters are revived after."""
    entries = master_entries(
        masters, ALIASES, mutex_prefix, TIMEOUT=2, QUORUM_TIMEOUT=LOADED_QUORUM_TIMEOUT
    )
    with extra_caches(entries):
        yield masters
    for server in masters:
        if server.process is None:
            server.start()


def raw_clients(masters: list[RedisServer]) -> list[redis.Redis]:
    return [redis.Redis(port=server.port, socket_timeout=2) for server in masters]


def lock_key(name: str) -> str:
    return LockKeys.for_name(namespace(ALIASES[0]), name).lock


def tokens_at(masters: list[RedisServer], name: str) -> list[str | None]:
    """Return the token stored at the lock key on each live master (None: no lock there)."""
    found: list[str | None] = []
    for server, client in zip(masters, raw_clients(masters), strict=True):
        try:
            if server.process is None:
                found.append(None)
                continue
            token = client.hget(lock_key(name), "token")
            found.append(token.decode() if isinstance(token, bytes) else token)
        finally:
            client.close()
    return found


# Another quorum owner's token ("q..."), whose lock is left on some masters (as
# when its release had not reached them).
FOREIGN = "qforeign-token"


def clog(masters: list[RedisServer], which: tuple[int, ...], name: str) -> None:
    """Put another quorum owner's lock (a full hash, 10 s lease) at the lock key on ``which``."""
    key = lock_key(name)
    for index in which:
        client = redis.Redis(port=masters[index].port)
        try:
            client.hset(
                key,
                mapping={
                    "token": FOREIGN,
                    "fence": "7",
                    "owner": json.dumps(FOREIGN_OWNER),
                    "acquired": str(int(time.time() * 1000)),
                    "name": name,
                },
            )
            client.pexpire(key, 10_000)
        finally:
            client.close()


# -- many processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_processes_exclude_each_other_on_a_quorum(
    quorum: list[RedisServer], raw: redis.Redis, mutex_prefix: str
) -> None:
    caches = master_entries(quorum, ALIASES, mutex_prefix)
    workers = SectionWorkers(
        raw, caches, ALIASES, workers=2, threads=3, names=2, iterations=25, hold=0.002
    )
    try:
        workers.start()
        history = workers.finish()
    finally:
        workers.close()

    assert len(history) == 2 * 3 * 25
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert history.lost() == []


@pytest.mark.slow
def test_processes_keep_excluding_when_a_master_is_killed_mid_run(
    quorum: list[RedisServer], raw: redis.Redis, mutex_prefix: str
) -> None:
    caches = master_entries(quorum, ALIASES, mutex_prefix)
    workers = SectionWorkers(raw, caches, ALIASES, workers=2, threads=3, names=2, hold=0.002)
    try:
        workers.start()
        wait_until(lambda: workers.counted() >= 30, 30, "30 sections before the kill")
        quorum[1].kill()
        after_kill = workers.counted()
        wait_until(
            lambda: workers.counted() >= after_kill + 30, 30, "30 sections with one master dead"
        )
        workers.stop()
        history = workers.finish()
    finally:
        workers.close()

    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert history.lost() == []


# -- masters down ------------------------------------------------------------------------------


def test_one_master_killed_still_excludes_and_hands_over(quorum: list[RedisServer]) -> None:
    quorum[0].kill()
    holder = Mutex("inventory", using=ALIASES)
    assert holder.acquire()
    assert not Mutex("inventory", using=ALIASES, reentrant=False).acquire(blocking=False)
    first_fence = holder.fence or 0

    holder.release()

    second = Mutex("inventory", using=ALIASES, reentrant=False)
    assert second.acquire(blocking=False)
    assert (second.fence or 0) > first_fence
    second.release()


def test_two_masters_killed_is_a_clear_backend_unavailable(quorum: list[RedisServer]) -> None:
    quorum[0].kill()
    quorum[2].kill()
    ran = False

    with pytest.raises(LockBackendUnavailable) as caught, mutex("payments", using=ALIASES):
        ran = True

    assert not ran
    assert caught.value.name == "payments"
    assert "quorum lock 'payments'" in str(caught.value)
    assert "2 of 3 Redis masters are unavailable" in str(caught.value)
    # The one master that granted its part was asked to give it back.
    assert tokens_at(quorum, "payments") == [None, None, None]


def test_two_masters_killed_is_backend_unavailable_for_async_too(
    quorum: list[RedisServer],
) -> None:
    quorum[1].kill()
    quorum[2].kill()

    async def main() -> None:
        async with mutex("payments", using=ALIASES):
            pass

    with pytest.raises(LockBackendUnavailable, match="2 of 3 Redis masters"):
        asyncio.run(main())
    assert tokens_at(quorum, "payments") == [None, None, None]


def test_master_restarted_empty_under_a_held_lock_lets_no_second_owner_in(
    quorum: list[RedisServer],
) -> None:
    with mutex("inventory", using=ALIASES) as holder:
        quorum[0].restart()  # no persistence: it forgot the lock
        intruder = Mutex("inventory", using=ALIASES, reentrant=False)

        assert not intruder.acquire(blocking=False)
        # Its grant on the forgetful master was undone; the holder still has a majority.
        assert tokens_at(quorum, "inventory") == [None, holder.token, holder.token]
        assert holder.owned()


# -- clogged masters ---------------------------------------------------------------------------


@pytest.mark.parametrize("clogged", [(0,), (1,), (2,)], ids=lambda c: f"clogged{c}")
def test_one_clogged_master_does_not_stop_acquisition(
    quorum: list[RedisServer], clogged: tuple[int, ...]
) -> None:
    clog(quorum, clogged, "clogged")

    with mutex("clogged", using=ALIASES, blocking=False) as lock:
        ours = lock.token
        held = tokens_at(quorum, "clogged")

    assert [t == FOREIGN for t in held] == [i in clogged for i in range(3)]
    assert held.count(ours) == 2
    # Releasing deletes only our own keys: the foreign lock is left alone.
    assert tokens_at(quorum, "clogged") == [FOREIGN if i in clogged else None for i in range(3)]


@pytest.mark.parametrize(
    "clogged", [(0, 1), (0, 2), (1, 2), (0, 1, 2)], ids=lambda c: f"clogged{c}"
)
def test_a_majority_of_clogged_masters_refuses_acquisition(
    quorum: list[RedisServer], clogged: tuple[int, ...]
) -> None:
    clog(quorum, clogged, "clogged")

    with pytest.raises(LockContended) as caught, mutex("clogged", using=ALIASES, blocking=False):
        pass

    assert caught.value.name == "clogged"
    assert caught.value.owner == Owner(**FOREIGN_OWNER)
    assert caught.value.retry_after >= 1
    # A grant on an unclogged master was undone.
    assert tokens_at(quorum, "clogged") == [FOREIGN if i in clogged else None for i in range(3)]


def test_a_majority_of_clogged_masters_times_out_a_blocking_acquire(
    quorum: list[RedisServer],
) -> None:
    clog(quorum, (0, 2), "clogged")
    started = time.monotonic()

    acquired = Mutex("clogged", using=ALIASES, timeout=0.3).acquire()

    assert acquired is False
    assert 0.3 <= time.monotonic() - started < 0.3 + 1.0


def test_one_master_clogged_with_a_foreign_string_does_not_stop_acquisition(
    quorum: list[RedisServer],
) -> None:
    # redsync and most Redlock clients store a lock as a plain string.
    client = redis.Redis(port=quorum[1].port)
    try:
        client.set(lock_key("clogged"), FOREIGN, px=10_000)
    finally:
        client.close()

    with mutex("clogged", using=ALIASES, blocking=False) as lock:
        assert tokens_at(quorum[::2], "clogged") == [lock.token, lock.token]


# -- extend, release and renewal with a master down --------------------------------------------


def test_extend_with_one_master_down_sets_the_lease_on_the_majority(
    quorum: list[RedisServer],
) -> None:
    lock = Mutex("long-job", using=ALIASES, ttl=2, watchdog=False)
    assert lock.acquire()
    quorum[2].kill()

    lock.extend(20)

    assert 18 < lock.time_left() <= 20
    assert lock.owned()
    lock.release()


def test_extend_with_two_masters_down_is_backend_unavailable(quorum: list[RedisServer]) -> None:
    lock = Mutex("long-job", using=ALIASES, watchdog=False)
    assert lock.acquire()
    quorum[0].kill()
    quorum[1].kill()

    with pytest.raises(LockBackendUnavailable, match="Cannot extend quorum lock 'long-job'"):
        lock.extend(20)


def test_release_with_one_master_down_frees_the_lock_at_once(quorum: list[RedisServer]) -> None:
    lock = Mutex("job", using=ALIASES)
    assert lock.acquire()
    quorum[1].kill()

    lock.release()

    assert tokens_at(quorum, "job") == [None, None, None]
    again = Mutex("job", using=ALIASES, reentrant=False)
    assert again.acquire(blocking=False)
    again.release()


def test_release_with_one_master_down_succeeds_for_a_lock_held_on_two_masters(
    quorum: list[RedisServer],
) -> None:
    # The lock lives on q1 and q2 only (q3 was held by another owner at the
    # time, as happens when the previous holder's release had not reached it).
    clog(quorum, (2,), "job")
    lock = Mutex("job", using=ALIASES)
    assert lock.acquire(blocking=False)
    quorum[1].kill()

    lock.release()  # q1 lets go and q2 is gone: no majority can hold it any more

    assert tokens_at(quorum, "job") == [None, None, FOREIGN]


def test_release_with_two_masters_down_is_backend_unavailable(quorum: list[RedisServer]) -> None:
    lock = Mutex("job", using=ALIASES)
    assert lock.acquire()
    quorum[0].kill()
    quorum[2].kill()

    with pytest.raises(LockBackendUnavailable, match="Cannot release quorum lock 'job'"):
        lock.release()


def test_async_extend_and_release_with_one_master_down(quorum: list[RedisServer]) -> None:
    async def main() -> tuple[float, bool]:
        lock = Mutex("async-job", using=ALIASES, ttl=2, watchdog=False)
        assert await lock.aacquire()
        quorum[0].kill()
        await lock.aextend(20)
        left = await lock.atime_left()
        await lock.arelease()
        return left, await Mutex("async-job", using=ALIASES).alocked()

    left, still_locked = asyncio.run(main())

    assert 18 < left <= 20
    assert still_locked is False


def test_watchdog_keeps_a_quorum_lock_with_one_master_down(quorum: list[RedisServer]) -> None:
    with mutex("renewed", using=ALIASES, ttl=0.8) as lock:
        quorum[1].kill()
        threading.Event().wait(2.4)  # three leases: only renewals on two masters keep it

        assert lock.owned() and not lock.lost
        assert not Mutex("renewed", using=ALIASES, reentrant=False).acquire(blocking=False)


def test_holder_is_told_when_a_majority_of_masters_forgets_its_lock(
    quorum: list[RedisServer],
) -> None:
    with (
        pytest.raises(LockLost, match="'forgotten'"),
        mutex("forgotten", using=ALIASES, ttl=0.6) as lock,
    ):
        quorum[0].restart()
        quorum[1].restart()
        wait_until(lambda: lock.lost, 5, "the watchdog to notice the lost majority")


# -- the QUORUM alias --------------------------------------------------------------------------


def test_options_next_to_quorum_apply_to_the_quorum_alias_locks(
    quorum: list[RedisServer], mutex_prefix: str
) -> None:
    locks_alias = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": quorum[0].url,
        "MUTEX": {"QUORUM": ALIASES, "PREFIX": mutex_prefix, "TTL": 7, "FAIL_OPEN": True},
    }
    with extra_caches({"locks": locks_alias}):
        lock = Mutex("report", using="locks")

        assert (lock.lease, lock.settings.fail_open) == (7, True)
