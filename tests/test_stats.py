"""Contention figures per lock class: counted by real locks, flushed to real Redis, read back.

``STATS`` is turned on for the default alias per test; each test flushes what
it counted before its namespace goes away, so no figure lands in another
test's namespace.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_redis_mutex import (
    LockBackendUnavailable,
    Mutex,
    Semaphore,
    mutex,
    signals,
    stats,
)
from django_redis_mutex.conf import parse_settings
from django_redis_mutex.keys import stats_key

from .helpers import caches_with, wait_until
from .proxy import Proxy


@pytest.fixture
def stats_on() -> Iterator[None]:
    """Count contention on the default alias; write what is left before the namespace goes."""
    with override_settings(CACHES=caches_with(STATS=True)):
        yield
        stats.flush()


def figures(lock_class: str) -> stats.ClassStats:
    stats.flush()
    report = stats.read_stats("default", minutes=5)
    [found] = [c for c in report.classes if c.lock_class == lock_class]
    return found


def product_lock(pk: int, **options: Any) -> Mutex:
    lock = Mutex(f"product:{pk}", **options)
    lock.lock_class = "product:{pk}"
    return lock


def contend_in_threads(pk: int) -> None:
    """One thread holds the lock until another is queued behind it; a third gives up."""
    holder = product_lock(pk)
    assert holder.acquire()
    queued = threading.Event()

    def on_waiting(sender: str, name: str, waiting: bool, **kwargs: Any) -> None:
        if waiting and name == f"product:{pk}":
            queued.set()

    signals.lock_waiting.connect(on_waiting)
    waiter = product_lock(pk)
    thread = threading.Thread(target=lambda: waiter.acquire() and waiter.release())
    try:
        thread.start()
        assert queued.wait(30)
        refused = product_lock(pk)
        assert not refused.acquire(blocking=False)
    finally:
        signals.lock_waiting.disconnect(on_waiting)
        holder.release()
        thread.join(30)
    assert not thread.is_alive()


def test_contended_class_counts_acquisitions_waits_and_give_ups(stats_on: None) -> None:
    contend_in_threads(1)
    contend_in_threads(2)  # another name of the same class

    found = figures("product:{pk}")
    assert (found.acquired, found.waited, found.contended, found.lost) == (4, 2, 2, 0)
    assert found.waited_share == 0.5
    assert found.hold_p50 is not None and found.hold_p99 is not None
    assert found.wait_p99 is not None and found.wait_p50 is not None
    assert found.wait_p50 <= found.wait_p99
    assert sum(found.per_window) == found.contention == 4


def test_figures_live_in_one_expiring_hash_per_window(stats_on: None, raw: Any) -> None:
    from django_redis_mutex.client import namespace

    with mutex("report:{day}"):
        pass
    stats.flush()
    [window] = stats.read_stats("default", minutes=1).windows
    key = stats_key(namespace("default"), window)
    assert raw.hget(key, "a|report:{day}") == b"1"
    assert 0 < raw.ttl(key) <= stats.RETENTION + stats.WINDOW


def test_figures_are_not_counted_without_the_setting(raw: Any) -> None:
    with mutex("report:{day}"):
        pass
    with override_settings(CACHES=caches_with(STATS=True)):
        stats.flush()
        assert stats.read_stats("default", minutes=1).classes == ()


def test_retry_after_without_history_is_the_holders_time_so_far(stats_on: None) -> None:
    # No hold of the class is known yet: the lease (30 s, renewed by the
    # watchdog) says nothing of when the holder is done, and the estimate is
    # the holder's time so far, so callers told again and again back off.
    holder = Mutex("fresh:1", ttl=30)
    assert holder.acquire()
    try:
        assert wait_until(lambda: holder.time_left() <= 27.5, timeout=10)
        contender = Mutex("fresh:1")
        assert not contender.acquire(blocking=False)
        held = 30 - holder.time_left()
        assert 2 <= contender.contended().retry_after <= held + 2
    finally:
        holder.release()


def test_a_writer_refused_by_shared_holders_is_told_the_latest_ones_time_so_far(
    stats_on: None,
) -> None:
    # Every shared holder must leave before the writer gets in: the latest
    # taken says most, and its time so far is the estimate without history.
    first = Mutex("read:1", ttl=30, shared=True)
    assert first.acquire()
    try:
        assert wait_until(lambda: first.time_left() <= 27.5, timeout=10)
        latest = Mutex("read:1", ttl=30, shared=True)
        assert latest.acquire()
        try:
            assert wait_until(lambda: latest.time_left() <= 28.5, timeout=10)
            contender = Mutex("read:1")
            assert not contender.acquire(blocking=False)
            refused = contender.contended()
            held = 30 - latest.time_left()
            # Not the 30 s lease, nor the first holder's 2.5 s and more.
            assert 1 <= refused.retry_after <= held + 1 < 30 - first.time_left()
            assert refused.owner is not None and refused.owner.pid == os.getpid()
        finally:
            latest.release()
    finally:
        first.release()


def test_a_full_semaphore_tells_the_longest_held_permits_time_so_far(stats_on: None) -> None:
    # The permit held longest is likely the first to come free.
    oldest = Semaphore("slots", 2, ttl=30)
    assert oldest.acquire()
    try:
        assert wait_until(lambda: oldest.time_left() <= 27.5, timeout=10)
        newest = Semaphore("slots", 2, ttl=30)
        assert newest.acquire()
        try:
            refused = Semaphore("slots", 2)
            assert not refused.acquire(blocking=False)
            held = 30 - oldest.time_left()
            assert 2 <= refused.contended().retry_after <= held + 1
        finally:
            newest.release()
    finally:
        oldest.release()


def test_a_semaphore_is_counted_apart_from_a_lock_of_the_same_name(stats_on: None) -> None:
    permits = [Semaphore("jobs", 2), Semaphore("jobs", 2)]
    assert all(permit.acquire() for permit in permits)
    try:
        assert not Semaphore("jobs", 2).acquire(blocking=False)
    finally:
        for permit in permits:
            permit.release()
    with mutex("jobs"):
        pass
    stats.flush()
    report = stats.read_stats("default", minutes=5)
    found = {(c.kind, c.lock_class): c for c in report.classes if c.lock_class == "jobs"}
    assert set(found) == {("semaphore", "jobs"), ("lock", "jobs")}
    counted, lock = found["semaphore", "jobs"], found["lock", "jobs"]
    assert (counted.acquired, counted.contended, lock.acquired, lock.contended) == (2, 1, 1, 0)
    assert counted.label == "jobs (semaphore)" and lock.label == "jobs"


@pytest.mark.parametrize("held_first", [0.0, 0.05])
def test_retry_after_of_short_holds_is_one_second(stats_on: None, held_first: float) -> None:
    for _ in range(20):
        with Mutex("quick:1", ttl=30):
            pass
    holder = Mutex("quick:1", ttl=30)
    assert holder.acquire()
    try:
        # Refused at once, or once the holder outlasted every recent hold.
        threading.Event().wait(held_first)
        contender = Mutex("quick:1")
        assert not contender.acquire(blocking=False)
        # The lease says 30 s; twenty holds of a few ms say "try again at once".
        assert contender.contended().retry_after == 1
    finally:
        holder.release()


def test_retry_after_is_what_is_left_of_the_usual_hold(stats_on: None) -> None:
    done = threading.Event()
    with Mutex("slow:1", ttl=30):
        done.wait(2.5)  # the history: one hold of 2.5 s
    holder = Mutex("slow:1", ttl=30)
    assert holder.acquire()
    try:
        contender = Mutex("slow:1")
        assert not contender.acquire(blocking=False)
        assert 2 <= contender.contended().retry_after <= 3
    finally:
        holder.release()


def test_counts_survive_a_flush_to_a_redis_that_is_down(redis_url: str) -> None:
    from urllib.parse import urlsplit

    port = urlsplit(redis_url).port or 0
    proxy = Proxy(port).start()
    caches = caches_with(STATS=True)
    caches["default"]["LOCATION"] = proxy.url
    try:
        with override_settings(CACHES=caches):
            with mutex("billing:{run}"):
                pass
            proxy.close()
            with pytest.raises(LockBackendUnavailable):
                stats.flush()
    finally:
        proxy.close()
    # Redis is back (reached directly now): the next flush writes what the failed one kept.
    with override_settings(CACHES=caches_with(STATS=True)):
        assert figures("billing:{run}").acquired == 1


def test_a_forked_child_starts_with_nothing_to_write(stats_on: None) -> None:
    with mutex("fork:{n}"):
        pass
    assert stats._pending
    pid = os.fork()
    if pid == 0:  # the child: exit at once, with what it found
        os._exit(0 if not stats._pending and stats._flusher is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert figures("fork:{n}").acquired == 1  # the parent's count, written once


def test_figures_of_processes_are_written_at_their_exit(stats_on: None, spawn: Any) -> None:
    workers = [spawn("stats_cycles.py", 5) for _ in range(2)]
    for worker in workers:
        worker.expect("done")
        assert worker.finish() == 0
    assert figures("cycle:{n}").acquired == 10


def test_flush_interval_is_checked_where_it_is_set() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"STATS_FLUSH_INTERVAL.*at least 0.5"):
        parse_settings("default", {"STATS": True, "STATS_FLUSH_INTERVAL": 0})
    with pytest.raises(ImproperlyConfigured, match=r"STATS_FLUSH_INTERVAL.*number of seconds"):
        parse_settings("default", {"STATS_FLUSH_INTERVAL": "10"})
    assert parse_settings("default", {"STATS": True}).stats_flush_interval == 10


def test_the_background_flusher_writes_without_being_asked() -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = {
        **caches["default"]["MUTEX"],
        "STATS": True,
        "STATS_FLUSH_INTERVAL": 0.5,
    }
    with override_settings(CACHES=caches):
        try:
            with mutex("tick:{n}"):
                pass

            def written() -> bool:
                classes = stats.read_stats("default", minutes=2).classes
                return any(c.lock_class == "tick:{n}" for c in classes)

            wait_until(written, 30, "the background flusher to write the figures", 0.1)
        finally:
            stats.flush()
