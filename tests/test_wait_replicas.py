"""WAIT_REPLICAS: an acquisition succeeds only once enough replicas acknowledged it.

One real master with two real replicas (``redis-server --replicaof``) for the
module. A test that needs a replica gone freezes it (SIGSTOP: its link stays
up, it just never acknowledges) and lets it run again afterwards; every test
starts with both replicas caught up. Replicas are read directly, never through
the app.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_redis_mutex import (
    LockBackendUnavailable,
    LockNotReplicated,
    Mutex,
    Semaphore,
    held_semaphores,
    mutex,
    semaphore,
)
from django_redis_mutex.acquisition import start
from django_redis_mutex.checks import check_mutex_settings
from django_redis_mutex.conf import parse_settings
from django_redis_mutex.driver import Acknowledged, Script
from django_redis_mutex.testing import RedisServer

from .helpers import await_until, wait_until
from .topologies import SentinelGroup

# Generous against a busy 2-core machine; a healthy setup needs a fraction.
SYNC_TIMEOUT = 30.0
WAIT_TIMEOUT = 0.5
SOCKET_OPTIONS = {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 5}


class Replicated:
    """A master, its two replicas, and a plain client on each."""

    def __init__(self) -> None:
        fast_sync = ["--repl-diskless-sync-delay", "0"]
        self.master = RedisServer(extra_args=fast_sync).start()
        self.replicas: list[RedisServer] = []
        try:
            for _ in range(2):
                replica = RedisServer(
                    extra_args=[*fast_sync, "--replicaof", "127.0.0.1", str(self.master.port)]
                )
                self.replicas.append(replica.start())
            self.on_master = redis.Redis(port=self.master.port)
            self.on_replicas = [redis.Redis(port=r.port) for r in self.replicas]
            wait_until(self._online, SYNC_TIMEOUT, "both replicas to be online")
        except BaseException:
            self.close()
            raise

    def _online(self) -> bool:
        info = self.on_master.info("replication")
        online = [
            value
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict)
        ]
        return len(online) == 2 and all(r.get("state") == "online" for r in online)

    def caught_up(self) -> bool:
        """Return True once both replicas acknowledged everything written so far."""
        self.on_master.set("wait-replicas-probe", "1", px=10_000)
        return int(self.on_master.wait(2, 1000)) == 2

    def close(self) -> None:
        for server in [*self.replicas, self.master]:
            server.resume()
            server.close()


@pytest.fixture(scope="module")
def topology() -> Iterator[Replicated]:
    servers = Replicated()
    yield servers
    servers.close()


@pytest.fixture
def servers(topology: Replicated) -> Iterator[Replicated]:
    """The topology with both replicas running and caught up; frozen replicas thawed after."""
    wait_until(topology.caught_up, SYNC_TIMEOUT, "both replicas to catch up")
    yield topology
    for replica in topology.replicas:
        replica.resume()


def entry(server: RedisServer, prefix: str, **mutex: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": server.url,
        "KEY_PREFIX": "tests",
        "OPTIONS": dict(SOCKET_OPTIONS),
        "MUTEX": {"PREFIX": prefix, **mutex},
    }


@pytest.fixture
def replicated_caches(servers: Replicated, mutex_prefix: str) -> Iterator[None]:
    """``default`` on the master with ``WAIT_REPLICAS: 2``; ``one`` needs one; ``plain`` none.

    All three share the namespace, so they take the same locks.
    """
    caches = copy.deepcopy(settings.CACHES)
    caches["default"] = entry(
        servers.master, mutex_prefix, WAIT_REPLICAS=2, WAIT_TIMEOUT=WAIT_TIMEOUT
    )
    caches["one"] = entry(servers.master, mutex_prefix, WAIT_REPLICAS=1, WAIT_TIMEOUT=WAIT_TIMEOUT)
    caches["plain"] = entry(servers.master, mutex_prefix)
    with override_settings(CACHES=caches):
        yield


def token_on(client: redis.Redis, lock: Mutex) -> str | None:
    value: bytes | None = client.hget(lock.keys.lock, "token")  # type: ignore[assignment]
    return None if value is None else value.decode()


def queued(servers: Replicated, lock: Mutex) -> int:
    return int(servers.on_master.zcard(lock.keys.queue))


# -- acquisition -------------------------------------------------------------------------------


@pytest.mark.usefixtures("replicated_caches")
def test_acquire_returns_once_both_replicas_hold_the_lock(servers: Replicated) -> None:
    lock = Mutex("report")
    assert lock.acquire()
    try:
        # Read at once, no waiting: WAIT already had both replicas acknowledge it.
        assert [token_on(replica, lock) for replica in servers.on_replicas] == [lock.token] * 2
    finally:
        lock.release()


@pytest.mark.usefixtures("replicated_caches")
def test_too_few_replicas_give_the_lock_back_and_raise(servers: Replicated) -> None:
    servers.replicas[1].pause()
    lock = Mutex("report")
    started = time.monotonic()
    with pytest.raises(LockNotReplicated) as raised:
        lock.acquire()
    took = time.monotonic() - started
    assert WAIT_TIMEOUT * 0.8 <= took < WAIT_TIMEOUT + 3
    error = raised.value
    assert isinstance(error, LockBackendUnavailable)
    assert (error.name, error.alias, error.acknowledged, error.required) == (
        "report",
        "default",
        1,
        2,
    )
    assert "'report'" in str(error) and "'default'" in str(error)
    assert "acknowledged by 1 replica(s)" in str(error) and "2 required" in str(error)
    assert not servers.on_master.exists(lock.keys.lock)  # given back, not left held
    assert lock.token is None


@pytest.mark.usefixtures("replicated_caches")
def test_with_block_does_not_run_without_enough_replicas(servers: Replicated) -> None:
    servers.replicas[0].pause()
    ran = []
    with pytest.raises(LockBackendUnavailable, match="acknowledged by 1 replica"), Mutex("report"):
        ran.append(True)
    assert ran == []
    assert not servers.on_master.exists(Mutex("report").keys.lock)


@pytest.mark.usefixtures("replicated_caches")
def test_one_replica_is_enough_when_one_is_required(servers: Replicated) -> None:
    servers.replicas[1].pause()
    lock = Mutex("report", using="one")
    assert lock.acquire()
    try:
        assert token_on(servers.on_replicas[0], lock) == lock.token
        assert token_on(servers.on_master, lock) == lock.token
    finally:
        lock.release()


@pytest.mark.usefixtures("replicated_caches")
def test_refused_try_returns_false_without_raising(servers: Replicated) -> None:
    holder = Mutex("report", using="plain")
    assert holder.acquire()
    try:
        assert Mutex("report").acquire(blocking=False) is False
        assert token_on(servers.on_master, holder) == holder.token
    finally:
        holder.release()


# -- a lock handed over by someone else's release --------------------------------------------


def _acquire_in_thread(lock: Mutex, outcome: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            outcome["acquired"] = lock.acquire(timeout=20)
            outcome["token"] = lock.token
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.usefixtures("replicated_caches")
def test_waiter_handed_the_lock_has_it_acknowledged_by_the_replicas(
    servers: Replicated,
) -> None:
    holder = Mutex("report", using="plain")
    assert holder.acquire()
    waiter = Mutex("report")
    outcome: dict[str, Any] = {}
    thread = _acquire_in_thread(waiter, outcome)
    wait_until(lambda: queued(servers, holder) == 1, 10, "the waiter to queue")
    holder.release()
    thread.join(20)
    assert outcome.get("acquired") is True, outcome
    try:
        assert [token_on(replica, waiter) for replica in servers.on_replicas] == [
            outcome["token"]
        ] * 2
    finally:
        waiter.release()


@pytest.mark.usefixtures("replicated_caches")
def test_waiter_handed_the_lock_without_replicas_hands_it_on(servers: Replicated) -> None:
    holder = Mutex("report", using="plain")
    assert holder.acquire()
    first = Mutex("report")  # needs both replicas
    second = Mutex("report", using="plain")  # needs none, queued behind
    first_outcome: dict[str, Any] = {}
    second_outcome: dict[str, Any] = {}
    first_thread = _acquire_in_thread(first, first_outcome)
    wait_until(lambda: queued(servers, holder) == 1, 10, "the first waiter to queue")
    second_thread = _acquire_in_thread(second, second_outcome)
    wait_until(lambda: queued(servers, holder) == 2, 10, "the second waiter to queue")
    servers.replicas[1].pause()
    holder.release()
    first_thread.join(20)
    second_thread.join(20)
    error = first_outcome.get("error")
    assert isinstance(error, LockNotReplicated), first_outcome
    assert (error.acknowledged, error.required) == (1, 2)
    assert second_outcome.get("acquired") is True, second_outcome
    try:
        assert token_on(servers.on_master, second) == second_outcome["token"]
    finally:
        second.release()


def shared_record_on(client: redis.Redis, lock: Mutex) -> bool:
    return bool(client.hexists(lock.keys.lock, f"r:{lock.token}"))


@pytest.mark.usefixtures("replicated_caches")
def test_a_shared_hold_is_on_both_replicas_when_acquire_returns(servers: Replicated) -> None:
    reader = Mutex("report", shared=True)
    assert reader.acquire()
    try:
        assert [shared_record_on(replica, reader) for replica in servers.on_replicas] == [
            True,
            True,
        ]
    finally:
        reader.release()


@pytest.mark.usefixtures("replicated_caches")
def test_a_shared_hold_without_enough_replicas_is_given_back(servers: Replicated) -> None:
    other = Mutex("report", using="plain", shared=True)
    assert other.acquire()
    servers.replicas[1].pause()
    reader = Mutex("report", shared=True)
    with pytest.raises(LockNotReplicated):
        reader.acquire()
    # Only its own record went; the other reader still holds.
    fields = servers.on_master.hkeys(other.keys.lock)
    assert fields == [f"r:{other.token}".encode()]
    other.release()


@pytest.mark.usefixtures("replicated_caches")
def test_a_shared_waiter_handed_the_lock_has_it_acknowledged(servers: Replicated) -> None:
    writer = Mutex("report", using="plain")
    assert writer.acquire()
    reader = Mutex("report", shared=True)
    outcome: dict[str, Any] = {}
    thread = _acquire_in_thread(reader, outcome)
    wait_until(lambda: queued(servers, writer) == 1, 10, "the reader to queue")
    writer.release()
    thread.join(20)
    assert outcome.get("acquired") is True, outcome
    try:
        field = f"r:{outcome['token']}"
        assert [bool(r.hexists(reader.keys.lock, field)) for r in servers.on_replicas] == [
            True,
            True,
        ]
    finally:
        reader.release()


# -- async -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("replicated_caches")
def test_async_acquire_returns_once_both_replicas_hold_the_lock(servers: Replicated) -> None:
    async def main() -> list[str | None]:
        lock = Mutex("report")
        assert await lock.aacquire()
        try:
            return [token_on(replica, lock) for replica in servers.on_replicas] + [lock.token]
        finally:
            await lock.arelease()

    *on_replicas, token = asyncio.run(main())
    assert token is not None and on_replicas == [token, token]


@pytest.mark.usefixtures("replicated_caches")
def test_async_acquire_without_replicas_gives_the_lock_back(servers: Replicated) -> None:
    servers.replicas[0].pause()

    async def main() -> LockNotReplicated:
        with pytest.raises(LockNotReplicated) as raised:
            async with Mutex("report"):
                pass
        return raised.value

    error = asyncio.run(main())
    assert (error.acknowledged, error.required) == (1, 2)
    assert not servers.on_master.exists(Mutex("report", using="plain").keys.lock)


@pytest.mark.usefixtures("replicated_caches")
def test_async_waiter_handed_the_lock_without_replicas_gives_it_back(
    servers: Replicated,
) -> None:
    holder = Mutex("report", using="plain")
    assert holder.acquire()

    async def main() -> BaseException | None:
        waiter = Mutex("report")
        task = asyncio.ensure_future(waiter.aacquire(timeout=20))
        await await_until(lambda: queued(servers, holder) == 1, 10, "the waiter to queue")
        servers.replicas[1].pause()
        await asyncio.to_thread(holder.release)
        done, _ = await asyncio.wait({task}, timeout=20)
        return task.exception() if done else None

    error = asyncio.run(main())
    assert isinstance(error, LockNotReplicated), error
    assert (error.acknowledged, error.required) == (1, 2)
    assert not servers.on_master.exists(holder.keys.lock)


# -- Sentinel ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    with SentinelGroup(replicas=2, sentinel_count=1, quorum=1) as group:
        yield group


@pytest.fixture
def sentinel_lock(sentinel_group: SentinelGroup, mutex_prefix: str) -> Iterator[SentinelGroup]:
    """``default``: the Sentinel service with ``WAIT_REPLICAS: 2``; frozen replicas thawed after."""

    def caught_up() -> bool:
        with redis.Redis(port=sentinel_group.master.port) as master:
            master.set("wait-replicas-probe", "1", px=10_000)
            return int(master.wait(2, 1000)) == 2

    wait_until(caught_up, SYNC_TIMEOUT, "both Sentinel replicas to catch up")
    caches = copy.deepcopy(settings.CACHES)
    caches["default"] = sentinel_group.cache_entry(
        mutex_prefix, WAIT_REPLICAS=2, WAIT_TIMEOUT=WAIT_TIMEOUT
    )
    try:
        with override_settings(CACHES=caches):
            yield sentinel_group
    finally:
        for replica in sentinel_group.replica_servers():
            replica.resume()


def test_sentinel_lock_is_on_both_replicas_when_acquire_returns(
    sentinel_lock: SentinelGroup,
) -> None:
    lock = Mutex("report")
    assert lock.acquire()
    try:
        for replica in sentinel_lock.replica_servers():
            with redis.Redis(port=replica.port) as client:
                assert token_on(client, lock) == lock.token
    finally:
        lock.release()


def test_async_sentinel_lock_without_replicas_is_given_back(sentinel_lock: SentinelGroup) -> None:
    sentinel_lock.replica_servers()[0].pause()

    async def main() -> LockNotReplicated:
        with pytest.raises(LockNotReplicated) as raised:
            await Mutex("report").aacquire()
        return raised.value

    error = asyncio.run(main())
    assert (error.acknowledged, error.required) == (1, 2)
    with redis.Redis(port=sentinel_lock.master.port) as client:
        assert not client.exists(Mutex("report").keys.lock)


# -- off by default, and settings ------------------------------------------------------------


def test_off_by_default_sends_the_plain_script() -> None:
    lock = Mutex("report")
    assert lock.settings.wait_replicas == 0
    steps = lock._where.acquire_steps(start(lock, False, None))
    try:
        first = next(steps)
    finally:
        steps.close()
    assert isinstance(first, Script) and not isinstance(first, Acknowledged)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"WAIT_REPLICAS": -1}, r"\['WAIT_REPLICAS'\] must be a whole number"),
        ({"WAIT_REPLICAS": 1.5}, r"\['WAIT_REPLICAS'\] must be a whole number"),
        ({"WAIT_REPLICAS": True}, r"\['WAIT_REPLICAS'\] must be a whole number"),
        ({"WAIT_REPLICAS": "2"}, r"\['WAIT_REPLICAS'\] must be a whole number"),
        ({"WAIT_REPLICAS": 1, "WAIT_TIMEOUT": 0}, r"\['WAIT_TIMEOUT'\] must be at least"),
        ({"WAIT_REPLICAS": 1, "WAIT_TIMEOUT": -1}, r"\['WAIT_TIMEOUT'\] must be at least"),
        ({"WAIT_REPLICAS": 1, "WAIT_TIMEOUT": "1"}, r"\['WAIT_TIMEOUT'\] must be a number"),
        ({"WAIT_REPLICAS": 1, "WAIT_TIMEOUT": math.nan}, r"\['WAIT_TIMEOUT'\] must be a finite"),
        (
            {"WAIT_REPLICAS": 1, "WAIT_TIMEOUT": 5, "TTL": 5},
            r"\['WAIT_TIMEOUT'\] must be shorter than the TTL",
        ),
        (
            {"WAIT_REPLICAS": 1, "QUORUM": ["a", "b"]},
            r"\['WAIT_REPLICAS'\] cannot be combined with QUORUM",
        ),
        (
            {"WAIT_REPLICAS": 1, "CLUSTER": True},
            r"\['WAIT_REPLICAS'\] cannot be combined with CLUSTER",
        ),
    ],
)
def test_bad_settings_name_the_key(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"CACHES\['locks'\]\['MUTEX'\]" + message):
        parse_settings("locks", block)


def test_system_check_reports_a_bad_wait_setting() -> None:
    caches: dict[str, Any] = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = {**caches["default"]["MUTEX"], "WAIT_REPLICAS": -1}
    with override_settings(CACHES=caches):
        errors = check_mutex_settings()
    assert [e.id for e in errors] == ["django_redis_mutex.E002"]
    assert "['WAIT_REPLICAS'] must be a whole number of replicas" in errors[0].msg


def test_quorum_refuses_a_member_that_waits_for_replicas(mutex_prefix: str) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["r2"] = copy.deepcopy(caches["default"])
    caches["r2"]["MUTEX"] = {"PREFIX": mutex_prefix, "WAIT_REPLICAS": 1}
    refused = pytest.raises(ImproperlyConfigured, match=r"cannot use cache 'r2'.*WAIT_REPLICAS")
    with override_settings(CACHES=caches), refused:
        Mutex("report", using=["default", "r2"])


# -- every kind of lock on a WAIT_REPLICAS alias --------------------------------------------


@pytest.fixture
def waits_without_replicas() -> Iterator[None]:
    """``default`` (the suite's server, which has no replica) waits for one replica."""
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = {
        **caches["default"]["MUTEX"],
        "WAIT_REPLICAS": 1,
        "WAIT_TIMEOUT": 0.2,
    }
    with override_settings(CACHES=caches):
        yield


@pytest.mark.usefixtures("waits_without_replicas")
def test_an_exclusive_hold_without_a_replica_is_refused(raw: redis.Redis) -> None:
    lock = Mutex("report")
    with pytest.raises(LockNotReplicated):
        lock.acquire()
    assert not raw.exists(lock.keys.lock)


@pytest.mark.usefixtures("waits_without_replicas")
def test_a_shared_hold_without_a_replica_is_refused(raw: redis.Redis) -> None:
    ran = []
    with pytest.raises(LockNotReplicated), mutex("report", shared=True):
        ran.append(True)
    assert ran == []
    assert not raw.exists(Mutex("report").keys.lock)


@pytest.mark.usefixtures("waits_without_replicas")
def test_a_permit_without_a_replica_is_refused_and_given_back(raw: redis.Redis) -> None:
    ran = []
    with pytest.raises(LockNotReplicated), semaphore("exports", 2):
        ran.append(True)
    assert ran == []
    assert held_semaphores() == []


@pytest.mark.usefixtures("replicated_caches")
def test_a_permit_is_on_both_replicas_when_acquire_returns(servers: Replicated) -> None:
    permit = Semaphore("exports", 2)
    assert permit.acquire()
    try:
        assert [shared_record_on(replica, permit) for replica in servers.on_replicas] == [
            True,
            True,
        ]
    finally:
        permit.release()
