"""``@skip_if_locked``: run under the lock, or skip the call while another owner holds it.

The decorator for tasks whose duplicates are dropped, not queued; here it
decorates plain sync and async functions (tests/test_celery.py and
tests/test_django_tasks.py run it in real task workers).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from django_redis_mutex import LockContended, Mutex, mutex, skip_if_locked
from django_redis_mutex.signals import lock_contended


@contextmanager
def held_elsewhere(name: str) -> Iterator[Mutex]:
    """Hold ``name`` from another thread (another owner) until the block ends."""
    lock = Mutex(name, ttl=60)
    thread = threading.Thread(target=lock.acquire, kwargs={"blocking": False})
    thread.start()
    thread.join()
    assert lock.owned()
    try:
        yield lock
    finally:
        lock.release()


@skip_if_locked("sync:{account_id}")
def sync_account(account_id: int, calls: list[int]) -> str:
    calls.append(account_id)
    assert Mutex(f"sync:{account_id}").locked()
    return "synced"


@skip_if_locked("sync:{account_id}")
async def async_sync_account(account_id: int, calls: list[int]) -> str:
    calls.append(account_id)
    assert await Mutex(f"sync:{account_id}").alocked()
    return "synced"


def test_runs_under_the_lock_when_free_and_releases_it() -> None:
    calls: list[int] = []
    assert sync_account(1, calls) == "synced"
    assert calls == [1]
    assert not Mutex("sync:1").locked()


def test_skips_without_calling_while_another_owner_holds_the_lock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    contended: list[str] = []

    def record(sender: str, name: str, **kwargs: Any) -> None:
        contended.append(name)

    lock_contended.connect(record, weak=False)
    try:
        with held_elsewhere("sync:1"), caplog.at_level(logging.INFO, "django_redis_mutex"):
            assert sync_account(1, calls) is None
            assert sync_account(2, calls) == "synced"
    finally:
        lock_contended.disconnect(record)
    assert calls == [2]
    assert contended == ["sync:1"]
    assert "Skipped sync_account: lock 'sync:1' is held" in caplog.text


def test_async_function_is_skipped_while_held_and_runs_when_free() -> None:
    calls: list[int] = []
    with held_elsewhere("sync:3"):
        assert asyncio.run(async_sync_account(3, calls)) is None
    assert asyncio.run(async_sync_account(3, calls)) == "synced"
    assert calls == [3]


def test_waits_up_to_its_timeout_and_runs_if_the_lock_comes_free() -> None:
    calls: list[int] = []
    lock = Mutex("sync:4", ttl=60)
    assert lock.acquire()
    timer = threading.Timer(0.2, lock.release)
    timer.start()
    try:

        @skip_if_locked("sync:{account_id}", timeout=10)
        def patient(account_id: int) -> str:
            calls.append(account_id)
            return "synced"

        assert patient(4) == "synced"
    finally:
        timer.join()
    assert calls == [4]


def test_contention_of_another_lock_inside_the_body_is_not_a_skip() -> None:
    @skip_if_locked("outer")
    def body() -> None:
        with mutex("inner", timeout=0):
            pass

    with held_elsewhere("inner"), pytest.raises(LockContended) as raised:
        body()
    assert raised.value.name == "inner"
    assert not Mutex("outer").locked()


def test_errors_of_the_body_propagate_and_release_the_lock() -> None:
    @skip_if_locked("failing")
    def body() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        body()
    assert not Mutex("failing").locked()


def test_waiting_forever_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a timeout"):
        skip_if_locked("x", timeout=None)  # type: ignore[arg-type]


def test_generators_are_refused() -> None:
    def rows() -> Iterator[int]:
        yield 1

    with pytest.raises(TypeError, match="not a generator"):
        skip_if_locked("x")(rows)
