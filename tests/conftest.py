"""Real Redis for every test: a throwaway server per session, a fresh namespace per test.

With REDIS_URL set, tests use that server instead; they then only ever touch
keys under their own per-test namespace, never anything else in it.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import override_settings

from django_redis_mutex.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the Redis the suite runs against."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session", autouse=True)
def _session_cache(redis_url: str) -> Iterator[None]:
    from django.conf import settings

    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["LOCATION"] = redis_url
    os.environ["DJANGO_REDIS_MUTEX_TEST_URL"] = redis_url
    with override_settings(CACHES=caches):
        yield


@pytest.fixture(autouse=True)
def mutex_prefix() -> Iterator[str]:
    """Give each test its own lock namespace, so tests never see each other's keys."""
    from django.conf import settings

    prefix = "t" + uuid.uuid4().hex[:12]
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = {**caches["default"].get("MUTEX", {}), "PREFIX": prefix}
    os.environ["DJANGO_REDIS_MUTEX_TEST_PREFIX"] = prefix
    with override_settings(CACHES=caches):
        yield prefix


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A separate plain client on the test server, for looking behind the app's back."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def namespace_keys(raw: redis.Redis, mutex_prefix: str):  # type: ignore[no-untyped-def]
    """Return a function listing every key in this test's lock namespace."""

    def keys() -> list[bytes]:
        return sorted(raw.scan_iter(match=f"tests:{mutex_prefix}:*"))

    return keys


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


USING_DJANGO_BACKEND = os.environ.get("DJANGO_REDIS_MUTEX_TEST_BACKEND") == "django"


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


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` every 10 ms until it is true (True) or ``timeout`` passes (False)."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """Start worker scripts as OS processes; kill whatever is left of them after the test."""
    from .worker import Worker

    started: list[Worker] = []

    def start(script: str, *args: object) -> Worker:
        worker = Worker(script, run_worker(script, *map(str, args)))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def poll_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Return the first truthy result of ``check()``; fail naming ``what`` after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}.")
        time.sleep(interval)
