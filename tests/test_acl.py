"""Least privilege: the app runs as a Redis ACL user limited to its commands and namespace.

``lock_acl_rules()`` (in :mod:`django_redis_mutex.testing`) is the one list of
rules the docs publish; these tests prove it is enough for every lock feature
(``ACL LOG`` records no denial at all) and that it keeps the user away from
everything outside the lock namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.test import override_settings
from redis.exceptions import NoPermissionError, ResponseError

from django_redis_mutex import (
    LockContended,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
    reset,
    reset_all,
    scripts,
)
from django_redis_mutex.testing import (
    CLUSTER_COMMANDS,
    LOCK_COMMANDS,
    SCRIPT_COMMANDS,
    RedisClusterServers,
    RedisServer,
    lock_acl_rules,
)

from .helpers import await_until, wait_until
from .topologies import SentinelGroup

ROOT = Path(__file__).resolve().parent.parent
USER, PASSWORD = "locks", "s3cret:pw@x"
NAMESPACE = "tests:mutexacl"
PATTERN = f"{NAMESPACE}:*"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """One private server for this module; the default user stays the admin."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def admin(acl_server: RedisServer) -> Iterator[redis.Redis]:
    """An unrestricted client on the ACL server; it empties the server after each test."""
    client = redis.Redis(port=acl_server.port)
    client.execute_command("ACL", "LOG", "RESET")
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def user_url(acl_server: RedisServer, admin: redis.Redis) -> str:
    """A URL logging in as a fresh lock user confined to ``PATTERN``."""
    return acl_server.add_lock_user(USER, PASSWORD, PATTERN)


def acl_caches(url: str, *, style: str) -> dict[str, Any]:
    """Return CACHES whose default alias logs in as the lock user, the way ``style`` says."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    if style == "django":
        entry: dict[str, Any] = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": url,
            "OPTIONS": {"socket_timeout": 5},
        }
    elif style == "url":
        entry = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": url,
            "OPTIONS": {"SOCKET_TIMEOUT": 5},
        }
    else:  # django-redis OPTIONS USERNAME / PASSWORD, a LOCATION without credentials
        entry = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{port}/0",
            "OPTIONS": {"SOCKET_TIMEOUT": 5, "USERNAME": USER, "PASSWORD": PASSWORD},
        }
    entry.update(KEY_PREFIX="tests", MUTEX={"PREFIX": "mutexacl"})
    return {"default": entry}


def denials(admin: redis.Redis) -> list[Any]:
    """Return what ``ACL LOG`` recorded: every command or key the server refused."""
    return list(admin.execute_command("ACL", "LOG"))


def sync_workload(admin: redis.Redis) -> None:
    """Contention, queueing and hand-off between threads, renewal, extend and the readers."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with mutex("acl:job", ttl=5):
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(5)
        with pytest.raises(LockContended), mutex("acl:job", blocking=False):
            pass
        waiter = Mutex("acl:job", ttl=5)
        got: dict[str, bool] = {}
        waiting = threading.Thread(target=lambda: got.setdefault("ok", waiter.acquire(timeout=10)))
        waiting.start()
        wait_until(lambda: admin.zcard(f"{NAMESPACE}:{{acl:job}}:queue"), 5, "the waiter to queue")
        release.set()
        waiting.join(10)
        assert got == {"ok": True}  # handed over through its wake-up list (BLPOP)
        assert waiter.fence is not None
        waiter.release()
    finally:
        release.set()
        holder.join(10)

    # The watchdog renews a 0.6 s lease in pipelines of EVALSHA for 1.5 s.
    with mutex("acl:renew", ttl=0.8) as renewed:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            assert renewed.owned()
            time.sleep(0.05)
        assert not renewed.lost

    lock = Mutex("acl:extend", ttl=5, label="acl")
    assert lock.acquire()
    try:
        lock.extend(30)
        assert lock.time_left() > 20
        assert lock.owned() and lock.locked()
        assert (owner := lock.owner()) is not None and owner.label == "acl"
        assert {held.name for held in held_locks()} == {"acl:extend"}
        table = StringIO()
        call_command("locks", stdout=table)
        assert "acl:extend" in table.getvalue()
        listed = StringIO()
        call_command("locks", "--json", stdout=listed)
        assert [row["name"] for row in json.loads(listed.getvalue())] == ["acl:extend"]
        assert reset("acl:extend") is True
        assert not lock.locked()
    finally:
        # Reset under it: the release tells so (and the watchdog lets it go).
        with contextlib.suppress(LockNotOwned):
            lock.release()

    for name in ("acl:a", "acl:b"):
        assert Mutex(name, ttl=30, watchdog=False).acquire()
    assert reset_all() == 2
    assert held_locks() == []
    out = StringIO()
    assert Mutex("acl:c", ttl=30, watchdog=False).acquire()
    call_command("locks", "--reset-all", "--noinput", stdout=out)
    assert "Released 1 lock" in out.getvalue()
    assert held_locks() == []


async def async_workload(admin: redis.Redis) -> None:
    """The async client: contention with another owner, hand-off, extend, readers."""
    async with mutex("acl:async", ttl=5) as first:
        assert await first.aowned()
        second = Mutex("acl:async", ttl=5)
        waiting = asyncio.ensure_future(second.aacquire(timeout=10))
        await await_until(
            lambda: admin.zcard(f"{NAMESPACE}:{{acl:async}}:queue"), 5, "the async waiter to queue"
        )
    assert await waiting
    await second.aextend(20)
    assert await second.atime_left() > 10
    assert await second.alocked()
    await second.arelease()
    async with mutex("acl:async-renew", ttl=0.8) as renewed:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            assert await renewed.aowned()
            await asyncio.sleep(0.05)
        assert not renewed.lost


@pytest.mark.parametrize("style", ["url", "options", "django"])
def test_every_lock_feature_runs_as_the_acl_user_without_a_single_denial(
    user_url: str, admin: redis.Redis, style: str
) -> None:
    with override_settings(CACHES=acl_caches(user_url, style=style)):
        sync_workload(admin)
        asyncio.run(async_workload(admin))
        who = [
            entry for entry in admin.client_list() if entry.get("user") == USER
        ]  # the app's connections really are the restricted user
        assert who
    assert denials(admin) == []


def test_the_user_is_refused_everything_outside_the_lock_namespace(
    user_url: str, admin: redis.Redis
) -> None:
    admin.set("tests:1:foo", "cached")
    admin.hset("other:mutex:{x}", mapping={"token": "t", "name": "x"})
    user = redis.Redis.from_url(user_url)
    try:
        with pytest.raises(NoPermissionError):
            user.set("tests:1:foo", "overwritten")
        with pytest.raises(NoPermissionError):
            user.get("tests:1:foo")
        with pytest.raises(NoPermissionError):
            user.delete("other:mutex:{x}")
        with pytest.raises(NoPermissionError):
            user.flushall()
        with pytest.raises(NoPermissionError):
            user.execute_command("CONFIG", "GET", "dir")
        # A lock script aimed at a key outside the namespace is refused too:
        # Redis checks the keys a script declares against the caller's ACL.
        user.script_load(scripts.RESET.source)
        with pytest.raises(NoPermissionError):
            user.evalsha(scripts.RESET.sha, 1, "other:mutex:{x}")
        # And a key a script reaches on its own, past the keys it declared.
        sneaky = user.script_load("return redis.call('SET', 'tests:1:foo', 'x')")
        with pytest.raises(ResponseError, match="can't access"):
            user.evalsha(sneaky, 1, f"{NAMESPACE}:{{x}}")
        # What the rules do not hide: SCAN lists every key's name (never its value).
        assert b"tests:1:foo" in set(user.scan_iter(match="tests:1:*"))
    finally:
        user.close()
    assert admin.get("tests:1:foo") == b"cached"
    assert admin.hget("other:mutex:{x}", "token") == b"t"
    assert denials(admin)  # each refusal above was logged


def test_django_cache_calls_are_refused_for_the_lock_user(
    user_url: str, admin: redis.Redis
) -> None:
    from django.core.cache import caches

    with (
        override_settings(CACHES=acl_caches(user_url, style="url")),
        pytest.raises(NoPermissionError),
    ):
        caches["default"].set("foo", "bar")
    assert admin.dbsize() == 0


def test_reset_all_as_the_user_leaves_look_alike_keys_outside_the_pattern(
    user_url: str, admin: redis.Redis
) -> None:
    look_alikes = ["other:mutexacl:{x}", "tests:mutexacl2:{x}", "tests:1:mutexacl:{x}"]
    for key in look_alikes:
        admin.hset(key, mapping={"token": "t", "name": "x", "fence": "1"})
    with override_settings(CACHES=acl_caches(user_url, style="url")):
        assert Mutex("mine", ttl=30, watchdog=False).acquire()
        assert reset_all() == 1
        assert held_locks() == []
    for key in look_alikes:
        assert admin.hget(key, "token") == b"t"
    assert denials(admin) == []


def test_rules_are_deny_by_default_and_confined_to_the_pattern() -> None:
    rules = lock_acl_rules("app:mutex:*")
    assert rules[:4] == ["resetkeys", "~app:mutex:*", "resetchannels", "-@all"]
    assert rules[4:] == [f"+{command}" for command in LOCK_COMMANDS]
    assert not any(rule.startswith(("+@", "allkeys", "~*", "&", "allcommands")) for rule in rules)
    assert lock_acl_rules("p:*", client_setinfo=True)[-1] == "+client|setinfo"
    with_cluster = lock_acl_rules("p:*", cluster=True)
    assert with_cluster[-len(CLUSTER_COMMANDS) :] == [f"+{c}" for c in CLUSTER_COMMANDS]


def test_the_rules_grant_what_the_scripts_run_and_nothing_they_no_longer_run() -> None:
    """The list of commands is kept by hand beside the Lua: it must follow the scripts' changes."""
    run = {
        command.lower()
        for script in scripts.SCRIPTS
        for command in re.findall(r"redis\.p?call\('([A-Za-z]+)'", script.source)
    }
    assert len(run) > 10  # the pattern still finds the scripts' commands
    assert run - set(LOCK_COMMANDS) == set(), "run by a script, refused by the rules"
    assert set(SCRIPT_COMMANDS) - run == set(), "granted for the scripts, run by none"


def topology_workload() -> None:
    """Sync and async locks, renewal, held_locks and reset_all on the default alias."""
    for index in range(12):  # names spread over a cluster's primaries
        with mutex(f"acl:spread:{index}", ttl=5) as lock:
            assert lock.owned()
    with mutex("acl:topology-renew", ttl=0.6) as renewed:
        started = time.monotonic()
        while time.monotonic() - started < 1.2:
            assert renewed.owned()
            time.sleep(0.05)
        assert not renewed.lost

    async def async_lock() -> None:
        async with mutex("acl:topology-async", ttl=5) as held:
            assert await held.aowned()

    asyncio.run(async_lock())
    assert Mutex("acl:topology-held", ttl=30, watchdog=False).acquire()
    assert [held.name for held in held_locks()] == ["acl:topology-held"]
    assert reset_all() == 1


def test_a_cluster_lock_alias_runs_as_the_acl_user_with_the_cluster_rules() -> None:
    """A CLUSTER alias needs the two extra rules ``cluster=True`` adds, and no more."""
    with RedisClusterServers() as cluster:
        admins = [redis.Redis(port=node.port) for node in cluster.nodes]
        try:
            urls = [
                node.add_lock_user(USER, PASSWORD, PATTERN, cluster=True) for node in cluster.nodes
            ]
            entry = {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": urls[0],
                "KEY_PREFIX": "tests",
                "OPTIONS": {"SOCKET_TIMEOUT": 5},
                "MUTEX": {"CLUSTER": True, "PREFIX": "mutexacl"},
            }
            with override_settings(CACHES={"default": entry}):
                topology_workload()
            assert [denials(admin) for admin in admins] == [[]] * len(admins)
        finally:
            for admin in admins:
                admin.close()


def test_a_sentinel_lock_alias_runs_as_the_acl_user_with_the_plain_rules() -> None:
    """django-redis's Sentinel client: the data nodes need no rule beyond the plain ones."""
    with SentinelGroup(replicas=1, sentinel_count=1, quorum=1) as group:
        admins = [redis.Redis(port=server.port) for server in group.servers]
        try:
            for server in group.servers:  # the user must exist wherever a failover may lead
                server.add_lock_user(USER, PASSWORD, PATTERN)
            entry = group.cache_entry("mutexacl")
            entry["OPTIONS"].update(USERNAME=USER, PASSWORD=PASSWORD)
            with override_settings(CACHES={"default": entry}):
                topology_workload()
                clients = [c for c in admins[0].client_list() if c.get("user") == USER]
                assert clients  # the app's connections to the master are the lock user's
            assert [denials(admin) for admin in admins] == [[]] * len(admins)
        finally:
            for admin in admins:
                admin.close()


def test_the_core_lock_suite_passes_as_the_acl_user(acl_server: RedisServer) -> None:
    """Run tests/test_api.py in a child pytest whose Redis login can only touch ``tests:t*``.

    With REDIS_URL set, the suite's conftest uses that server and gives every
    test the namespace ``tests:t<hex>``, which the pattern covers.
    """
    url = acl_server.add_lock_user("suite", PASSWORD, "tests:t*")
    admin = redis.Redis(port=acl_server.port)
    try:
        admin.execute_command("ACL", "LOG", "RESET")
        # Lock the default user too, so nothing in the child can fall back on
        # it: every connection it opens must log in as the lock user.
        admin.execute_command("ACL", "SETUSER", "default", "resetpass", ">admin-only")
        env = dict(os.environ, REDIS_URL=url)
        env.pop("DJANGO_REDIS_MUTEX_TEST_URL", None)
        env.pop("DJANGO_REDIS_MUTEX_TEST_PREFIX", None)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/test_api.py", "-q", "-p", "no:cacheprovider"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert " passed" in result.stdout
        assert list(admin.execute_command("ACL", "LOG")) == []
        anonymous = redis.Redis(port=acl_server.port)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.ping()  # the lockdown was real during the run
        finally:
            anonymous.close()
    finally:
        admin.execute_command("ACL", "SETUSER", "default", "resetpass", "nopass")
        admin.flushall()
        admin.close()


def test_the_security_page_publishes_exactly_the_helpers_rules() -> None:
    """docs/security.rst copies the rules; it must not drift from lock_acl_rules()."""
    text = (ROOT / "docs" / "security.rst").read_text(encoding="utf-8")
    start = text.index("redis-cli ACL SETUSER locks on")
    block = text[start : text.index("\n\n", start)]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:6] == ["redis-cli", "ACL", "SETUSER", "locks", "on", ">CHANGE-ME"]
    assert words[6:] == lock_acl_rules("myapp:mutex:*")
    for command in CLUSTER_COMMANDS:
        assert f"``+{command}``" in text
