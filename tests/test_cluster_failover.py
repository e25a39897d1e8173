"""Locks on a Redis Cluster whose primary fails over to its replica while they are used.

The cluster has three primaries with one replica each and a 1 s
``cluster-node-timeout``. A primary serving held, awaited and contended locks
is replaced twice over: by ``CLUSTER FAILOVER`` on its replica (the replica
catches up first, so nothing may be lost), and by a SIGKILL after which the
other primaries declare it failed and its replica wins the election. For the
kill the replica is first cut off, and one more lock is taken, so that lock
certainly never reaches the replica.

What must hold: work resumes on the promoted replica (worker processes keep
running sections, retrying what failed with ``LockBackendUnavailable``); a
lock that reached the replica keeps its holder, fence and waiters; a holder
whose lock did not reach it is told (``lock.lost``, ``LockNotOwned``) instead
of silently believing it still holds it; no two untold holders overlap, and
every fence handed out after the failover is larger than every fence before it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis

from django_redis_mutex import LockNotOwned, Mutex, held_locks
from django_redis_mutex.client import clear_clients, namespace
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisClusterServers

from .cluster_ops import (
    ClusterNode,
    blocked_clients,
    cluster_nodes,
    cut_off,
    fail_over_by_hand,
    lock_slot,
    names_in,
    primary_of_slot,
    replica_of,
    server_of,
    stored_on,
    wait_for_promotion,
)
from .helpers import wait_until
from .history import History
from .holders import Holders, ended_early
from .topologies import SectionWorkers, cluster_entry, extra_caches
from .worker import Worker

ALIAS = "cluster"
# Leases of the locks held across a failover: longer than the failover takes
# (node timeout, election, a busy machine), so only the failover can lose them.
HOLD_TTL = 10.0
# More processes, more sections per phase, and a failover back, with DRM_FULL_TOPOLOGY=1.
FULL = os.environ.get("DRM_FULL_TOPOLOGY") == "1"
PHASE, WORKERS = (200, 3) if FULL else (20, 2)
Caches = dict[str, dict[str, Any]]


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """Three primaries with a replica each, of this test's own (failovers change roles)."""
    with RedisClusterServers(primaries=3, replicas=1, node_timeout=1000) as running:
        yield running


@pytest.fixture
def caches(cluster: RedisClusterServers, mutex_prefix: str) -> Iterator[Caches]:
    entries = {ALIAS: cluster_entry(cluster, mutex_prefix, TIMEOUT=20)}
    with extra_caches(entries):
        yield entries


def doomed_primary(cluster: RedisClusterServers) -> tuple[ClusterNode, ClusterNode, ClusterNode]:
    """Return the primary to fail over, its replica, and another primary.

    Never the first node: it is the LOCATION every client starts from.
    """
    nodes = cluster_nodes(cluster)
    primary = next(n for n in nodes if n.port == cluster.nodes[1].port)
    other = next(n for n in nodes if n.port == cluster.nodes[2].port)
    return primary, replica_of(cluster, primary), other


def lock_keys(name: str) -> LockKeys:
    return LockKeys.for_name(namespace(ALIAS), name)


def contend(raw: redis.Redis, caches: Caches, names: list[str]) -> SectionWorkers:
    return SectionWorkers(
        raw, caches, ALIAS, workers=WORKERS, threads=2, names=names, hold=0.003, ttl=2, timeout=20
    )


def sections_continue(workers: SectionWorkers, count: int, what: str) -> None:
    start = workers.counted()
    wait_until(lambda: workers.counted() >= start + count or ended_early(workers), 60, what)
    failed = ended_early(workers)
    assert failed is None, failed


def check_fences_grow_across(
    history: History, before: float, after: float, failed_over: list[str]
) -> None:
    """Each fence of a section entered after ``after`` beats every one entered before ``before``.

    At least one of the ``failed_over`` locks (served by the primary that was
    replaced) must have sections on both sides.
    """
    checked = set()
    for name in history.names():
        earlier = [s.fence for s in history.of(name) if s.enter < before]
        later = [s.fence for s in history.of(name) if s.enter > after]
        if earlier and later:
            assert min(later) > max(earlier), name
            checked.add(name)
    assert checked & set(failed_over), f"no sections of {failed_over} on both sides"


def check_run(workers: SectionWorkers, history: History) -> None:
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert workers.of("contended") == []
    assert {f["error"] for f in workers.of("failure")} <= {"LockBackendUnavailable"}


def test_manual_failover_keeps_held_locks_waiters_and_fence_order(
    cluster: RedisClusterServers, caches: Caches, raw: redis.Redis, spawn: Callable[..., Worker]
) -> None:
    primary, replica, other = doomed_primary(cluster)
    stem = uuid.uuid4().hex[:6]
    held = names_in(primary.slots, 1, f"held-{stem}")
    busy = names_in(primary.slots, 2, f"busy-{stem}")
    contended = busy + names_in(other.slots, 1, stem)
    with ExitStack() as stack:
        holders = Holders(spawn, raw, caches, ALIAS, ttl=HOLD_TTL)
        holders.hold(held, waiters=2)
        workers = contend(raw, caches, contended)
        stack.callback(workers.close)
        workers.start()
        sections_continue(workers, PHASE, f"{PHASE} sections before the failover")
        keys = lock_keys(held[0])
        wait_until(
            lambda: stored_on(replica.port, keys.lock) and stored_on(replica.port, keys.queue),
            10,
            "the held lock and its queue to reach the replica",
        )
        # Both waiters blocked on the primary: the failover ends their waits (UNBLOCKED).
        wait_until(lambda: blocked_clients(primary.port) >= 2, 10, "the waiters to block")
        before = time.time()

        fail_over_by_hand(cluster, replica)

        after = time.time()
        holders.wait_queued(held[0], 2)
        sections_continue(workers, PHASE, f"{PHASE} sections on the promoted replica")
        slot = lock_slot(held[0])
        assert primary_of_slot(cluster, slot).id == replica.id
        # Asked by key, the stale primary redirects this process's client to the promoted
        # replica; the listing after it must not count the lock twice.
        assert Mutex(held[0], using=ALIAS).locked()
        (listed,) = [h for h in held_locks(using=ALIAS) if h.name == held[0]]
        assert (listed.owner.pid, listed.fence) == (
            holders.holders[held[0]].pid,
            holders.fences[held[0]],
        )
        if FULL:
            # And back: the demoted primary, now the replica, takes over again.
            fail_over_by_hand(cluster, replica_of(cluster, primary_of_slot(cluster, slot)))
            holders.wait_queued(held[0], 2)
            sections_continue(workers, PHASE, f"{PHASE} sections after failing back")
        workers.stop()
        history = workers.finish()
        check_run(workers, history)
        # The replica had every write: nothing was lost, nobody had to be told.
        assert history.lost() == []
        check_fences_grow_across(history, before, after, busy)
        handed = holders.let_go()
        assert handed.violations() == [] and handed.lost() == []
        holders.check_handed_in_turn(handed)


def test_killed_primary_is_replaced_and_a_holder_whose_lock_was_lost_is_told(
    cluster: RedisClusterServers, caches: Caches, raw: redis.Redis, spawn: Callable[..., Worker]
) -> None:
    primary, replica, other = doomed_primary(cluster)
    stem = uuid.uuid4().hex[:6]
    kept, unreplicated = names_in(primary.slots, 2, f"held-{stem}")
    busy = names_in(primary.slots, 2, f"busy-{stem}")
    contended = busy + names_in(other.slots, 1, stem)
    with ExitStack() as stack:
        holders = Holders(spawn, raw, caches, ALIAS, ttl=HOLD_TTL)
        holders.hold([kept], waiters=1)
        workers = contend(raw, caches, contended)
        stack.callback(workers.close)
        workers.start()
        sections_continue(workers, PHASE, f"{PHASE} sections before the kill")
        wait_until(
            lambda: stored_on(replica.port, lock_keys(kept).queue), 10, "the queue to replicate"
        )
        lone = Mutex(unreplicated, using=ALIAS, ttl=HOLD_TTL)
        with cut_off(cluster, replica, primary):
            assert lone.acquire(blocking=False)  # acknowledged by the primary alone
            lone_fence = lone.fence or 0
            killed = time.time()
            server_of(cluster, primary).kill()

        wait_for_promotion(cluster, replica)

        promoted = time.time()
        holders.wait_queued(kept, 1)
        sections_continue(workers, PHASE, f"{PHASE} sections on the promoted replica")
        # The promoted replica never saw the lone lock: its holder is told, not fooled.
        wait_until(lambda: lone.lost, 10, "the lone holder's watchdog to find its lock gone")
        with pytest.raises(LockNotOwned, match=unreplicated):
            lone.release()
        second = Mutex(unreplicated, using=ALIAS, reentrant=False)
        assert second.acquire(blocking=False)
        assert (second.fence or 0) > lone_fence
        second.release()
        # The lock that reached the replica kept its holder and fence.
        (listed,) = [h for h in held_locks(using=ALIAS) if h.name == kept]
        assert (listed.owner.pid, listed.fence) == (holders.holders[kept].pid, holders.fences[kept])
        workers.stop()
        history = workers.finish()
        check_run(workers, history)
        check_fences_grow_across(history, killed, promoted, busy)
        handed = holders.let_go()
        assert handed.violations() == []
        assert holders.reports("released") and not holders.reports("lost")
        holders.check_handed_in_turn(handed)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_wait_that_redis_unblocks_goes_on_until_the_lock_is_handed_over(
    raw: redis.Redis, use_async: bool
) -> None:
    """A demoted primary answers its blocked clients UNBLOCKED; so does CLIENT UNBLOCK ERROR."""
    holder = Mutex("report")
    assert holder.acquire()
    fences: list[int] = []

    def wait_for_it() -> None:
        waiter = Mutex("report", timeout=20)
        if use_async:

            async def take() -> bool:
                if not await waiter.aacquire():
                    return False
                fences.append(waiter.fence or 0)
                await waiter.arelease()
                return True

            asyncio.run(take())
        elif waiter.acquire():
            fences.append(waiter.fence or 0)
            waiter.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()

    def blocked() -> list[int]:
        return [int(c["id"]) for c in raw.client_list() if "b" in c.get("flags", "")]

    def unblock() -> bool:
        # A wait slice may end on its own between the listing and the unblock.
        return any(raw.execute_command("CLIENT", "UNBLOCK", i, "ERROR") for i in blocked())

    wait_until(unblock, 10, "the waiter to block, to unblock it")
    wait_until(blocked, 10, "the waiter to block again after checking in")
    first = holder.fence or 0
    holder.release()
    thread.join(20)

    assert len(fences) == 1 and fences[0] > first


def test_a_cluster_alias_goes_on_when_its_seed_node_dies(
    cluster: RedisClusterServers, mutex_prefix: str
) -> None:
    # LOCATION names the first primary first, and a second node as a spare seed.
    seed = cluster.nodes[0]
    spare = cluster.nodes[1]
    entry = cluster_entry(cluster, mutex_prefix, TIMEOUT=1)
    entry["LOCATION"] = f"{seed.url},{spare.url}"
    seed_node = next(n for n in cluster_nodes(cluster) if n.port == seed.port)
    replica = replica_of(cluster, seed_node)
    [name] = names_in(seed_node.slots, 1, f"seed-{uuid.uuid4().hex[:6]}")
    with extra_caches({ALIAS: entry}):
        with Mutex(name, using=ALIAS):
            pass  # the client has found the cluster through its seed
        seed.kill()
        errors: list[BaseException] = []

        def taken() -> bool:
            try:
                lock = Mutex(name, using=ALIAS, blocking=False)
                if lock.acquire():
                    lock.release()
                    return True
            except Exception as exc:  # anything but LockBackendUnavailable fails below
                errors.append(exc)
            return False

        wait_for_promotion(cluster, replica)
        wait_until(taken, 30, "a lock on the promoted replica after the seed died")
        # While the cluster failed over, callers met one error class only.
        assert {type(error).__name__ for error in errors} <= {"LockBackendUnavailable"}
        # A client made now starts from the dead seed and finds the spare.
        clear_clients()
        assert taken(), errors[-3:]
