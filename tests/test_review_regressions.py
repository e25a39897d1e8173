"""Regressions for defects found in review: each test failed before its fix."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from django_redis_mutex import LockLost, Mutex, mutex, reset, signals
from django_redis_mutex.holds import _holds
from django_redis_mutex.watchdog import get_watchdog

from .conftest import wait_until


def test_failing_lock_lost_receiver_does_not_stop_renewal_of_other_locks(raw):
    def broken_receiver(**kwargs):
        raise RuntimeError("metrics backend down")

    signals.lock_lost.connect(broken_receiver)
    try:
        survivor = Mutex("survivor", ttl=0.6)
        victim = Mutex("victim", ttl=0.6)
        assert survivor.acquire() and victim.acquire()
        raw.delete(victim.keys.lock)  # the watchdog finds it gone: lock_lost is sent
        assert wait_until(lambda: victim.lost, timeout=5)
        time.sleep(1.5)  # past two of the survivor's leases: only renewal keeps it
        assert survivor.owned()
        survivor.release()
    finally:
        signals.lock_lost.disconnect(broken_receiver)


def test_extend_racing_a_renewal_keeps_the_longer_lease():
    lock = Mutex("extended", ttl=0.6)
    assert lock.acquire()
    for _ in range(10):
        lock.extend(30)
        time.sleep(0.05)
    time.sleep(0.8)  # any renewal to the old 0.6 s lease would have landed by now
    assert lock.ttl() > 20
    lock.release()


def test_failing_lock_acquired_receiver_gives_the_lock_back():
    def broken_receiver(**kwargs):
        raise RuntimeError("boom")

    signals.lock_acquired.connect(broken_receiver)
    try:
        with pytest.raises(RuntimeError, match="boom"), mutex("given-back", ttl=1):
            pass
    finally:
        signals.lock_acquired.disconnect(broken_receiver)
    assert not Mutex("given-back").locked()


def test_a_handle_shared_by_two_threads_does_not_nest_for_the_other_thread():
    shared = Mutex("shared", timeout=0)
    assert shared.acquire()
    results = []
    thread = threading.Thread(target=lambda: results.append(shared.acquire(blocking=False)))
    thread.start()
    thread.join()
    assert results == [False]
    shared.release()


def test_clean_exit_never_reports_lost_when_release_races_a_renewal():
    # A lease of 3 ms makes the watchdog renew constantly, so releases meet
    # renewals in flight.
    for i in range(200):
        with mutex(f"race-{i % 5}", ttl=0.01):
            pass


def test_released_async_holds_do_not_pile_up_in_the_task_context():
    async def entries_after(rounds: int) -> int:
        for i in range(rounds):
            async with mutex(f"object:{i}"):
                pass
        return sum(1 for hold in (_holds.get() or {}).values() if hold.name.startswith("object:"))

    # Bounded, whatever the number of names used: only live holds are carried.
    assert asyncio.run(entries_after(200)) == asyncio.run(entries_after(20)) <= 2


def test_generator_body_runs_under_the_lock():
    @mutex("gen")
    def numbers():
        yield Mutex("gen", reentrant=False).locked()
        yield 2

    @mutex("agen")
    async def anumbers():
        yield await Mutex("agen", reentrant=False).alocked()

    async def collect():
        return [item async for item in anumbers()]

    assert list(numbers()) == [True, 2]
    assert asyncio.run(collect()) == [True]
    assert not Mutex("gen").locked()


def test_a_lock_reset_under_its_holder_is_still_reported_lost():
    with pytest.raises(LockLost), mutex("really-lost", ttl=0.3) as lock:
        reset("really-lost")
        assert wait_until(lambda: lock.lost, timeout=5)
        hold = lock._hold
    assert not get_watchdog().watching(hold)
