"""pytest fixtures that run a project's locked code on a real, throwaway Redis.

Installed with the package and loaded by pytest through the ``pytest11`` entry
point (turn it off with ``-p no:django_redis_mutex``). Nothing starts unless a
test asks for a fixture. :doc:`testing-your-code` shows them at work, and what
an alias pointed at the throwaway server keeps of its own settings.

``--lock-order`` (or the ``lock_order`` ini option) checks the order in which
the run takes nested locks: a test that takes two lock classes in the opposite
order of an earlier one fails (see :doc:`lock-order`).

.. versionadded:: 0.1
.. versionchanged:: 0.3.0
   ``--lock-order`` and the ``lock_order`` ini option.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Generator, Iterator
from typing import Any

import _pytest
import pluggy
import pytest

from . import lockorder
from .testing import RedisServer

__all__ = ["redis_mutex_cache", "redis_mutex_cache_alias", "redis_mutex_server"]

# What the alias keeps from its own CACHES entry: how its keys are named and how
# long cache entries live. Where the server is, and how to reach it, is ours.
_KEPT = ("KEY_PREFIX", "VERSION", "KEY_FUNCTION", "TIMEOUT")
# A MUTEX block keeps its lock defaults, not its topology: the test has one Redis.
_TOPOLOGY = ("QUORUM", "QUORUM_TIMEOUT", "CLUSTER")
_DEFAULT_BACKEND = "django_redis.cache.RedisCache"
_SCAN_BATCH = 500
_RECORDER = pytest.StashKey[lockorder.Recorder]()
# The inversions already reported as a test's failure.
_REPORTED = pytest.StashKey[set[int]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("django_redis_mutex", "django-redis-mutex")
    group.addoption(
        "--lock-order",
        action="store_true",
        default=None,
        dest="lock_order",
        help="fail a test that takes two lock classes in the opposite order of another "
        "code path of the run (default: the lock_order ini option).",
    )
    parser.addini(
        "lock_order",
        type="bool",
        default=False,
        help="check the order in which the run takes nested locks, as --lock-order does.",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("lock_order") or config.getini("lock_order"):
        # The runner's frames say nothing about the code under test.
        runner = (_pytest, pluggy, pytest)
        hidden = [os.path.dirname(module.__file__ or "") + os.sep for module in runner]
        config.stash[_RECORDER] = lockorder.start(hidden)
        config.stash[_REPORTED] = set()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _RECORDER in config.stash:
        del config.stash[_RECORDER]
        lockorder.stop()


def _checked(item: pytest.Item, phase: str) -> Generator[None, object, object]:
    """Run one phase of ``item``; fail it when it took two lock classes against the known order.

    A phase that fails on its own keeps its own failure: the inversions it
    found are listed at the end of the run, which fails too.
    """
    recorder = item.config.stash.get(_RECORDER, None)
    if recorder is None:
        return (yield)
    recorder.during = item.nodeid if phase == "call" else f"{item.nodeid} ({phase})"
    seen = len(recorder.inversions)
    result = yield
    found = range(seen, len(recorder.inversions))
    if found:
        item.config.stash[_REPORTED].update(found)
        pytest.fail("\n\n".join(str(recorder.inversions[i]) for i in found), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _checked(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _checked(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _checked(item, "teardown"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    recorder = session.config.stash.get(_RECORDER, None)
    if recorder is not None and recorder.inversions and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    recorder = config.stash.get(_RECORDER, None)
    if recorder is None or not recorder.inversions:
        return
    reported = config.stash[_REPORTED]
    terminalreporter.section("lock order inversions", red=True)
    for index, inversion in enumerate(recorder.inversions):
        if index in reported:
            later = inversion.later
            terminalreporter.line(
                f"{later.then} and {later.first}: taken in both orders "
                f"(failed {later.during or 'outside a test'})"
            )
        else:
            terminalreporter.line(str(inversion))


def _entry_on(server: RedisServer, entry: dict[str, Any]) -> dict[str, Any]:
    """Return ``entry`` moved onto ``server``, keeping its key naming and lock defaults."""
    from .client import backend_kind

    backend = str(entry.get("BACKEND", ""))
    moved = {key: copy.deepcopy(entry[key]) for key in _KEPT if key in entry}
    moved["BACKEND"] = backend if backend_kind(backend) else _DEFAULT_BACKEND
    moved["LOCATION"] = server.url
    block = entry.get("MUTEX")
    if isinstance(block, dict):
        moved["MUTEX"] = {k: copy.deepcopy(v) for k, v in block.items() if k not in _TOPOLOGY}
    return moved


def _patterns(alias: str) -> list[str]:
    """Return SCAN patterns matching the keys of ``alias`` and no other alias's."""
    from django.conf import settings

    from .client import namespace
    from .keys import app_key_patterns, glob_escape

    # Every key of every lock and semaphore (see keys.py).
    patterns = list(app_key_patterns(namespace(alias)))
    entry = settings.CACHES[alias]
    if "KEY_FUNCTION" not in entry:
        # Django's key function: "<KEY_PREFIX>:<VERSION>:<key>", the version a number.
        patterns.append(glob_escape(str(entry.get("KEY_PREFIX") or "")) + ":[0-9]*")
    return patterns


def _delete_keys(server: RedisServer, patterns: list[str]) -> None:
    import redis

    client = redis.Redis(port=server.port)
    try:
        for pattern in patterns:
            cursor = None
            while cursor != 0:
                cursor, keys = client.scan(cursor or 0, match=pattern, count=_SCAN_BATCH)
                if keys:
                    client.unlink(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_mutex_server() -> Iterator[RedisServer]:
    """Return a private redis-server for this test session, started on first use."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_mutex_cache_alias() -> str:
    """Return the cache alias ``redis_mutex_cache`` points at the server (override to change)."""
    return "default"


@pytest.fixture
def redis_mutex_cache(
    redis_mutex_server: RedisServer, redis_mutex_cache_alias: str
) -> Iterator[str]:
    """Point a cache alias at the session's redis-server for one test; return the alias.

    Afterwards delete only that alias's keys: those of its locks and semaphores,
    and its cache entries when it uses Django's key function.
    """
    from django.conf import settings
    from django.test import override_settings

    alias = redis_mutex_cache_alias
    if not isinstance(alias, str) or not alias:
        pytest.fail(
            f"redis_mutex_cache_alias must return a cache alias (a non-empty str), not {alias!r}.",
            pytrace=False,
        )
    if not settings.configured:
        pytest.fail(
            "redis_mutex_cache needs Django settings: set DJANGO_SETTINGS_MODULE "
            "(or pytest-django's --ds / DJANGO_SETTINGS_MODULE ini option), or call "
            "settings.configure() in conftest.py.",
            pytrace=False,
        )
    caches = copy.deepcopy(settings.CACHES)
    caches[alias] = _entry_on(redis_mutex_server, caches.get(alias, {}))
    with override_settings(CACHES=caches):
        patterns = _patterns(alias)
        try:
            yield alias
        finally:
            _delete_keys(redis_mutex_server, patterns)
