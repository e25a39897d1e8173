"""Locks through Redis Sentinel (django-redis's SentinelClient), across a real failover.

The group is one master, two replicas and three sentinels, all real
redis-server processes (the sentinels run with ``--sentinel``); a failover is
real too: the master is SIGKILLed and the sentinels promote a replica after
``down-after-milliseconds`` (1 s here). Replication is asynchronous, so what a
failover does to a lock held at that moment depends on whether the lock's
write reached the promoted replica; the tests below show both outcomes, and
that fencing tokens keep their order either way.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import pytest
import redis

from django_redis_mutex import (
    LockBackendUnavailable,
    LockDeadlock,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
)
from django_redis_mutex.testing import RedisServer

from .helpers import await_until, wait_until
from .holders import Holders
from .topologies import SectionWorkers, SentinelGroup, extra_caches
from .worker import Worker

ALIAS = "sentinel"


@pytest.fixture(scope="module")
def steady_group() -> Iterator[SentinelGroup]:
    """A Sentinel group the tests of this module never fail over.

    Its sentinels wait 5 s before calling the master down, so a busy machine
    cannot set off a failover by accident.
    """
    with SentinelGroup(down_after_ms=5000) as group:
        yield group


@pytest.fixture
def steady(steady_group: SentinelGroup, mutex_prefix: str) -> Iterator[SentinelGroup]:
    with extra_caches({ALIAS: steady_group.cache_entry(mutex_prefix)}):
        yield steady_group


@pytest.fixture
def group(mutex_prefix: str) -> Iterator[SentinelGroup]:
    """A fresh Sentinel group of this test's own, to fail over."""
    with SentinelGroup() as fresh, extra_caches({ALIAS: fresh.cache_entry(mutex_prefix)}):
        yield fresh


def token_on(port: int, key: str) -> str | None:
    """Return the lock token stored at ``key`` on the node at ``port`` (None: not there)."""
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        token = client.hget(key, "token")
    finally:
        client.close()
    return token.decode() if isinstance(token, bytes) else token


def queued_on(port: int, key: str) -> int:
    """Return how many waiters the queue at ``key`` holds on the node at ``port``."""
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return int(client.zcard(key))
    finally:
        client.close()


def fence_on(port: int, key: str) -> int:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return int(client.get(key) or 0)
    finally:
        client.close()


# -- a steady group ----------------------------------------------------------------------------


def test_sentinel_alias_locks_on_the_master_and_replicates(steady: SentinelGroup) -> None:
    with mutex("inventory", using=ALIAS) as lock:
        ours = lock.token
        on_master = token_on(steady.master.port, lock.keys.lock)
        wait_until(
            lambda: all(token_on(r.port, lock.keys.lock) == ours for r in steady.replica_servers()),
            10,
            "the lock to reach both replicas",
        )
        refused = not Mutex("inventory", using=ALIAS, reentrant=False).acquire(blocking=False)
        listed = [h.name for h in held_locks(using=ALIAS)]

    assert on_master == ours
    assert refused
    assert listed == ["inventory"]


def test_async_sentinel_lock_excludes_and_hands_over(steady: SentinelGroup) -> None:
    async def main() -> tuple[bool, bool, int, int]:
        holder = Mutex("async-job", using=ALIAS)
        assert await holder.aacquire()
        on_master = token_on(steady.master.port, holder.keys.lock) == holder.token
        refused = not await Mutex("async-job", using=ALIAS, reentrant=False).aacquire(
            blocking=False
        )

        async def wait_for_it() -> int:
            async with mutex("async-job", using=ALIAS, timeout=10) as waiter:
                return waiter.fence or 0

        waiting = asyncio.create_task(wait_for_it())
        await await_until(
            lambda: any(h.waiters for h in held_locks(using=ALIAS)), 5, "the waiter to queue"
        )
        first_fence = holder.fence or 0
        await holder.arelease()
        handed_fence = await asyncio.wait_for(waiting, 10)
        return on_master, refused, first_fence, handed_fence

    on_master, refused, first_fence, handed_fence = asyncio.run(main())

    assert on_master
    assert refused
    assert handed_fence > first_fence


def test_a_cycle_of_waits_through_sentinel_ends_the_younger_wait_only(
    steady_group: SentinelGroup, mutex_prefix: str
) -> None:
    entry = steady_group.cache_entry(mutex_prefix)
    entry["MUTEX"]["DEADLOCK_TIMEOUT"] = 0.2
    outcomes: dict[str, str] = {}
    holding = {who: threading.Event() for who in ("first", "second")}
    go = {who: threading.Event() for who in ("first", "second")}

    def member(who: str, held: str, wanted: str) -> None:
        with mutex(held, using=ALIAS):
            holding[who].set()
            assert go[who].wait(30)
            try:
                with mutex(wanted, using=ALIAS, timeout=30):
                    outcomes[who] = "acquired"
            except LockDeadlock:
                outcomes[who] = "deadlock"

    with extra_caches({ALIAS: entry}):
        threads = [
            threading.Thread(target=member, args=("first", "sd-a", "sd-b")),
            threading.Thread(target=member, args=("second", "sd-b", "sd-a")),
        ]
        for thread in threads:
            thread.start()
        assert all(event.wait(10) for event in holding.values())
        go["first"].set()
        queue = Mutex("sd-b", using=ALIAS).keys.queue
        wait_until(lambda: queued_on(steady_group.master.port, queue), 10, "first in line")
        go["second"].set()  # the younger wait
        for thread in threads:
            thread.join(30)

    assert outcomes == {"first": "acquired", "second": "deadlock"}


@pytest.mark.slow
def test_processes_exclude_each_other_through_sentinel(
    steady: SentinelGroup, raw: redis.Redis, mutex_prefix: str
) -> None:
    workers = SectionWorkers(
        raw,
        {ALIAS: steady.cache_entry(mutex_prefix)},
        ALIAS,
        workers=2,
        threads=3,
        names=2,
        iterations=30,
        hold=0.001,
    )
    try:
        workers.start()
        history = workers.finish()
    finally:
        workers.close()

    assert len(history) == 2 * 3 * 30
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert history.lost() == []


# -- failovers ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_failover_during_a_run_keeps_exclusion_and_fence_order(
    group: SentinelGroup, raw: redis.Redis, mutex_prefix: str
) -> None:
    """Kill the master while processes contend; sections go on on the promoted replica.

    While the sentinels decide (about 1 s of down-after plus an election),
    attempts fail with LockBackendUnavailable and are retried. A section
    whose lock write had not reached the promoted replica may lose its lock;
    the checker only lets such a section overlap another if its holder was
    told (LockLost). Fences stay in order across the failover because each is
    at least the server clock in microseconds, and the new master runs on the
    same clock.
    """
    workers = SectionWorkers(
        raw,
        {ALIAS: group.cache_entry(mutex_prefix)},
        ALIAS,
        workers=2,
        threads=2,
        names=2,
        hold=0.002,
        ttl=2,
    )
    try:
        workers.start()
        wait_until(lambda: workers.counted() >= 20, 30, "20 sections before the failover")
        killed: list[float] = []
        new = group.fail_over(while_down=lambda: killed.append(time.time()))
        killed_at, promoted_at = killed[0], time.time()
        settled = workers.counted()
        wait_until(lambda: workers.counted() >= settled + 20, 30, "20 sections after the failover")
        workers.stop()
        history = workers.finish()
    finally:
        workers.close()

    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    before = [s.fence for s in history.sections if s.enter < killed_at]
    after = [s.fence for s in history.sections if s.enter > promoted_at]
    assert before and len(after) >= 20
    assert min(after) > max(before)
    # The fences handed out after the failover came from the promoted replica.
    latest = {name: max(s.fence for s in history.of(name)) for name in history.names()}
    for name, fence in latest.items():
        fence_key = Mutex(name, using=ALIAS).keys.fence
        assert fence_on(new.port, fence_key) == fence


@pytest.mark.slow  # a real failover takes about 3 s
def test_acquisitions_after_failover_go_to_the_promoted_replica(group: SentinelGroup) -> None:
    def take(name: str) -> int:
        with mutex(name, using=ALIAS) as lock:
            return lock.fence or 0

    async def atake(name: str) -> int:
        async with mutex(name, using=ALIAS) as lock:
            return lock.fence or 0

    async def main() -> tuple[list[int], list[int], RedisServer]:
        # One event loop on both sides of the failover, as a long-running ASGI server has;
        # its pooled connections to the old master are the ones to replace.
        sync_before = take("sync-job")
        async_before = await atake("async-job")
        new = await asyncio.to_thread(group.fail_over)
        sync_after = take("sync-job")
        async_after = await atake("async-job")
        return [sync_before, sync_after], [async_before, async_after], new

    sync_fences, async_fences, new = asyncio.run(main())

    assert sync_fences[1] > sync_fences[0]
    assert async_fences[1] > async_fences[0]
    # The fences after the failover were handed out by the promoted replica.
    assert fence_on(new.port, Mutex("sync-job", using=ALIAS).keys.fence) == sync_fences[1]
    assert fence_on(new.port, Mutex("async-job", using=ALIAS).keys.fence) == async_fences[1]


@pytest.mark.slow  # a real failover takes about 3 s
def test_lock_replicated_before_failover_survives_and_keeps_excluding(
    group: SentinelGroup,
) -> None:
    holder = Mutex("report", using=ALIAS, ttl=10)
    assert holder.acquire()
    wait_until(
        lambda: all(
            token_on(r.port, holder.keys.lock) == holder.token for r in group.replica_servers()
        ),
        10,
        "the lock to reach the replicas",
    )

    new = group.fail_over()

    contender = Mutex("report", using=ALIAS, reentrant=False)
    assert not contender.acquire(blocking=False)
    assert token_on(new.port, holder.keys.lock) == holder.token
    assert holder.owned()
    first_fence = holder.fence or 0
    holder.release()
    assert contender.acquire(blocking=False)
    assert (contender.fence or 0) > first_fence
    contender.release()


@pytest.mark.slow  # a real failover takes about 3 s
def test_lock_held_at_failover_can_be_lost_but_fences_still_order(group: SentinelGroup) -> None:
    """A lock whose write never reached the promoted replica is lost in the failover.

    Redis replicates asynchronously: the master acknowledges the lock before
    any replica has it, and a replica promoted before it received the write
    knows nothing of the lock. A second owner then gets the "held" lock at
    once and two processes believe they hold it. No lock on a Redis with
    asynchronous replication can rule this out (WAIT narrows the window but a
    replica that acknowledged can still lose the write); the remedy is the
    fencing token. The test makes the loss certain: it stops both replicas,
    cuts their links, takes the lock, and kills the master before they can
    catch up. The second owner's fence is still larger than the first's (the
    next fence is at least the server clock in microseconds, and the promoted
    replica runs on the same clock), so storage that checks fences rejects the
    first owner's late writes; and the first owner learns of the loss when it
    releases.
    """
    with mutex("report", using=ALIAS) as earlier:
        replicated_fence = earlier.fence or 0
    wait_until(
        lambda: all(
            fence_on(r.port, earlier.keys.fence) == replicated_fence
            for r in group.replica_servers()
        ),
        10,
        "the earlier fence to reach the replicas",
    )
    holder = Mutex("report", using=ALIAS, ttl=10)

    # The master alone acknowledges the lock, then dies.
    new = group.fail_over(unreplicated=holder.acquire)

    second = Mutex("report", using=ALIAS, reentrant=False)
    acquired = second.acquire(blocking=False)

    assert holder.fence is not None  # the first holder was granted the lock
    assert acquired, "the promoted replica never saw the first holder's lock"
    assert token_on(new.port, second.keys.lock) == second.token
    assert (second.fence or 0) > (holder.fence or 0) > replicated_fence
    with pytest.raises(LockNotOwned, match="'report'"):
        holder.release()
    second.release()


@pytest.mark.slow  # a real failover takes about 3 s
def test_waiters_queued_at_failover_get_the_lock_in_turn_on_the_promoted_replica(
    group: SentinelGroup, raw: redis.Redis, mutex_prefix: str, spawn: Callable[..., Worker]
) -> None:
    """A holder and two waiters, each its own process, straddle a killed master.

    The lock and its queue reached the replicas before the kill, so the holder
    keeps its lock (its lease outlasts the failover); each waiter's blocking
    wait breaks with the master, and it waits again on the promoted replica
    (retrying what failed with LockBackendUnavailable, within its timeout).
    """
    holders = Holders(spawn, raw, {ALIAS: group.cache_entry(mutex_prefix)}, ALIAS, ttl=10)
    holders.hold(["report"], waiters=2)
    keys = Mutex("report", using=ALIAS).keys
    wait_until(
        lambda: all(
            token_on(r.port, keys.lock) == holders.tokens["report"]
            and queued_on(r.port, keys.queue) == 2
            for r in group.replica_servers()
        ),
        10,
        "the lock and its queue to reach the replicas",
    )

    new = group.fail_over()

    holders.wait_queued("report", 2)
    (listed,) = held_locks(using=ALIAS)
    assert (listed.owner.pid, listed.fence) == (
        holders.holders["report"].pid,
        holders.fences["report"],
    )
    handed = holders.let_go()
    assert handed.violations() == []
    assert holders.reports("lost") == [] and len(holders.reports("released")) == 3
    holders.check_handed_in_turn(handed)  # holder first, then each waiter once, fences growing
    assert fence_on(new.port, keys.fence) == max(s.fence for s in handed.of("report"))


# -- engine bugs -------------------------------------------------------------------------------


@pytest.mark.slow  # a real failover takes about 3 s
def test_thread_whose_release_failed_does_not_reenter_a_lock_lost_in_the_failover(
    group: SentinelGroup,
) -> None:
    """A hold whose release failed is never joined again without asking Redis.

    The release may have reached Redis with only its reply lost, or (as here)
    the lock may vanish in a failover; either way another owner can hold the
    lock now, so a later acquisition in the same thread must ask Redis.
    """
    holder = Mutex("report", using=ALIAS, ttl=10)
    release_failed: list[LockBackendUnavailable] = []

    def release_while_the_master_is_dead() -> None:
        try:
            holder.release()
        except LockBackendUnavailable as exc:
            release_failed.append(exc)

    group.fail_over(unreplicated=holder.acquire, while_down=release_while_the_master_is_dead)
    assert len(release_failed) == 1
    other = Mutex("report", using=ALIAS)
    taken: list[bool] = []
    # Another owner (thread) takes the lock, which was lost in the failover.
    thread = threading.Thread(target=lambda: taken.append(other.acquire(blocking=False)))
    thread.start()
    thread.join(10)
    assert taken == [True]

    again = Mutex("report", using=ALIAS).acquire(blocking=False)

    other.release()
    assert again is False


def test_async_sentinel_lock_closes_its_sentinel_connections_with_the_loop(
    steady: SentinelGroup,
) -> None:
    async def main() -> int:
        async with mutex("async-job", using=ALIAS) as lock:
            return lock.fence or 0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fence = asyncio.run(main())
        gc.collect()

    assert fence > 0
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
