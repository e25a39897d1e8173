"""A lock alias whose Redis may evict keys: detected, warned about once, refusable, counted.

Each test points the default cache at a private redis-server started with the
``maxmemory`` and ``maxmemory-policy`` it needs. The danger is shown first: on
a small ``allkeys-lru`` server, filling the cache evicts a held lock and lets
a second owner in while the first is still inside.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import Client, override_settings

from django_redis_mutex import (
    LockBackendUnavailable,
    LockNotOwned,
    Mutex,
    Semaphore,
    eviction,
    mutex,
)
from django_redis_mutex.checks import check_lock_eviction
from django_redis_mutex.conf import parse_settings
from django_redis_mutex.testing import (
    RedisClusterServers,
    RedisServer,
    free_port,
    lock_acl_rules,
)
from tests.helpers import wait_until

EVICTING = ["allkeys-lru", "volatile-lru"]
LOGGER = "django_redis_mutex"


@contextmanager
def lock_redis(*extra_args: str, **mutex_options: Any) -> Iterator[redis.Redis]:
    """Point the default cache at a private redis-server started with ``extra_args``.

    ``mutex_options`` are merged into the default alias's MUTEX block. Yields a
    plain client on the server.
    """
    with RedisServer(extra_args=list(extra_args)) as server:
        caches = copy.deepcopy(settings.CACHES)
        caches["default"]["LOCATION"] = server.url
        caches["default"]["MUTEX"] = {**caches["default"]["MUTEX"], **mutex_options}
        client = redis.Redis(port=server.port)
        try:
            with override_settings(CACHES=caches):
                yield client
        finally:
            client.close()


def policy_args(policy: str, maxmemory: str = "64mb") -> list[str]:
    return ["--maxmemory", maxmemory, "--maxmemory-policy", policy]


def vetted(alias: str = "default") -> None:
    """Wait for the eviction check a lock's first use started in the background."""
    wait_until(lambda: eviction.remembered(alias) is not None, 10, "the eviction check")


def info_calls(client: redis.Redis) -> int:
    """Return how many INFO commands the server ran before this one (counted once it ends)."""
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_info", {}).get("calls", 0))


def eviction_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == LOGGER and "evict" in record.getMessage()
    ]


def check_ids() -> list[str]:
    return [message.id for message in check_lock_eviction()]


# -- the danger ------------------------------------------------------------------------------


def test_filling_an_allkeys_lru_cache_evicts_a_held_lock_and_lets_a_second_owner_in() -> None:
    with lock_redis(*policy_args("allkeys-lru", "2mb")) as client:
        first = Mutex("report", ttl=60, watchdog=False)
        assert first.acquire(blocking=False)
        filler = b"x" * 10_000
        written = 0
        while client.exists(first.keys.lock) and written < 5_000:
            client.set(f"tests:1:page:{written}", filler)
            written += 1
        assert not client.exists(first.keys.lock), f"still held after {written} cache writes"
        assert int(client.info("stats")["evicted_keys"]) > 0
        # Room again (the pages written here go), so the cache at its limit
        # cannot evict the second owner's keys too: at a 1 s LRU clock they
        # look as old as the pages.
        client.delete(*(f"tests:1:page:{page}" for page in range(written)))
        # The first owner is still inside its block, and the second gets in.
        second = Mutex("report", ttl=60, watchdog=False)
        assert second.acquire(blocking=False)
        # A store that checks fences still refuses the first owner's writes.
        assert first.fence is not None and second.fence is not None
        assert second.fence > first.fence
        # The first owner learns at its release, which leaves the second's lock alone.
        with pytest.raises(LockNotOwned):
            first.release()
        assert client.exists(second.keys.lock)
        second.release()
        assert not client.exists(second.keys.lock)


# -- detection at first use --------------------------------------------------------------------


@pytest.mark.parametrize("policy", EVICTING)
def test_first_lock_on_an_evicting_server_logs_one_warning_naming_alias_policy_and_fix(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    with lock_redis(*policy_args(policy)) as client, caplog.at_level(logging.WARNING, LOGGER):
        for _ in range(3):
            with mutex("report"):
                pass
        vetted()
        assert info_calls(client) == 1  # the first cycle asked; the others did not
    (message,) = eviction_warnings(caplog)
    assert "cache 'default'" in message.lower()
    assert f"maxmemory-policy {policy}" in message
    assert "noeviction" in message and "separate server" in message


def test_async_first_use_warns_once_too(caplog: pytest.LogCaptureFixture) -> None:
    async def cycles() -> None:
        for _ in range(3):
            async with mutex("report"):
                pass

    with lock_redis(*policy_args("allkeys-lru")) as client, caplog.at_level(logging.WARNING):
        asyncio.run(cycles())
        vetted()
        assert info_calls(client) == 1
    assert len(eviction_warnings(caplog)) == 1


@pytest.mark.parametrize(
    "args",
    [policy_args("noeviction"), ["--maxmemory", "0", "--maxmemory-policy", "allkeys-lru"]],
    ids=["noeviction", "no-maxmemory"],
)
def test_a_server_that_never_evicts_is_not_warned_about(
    args: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with lock_redis(*args), caplog.at_level(logging.WARNING, LOGGER):
        with mutex("report"):
            pass
        vetted()
        assert check_ids() == []
    assert eviction_warnings(caplog) == []


def test_a_server_down_at_first_use_is_asked_once_it_is_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_redis_mutex import client as client_module

    monkeypatch.setattr(client_module, "VET_RETRY", 0.0)
    port = free_port()
    server = RedisServer(port, extra_args=policy_args("allkeys-lru"))
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["LOCATION"] = server.url
    with override_settings(CACHES=caches), caplog.at_level(logging.WARNING, LOGGER):
        with pytest.raises(LockBackendUnavailable):
            Mutex("report").acquire()
        assert eviction_warnings(caplog) == []
        with server:
            with mutex("report"):
                pass
            vetted()
    assert len(eviction_warnings(caplog)) == 1


def test_a_cluster_with_one_evicting_primary_is_warned_about(
    mutex_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisClusterServers() as cluster:
        last = redis.Redis(port=cluster.nodes[-1].port)
        last.config_set("maxmemory", "64mb")
        last.config_set("maxmemory-policy", "allkeys-lru")
        last.close()
        entry = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": cluster.url,
            "KEY_PREFIX": "tests",
            "OPTIONS": {"SOCKET_TIMEOUT": 5},
            "MUTEX": {"CLUSTER": True, "PREFIX": mutex_prefix},
        }
        with override_settings(CACHES={"default": entry}), caplog.at_level(logging.WARNING):
            with mutex("report"):
                pass
            vetted()
            assert check_ids() == ["django_redis_mutex.W003"]
    (message,) = eviction_warnings(caplog)
    assert "maxmemory-policy allkeys-lru" in message


# -- the system check --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", EVICTING)
def test_system_check_warns_about_an_evicting_lock_server(policy: str) -> None:
    with lock_redis(*policy_args(policy)):
        (message,) = check_lock_eviction()
    assert message.id == "django_redis_mutex.W003"
    assert "'default'" in message.msg and f"maxmemory-policy {policy}" in message.msg
    assert "noeviction" in (message.hint or "")


def test_system_check_says_nothing_about_an_unreachable_server() -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["LOCATION"] = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(CACHES=caches):
        assert check_lock_eviction() == []


def test_system_check_says_nothing_about_an_unreachable_cluster(mutex_prefix: str) -> None:
    entry = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
        "KEY_PREFIX": "tests",
        "MUTEX": {"CLUSTER": True, "PREFIX": mutex_prefix},
    }
    with override_settings(CACHES={"default": entry}):
        assert check_lock_eviction() == []


def test_system_check_covers_quorum_members_without_a_mutex_block(mutex_prefix: str) -> None:
    with lock_redis(*policy_args("allkeys-lru")):
        caches = copy.deepcopy(settings.CACHES)
        member = copy.deepcopy(caches["default"])
        del member["MUTEX"]
        caches = {
            "default": caches["default"],
            "m1": member,
            "m2": copy.deepcopy(member),
            "locks": {**copy.deepcopy(member), "MUTEX": {"QUORUM": ["m1", "m2"]}},
        }
        with override_settings(CACHES=caches):
            found = check_lock_eviction()
    assert sorted(m.msg.split("'")[1] for m in found) == ["default", "m1", "m2"]


# -- REQUIRE_NOEVICTION ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", EVICTING)
def test_require_noeviction_refuses_to_lock_on_an_evicting_server(policy: str) -> None:
    with lock_redis(*policy_args(policy), REQUIRE_NOEVICTION=True) as client:
        lock = Mutex("report")
        for _ in range(2):  # every attempt, not only the first
            with pytest.raises(ImproperlyConfigured) as raised:
                lock.acquire()
            assert "'default'" in str(raised.value)
            assert f"maxmemory-policy {policy}" in str(raised.value)
            assert "REQUIRE_NOEVICTION" in str(raised.value)
        ran = []
        with pytest.raises(ImproperlyConfigured), mutex("report"):
            ran.append(True)
        with pytest.raises(ImproperlyConfigured), Semaphore("exports", 2):
            ran.append(True)

        async def in_async() -> None:
            async with mutex("report"):
                ran.append(True)

        with pytest.raises(ImproperlyConfigured):
            asyncio.run(in_async())
        assert ran == []
        assert client.dbsize() == 0  # not a key written
        assert [m.id for m in check_lock_eviction()] == ["django_redis_mutex.E004"]


def test_require_noeviction_locks_on_a_noeviction_server() -> None:
    with lock_redis(*policy_args("noeviction"), REQUIRE_NOEVICTION=True):
        with mutex("report") as lock:
            assert lock.owned()
        assert check_ids() == []


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"REQUIRE_NOEVICTION": 1}, r"\['REQUIRE_NOEVICTION'\] must be True or False"),
        ({"REQUIRE_NOEVICTION": "yes"}, r"\['REQUIRE_NOEVICTION'\] must be True or False"),
        (
            {"REQUIRE_NOEVICTION": True, "QUORUM": ["a", "b"]},
            r"\['REQUIRE_NOEVICTION'\] has no effect on a QUORUM alias",
        ),
    ],
)
def test_bad_require_noeviction_settings_name_the_key(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"CACHES\['locks'\]\['MUTEX'\]" + message):
        parse_settings("locks", block)


# -- INFO refused by an ACL --------------------------------------------------------------------


@contextmanager
def user_without_info(*, policy: str, **mutex_options: Any) -> Iterator[redis.Redis]:
    """The default cache logs in as a lock user whose ACL lacks +info; yields an admin client."""
    with lock_redis(*policy_args(policy), **mutex_options) as admin:
        prefix = settings.CACHES["default"]["MUTEX"]["PREFIX"]
        rules = [rule for rule in lock_acl_rules(f"tests:{prefix}:*") if rule != "+info"]
        admin.execute_command("ACL", "SETUSER", "locks", "reset", "on", ">pw", *rules)
        caches = copy.deepcopy(settings.CACHES)
        port = admin.connection_pool.connection_kwargs["port"]
        caches["default"]["LOCATION"] = f"redis://locks:pw@127.0.0.1:{port}/0"
        with override_settings(CACHES=caches):
            yield admin


def test_info_refused_by_the_acl_is_said_once_and_locks_still_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with user_without_info(policy="allkeys-lru"), caplog.at_level(logging.WARNING, LOGGER):
        for _ in range(2):
            with mutex("report") as lock:
                assert lock.owned()
        (message,) = check_lock_eviction()
    assert message.id == "django_redis_mutex.I001"
    notes = [r.getMessage() for r in caplog.records if "refused INFO" in r.getMessage()]
    assert len(notes) == 1
    assert "'default'" in notes[0] and "+info" in notes[0]


def test_require_noeviction_refuses_when_info_is_refused() -> None:
    with user_without_info(policy="noeviction", REQUIRE_NOEVICTION=True):
        with pytest.raises(ImproperlyConfigured, match="'default' refused INFO"):
            Mutex("report").acquire()
        assert check_ids() == ["django_redis_mutex.E004"]


# -- evictions shown where locks are listed --------------------------------------------------


def evict_some(client: redis.Redis) -> int:
    """Fill a small server until it evicted keys; return how many it says it evicted."""
    filler = b"x" * 10_000
    for index in range(5_000):
        client.set(f"tests:1:page:{index}", filler)
        if index % 50 == 0 and int(client.info("stats")["evicted_keys"]):
            break
    return int(client.info("stats")["evicted_keys"])


def evicted_in(line: str) -> int:
    found = re.search(r"(\d+) keys evicted since it started", line)
    assert found, line
    return int(found.group(1))


def test_locks_command_shows_how_many_keys_the_server_evicted() -> None:
    with lock_redis(*policy_args("allkeys-lru", "2mb")) as client:
        evicted = evict_some(client)
        assert evicted > 0
        out = StringIO()
        call_command("locks", stdout=out)
        listed = StringIO()
        call_command("locks", "--json", stdout=listed)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Cache 'default' at redis://127.0.0.1:")
    assert lines[1].startswith("The Redis of cache 'default' evicts keys (maxmemory-policy ")
    assert "allkeys-lru): " in lines[1] and evicted_in(lines[1]) >= evicted
    assert listed.getvalue().strip() == "[]"  # the --json array is unchanged


def test_locks_command_says_nothing_of_evictions_on_a_noeviction_server() -> None:
    with lock_redis(*policy_args("noeviction")):
        out = StringIO()
        call_command("locks", stdout=out)
    assert "evict" not in out.getvalue()


@pytest.mark.django_db
def test_admin_locks_page_shows_how_many_keys_the_server_evicted(django_user_model: Any) -> None:
    staff = Client()
    staff.force_login(django_user_model.objects.create_superuser("root", password=None))
    with lock_redis(*policy_args("allkeys-lru", "2mb")) as client:
        evicted = evict_some(client)
        page = staff.get("/admin/django_redis_mutex/lock/")
    assert page.status_code == 200
    (line,) = page.context["evictions"]
    # Redis may evict a few more while the page reads it, never fewer.
    assert evicted_in(line) >= evicted
    assert 'id="lock-evictions"' in page.content.decode()
    assert "maxmemory-policy allkeys-lru" in page.content.decode()
