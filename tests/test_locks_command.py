"""``manage.py locks``: list, reset, reset-all, and one-line errors.

Everything runs against the session's real redis-server. The reset-all test
fills the same database with 10,000 keys that are not this alias's locks
(lookalike keys, cache entries, another alias's locks) and checks that only
the locks went.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import fields
from io import StringIO
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings as django_settings
from django.core.cache import caches
from django.core.management import CommandError, call_command

from django_redis_mutex import HeldLock, LockNotOwned, Mutex, held_locks
from django_redis_mutex.management.commands.locks import describe_redis
from django_redis_mutex.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def locks(*args: str) -> str:
    """Run the command in this process and return its stdout."""
    out = StringIO()
    call_command("locks", *args, stdout=out)
    return out.getvalue()


def redis_address() -> str:
    """Return the session Redis as the command names it: scheme, host, port and db only."""
    url = urlsplit(django_settings.CACHES["default"]["LOCATION"])
    return f"redis://{url.hostname}:{url.port}/{url.path.lstrip('/') or 0}"


@pytest.fixture
def held(settings: Any) -> Iterator[list[Mutex]]:
    """Collect handles a test acquires, and release those still held at the end.

    Depends on ``settings`` so the release runs before test-added aliases go away.
    """
    handles: list[Mutex] = []
    yield handles
    for handle in handles:
        with contextlib.suppress(LockNotOwned):
            handle.release()


def hold(held: list[Mutex], name: str, **options: Any) -> Mutex:
    lock = Mutex(name, **options)
    assert lock.acquire(blocking=False)
    held.append(lock)
    return lock


@pytest.fixture
def other_alias(settings: Any, mutex_prefix: str) -> str:
    """Add cache alias "other": the same Redis database, another KEY_PREFIX."""
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        "other": {**default, "KEY_PREFIX": "other", "MUTEX": {"PREFIX": mutex_prefix}},
    }
    return "other"


# -- listing ---------------------------------------------------------------


def test_table_lists_held_lock_with_owner(held: list[Mutex]) -> None:
    hold(held, "inventory", label="nightly import")
    out = locks()
    source, header, row, footer = out.splitlines()
    assert source == f"Cache 'default' at {redis_address()}:"
    assert header.split() == [
        "NAME",
        "HOST",
        "PID",
        "THREAD",
        "LABEL",
        "HELD",
        "FOR",
        "TIME",
        "LEFT",
        "FENCE",
        "WAITERS",
    ]
    assert row.startswith("inventory ")
    assert "nightly import" in row
    assert f" {os.getpid()} " in row
    assert f" {threading.current_thread().name} " in row
    assert f" {held[0].fence} " in row
    assert footer == "1 lock held in cache 'default'."


def test_table_says_so_when_nothing_is_held() -> None:
    assert locks() == (
        f"Cache 'default' at {redis_address()}:\nNo locks are held in cache 'default'.\n"
    )


def test_table_names_each_master_of_a_quorum(settings: Any) -> None:
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        "m1": {**default, "KEY_PREFIX": "m1"},
        "m2": {**default, "KEY_PREFIX": "m2"},
        "q": {**default, "MUTEX": {**default["MUTEX"], "QUORUM": ["m1", "m2"]}},
    }
    address = redis_address()
    assert locks("--using", "q").splitlines() == [
        f"Cache 'q' (a quorum of 'm1' at {address}; 'm2' at {address}):",
        "No locks are held in cache 'q'.",
    ]


def test_redis_is_described_without_its_password(settings: Any) -> None:
    # Describing builds the client but never connects, so no server is needed.
    settings.CACHES = {
        **settings.CACHES,
        "secret": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://locks:s3cret@127.0.0.1:1/3",
        },
    }
    assert describe_redis("secret") == "redis://127.0.0.1:1/3"


def test_json_is_an_array_of_heldlock_fields(held: list[Mutex]) -> None:
    first = hold(held, "b-lock", ttl=20, label="worker")
    second = hold(held, "a-lock")
    data = json.loads(locks("--json"))
    assert [item["name"] for item in data] == ["a-lock", "b-lock"]
    # Every HeldLock field, plus "ttl": time_left under its old name, for one release.
    assert all(set(item) == {f.name for f in fields(HeldLock)} | {"ttl"} for item in data)
    item = data[1]
    assert item["owner"] == {
        "host": item["owner"]["host"],
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "label": "worker",
    }
    assert item["fence"] == first.fence
    assert data[0]["fence"] == second.fence
    assert 0 < item["time_left"] <= 20
    assert item["ttl"] == item["time_left"]
    assert item["waiters"] == 0
    assert item["acquired_at"].endswith("+00:00")


def test_json_of_nothing_held_is_an_empty_array() -> None:
    assert json.loads(locks("--json")) == []


# -- reset -----------------------------------------------------------------


def test_reset_releases_held_names_and_reports_those_not_held(held: list[Mutex]) -> None:
    lock = hold(held, "payments")
    out = locks("--reset", "payments", "never-taken")
    assert out.splitlines() == ["Released 'payments'.", "'never-taken' was not held."]
    assert not Mutex("payments").locked()
    with pytest.raises(LockNotOwned):
        lock.release()


def test_reset_leaves_other_locks_held(held: list[Mutex]) -> None:
    hold(held, "payments")
    keep = hold(held, "inventory")
    locks("--reset", "payments")
    assert keep.owned()
    assert [h.name for h in held_locks()] == ["inventory"]


def test_reset_all_noinput_keeps_every_key_that_is_not_a_lock(
    raw: redis.Redis, held: list[Mutex], other_alias: str, mutex_prefix: str
) -> None:
    tag = mutex_prefix  # makes every key below unique to this test
    unrelated: list[str] = []
    pipe = raw.pipeline(transaction=False)
    lock_like = {"token": "abc", "fence": "1", "owner": "{}", "acquired": "1", "name": "x"}
    for i in range(10_000):
        shape = i % 8
        if shape == 0:
            key = f"unrelated:{tag}:{i}"
            pipe.set(key, i)
        elif shape == 1:  # a namespace that merely starts with ours
            key = f"tests:{tag}x:{{n{i}}}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 2:  # our MUTEX PREFIX without the cache KEY_PREFIX
            key = f"{tag}:{{n{i}}}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 3:  # inside our namespace, but not a lock key
            key = f"tests:{tag}:n{i}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 4:  # shaped like a django cache key
            key = f"tests:1:{tag}:{{n{i}}}"
            pipe.set(key, i)
        elif shape == 5:
            key = f"mutex:{{{tag}{i}}}"
            pipe.rpush(key, i)
        elif shape == 6:
            key = f"*:{tag}:[{i}]"
            pipe.sadd(key, i)
        else:
            key = f"other:{tag}:{{n{i}}}:queue"
            pipe.zadd(key, {"w": i})
        unrelated.append(key)
    pipe.execute()
    default_cache, other_cache = caches["default"], caches[other_alias]
    cache_keys = [f"{tag}-entry-{i}" for i in range(50)]
    for i, key in enumerate(cache_keys):
        default_cache.set(key, i, timeout=300)
        other_cache.set(key, -i, timeout=300)
    other_lock = hold(held, "shared-name", using=other_alias)
    for name in ("shared-name", "reports", "{braces}*?"):
        hold(held, name, label="to reset")

    try:
        out = locks("--reset-all", "--noinput")

        assert out == "Released 3 locks in cache 'default'.\n"
        assert held_locks() == []
        assert raw.exists(*unrelated) == len(unrelated)
        assert [default_cache.get(key) for key in cache_keys] == list(range(50))
        assert [other_cache.get(key) for key in cache_keys] == [-i for i in range(50)]
        assert other_lock.owned()
        assert [h.name for h in held_locks(using=other_alias)] == ["shared-name"]
    finally:
        for start in range(0, len(unrelated), 1000):
            raw.delete(*unrelated[start : start + 1000])
        default_cache.delete_many(cache_keys)
        other_cache.delete_many(cache_keys)


def test_reset_all_asks_for_confirmation_and_proceeds_on_yes(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    hold(held, "a")
    hold(held, "b")
    prompts: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt: prompts.append(prompt) or "yes")
    out = locks("--reset-all")
    assert len(prompts) == 1
    assert "every lock in cache 'default' (2 locks held now)" in prompts[0]
    assert prompts[0].endswith("Type 'yes' to continue, or 'no' to cancel: ")
    assert out == "Released 2 locks in cache 'default'.\n"
    assert held_locks() == []


def test_reset_all_keeps_locks_when_not_confirmed(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = hold(held, "a")
    monkeypatch.setattr(builtins, "input", lambda prompt: "no")
    out = locks("--reset-all")
    assert out == "Reset cancelled.\n"
    assert lock.owned()


def test_reset_and_json_cannot_be_combined() -> None:
    with pytest.raises(CommandError, match="not allowed with argument"):
        locks("--json", "--reset", "a")


# -- errors ----------------------------------------------------------------


def test_unknown_alias_is_a_command_error() -> None:
    with pytest.raises(CommandError, match=r"Cache alias 'nope' is not configured"):
        locks("--using", "nope")


def test_non_redis_cache_is_a_command_error(settings: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    with pytest.raises(CommandError, match=r"'local' uses BACKEND .*LocMemCache.*not a Redis"):
        locks("--using", "local", "--reset-all", "--noinput")


def test_unreachable_redis_is_a_command_error(settings: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "down": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1},
        },
    }
    with pytest.raises(CommandError, match=r"Redis for cache 'down' is unavailable: .*refused"):
        locks("--using", "down")


def test_command_line_error_is_one_line_on_stderr_without_traceback() -> None:
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        DJANGO_REDIS_MUTEX_TEST_URL=f"redis://127.0.0.1:{free_port()}/0",
        PYTHONPATH=ROOT,
    )
    result = subprocess.run(
        [sys.executable, "-m", "django", "locks", "--reset", "a"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("CommandError: Redis for cache 'default' is unavailable: ")
