"""The watchdog: renewals keep held locks alive, and find out when they are gone.

Renewal runs in one lane per Redis; these tests check what a holder sees
when renewals race its own extend() and release, when a lock_lost receiver
fails, and when an operator resets the lock under it.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest
from django.test import override_settings

from django_redis_mutex import (
    LockLost,
    Mutex,
    mutex,
    reset,
    scripts,
    signals,
)
from django_redis_mutex.watchdog import get_watchdog

from .helpers import caches_with, wait_until


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
    assert lock.time_left() > 20
    lock.release()


def test_clean_exit_never_reports_lost_when_release_races_a_renewal():
    # Holds end anywhere from before the first renewal (a third into the
    # 450 ms lease) to well after it, so releases meet renewals in flight.
    # The lease is long enough that only a stall of the whole process (about
    # 300 ms, on a loaded machine) could let it lapse for real.
    # A block's exit raises LockLost if it took a race for a loss.
    for i in range(80):
        with mutex(f"race-{i % 5}", ttl=0.45) as lock:
            time.sleep(random.uniform(0.05, 0.25))
        assert not lock.lost


def test_a_lock_reset_under_its_holder_is_still_reported_lost():
    with pytest.raises(LockLost), mutex("really-lost", ttl=0.3) as lock:
        reset("really-lost")
        assert wait_until(lambda: lock.lost, timeout=5)
        hold = lock._current()
    assert not get_watchdog().watching(hold)


# -- Renewal stops when the lock is gone or released, and at MAX_HOLD. -------------


def test_watchdog_stops_on_not_owner_and_tells_the_holder():
    lost: list[str] = []

    def on_lost(sender: str, name: str, **kwargs: Any) -> None:
        lost.append(name)

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockLost, match="watched"), mutex("watched", ttl=0.3) as lock:
            hold = lock._current()
            assert reset("watched")
            assert wait_until(lambda: lock.lost, timeout=3)
            assert not get_watchdog().watching(hold)
            assert not lock.locked()  # never re-created by a renewal
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert lost == ["watched"]


def test_watchdog_stops_renewing_after_release():
    with mutex("brief", ttl=0.3) as lock:
        hold = lock._current()
        assert get_watchdog().watching(hold)
    assert not get_watchdog().watching(hold)


def test_max_hold_stops_renewal_of_a_hung_holder(caplog):
    with override_settings(CACHES=caches_with(MAX_HOLD=0.4)):
        hung = Mutex("hung", ttl=0.3)
        with caplog.at_level(logging.WARNING, logger="django_redis_mutex"):
            assert hung.acquire()
            assert wait_until(lambda: not hung.locked(), timeout=5)
    assert any("hung" in r.getMessage() and "MAX_HOLD" in r.getMessage() for r in caplog.records)
    assert Mutex("hung", watchdog=False).acquire(blocking=False)


def test_one_renewal_failing_in_a_round_does_not_cost_the_other_holds_their_renewal(raw):
    # A pipeline raises its first error and drops every other reply: one lock
    # key overwritten with a string (EXTEND then fails with WRONGTYPE) used to
    # fail the whole round, every round, until the other locks expired.
    survivor = Mutex("survivor", ttl=1.2, watchdog=False)
    victim = Mutex("victim", ttl=1.2, watchdog=False)
    assert survivor.acquire() and victim.acquire()
    holds = [survivor._current(), victim._current()]
    # Both due at the same moment, so the lane renews them in one pipeline.
    due_from = time.monotonic()
    for hold in holds:
        hold.confirm(hold.alias, due_from, 1.2)
    raw.set(victim.keys.lock, "not a lock")
    for hold in holds:
        get_watchdog().watch(hold)
    try:
        assert wait_until(lambda: victim.lost, timeout=5, what="the victim to be found lost")
        # Past two of the survivor's leases: only renewal keeps it.
        time.sleep(max(0.0, due_from + 2.5 - time.monotonic()))
        assert survivor.owned()
        assert not survivor.lost
    finally:
        get_watchdog().unwatch(holds[0])
        survivor.release()
        raw.delete(victim.keys.lock)


def test_renewal_loads_the_scripts_again_when_the_server_forgot_them(raw):
    with mutex("forgetful", ttl=0.6) as lock:
        raw.script_flush()  # as a restart or a failover does
        time.sleep(1.5)  # past two leases: only renewal keeps it
        assert lock.owned()
        assert not lock.lost
    assert raw.script_exists(scripts.EXTEND.sha) == [True]
