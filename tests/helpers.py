"""Helpers shared by the test modules: paths, worker processes, settings, polling.

Fixtures live in ``conftest.py``; plain functions live here, imported by name.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

__all__ = [
    "ROOT",
    "USING_DJANGO_BACKEND",
    "await_until",
    "cache_options",
    "caches_with",
    "cancel_repeatedly",
    "dedicated_redis",
    "forget_scripts_but",
    "held_elsewhere",
    "held_shared",
    "run_worker",
    "script_parked",
    "take_and_release",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent

USING_DJANGO_BACKEND = os.environ.get("DJANGO_REDIS_MUTEX_TEST_BACKEND") == "django"


def wait_until(
    check: Callable[[], Any],
    timeout: float = 5.0,
    what: str = "the condition",
    interval: float = 0.01,
) -> Any:
    """Return the first truthy result of ``check()``; fail naming ``what`` after ``timeout``.

    The one way tests wait for something another thread, process or server
    does: poll with a deadline, never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}.")
        time.sleep(interval)


async def await_until(
    check: Callable[[], Any],
    timeout: float = 5.0,
    what: str = "the condition",
    interval: float = 0.01,
) -> Any:
    """Async twin of :func:`wait_until` for tests running on an event loop.

    An ``async def`` check is awaited on the loop; a plain one runs in a worker
    thread, since it may block on Redis.
    """
    deadline = time.monotonic() + timeout
    while True:
        if inspect.iscoroutinefunction(check):
            result = await check()
        else:
            result = await asyncio.to_thread(check)
            if inspect.isawaitable(result):
                result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}.")
        await asyncio.sleep(interval)


async def cancel_repeatedly(acquiring: Callable[[], Any], rng: Any, *, cancels: int = 3) -> bool:
    """Start ``acquiring()`` as a task and cancel it ``cancels`` times, a few loop steps apart.

    Each cancel comes 0 to 5 loop steps after the one before, as an AnyIO-style
    cancel scope re-delivers its cancel at every await; the steps themselves
    are the synchronisation, no sleeps stand in for it. Return what the task
    returned, or False if it ended cancelled.
    """
    task = asyncio.ensure_future(acquiring())
    for _ in range(cancels):
        for _ in range(rng.randint(0, 5)):
            await asyncio.sleep(0)
        task.cancel()
    try:
        return bool(await task)
    except asyncio.CancelledError:
        return False


def forget_scripts_but(client: Any, *kept: Any) -> None:
    """Empty the server's script cache (as a restart or failover does), then load ``kept``.

    A script the server no longer knows costs its next caller three round
    trips (NOSCRIPT, SCRIPT LOAD, EVALSHA) instead of one.
    """
    client.script_flush()
    for script in kept:
        client.script_load(script.source)


def script_parked(client: Any) -> bool:
    """Return True when a script call waits at a server whose writes are paused (CLIENT PAUSE).

    CLIENT LIST names each client's last command; a paused one is flagged blocked.
    """
    return any(
        c.get("cmd") == "evalsha" and "b" in c.get("flags", "") for c in client.client_list()
    )


def run_worker(script: str, *args: str, timeout: float = 120) -> subprocess.Popen[str]:
    """Start ``tests/workers/<script>`` as a real OS process with this test's settings."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "workers" / script), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cache_options(
    *, socket_timeout: float | None = None, decode_responses: bool | None = None
) -> dict[str, object]:
    """Return OPTIONS for the backend under test (django-redis and Django spell them apart)."""
    options: dict[str, object] = {}
    if USING_DJANGO_BACKEND:
        if socket_timeout is not None:
            options["socket_timeout"] = socket_timeout
        if decode_responses is not None:
            options["decode_responses"] = decode_responses
        return options
    if socket_timeout is not None:
        options["SOCKET_TIMEOUT"] = socket_timeout
    if decode_responses is not None:
        options["CONNECTION_POOL_KWARGS"] = {"decode_responses": decode_responses}
    return options


def caches_with(**options: object) -> dict[str, Any]:
    """Return a copy of settings.CACHES with ``options`` merged into the default MUTEX block."""
    from django.conf import settings

    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = {**caches["default"].get("MUTEX", {}), **options}
    return caches


def take_and_release(lock: Any) -> None:
    """Wait for ``lock`` as a queued waiter, then let it go (so no hold outlives the test)."""
    if lock.acquire():
        lock.release()


@contextmanager
def dedicated_redis(*extra_args: str) -> Iterator[tuple[Any, Any]]:
    """Point the default cache at a private redis-server this test may pause or kill.

    Yields the ``RedisServer`` and a plain client on it.
    """
    import redis
    from django.conf import settings
    from django.test import override_settings

    from django_redis_mutex.testing import RedisServer

    with RedisServer(extra_args=list(extra_args)) as server:
        entries = copy.deepcopy(settings.CACHES)
        entries["default"]["LOCATION"] = server.url
        client = redis.Redis(port=server.port)
        try:
            with override_settings(CACHES=entries):
                yield server, client
        finally:
            client.close()


@contextmanager
def held_shared(name: str, *labels: str, ttl: float = 60) -> Iterator[list[Any]]:
    """Hold ``name`` shared from one thread per label, each its own owner, until the block ends.

    The threads are named ``reader-1``, ``reader-2``...; the handles (no
    watchdog) are yielded in the order they acquired. A holder whose hold was
    reset meanwhile lets go without complaint.
    """
    from django_redis_mutex import LockLost, LockNotOwned, Mutex

    done = threading.Event()
    handles: list[Any] = []
    threads: list[threading.Thread] = []
    try:
        for index, label in enumerate(labels, start=1):
            handle = Mutex(name, shared=True, label=label, ttl=ttl, watchdog=False)
            acquired: list[bool] = []
            ready = threading.Event()

            def hold(
                handle: Any = handle, acquired: list[bool] = acquired, ready: Any = ready
            ) -> None:
                acquired.append(handle.acquire(blocking=False))
                ready.set()
                if acquired[0]:
                    done.wait(60)
                    with suppress(LockLost, LockNotOwned):
                        handle.release()

            thread = threading.Thread(target=hold, name=f"reader-{index}")
            thread.start()
            threads.append(thread)
            assert ready.wait(10) and acquired == [True], f"reader-{index} did not get {name!r}"
            handles.append(handle)
        yield handles
    finally:
        done.set()
        for thread in threads:
            thread.join(10)


@contextmanager
def held_elsewhere(name: str, **options: Any) -> Iterator[Any]:
    """Hold lock ``name`` from another thread (another owner) until the block ends.

    ``options`` go to :class:`~django_redis_mutex.Mutex`. At the end the lock
    is released if it is still held: a test may let it expire or reset it.
    """
    from django_redis_mutex import Mutex

    lock = Mutex(name, **options)
    acquired: list[bool] = []
    thread = threading.Thread(target=lambda: acquired.append(lock.acquire(blocking=False)))
    thread.start()
    thread.join()
    assert acquired == [True], f"could not take {name!r} for the test"
    try:
        yield lock
    finally:
        if lock.owned():
            lock.release()
