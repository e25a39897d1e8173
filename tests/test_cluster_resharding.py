"""Locks on a Redis Cluster whose slots move between primaries while they are used.

Worker processes contend for locks; another process holds a lock for the whole
move with two waiter processes queued behind it; the slots of those locks move
to another primary, by hand (``SETSLOT IMPORTING/MIGRATING``,
``GETKEYSINSLOT`` and ``MIGRATE`` one key at a time) and with
``redis-cli --cluster reshard`` (plus ``--cluster rebalance`` in the full
run, ``DRM_FULL_TOPOLOGY=1``). The test process probes the moving locks all
along (a non-blocking acquire, then a release), one of them a lock nobody
else takes, so lock scripts certainly run while a slot's keys are split
between two primaries. What must hold across a move:

* every lock operation succeeds or fails with ``LockBackendUnavailable`` (the
  workers then retry within their timeout);
* no two holders overlap and fences keep increasing (``tests/history.py``);
* a lock held across the move keeps its owner, fence and lease, and its
  waiters get it in turn once it is released;
* afterwards ``held_locks()`` and ``manage.py locks`` list every held lock,
  read from the primary that now stores it, and no key of the lock namespace
  is left without an expiry (PTTL of every key, SCAN on every primary).

A lock script that touches a key it did not declare in KEYS (the queue,
fence and wake-up keys derived inside Lua) fails on a half-moved slot: Redis
refuses an undeclared key the node does not have ("Script attempted to
access a non local key"), and a key one writes on the importing node makes
the next MIGRATE fail with BUSYKEY. Those failures are raised as
:class:`UndeclaredKeyFailure` and :class:`~tests.cluster_ops.MigrationRefused`.
"""

from __future__ import annotations

import io
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis
from django.core.management import call_command

from django_redis_mutex import LockBackendUnavailable, LockNotOwned, Mutex, held_locks
from django_redis_mutex.client import namespace
from django_redis_mutex.keys import escape_name, glob_escape
from django_redis_mutex.testing import RedisClusterServers

from .cluster_ops import (
    ClusterNode,
    cluster_nodes,
    keys_by_node,
    keys_without_expiry,
    lock_slot,
    migrate_slot,
    names_in,
    primary_of_slot,
    rebalance,
    reshard,
)
from .helpers import wait_until
from .history import History, Section
from .holders import Holders, ended_early
from .topologies import SectionWorkers, cluster_entry, extra_caches
from .worker import Worker

ALIAS = "cluster"
# More workers, names and slots, and a rebalance after the reshard, with DRM_FULL_TOPOLOGY=1.
FULL = os.environ.get("DRM_FULL_TOPOLOGY") == "1"
# Redis's answers to a script that touched an undeclared key the node lacks.
UNDECLARED_KEY_ERRORS = (
    "Script attempted to access a non local key",
    "Script attempted to access keys that do not hash to the same slot",
)

Caches = dict[str, dict[str, Any]]


class UndeclaredKeyFailure(AssertionError):
    """A lock script broke on a half-moved slot because it used a key it had not declared."""


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """A cluster of this test's own: a failed move leaves slots open, which redis-cli refuses."""
    with RedisClusterServers(primaries=3) as running:
        yield running


@pytest.fixture
def caches(cluster: RedisClusterServers, mutex_prefix: str) -> Iterator[Caches]:
    """The lock alias ``cluster`` in this test's namespace (the workers get it too)."""
    entries = {ALIAS: cluster_entry(cluster, mutex_prefix, TIMEOUT=20)}
    with extra_caches(entries):
        yield entries


def namespace_pattern() -> str:
    return glob_escape(namespace(ALIAS)) + ":*"


# -- who takes part in a move --------------------------------------------------------------------


class Probe:
    """Take and drop the moving locks from the test process, recording each section.

    Each attempt is a non-blocking acquire and, when granted, an immediate
    release; the one allowed failure is ``LockBackendUnavailable``. Anything
    else is kept in ``errors`` and raised by :meth:`check`.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.history = History()
        self.errors: list[BaseException] = []
        self.unavailable = 0
        self.stop = threading.Event()

    def once(self) -> None:
        for name in self.names:
            self._attempt(name)

    def until_stopped(self) -> None:
        while not self.stop.is_set():
            self.once()

    def _attempt(self, name: str) -> None:
        lock = Mutex(name, using=ALIAS, ttl=2, reentrant=False, watchdog=False)
        try:
            if not lock.acquire(blocking=False):
                return
        except LockBackendUnavailable:
            self.unavailable += 1
            return
        except Exception as exc:
            self.errors.append(exc)
            return
        enter = time.time()
        fence, lost = lock.fence or 0, False
        leave = time.time()
        try:
            lock.release()
        except LockBackendUnavailable:
            self.unavailable += 1  # the lease (2 s, not renewed) ends it
        except LockNotOwned:
            lost = True
        except Exception as exc:
            self.errors.append(exc)
        self.history.add(Section(name, fence, enter, leave, os.getpid(), "probe", lost=lost))

    def check(self) -> None:
        """Raise the first unexpected error, as UndeclaredKeyFailure when it is one."""
        if not self.errors:
            return
        described = "; ".join(f"{type(e).__name__}: {e}" for e in self.errors[:3])
        if any(sign in str(self.errors[0]) for sign in UNDECLARED_KEY_ERRORS):
            raise UndeclaredKeyFailure(
                f"a lock script failed on a half-moved slot: {described}"
            ) from self.errors[0]
        raise AssertionError(
            f"lock operations on a moving slot failed with {described}"
        ) from self.errors[0]


def fill(cluster: RedisClusterServers, names: list[str], per_slot: int) -> list[str]:
    """Store ``per_slot`` cache entries (10 min expiry) in the slot of each of ``names``.

    A slot that carries data besides a lock takes several MIGRATE round trips
    to move, so the lock stays half-moved for longer.
    """
    entries = []
    for name in names:
        port = primary_of_slot(cluster, lock_slot(name)).port
        client = redis.Redis(port=port)
        try:
            pipe = client.pipeline(transaction=False)
            for index in range(per_slot):
                key = f"tests:1:{{{escape_name(name)}}}:entry:{index}"
                pipe.set(key, "cached", ex=600)
                entries.append(key)
            pipe.execute()
        finally:
            client.close()
    return entries


# -- the checks ----------------------------------------------------------------------------------


def check_after_move(
    cluster: RedisClusterServers, holders: Holders, expected: ClusterNode | None
) -> None:
    """Held locks are listed with owner, fence and waiters, from the primary storing them."""
    listed = {h.name: h for h in held_locks(using=ALIAS)}
    stored = keys_by_node(cluster, namespace_pattern())
    for name, worker in holders.holders.items():
        assert name in listed, f"{name!r} is held but not listed: {sorted(listed)}"
        held = listed[name]
        assert (held.owner.pid, held.fence) == (worker.pid, holders.fences[name])
        assert held.time_left > 0
        # A waiter that had to queue again may leave its old place until it lapses.
        assert held.waiters >= len(holders.waiters[name])
        now = primary_of_slot(cluster, lock_slot(name))
        if expected is not None:
            assert now.id == expected.id, f"{name!r} is on {now.port}, not {expected.port}"
        lock_key = f"{namespace(ALIAS)}:{{{escape_name(name)}}}"
        assert [port for port, keys in stored.items() if lock_key in keys] == [now.port]
    out = io.StringIO()
    call_command("locks", "--using", ALIAS, stdout=out)
    assert all(name in out.getvalue() for name in holders.holders), out.getvalue()
    assert keys_without_expiry(cluster, namespace_pattern()) == []


def check_history(history: History) -> None:
    assert history.violations() == []
    assert history.lost() == []


Move = Callable[[SectionWorkers, Probe], None]
# How many moving locks are held across the move (with two waiters each), and
# contended by the workers; one more is taken only by the probe, so it is free
# whenever the probe tries it.
HELD, CONTENDED = (2, 3) if FULL else (1, 2)
MOVING = HELD + 1 + CONTENDED


def split(moving: list[str]) -> tuple[list[str], str, list[str]]:
    """Return the held, the idle (probe only) and the contended names among ``moving``."""
    return moving[:HELD], moving[HELD], moving[HELD + 1 :]


def run_move(
    cluster: RedisClusterServers,
    raw: redis.Redis,
    caches: Caches,
    spawn: Callable[..., Worker],
    move: Move,
    *,
    moving: list[str],
    staying: list[str],
    expected: ClusterNode | None,
) -> None:
    """Contend on ``moving`` and ``staying`` locks, hold some moving ones, ``move``; check all."""
    held, idle, contended = split(moving)
    probe = Probe([idle, *contended])
    with ExitStack() as stack:
        workers = SectionWorkers(
            raw,
            caches,
            ALIAS,
            workers=3 if FULL else 2,
            threads=3 if FULL else 2,
            names=contended + staying,
            hold=0.003,
            ttl=2,
            timeout=20,
        )
        stack.callback(workers.close)
        holders = Holders(spawn, raw, caches, ALIAS)
        holders.hold(held, waiters=2)
        workers.start()
        wait_until(lambda: workers.counted() >= 20, 60, "20 sections before the move")
        before = workers.counted()

        move(workers, probe)

        probe.check()
        wait_until(lambda: workers.counted() >= before + 20, 60, "20 sections after the move")
        check_after_move(cluster, holders, expected)
        workers.stop()
        history = workers.finish()
        assert history.counter_violations(workers.counters()) == []
        history.sections += probe.history.sections
        check_history(history)
        assert workers.of("contended") == []
        assert {f["error"] for f in workers.of("failure")} <= {"LockBackendUnavailable"}
        assert set(contended) <= set(history.names())
        handed = holders.let_go()
        check_history(handed)
        holders.check_handed_in_turn(handed)
    assert held_locks(using=ALIAS) == []
    assert keys_without_expiry(cluster, namespace_pattern()) == []


# -- by hand -------------------------------------------------------------------------------------


def test_slots_moved_by_hand_one_key_at_a_time_keep_locks_and_queues(
    cluster: RedisClusterServers, caches: Caches, raw: redis.Redis, spawn: Callable[..., Worker]
) -> None:
    primaries = [n for n in cluster_nodes(cluster) if n.primary]
    source, target, other = primaries
    moving = names_in(source.slots, MOVING, f"by-hand-{uuid.uuid4().hex[:6]}")
    staying = names_in(other.slots, 2, f"staying-{uuid.uuid4().hex[:6]}")

    def move(workers: SectionWorkers, probe: Probe) -> None:
        progress = [workers.counted()]

        def half_moved(moved: int) -> None:
            # Lock scripts run on the slot while its keys are split.
            probe.once()
            probe.check()
            wait_until(
                lambda: workers.counted() >= progress[0] + 2 or ended_early(workers),
                30,
                "sections while the slot is half-moved",
            )
            failed = ended_early(workers)
            assert failed is None, failed
            progress[0] = workers.counted()

        for name in moving:
            migrate_slot(cluster, lock_slot(name), target, batch=1, between=half_moved)
        # The idle lock's fence counter moved alone: the probe found the lock split
        # between two primaries and was refused (TRYAGAIN), not run on part of it.
        assert probe.unavailable > 0

    run_move(cluster, raw, caches, spawn, move, moving=moving, staying=staying, expected=target)


# -- redis-cli -----------------------------------------------------------------------------------


def test_redis_cli_reshard_keeps_locks_and_queues(
    cluster: RedisClusterServers, caches: Caches, raw: redis.Redis, spawn: Callable[..., Worker]
) -> None:
    primaries = [n for n in cluster_nodes(cluster) if n.primary]
    source, target, other = primaries[2], primaries[0], primaries[1]
    # reshard moves the source's lowest slots: pick the names among them.
    lowest, span = min(first for first, _ in source.slots), 64
    moving = names_in(((lowest, lowest + span - 1),), MOVING, f"cli-{uuid.uuid4().hex[:6]}")
    staying = names_in(other.slots, 2, f"staying-{uuid.uuid4().hex[:6]}")
    held, idle, contended = split(moving)
    # The idle lock's slot carries the most data, so it stays half-moved longest.
    entries = fill(cluster, [idle], 2000) + fill(cluster, [*held, *contended], 100)

    def move(workers: SectionWorkers, probe: Probe) -> None:
        probing = threading.Thread(target=probe.until_stopped, name="probe")
        probing.start()
        try:
            reshard(cluster, source, target, span)
            if FULL:
                # The move left the target heavier than the others by more than 1%.
                assert "Moving" in rebalance(cluster)
        finally:
            probe.stop.set()
            probing.join(30)

    try:
        run_move(
            cluster,
            raw,
            caches,
            spawn,
            move,
            moving=moving,
            staying=staying,
            expected=None if FULL else target,
        )
    finally:
        client = redis.cluster.RedisCluster.from_url(cluster.url)
        try:
            for key in entries:
                client.delete(key)
        finally:
            client.close()
