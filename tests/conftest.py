"""Real Redis for every test: a throwaway server per session, a fresh namespace per test.

With REDIS_URL set, tests use that server instead; they then only ever touch
keys under their own per-test namespace, never anything else in it.
"""

from __future__ import annotations

import copy
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.test import override_settings

from django_redis_mutex.testing import RedisServer

from .databases import MariaDBServer, PostgresServer
from .helpers import run_worker, wait_until


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


@pytest.fixture(autouse=True)
def no_hold_left_watched() -> Iterator[None]:
    """Fail a test that leaves a lock or permit renewed by the watchdog after it ends.

    Such a hold is never released: it keeps its name locked and its lane's
    thread busy for the tests after it. A hold released by another thread may
    take a moment to leave, hence the short wait.
    """
    from django_redis_mutex.watchdog import get_watchdog

    yield
    watchdog = get_watchdog()
    if not watchdog.watched():
        return
    try:
        wait_until(lambda: not watchdog.watched(), 2.0, "the watchdog to stop renewing")
    except AssertionError:
        left = watchdog.watched()
        for hold in left:
            watchdog.unwatch(hold)  # so the next test starts clean
        pytest.fail(
            "still renewed by the watchdog after the test: "
            + ", ".join(hold.describe() for hold in left),
            pytrace=False,
        )


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


@dataclass
class HostHolder:
    """A process holding one lock as a process on another machine would (see hold_on_host)."""

    worker: Any
    go_key: str
    raw: redis.Redis

    @property
    def pid(self) -> int:
        return int(self.worker.pid)

    def let_go(self) -> str:
        """Tell the holder to leave its block; return "released" if it still held it, or "lost"."""
        self.raw.rpush(self.go_key, "go")
        assert self.worker.finish() == 0
        return str(self.worker.events[-1]["event"])


@pytest.fixture
def hold_on_host(
    spawn: Callable[..., Any], raw: redis.Redis, mutex_prefix: str
) -> Iterator[Callable[..., HostHolder]]:
    """Return ``start(name, host, label)``: a real process holding ``name``, reporting ``host``.

    Stands in for a worker on another machine: only the host name in its owner
    record is ``host``. Whatever is still running at the end is killed.
    """
    go_keys: list[str] = []

    def start(name: str, host: str, label: str = "deploy") -> HostHolder:
        go_key = f"{mutex_prefix}:go:{len(go_keys)}"
        go_keys.append(go_key)
        worker = spawn("hold_as_host.py", name, host, label, go_key)
        worker.expect("acquired")
        return HostHolder(worker, go_key, raw)

    yield start
    if go_keys:
        raw.delete(*go_keys)  # the signal lists this fixture made, if a holder never read them


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A private PostgreSQL server for the session (fails, saying why, if there is none)."""
    try:
        server = PostgresServer()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariaDBServer]:
    """A private MariaDB server for the session (fails, saying why, if there is none)."""
    try:
        import MySQLdb  # noqa: F401  (mysqlclient, when installed)
    except ImportError:
        try:
            import pymysql
        except ImportError:
            pytest.fail(
                "The MariaDB tests need a driver: PyMySQL is in the dev dependency group "
                "(uv sync), or install mysqlclient.",
                pytrace=False,
            )
        pymysql.install_as_MySQLdb()  # Django's mysql backend imports MySQLdb
    try:
        server = MariaDBServer()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server
