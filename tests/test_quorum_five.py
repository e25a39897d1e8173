"""Quorum (Redlock) locks over five masters while masters die, freeze and come back empty.

A lock over five masters is held when three granted it. Worker processes
contend all along while, in turn, one master is killed (SIGKILL), a second is
frozen (SIGSTOP: its sockets stay open and nothing answers, so each request to
it waits out the member deadline), and a third restarts empty (no
persistence) while a lock is held on it, leaving its holder with two masters
of five. Then the frozen one runs again and the dead one comes back empty.
A second run uses three Sentinel services as the quorum's members (each alias
is a django-redis Sentinel configuration), one of which fails over mid-run.

The history checker (``tests/history.py``) holds both runs to the promises
of a lease-based lock: no two holders that were not told they lost the lock
overlap, and fences strictly increase.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import redis

from django_redis_mutex import Mutex
from django_redis_mutex.testing import RedisServer

from .helpers import wait_until
from .holders import Holders, ended_early
from .topologies import SectionWorkers, SentinelGroup, extra_caches, master_entries, redis_servers
from .worker import Worker

ALIASES = ["q1", "q2", "q3", "q4", "q5"]
SERVICES = ["s1", "s2", "s3"]
# More processes and sections per phase with DRM_FULL_TOPOLOGY=1.
FULL = os.environ.get("DRM_FULL_TOPOLOGY") == "1"
PHASE, WORKERS = (200, 3) if FULL else (20, 2)


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(ALIASES)) as servers:
        yield servers


@pytest.fixture
def five(masters: list[RedisServer], mutex_prefix: str) -> Iterator[dict[str, dict[str, Any]]]:
    """The aliases q1..q5 in this test's namespace; frozen masters resume, dead ones restart."""
    entries = master_entries(masters, ALIASES, mutex_prefix)
    with extra_caches(entries):
        yield entries
    for server in masters:
        server.resume()
        if server.process is None:
            server.start()


def run_sections(workers: SectionWorkers, count: int, what: str) -> None:
    """Wait until the workers ran ``count`` more sections; fail at once if one of them died."""
    start = workers.counted()
    wait_until(lambda: workers.counted() >= start + count or ended_early(workers), 60, what)
    failed = ended_early(workers)
    assert failed is None, failed


def check(workers: SectionWorkers) -> None:
    history = workers.finish()
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert {f["error"] for f in workers.of("failure")} <= {"LockBackendUnavailable"}
    assert workers.of("contended") == []


def test_five_masters_exclude_through_a_kill_a_freeze_and_an_empty_restart(
    five: dict[str, dict[str, Any]],
    masters: list[RedisServer],
    raw: redis.Redis,
    spawn: Callable[..., Worker],
) -> None:
    with ExitStack() as stack:
        workers = SectionWorkers(
            raw, five, ALIASES, workers=WORKERS, threads=2, names=2, hold=0.002, ttl=3, timeout=20
        )
        stack.callback(workers.close)
        holders = Holders(spawn, raw, five, ALIASES, ttl=3)
        workers.start()
        run_sections(workers, PHASE, f"{PHASE} sections on five masters")

        masters[0].kill()
        run_sections(workers, PHASE, f"{PHASE} sections with one master dead")

        masters[1].pause()
        run_sections(workers, PHASE, f"{PHASE} sections with one master dead and one frozen")

        # A lock held on exactly three masters loses one of them.
        holders.hold(["held"])
        masters[2].restart()
        run_sections(workers, PHASE, f"{PHASE} sections after a master restarted empty")
        # Its holder is left with two of five: nobody else gets the lock until those
        # two leases end, and the holder is told it lost it.
        intruder = Mutex("held", using=ALIASES, timeout=20)
        assert intruder.acquire()
        intruder_fence = intruder.fence or 0
        intruder.release()
        handed = holders.let_go()
        assert holders.reports("lost") and not holders.reports("released")
        assert intruder_fence > holders.fences["held"]
        assert handed.violations() == []

        masters[1].resume()
        masters[0].start()  # back, and empty
        run_sections(workers, PHASE, f"{PHASE} sections with every master back")
        workers.stop()
        check(workers)


@pytest.fixture
def sentinel_quorum(mutex_prefix: str) -> Iterator[tuple[list[SentinelGroup], dict[str, Any]]]:
    """Three Sentinel services (a master, a replica, a sentinel each) as quorum members."""
    with ExitStack() as stack:
        groups = [
            stack.enter_context(SentinelGroup(replicas=1, sentinel_count=1, quorum=1))
            for _ in SERVICES
        ]
        entries = {
            alias: group.cache_entry(mutex_prefix)
            for alias, group in zip(SERVICES, groups, strict=True)
        }
        stack.enter_context(extra_caches(entries))
        yield groups, entries


@pytest.mark.slow  # a real failover takes about 3 s
def test_quorum_of_sentinel_services_excludes_through_a_failover(
    sentinel_quorum: tuple[list[SentinelGroup], dict[str, Any]], raw: redis.Redis
) -> None:
    groups, entries = sentinel_quorum
    with ExitStack() as stack:
        workers = SectionWorkers(
            raw,
            entries,
            SERVICES,
            workers=WORKERS,
            threads=2,
            names=2,
            hold=0.002,
            ttl=3,
            timeout=20,
        )
        stack.callback(workers.close)
        workers.start()
        run_sections(workers, PHASE, f"{PHASE} sections on three Sentinel services")
        killed = time.time()

        groups[0].fail_over()

        promoted = time.time()
        run_sections(workers, PHASE, f"{PHASE} sections after one service failed over")
        workers.stop()
        history = workers.finish()
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert {f["error"] for f in workers.of("failure")} <= {"LockBackendUnavailable"}
    # Two of three services answered all along: the failover cost nobody their lock.
    assert history.lost() == []
    for name in history.names():
        before = [s.fence for s in history.of(name) if s.enter < killed]
        after = [s.fence for s in history.of(name) if s.enter > promoted]
        assert before and after and min(after) > max(before)
