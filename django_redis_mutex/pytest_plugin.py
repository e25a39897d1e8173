"""pytest fixtures that run a project's locked code on a real, throwaway Redis.

Installed with the package and loaded by pytest through the ``pytest11`` entry
point (turn it off with ``-p no:django_redis_mutex``). Nothing starts unless a
test asks for a fixture. :doc:`testing-your-code` shows them at work, and what
an alias pointed at the throwaway server keeps of its own settings.

.. versionadded:: 0.1
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from .testing import RedisServer

__all__ = ["redis_mutex_cache", "redis_mutex_cache_alias", "redis_mutex_server"]

# What the alias keeps from its own CACHES entry: how its keys are named and how
# long cache entries live. Where the server is, and how to reach it, is ours.
_KEPT = ("KEY_PREFIX", "VERSION", "KEY_FUNCTION", "TIMEOUT")
# A MUTEX block keeps its lock defaults, not its topology: the test has one Redis.
_TOPOLOGY = ("QUORUM", "QUORUM_TIMEOUT", "CLUSTER")
_DEFAULT_BACKEND = "django_redis.cache.RedisCache"
_SCAN_BATCH = 500


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
