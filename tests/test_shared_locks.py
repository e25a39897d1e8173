"""Shared (read) locks: ``mutex(name, shared=True)`` beside exclusive holds of the same name.

Contenders are real threads (separate owners) and asyncio tasks on the suite's
real redis-server. What is promised: shared holders coexist, an exclusive
holder excludes everyone, a queued exclusive waiter stops new shared holders
(so readers never starve a writer), fences grow across both kinds, and the
reentrancy rules for mixing the two in one owner.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from django_redis_mutex import (
    LockContended,
    LockNotOwned,
    LockUpgradeRefused,
    Mutex,
    held_locks,
    mutex,
    reset,
)

from .helpers import wait_until
from .test_api import held_by_other_thread


def waiter_in_thread(name: str, entered: list[tuple[str, int]], tag: str, **options: Any):  # type: ignore[no-untyped-def]
    """Start a thread that waits for ``name`` and records (tag, fence) once inside."""

    def wait() -> None:
        with mutex(name, timeout=20, **options) as lock:
            entered.append((tag, lock.fence or 0))

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def queued(raw: redis.Redis, namespace_keys: Any, count: int) -> bool:
    queues = [key for key in namespace_keys() if key.endswith(b":queue")]
    return bool(queues) and raw.zcard(queues[0]) == count


def elsewhere(action: Callable[[], Any]) -> Any:
    """Return what ``action`` returns (or raises) when run by another thread: another owner."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(action())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    assert outcome, "the other thread never finished"
    return outcome[0]


def try_once(name: str, **options: Any) -> bool:
    """Try ``name`` once as another owner; give it back at once if it was had."""

    def attempt() -> bool:
        lock = Mutex(name, blocking=False, **options)
        if not lock.acquire():
            return False
        lock.release()
        return True

    return bool(elsewhere(attempt))


def test_shared_holders_hold_together_and_exclude_an_exclusive_one() -> None:
    with (
        held_by_other_thread("report", shared=True) as first,
        mutex("report", shared=True) as second,
    ):
        assert second.owned()
        assert second.fence is not None and second.fence > first["fence"]
        assert not try_once("report")

        def enter_exclusive() -> None:
            with mutex("report", blocking=False):
                pass

        assert isinstance(elsewhere(enter_exclusive), LockContended)
        assert try_once("report", shared=True)
    assert try_once("report")


def test_an_exclusive_holder_excludes_shared_ones() -> None:
    with held_by_other_thread("ledger"):
        assert not try_once("ledger", shared=True)
        with pytest.raises(LockContended), mutex("ledger", shared=True, timeout=0.2):
            pass


def test_a_queued_writer_stops_new_readers_and_gets_the_lock_before_them(
    raw: redis.Redis, namespace_keys: Any
) -> None:
    entered: list[tuple[str, int]] = []
    with held_by_other_thread("catalog", shared=True) as reader:
        writer = waiter_in_thread("catalog", entered, "writer")
        wait_until(lambda: queued(raw, namespace_keys, 1), 10, "the writer queued")
        # A new reader may not join the readers while the writer waits.
        assert not try_once("catalog", shared=True)
        late_reader = waiter_in_thread("catalog", entered, "late-reader", shared=True)
        wait_until(lambda: queued(raw, namespace_keys, 2), 10, "the late reader queued")
        assert entered == []
    writer.join(20)
    late_reader.join(20)
    assert [tag for tag, _ in entered] == ["writer", "late-reader"]
    fences = dict(entered)
    assert reader["fence"] < fences["writer"] < fences["late-reader"]


def test_readers_queued_behind_a_writer_are_admitted_together_when_it_leaves(
    raw: redis.Redis, namespace_keys: Any
) -> None:
    inside = threading.Barrier(4, timeout=20)
    together: list[bool] = []

    def read() -> None:
        with mutex("shelf", shared=True, timeout=20):
            # Every reader waits here for the others: only readers holding
            # the lock at the same moment get past the barrier.
            try:
                inside.wait()
                together.append(True)
            except threading.BrokenBarrierError:
                together.append(False)

    with held_by_other_thread("shelf"):
        readers = [threading.Thread(target=read) for _ in range(3)]
        for thread in readers:
            thread.start()
        wait_until(lambda: queued(raw, namespace_keys, 3), 10, "three readers queued")
    inside.wait()
    for thread in readers:
        thread.join(20)
    assert together == [True, True, True]


def test_a_writers_fence_is_larger_than_every_readers_before_it() -> None:
    fences = []
    for _ in range(3):
        with held_by_other_thread("fenced", shared=True) as reader:
            fences.append(reader["fence"])
    with mutex("fenced") as writer:
        assert writer.fence is not None and writer.fence > max(fences)


def test_a_dead_readers_lease_ends_and_the_writer_gets_in(raw: redis.Redis) -> None:
    # A holder that never releases nor renews: its lease is all that frees it.
    dead = Mutex("orphaned", shared=True, ttl=0.3, watchdog=False)
    assert dead.acquire()
    with mutex("orphaned", timeout=10) as writer:
        assert writer.owned()
    assert not dead.owned()
    with pytest.raises(LockNotOwned):
        dead.release()


def test_one_dead_reader_does_not_keep_the_lock_from_a_writer_after_the_live_ones_leave() -> None:
    dead = Mutex("mixed-leases", shared=True, ttl=0.3, watchdog=False)
    assert dead.acquire()
    with held_by_other_thread("mixed-leases", shared=True):
        assert not try_once("mixed-leases")
    with mutex("mixed-leases", timeout=10) as writer:
        assert writer.owned()


def test_the_watchdog_renews_a_shared_hold_past_its_lease() -> None:
    with mutex("renewed-read", shared=True, ttl=0.8) as reader:
        hold = reader._current()
        assert hold is not None
        wait_until(
            lambda: max(lease.sent for lease in hold.leases.values()) > hold.acquired_at + 0.9,
            10,
            "a renewal sent after the first lease would have ended",
        )
        assert reader.owned()
        assert not try_once("renewed-read")


def test_nesting_shared_in_shared_joins_the_hold() -> None:
    with mutex("nested-read", shared=True) as outer:
        with mutex("nested-read", shared=True) as inner:
            assert inner.fence == outer.fence
        assert outer.owned()


def test_nesting_shared_in_exclusive_joins_the_exclusive_hold() -> None:
    with mutex("write-then-read") as outer:
        with mutex("write-then-read", shared=True) as inner:
            assert inner.fence == outer.fence
        assert outer.owned()
        assert not try_once("write-then-read", shared=True)


def test_nesting_exclusive_in_shared_is_refused_with_a_clear_error() -> None:
    with mutex("read-then-write", shared=True) as reader:
        with (
            pytest.raises(LockUpgradeRefused, match="exclusively inside a shared hold"),
            mutex("read-then-write"),
        ):
            pass
        assert reader.owned()


def test_async_shared_holders_hold_together() -> None:
    async def main() -> tuple[int, int]:
        both = asyncio.Barrier(2)

        async def read() -> int:
            async with mutex("async-read", shared=True, timeout=10) as lock:
                await asyncio.wait_for(both.wait(), 10)
                return lock.fence or 0

        first, second = await asyncio.gather(read(), read())
        return first, second

    first, second = asyncio.run(main())
    assert first != second and min(first, second) > 0


def test_held_locks_lists_a_shared_lock_with_every_holder() -> None:
    with (
        held_by_other_thread("listed-read", shared=True, label="first"),
        mutex("listed-read", shared=True, label="second"),
    ):
        [listed] = [lock for lock in held_locks() if lock.name == "listed-read"]
        assert listed.shared
        assert sorted(holder.owner.label or "" for holder in listed.holders) == [
            "first",
            "second",
        ]
        assert all(holder.time_left > 0 for holder in listed.holders)
    assert [lock for lock in held_locks() if lock.name == "listed-read"] == []


def test_reset_frees_every_shared_holder() -> None:
    first = Mutex("reset-read", shared=True, watchdog=False)
    second = Mutex("reset-read", shared=True, watchdog=False)
    assert first.acquire() and second.acquire()
    assert reset("reset-read")
    assert not first.owned() and not second.owned()
    writer = Mutex("reset-read", blocking=False)
    assert writer.acquire()
    writer.release()


def test_a_shared_flag_that_is_not_a_bool_is_refused() -> None:
    with pytest.raises(TypeError, match="shared must be True or False"):
        mutex("typed", shared="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shared must be True or False"):
        Mutex("typed", shared=1)  # type: ignore[arg-type]
