"""Where a lock's keys live: in this app's namespace under the cache KEY_PREFIX.

Lock keys never mix with cache entries or another alias's locks, and the
tools that walk them (held_locks, reset_all) use SCAN within the namespace,
never KEYS. These tests reach outside the namespace on purpose, so they are
not part of the suite the least-privilege ACL user runs.
"""

from __future__ import annotations

import copy

import pytest
import redis
from django.core.cache import caches
from django.test import override_settings

from django_redis_mutex import Mutex, held_locks, mutex, reset_all

from .helpers import caches_with, dedicated_redis

# -- Introspection walks keys with SCAN, never KEYS, and stays in its namespace. ---


def test_introspection_and_reset_all_work_without_keys_command():
    with dedicated_redis("--rename-command", "KEYS", "") as (_server, client):
        with pytest.raises(redis.ResponseError):
            client.keys("*")
        locks = [Mutex(n, watchdog=False) for n in ("a", "b*", "c{d}")]
        for lock in locks:
            assert lock.acquire()
        assert sorted(h.name for h in held_locks()) == ["a", "b*", "c{d}"]
        assert reset_all() == 3
        assert held_locks() == []


def test_reset_all_leaves_other_namespaces_and_cache_keys_alone(mutex_prefix):
    caches["default"].set(f"{mutex_prefix}-value", "cached")
    with override_settings(CACHES=caches_with(PREFIX=f"{mutex_prefix}-other")):
        foreign = Mutex("a", watchdog=False)
        assert foreign.acquire()
    ours = Mutex("a", watchdog=False)
    assert ours.acquire()
    assert reset_all() == 1
    assert foreign.owned()
    assert caches["default"].get(f"{mutex_prefix}-value") == "cached"
    foreign.release()


# -- Lock keys live in their own namespace under the cache KEY_PREFIX. -------------


def test_lock_keys_live_under_the_cache_key_prefix(namespace_keys, mutex_prefix):
    with mutex("inventory"):
        keys = namespace_keys()
    assert keys
    assert all(k.startswith(f"tests:{mutex_prefix}:".encode()) for k in keys)


def test_cache_value_with_the_lock_name_leaves_the_lock_intact(mutex_prefix):
    name = f"{mutex_prefix}-inventory"
    with mutex(name) as lock:
        caches["default"].set(name, "not a lock")
        caches["default"].set(f"{mutex_prefix}:{name}", "not a lock either")
        assert lock.owned()
    assert caches["default"].get(name) == "not a lock"
    assert caches["default"].get(f"{mutex_prefix}:{name}") == "not a lock either"


def test_same_name_under_another_key_prefix_is_another_lock():
    entries = caches_with()
    entries["other"] = {**copy.deepcopy(entries["default"]), "KEY_PREFIX": "otherproject"}
    with override_settings(CACHES=entries), mutex("inventory"):
        other = Mutex("inventory", using="other")
        assert other.acquire(blocking=False)
        other.release()
