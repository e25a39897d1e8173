"""The lock across real OS processes and through process faults.

Every test here starts worker scripts from ``tests/workers/`` as separate
Python processes against the session's real redis-server, and checks what they
report (JSON lines on stdout) and what Redis holds. Faults are real too: a
holder is SIGKILLed, or SIGSTOPped past its lease and resumed; a worker forks.
Workers that must start together wait on a barrier list the test fills once
all of them said they are ready; a worker that must hold until told to blocks
on a list the test pushes to. Timestamps compared across processes are
``time.time()`` on this one machine.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis

from django_redis_mutex import Mutex

from .helpers import wait_until
from .worker import STEP_TIMEOUT, Worker

# Generous bound: these tests run on a busy 2-core machine.
START_TIMEOUT = 30.0


@pytest.fixture
def data_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a workload key of this test (outside the lock namespace)."""
    made: list[str] = []

    def key(purpose: str) -> str:
        made.append(f"processes:{mutex_prefix}:{purpose}")
        return made[-1]

    yield key
    if made:
        raw.delete(*made)


def start_together(raw: redis.Redis, barrier: str, workers: list[Worker]) -> None:
    """Wait until every worker is ready, then let them all go at once."""
    for worker in workers:
        worker.expect("ready", timeout=START_TIMEOUT)
    raw.rpush(barrier, *["go"] * len(workers))


def queued(raw: redis.Redis, name: str) -> int:
    """Return how many waiters are queued on lock ``name``."""
    return int(raw.zcard(Mutex(name).keys.queue))


def test_contended_read_modify_write_loses_no_increment_and_sections_never_overlap(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    counter, barrier = data_key("counter"), data_key("barrier")
    workers = [spawn("sections.py", "counter", counter, barrier, 200) for _ in range(8)]
    start_together(raw, barrier, workers)

    sections = []
    for worker in workers:
        sections += worker.expect("done", timeout=60)["sections"]
        assert worker.finish() == 0

    assert int(raw.get(counter) or 0) == 1600
    assert len(sections) == 1600
    assert len({pid for *_, pid in sections}) == 8
    in_order = sorted(sections, key=lambda section: section[1])
    overlaps = [(a, b) for a, b in pairwise(in_order) if b[1] < a[2]]
    assert overlaps == [], f"{len(overlaps)} overlapping sections, first: {overlaps[:3]}"
    fences = [fence for fence, *_ in in_order]
    assert all(a < b for a, b in pairwise(fences)), "fences not increasing in enter order"


def test_fences_strictly_increase_in_acquisition_order_across_processes(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    sequence, barrier = data_key("sequence"), data_key("barrier")
    workers = [spawn("fences.py", "fenced", sequence, barrier, 60) for _ in range(4)]
    start_together(raw, barrier, workers)

    by_pid: dict[int, list[list[Any]]] = {}
    for worker in workers:
        by_pid[worker.pid] = worker.expect("done", timeout=60)["sections"]
        assert worker.finish() == 0

    acquisitions = sorted(
        (seq, fence, pid, path) for pid, sections in by_pid.items() for seq, fence, path in sections
    )
    assert [seq for seq, *_ in acquisitions] == list(range(1, len(acquisitions) + 1))
    assert all(len(sections) > 0 for sections in by_pid.values())
    # Both ways to the lock were taken: a free-lock try and a queued wait.
    assert {path for *_, path in acquisitions} == {"try", "wait"}
    # The processes really interleaved: the holder changed many times.
    switches = sum(a[2] != b[2] for a, b in pairwise(acquisitions))
    assert switches >= 10, f"only {switches} hand-overs between processes"
    backwards = [(a, b) for a, b in pairwise(acquisitions) if b[1] <= a[1]]
    assert backwards == [], f"fence did not grow from one acquisition to the next: {backwards[:3]}"


def test_waiter_takes_over_soon_after_holder_is_killed(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    ttl = 1.0
    holder = spawn("hold.py", "crash", ttl, data_key("go"))
    acquired = holder.expect("acquired", timeout=START_TIMEOUT)
    waiter = spawn("wait.py", "crash", 10)
    waiter.expect("waiting", timeout=START_TIMEOUT)
    wait_until(lambda: queued(raw, "crash") == 1, 10, "the waiter queueing")
    # Let the holder keep its lock past one lease, so only the kill can free it.
    wait_until(lambda: time.time() - acquired["t"] > 1.5 * ttl, 10, "a hold past one lease")
    assert raw.hget(Mutex("crash").keys.lock, "token") == acquired["token"].encode()

    killed_at = time.time()
    holder.process.kill()
    taken = waiter.expect("acquired", timeout=STEP_TIMEOUT)

    latency = taken["t"] - killed_at
    assert 0 < latency < ttl + 2.0, f"waiter acquired {latency:.3f}s after the kill"
    assert taken["fence"] > acquired["fence"]
    waiter.expect("released")
    assert waiter.finish() == 0
    assert holder.finish() == -signal.SIGKILL
    assert not Mutex("crash").locked()


def test_release_wakes_waiting_process_at_once(
    spawn: Callable[..., Worker], raw: redis.Redis
) -> None:
    lock = Mutex("wake", ttl=30)
    assert lock.acquire()
    try:
        waiter = spawn("wait.py", "wake", 10)
        waiter.expect("waiting", timeout=START_TIMEOUT)
        wait_until(lambda: queued(raw, "wake") == 1, 10, "the waiter queueing")
    finally:
        released_at = time.time()
        lock.release()
    taken = waiter.expect("acquired")

    gap = taken["t"] - released_at
    assert 0 < gap < 0.8, f"waiter acquired {gap * 1000:.1f} ms after the release"
    assert waiter.finish() == 0


def test_releasing_process_does_not_barge_ahead_of_the_waiter(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    total, present, barrier = data_key("total"), data_key("present"), data_key("barrier")
    workers = [spawn("alternate.py", "pingpong", total, present, barrier, 2, 200) for _ in range(2)]
    start_together(raw, barrier, workers)

    numbers = {}
    for worker in workers:
        numbers[worker.pid] = worker.expect("done", timeout=60)["numbers"]
        assert worker.finish() == 0

    assert sorted(n for got in numbers.values() for n in got) == list(range(1, 201))
    shares = {pid: len(got) for pid, got in numbers.items()}
    holders = [pid for _, pid in sorted((n, pid) for pid, got in numbers.items() for n in got)]
    runs = [1]
    for a, b in pairwise(holders):
        runs.append(runs[-1] + 1 if a == b else 1)
    assert all(share >= 60 for share in shares.values()), (
        f"acquisitions per process: {shares}; longest run by one process: {max(runs)}"
    )


def test_watchdog_keeps_a_short_lease_through_a_long_hold(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    ttl, hold = 0.6, 2.5
    go = data_key("go")
    holder = spawn("hold.py", "long", ttl, go)
    acquired = holder.expect("acquired", timeout=START_TIMEOUT)

    attempts, stolen = 0, 0
    fences = set()
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        contender = Mutex("long", blocking=False)
        if contender.acquire():
            stolen += 1
            contender.release()
        attempts += 1
        fences.add(int(raw.hget(contender.keys.lock, "fence") or 0))
        time.sleep(0.02)
    raw.rpush(go, "go")
    released = holder.expect("released")

    assert stolen == 0, f"{stolen} of {attempts} non-blocking attempts got the lock"
    assert attempts > 20
    assert fences == {acquired["fence"]}, "the lock changed hands during the hold"
    assert released["held"] >= hold > 3 * ttl
    assert holder.finish() == 0


def test_forked_child_acquires_and_its_watchdog_renews(spawn: Callable[..., Worker]) -> None:
    ttl, hold = 0.5, 2.0
    worker = spawn("fork.py", "forked", ttl, hold)
    parent = worker.expect("parent_ready", timeout=START_TIMEOUT)
    assert parent["renewers"], "the parent had no renewer thread before the fork"

    acquired = worker.expect("child_acquired")
    assert acquired["pid"] != worker.pid
    assert acquired["owner"]["pid"] == acquired["pid"]
    released = worker.expect("child_released", timeout=hold + STEP_TIMEOUT)
    assert released["owned_at_end"] is True
    assert released["held"] >= hold > 3 * ttl
    done = worker.expect("parent_done")
    assert done["child_exit"] == 0
    assert worker.finish() == 0
    assert not Mutex("forked").locked()


def test_holder_resumed_after_its_lease_ran_out_learns_it_lost_and_spares_new_owner(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    ttl = 1.0
    go = data_key("go")
    holder = spawn("hold.py", "paused", ttl, go)
    first = holder.expect("acquired", timeout=START_TIMEOUT)

    os.kill(holder.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    successor = Mutex("paused", ttl=30, timeout=10)
    try:
        assert successor.acquire(), "the lock of a stopped holder was never taken over"
        assert time.monotonic() - stopped_at < ttl + 2.0
        os.kill(holder.pid, signal.SIGCONT)
        raw.rpush(go, "go")
        lost = holder.expect("lost")

        assert lost["error"] == "LockLost"
        assert lost["name"] == "paused"
        assert str(first["fence"]) in lost["message"]
        assert raw.hget(successor.keys.lock, "token") == successor.token.encode()
        assert successor.owned()
        assert successor.fence > first["fence"]
        assert holder.finish() == 0
    finally:
        if successor.token is not None:
            successor.release()
