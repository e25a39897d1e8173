"""The public contract of ``mutex()``, ``Mutex``, reentrancy, loss and introspection.

Every test runs against the suite's real redis-server; contenders are real
threads, which are separate lock owners exactly like separate processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.test import override_settings

from django_redis_mutex import (
    HeldLock,
    LockContended,
    LockLost,
    LockNotOwned,
    Mutex,
    Owner,
    held_locks,
    mutex,
    reset,
    reset_all,
)

from .helpers import cache_options, caches_with, take_and_release, wait_until


@contextmanager
def held_by_other_thread(name: str, **options: Any) -> Iterator[dict[str, Any]]:
    """Hold lock ``name`` from another thread (another owner) until the block ends."""
    acquired = threading.Event()
    done = threading.Event()
    info: dict[str, Any] = {}

    def hold() -> None:
        with mutex(name, **options) as lock:
            info["fence"] = lock.fence
            info["thread"] = threading.current_thread().name
            acquired.set()
            done.wait(30)

    thread = threading.Thread(target=hold, name="holder-thread")
    thread.start()
    assert acquired.wait(5), "the holder thread never got the lock"
    try:
        yield info
    finally:
        done.set()
        thread.join(10)


def in_thread(func: Any) -> Any:
    """Run ``func`` in a new thread (a different lock owner) and return its result."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = func()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in result:
        raise result["error"]
    return result["value"]


# -- with block and the handle ----------------------------------------------


def test_with_block_gives_handle_with_name_token_and_fence():
    with mutex("inventory") as lock:
        assert isinstance(lock, Mutex)
        assert lock.name == "inventory"
        assert isinstance(lock.token, str) and len(lock.token) >= 16
        assert isinstance(lock.fence, int) and lock.fence > 0


def test_with_block_holds_lock_only_inside():
    with mutex("inventory") as lock:
        assert lock.owned()
        assert Mutex("inventory").locked()
    assert not Mutex("inventory").locked()
    assert lock.token is None
    assert not lock.owned()


def test_mutex_handle_is_itself_a_context_manager():
    handle = Mutex("direct")
    with handle as lock:
        assert lock is handle
        assert handle.owned()
    assert not handle.locked()


def test_fence_grows_with_every_acquisition():
    fences = []
    for _ in range(3):
        with mutex("fenced") as lock:
            fences.append(lock.fence)
    assert fences == sorted(fences)
    assert len(set(fences)) == 3


def test_ttl_reports_seconds_left_on_the_lease():
    with mutex("leased", ttl=20, watchdog=False) as lock:
        assert 15 < lock.time_left() <= 20


def test_ttl_is_zero_when_handle_holds_nothing():
    assert Mutex("idle").time_left() == 0.0


def test_extend_sets_remaining_lease_to_given_ttl():
    with mutex("extended", ttl=5, watchdog=False) as lock:
        lock.extend(60)
        assert 55 < lock.time_left() <= 60


def test_extend_without_ttl_restores_handle_ttl():
    with mutex("extended", ttl=20, watchdog=False) as lock:
        lock.extend(2)
        assert lock.time_left() <= 2
        lock.extend()
        assert 15 < lock.time_left() <= 20


def test_extend_on_handle_not_holding_raises_lock_not_owned():
    with pytest.raises(LockNotOwned, match="extended"):
        Mutex("extended").extend(5)


def test_owner_reports_host_pid_thread_and_label():
    with mutex("owned", label="nightly report"):
        owner = Mutex("owned").owner()
    assert owner is not None
    assert owner.pid == os.getpid()
    assert owner.thread == threading.current_thread().name
    assert owner.label == "nightly report"
    assert isinstance(owner.host, str) and owner.host


def test_owner_is_none_when_free():
    assert Mutex("free").owner() is None


def test_owned_is_false_for_another_handle_on_held_lock():
    with held_by_other_thread("shared"):
        other = Mutex("shared")
        assert other.locked()
        assert not other.owned()


# -- acquire / release --------------------------------------------------------


def test_acquire_and_release_explicitly():
    lock = Mutex("explicit")
    assert lock.acquire() is True
    assert lock.owned()
    lock.release()
    assert not lock.locked()


def test_acquire_returns_false_when_held_by_another_owner():
    with held_by_other_thread("busy"):
        assert Mutex("busy").acquire(blocking=False) is False


def test_non_blocking_acquire_returns_at_once():
    with held_by_other_thread("busy"):
        started = time.monotonic()
        assert Mutex("busy").acquire(blocking=False) is False
        assert time.monotonic() - started < 0.5


def test_blocking_acquire_gives_up_after_timeout():
    with held_by_other_thread("busy"):
        started = time.monotonic()
        assert Mutex("busy").acquire(timeout=0.3) is False
        elapsed = time.monotonic() - started
    assert 0.28 <= elapsed < 2.0


def test_explicit_timeout_none_waits_past_the_default_timeout():
    with override_settings(CACHES=caches_with(TIMEOUT=0.2)):
        holder = Mutex("slow")
        assert holder.acquire()
        # The holder keeps the lock three times longer than the default TIMEOUT.
        timer = threading.Timer(0.6, holder.release)
        timer.start()
        waiter = Mutex("slow", timeout=None)
        started = time.monotonic()
        got = in_thread(waiter.acquire)
        elapsed = time.monotonic() - started
        timer.join(5)
        assert got is True
        assert elapsed >= 0.5
        waiter.release()


def test_default_timeout_comes_from_settings():
    with override_settings(CACHES=caches_with(TIMEOUT=0.2)), held_by_other_thread("busy"):
        started = time.monotonic()
        assert Mutex("busy").acquire() is False
        assert time.monotonic() - started < 2.0


def test_waiter_gets_lock_as_soon_as_holder_releases():
    holder = Mutex("handoff")
    assert holder.acquire()
    waiting = threading.Event()
    got: dict[str, float] = {}

    def wait_for_it() -> None:
        lock = Mutex("handoff", timeout=10)
        waiting.set()
        assert lock.acquire()
        got["at"] = time.monotonic()
        lock.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    assert waiting.wait(5)
    assert wait_until(lambda: held_locks()[0].waiters == 1)
    released_at = time.monotonic()
    holder.release()
    thread.join(10)
    assert got["at"] - released_at < 0.8  # woken by the release, not a 1 s check-in


def test_release_on_never_acquired_handle_raises_lock_not_owned():
    with pytest.raises(LockNotOwned, match="never-held"):
        Mutex("never-held").release()


def test_release_twice_raises_lock_not_owned():
    lock = Mutex("twice")
    assert lock.acquire()
    lock.release()
    with pytest.raises(LockNotOwned, match="twice"):
        lock.release()


def test_release_after_expiry_raises_lock_not_owned():
    lock = Mutex("short", ttl=0.1, watchdog=False)
    assert lock.acquire()
    assert wait_until(lambda: not lock.locked())
    with pytest.raises(LockNotOwned, match="short"):
        lock.release()


# -- LockContended --------------------------------------------------------------


def test_with_block_raises_lock_contended_when_held():
    with (
        held_by_other_thread("busy", label="holder") as info,
        pytest.raises(LockContended) as caught,
        mutex("busy", blocking=False),
    ):
        pytest.fail("the body must not run")
    error = caught.value
    assert error.name == "busy"
    assert error.retry_after >= 1
    assert error.owner is not None
    assert error.owner.thread == info["thread"]
    assert error.owner.label == "holder"
    assert "busy" in str(error)


def test_retry_after_reflects_holder_lease():
    with (
        held_by_other_thread("busy", ttl=20, watchdog=False),
        pytest.raises(LockContended) as caught,
        mutex("busy", timeout=0),
    ):
        pytest.fail("the body must not run")
    assert 15 <= caught.value.retry_after <= 20


def test_decorated_function_raises_lock_contended_when_held():
    calls = []

    @mutex("busy", blocking=False)
    def work() -> None:
        calls.append(1)

    with held_by_other_thread("busy"), pytest.raises(LockContended):
        work()
    assert calls == []


def test_blocking_false_with_timeout_is_a_value_error():
    with pytest.raises(ValueError, match="timeout"):
        Mutex("x", blocking=False, timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        Mutex("x").acquire(blocking=False, timeout=5)


# -- reentrancy ---------------------------------------------------------------


def test_nested_with_in_same_thread_reenters_same_hold():
    with mutex("nested") as outer, mutex("nested") as inner:
        assert inner.fence == outer.fence
        assert inner.token == outer.token


def test_lock_is_released_only_when_outermost_block_exits():
    with mutex("nested") as outer:
        with mutex("nested"):
            pass
        assert outer.owned()
        assert Mutex("nested").locked()
    assert not Mutex("nested").locked()


def test_explicit_acquire_nests_and_needs_matching_releases():
    lock = Mutex("counted")
    assert lock.acquire()
    assert lock.acquire()
    lock.release()
    assert lock.owned()
    lock.release()
    assert not lock.locked()


def test_other_thread_contends_while_lock_held_reentrantly():
    with mutex("nested"), mutex("nested"):
        assert in_thread(lambda: Mutex("nested").acquire(blocking=False)) is False


def test_non_reentrant_nested_attempt_contends():
    with mutex("strict"):
        assert Mutex("strict", reentrant=False).acquire(blocking=False) is False
        with pytest.raises(LockContended), mutex("strict", reentrant=False, blocking=False):
            pass


def test_non_reentrant_handle_acquired_twice_contends_with_itself():
    lock = Mutex("strict", reentrant=False)
    assert lock.acquire()
    assert lock.acquire(blocking=False) is False
    lock.release()
    assert not lock.locked()


def test_nested_acquire_after_own_lease_expired_contends_with_new_owner():
    first = Mutex("lapsed", ttl=0.1, watchdog=False)
    assert first.acquire()
    assert wait_until(lambda: not first.locked())
    other = Mutex("lapsed", watchdog=False)
    assert in_thread(other.acquire)
    # The first hold is gone: this thread must contend, not re-enter it.
    assert Mutex("lapsed").acquire(blocking=False) is False
    other.release()


def test_nested_acquire_reenters_a_hold_the_watchdog_renewed():
    with mutex("renewed", ttl=0.8) as outer:
        past_first_lease = time.monotonic() + 2.0
        while time.monotonic() < past_first_lease:
            assert outer.owned()
            time.sleep(0.05)
        with mutex("renewed") as inner:
            assert inner.fence == outer.fence


def test_nested_acquire_reenters_a_hold_extended_past_its_ttl():
    with mutex("extended", ttl=0.2, watchdog=False) as outer:
        outer.extend(10)
        time.sleep(0.4)  # past the first 0.2 s lease
        assert outer.owned()
        with mutex("extended") as inner:
            assert inner.fence == outer.fence


def test_recursive_decorated_function_reenters():
    depths = []

    @mutex("recursive")
    def countdown(n: int) -> int:
        depths.append(n)
        return n if n == 0 else countdown(n - 1)

    assert countdown(3) == 0
    assert depths == [3, 2, 1, 0]
    assert not Mutex("recursive").locked()


# -- decorator and name templates ---------------------------------------------


def test_decorator_holds_lock_during_call_and_returns_result():
    @mutex("report")
    def build(x: int) -> tuple[int, bool]:
        return x * 2, Mutex("report").locked()

    assert build(21) == (42, True)
    assert not Mutex("report").locked()


def test_one_mutex_object_shared_by_threads_excludes_them():
    guard = mutex("shared-object", timeout=10)
    inside = 0
    most = 0
    count_lock = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(5):
            with guard:
                with count_lock:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.002)
                with count_lock:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most == 1
    assert not Mutex("shared-object").locked()


def test_decorator_keeps_function_name_and_doc():
    @mutex("report")
    def build() -> None:
        """Build the report."""

    assert build.__name__ == "build"
    assert build.__doc__ == "Build the report."


def test_template_filled_from_positional_and_keyword_arguments():
    seen = []

    @mutex("order:{order_id}")
    def process(order_id: int) -> None:
        seen.append([h.name for h in held_locks()])

    process(7)
    process(order_id=8)
    assert seen == [["order:7"], ["order:8"]]


def test_template_applies_parameter_defaults():
    seen = []

    @mutex("{region}:{order_id}")
    def process(order_id: int, region: str = "eu") -> None:
        seen.append(held_locks()[0].name)

    process(1)
    process(2, region="us")
    assert seen == ["eu:1", "us:2"]


def test_template_reads_var_keyword_arguments():
    seen = []

    @mutex("job:{kind}")
    def run(**kwargs: Any) -> None:
        seen.append(held_locks()[0].name)

    run(kind="email")
    assert seen == ["job:email"]


def test_template_double_braces_are_literal():
    seen = []

    @mutex("set{{x}}:{n}")
    def run(n: int) -> None:
        seen.append(held_locks()[0].name)

    run(5)
    assert seen == ["set{x}:5"]


def test_template_attribute_of_self_on_method():
    class Product:
        def __init__(self, pk: int) -> None:
            self.pk = pk

        @mutex("product:{self.pk}")
        def restock(self, amount: int) -> str:
            return held_locks()[0].name

    assert Product(3).restock(10) == "product:3"


def test_same_template_different_arguments_are_different_locks():
    @mutex("order:{order_id}", blocking=False)
    def process(order_id: int) -> bool:
        return True

    with held_by_other_thread("order:1"):
        assert process(2) is True
        with pytest.raises(LockContended):
            process(1)


def test_callable_name_receives_call_arguments():
    seen = []

    @mutex(lambda order_id, region="eu": f"{region}/{order_id}")
    def process(order_id: int, region: str = "eu") -> None:
        seen.append(held_locks()[0].name)

    process(4, region="us")
    assert seen == ["us/4"]


def test_with_block_name_is_literal():
    with mutex("a{b}") as lock:
        assert lock.name == "a{b}"
        assert [h.name for h in held_locks()] == ["a{b}"]


def test_template_naming_missing_argument_fails_at_call_naming_placeholder():
    @mutex("order:{order_pk}")
    def process(order_id: int) -> None:
        pytest.fail("the body must not run")

    with pytest.raises(ValueError, match="order_pk"):
        process(1)


# -- losing the lock ----------------------------------------------------------


def test_exit_raises_lock_lost_when_lock_reset_during_successful_body():
    with pytest.raises(LockLost, match="victim"), mutex("victim", watchdog=False):
        assert reset("victim")


def test_exit_raises_lock_lost_when_lock_expired_during_body():
    with pytest.raises(LockLost), mutex("expiring", ttl=0.1, watchdog=False) as lock:
        assert wait_until(lambda: not lock.locked())


def test_raise_on_lost_false_logs_error_instead(caplog):
    with (
        override_settings(CACHES=caches_with(RAISE_ON_LOST=False)),
        caplog.at_level(logging.ERROR, logger="django_redis_mutex"),
        mutex("victim", watchdog=False),
    ):
        reset("victim")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("victim" in r.getMessage() for r in errors)


def test_watchdog_keeps_lock_beyond_its_ttl():
    with mutex("renewed", ttl=0.8) as lock:
        deadline = time.monotonic() + 2.4
        while time.monotonic() < deadline:
            assert lock.owned()
            time.sleep(0.05)
    assert not lock.lost


def test_without_watchdog_lock_expires_after_ttl():
    lock = Mutex("unwatched", ttl=0.3, watchdog=False)
    assert lock.acquire()
    assert wait_until(lambda: not lock.locked(), timeout=3)
    assert not lock.owned()


def test_watchdog_marks_holder_lost_when_lock_disappears():
    with pytest.raises(LockLost), mutex("watched", ttl=0.3) as lock:
        assert reset("watched")
        assert wait_until(lambda: lock.lost, timeout=3)


def test_max_hold_stops_renewal():
    with (
        override_settings(CACHES=caches_with(MAX_HOLD=1.2)),
        pytest.raises(LockLost),
        mutex("capped", ttl=0.8) as lock,
    ):
        started = time.monotonic()
        assert wait_until(lambda: not lock.locked(), timeout=5)
        held = time.monotonic() - started
    assert 1.15 <= held < 4.0


# -- held_locks, reset, reset_all ---------------------------------------------


def test_held_locks_describes_each_held_lock():
    before = datetime.now(timezone.utc)
    with mutex("described", ttl=20, watchdog=False, label="job"):
        [held] = held_locks()
    assert isinstance(held, HeldLock)
    assert held.name == "described"
    assert held.owner == Owner(
        host=socket.gethostname(),
        pid=os.getpid(),
        thread=threading.current_thread().name,
        label="job",
    )
    assert held.acquired_at.tzinfo is not None
    assert before - timedelta(seconds=2) <= held.acquired_at <= before + timedelta(seconds=5)
    assert isinstance(held.time_left, float) and 15 < held.time_left <= 20
    assert held.waiters == 0


def test_held_locks_fence_matches_holder():
    with mutex("fenced") as lock:
        assert held_locks()[0].fence == lock.fence


def test_held_locks_counts_waiters():
    with held_by_other_thread("popular"):
        thread = threading.Thread(target=take_and_release, args=(Mutex("popular", timeout=10),))
        thread.start()
        assert wait_until(lambda: held_locks()[0].waiters == 1)
    thread.join(10)


def test_held_locks_lists_nothing_when_free():
    with mutex("gone"):
        pass
    assert held_locks() == []


def test_reset_force_releases_held_lock():
    lock = Mutex("stuck", watchdog=False)
    assert lock.acquire()
    assert reset("stuck") is True
    assert not lock.locked()


def test_reset_of_free_lock_returns_false():
    assert reset("nobody") is False


def queued_waiter(waiter: Mutex) -> tuple[threading.Event, threading.Thread]:
    """Start a thread acquiring ``waiter``; return once it queued (event set when it got it)."""
    got = threading.Event()

    def wait_for_it() -> None:
        if waiter.acquire():
            got.set()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    assert wait_until(lambda: held_locks()[0].waiters == 1)
    return got, thread


def test_reset_hands_lock_to_waiter():
    holder = Mutex("stuck", watchdog=False)
    assert holder.acquire()
    waiter = Mutex("stuck", timeout=10)
    got, thread = queued_waiter(waiter)
    started = time.monotonic()
    assert reset("stuck")
    assert got.wait(5)
    assert time.monotonic() - started < 1.0
    thread.join(5)
    assert waiter.fence > holder.fence
    waiter.release()


def test_reset_all_releases_every_lock_and_counts_them():
    locks = [Mutex(name, watchdog=False) for name in ("one", "two", "three")]
    for lock in locks:
        assert lock.acquire()
    assert reset_all() == 3
    assert held_locks() == []
    assert not any(lock.locked() for lock in locks)


def test_reset_all_hands_locks_to_waiters():
    holders = [Mutex(name, watchdog=False) for name in ("one", "two")]
    for lock in holders:
        assert lock.acquire()
    waiters = [Mutex(name, timeout=10) for name in ("one", "two")]
    threads = [threading.Thread(target=w.acquire) for w in waiters]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: sum(h.waiters for h in held_locks()) == 2)
    assert reset_all() == 2
    for thread in threads:
        thread.join(5)
    assert all(w.fence is not None for w in waiters)
    assert sorted(h.name for h in held_locks()) == ["one", "two"]
    for waiter in waiters:
        waiter.release()


def test_reset_all_returns_zero_when_nothing_held():
    assert reset_all() == 0


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


# -- owner records and renamed names ------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"host": 7, "pid": "12", "thread": null, "label": ["x"]}', Owner()),
        (b'{"host": "web1", "pid": true, "extra": 1}', Owner(host="web1")),
    ],
    ids=["not-json", "not-an-object", "wrong-types", "partial"],
)
def test_owner_read_from_a_damaged_record_never_fails(raw, stored, expected):
    with mutex("damaged") as lock:
        raw.hset(lock.keys.lock, "owner", stored)
        assert Mutex("damaged").owner() == expected
        [held] = held_locks()
        # A lock always lists an owner, empty when its record is unreadable.
        assert held.owner == (expected or Owner())


def test_owner_reads_as_one_line():
    assert str(Owner("web1", 12, "Thread-3", "import")) == "import (web1, pid 12, thread Thread-3)"
    assert str(Owner("web1", 12, None, None)) == "web1, pid 12"
    assert str(Owner(label="import")) == "import"
    assert str(Owner()) == "unknown owner"


def test_dict_style_owner_access_still_answers_with_a_deprecation_warning():
    owner = Owner("web1", 12, "Thread-3", "import")
    with pytest.warns(DeprecationWarning, match=r"owner\.host"):
        assert owner["host"] == "web1"
    with pytest.warns(DeprecationWarning, match=r"owner\.label"):
        assert owner.get("label") == "import"
    with pytest.warns(DeprecationWarning):
        assert owner.get("nonsense", "fallback") == "fallback"
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        owner["nonsense"]


def test_old_names_of_time_left_warn_and_answer_the_same():
    with mutex("renamed", ttl=20) as lock:
        with pytest.warns(DeprecationWarning, match=r"time_left\(\)"):
            old = lock.ttl()
        assert 15 < old <= 20
        assert 15 < lock.time_left() <= old
        [held] = held_locks()
        with pytest.warns(DeprecationWarning, match="time_left"):
            assert held.ttl == held.time_left


def test_old_async_name_of_time_left_warns_and_answers():
    async def main() -> tuple[float, float]:
        async with mutex("renamed-async", ttl=20) as lock:
            with pytest.warns(DeprecationWarning, match=r"atime_left\(\)"):
                old = await lock.attl()
            return old, await lock.atime_left()

    old, new = asyncio.run(main())
    assert 15 < new <= old <= 20


def in_other_thread(func: Any) -> Any:
    """Run ``func`` in a new thread (another lock owner) and return its result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(func()))
    thread.start()
    thread.join(10)
    return result[0]


# -- Release checks the owner: an expired holder never deletes its successor's lock. ---


def test_release_after_expiry_keeps_new_owners_lock():
    old = Mutex("ledger", ttl=0.1, watchdog=False)
    assert old.acquire()
    assert wait_until(lambda: not old.locked())
    new = Mutex("ledger", watchdog=False)
    assert in_other_thread(new.acquire)
    with pytest.raises(LockNotOwned):
        old.release()
    assert new.owned()
    new.release()


def test_lock_can_be_released_from_another_thread():
    lock = Mutex("handover")
    assert lock.acquire()
    thread = threading.Thread(target=lock.release)
    thread.start()
    thread.join(10)
    assert not lock.locked()
    assert lock.token is None


# -- An exception from the body is never replaced by a lock error on the way out. ---


def test_exit_keeps_body_exception_when_lock_was_lost():
    with pytest.raises(KeyError, match="from the body"), mutex("victim", watchdog=False):
        reset("victim")
        raise KeyError("from the body")


# -- A dead holder's waiter wakes at the lease end; a releaser never barges the queue. ---


def test_waiter_behind_a_dead_holder_is_woken_at_its_ttl_expiry():
    dead = Mutex("orphaned", ttl=0.5, watchdog=False)
    assert dead.acquire()  # and never released: its owner "died"
    started = time.monotonic()
    waiter = Mutex("orphaned", timeout=10)
    assert waiter.acquire()
    assert time.monotonic() - started < 2.0
    waiter.release()


def test_releasing_owner_cannot_barge_ahead_of_a_waiter():
    holder = Mutex("fair")
    assert holder.acquire()
    waiter = Mutex("fair", timeout=10)
    got, thread = queued_waiter(waiter)
    holder.release()
    assert holder.acquire(blocking=False) is False
    assert got.wait(5)
    thread.join(5)
    waiter.release()


# -- Clients built with decode_responses work. -------------------------------------


def test_client_with_decode_responses_works():
    entries = caches_with()
    entries["default"]["OPTIONS"] = {
        **entries["default"].get("OPTIONS", {}),
        **cache_options(decode_responses=True),
    }
    with override_settings(CACHES=entries):
        with mutex("decoded", ttl=20, label="utf-8 ✓") as lock:
            assert lock.owned()
            assert 15 < lock.time_left() <= 20
            lock.extend(25)
            assert (owner := Mutex("decoded").owner()) is not None and owner.label == "utf-8 ✓"
            [held] = held_locks()
            assert held.name == "decoded" and held.fence == lock.fence
            assert in_other_thread(lambda: Mutex("decoded").acquire(blocking=False)) is False
        assert not lock.locked()


# -- Fencing tokens keep growing after their counter expired. ----------------------


def test_fence_keeps_growing_after_its_counter_expired(raw):
    with mutex("fenced") as lock:
        first = lock.fence
        fence_key = lock.keys.fence
    raw.delete(fence_key)  # as if unused past the counter's retention
    with mutex("fenced") as lock:
        assert lock.fence > first


def test_a_free_name_leaves_only_its_fence_counter_and_that_for_an_hour(raw):
    with mutex("fleeting") as lock:
        keys = lock.keys
    left = [key for key in keys.script_keys if raw.exists(key)]
    assert left == [keys.fence]
    assert 3_500_000 < raw.pttl(keys.fence) <= 3_600_000


def test_clients_forgotten_when_caches_change_leave_no_open_socket_behind():
    # A pool dropped with its sockets open warns (ResourceWarning) whenever it
    # is collected, which the suite turns into a failure of whatever test runs
    # then: the idle connections of forgotten clients are closed at once.
    from django_redis_mutex.client import clear_clients, get_blocking_client, get_client

    plain, blocking = get_client("default"), get_blocking_client("default", 1.0)
    pools = [plain.connection_pool, blocking.connection_pool]
    for pool in pools:  # one connected, idle connection each (no command: ACL users run this)
        pool.release(pool.get_connection())
    assert all(pool._available_connections for pool in pools)
    clear_clients()
    assert [
        connection._sock
        for pool in pools
        for connection in pool._available_connections
        if connection._sock is not None
    ] == []
