"""When Redis is unreachable, hung or dies mid-hold: fail fast, honestly, and recover.

``LockBackendUnavailable`` comes promptly; ``FAIL_OPEN`` runs ``with`` blocks
and decorated calls unlocked (with a warning) but never makes an explicit
``Mutex.acquire()`` pretend. Faults are real: a port nothing listens on, and a
dedicated redis-server that is killed, stopped (SIGSTOP) and restarted.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_redis_mutex import (
    LockBackendUnavailable,
    Mutex,
    Semaphore,
    held_locks,
    mutex,
    reset,
    reset_all,
    reset_semaphore,
    semaphore,
)
from django_redis_mutex.testing import RedisServer, free_port

from .helpers import cache_options, dedicated_redis, wait_until

# Generous bound for "promptly": far below the suite's 5 s socket timeout.
PROMPT = 2.0


def caches_for(
    location: str, options: dict[str, Any] | None = None, **mutex_options: Any
) -> dict[str, Any]:
    """Return settings.CACHES with the default alias moved to ``location``."""
    entries = copy.deepcopy(settings.CACHES)
    default = entries["default"]
    default["LOCATION"] = location
    default["OPTIONS"] = {**default.get("OPTIONS", {}), **(options or {})}
    default["MUTEX"] = {**default.get("MUTEX", {}), **mutex_options}
    return entries


@contextmanager
def unreachable(**mutex_options: Any) -> Iterator[None]:
    """Point the default cache at a loopback port nothing listens on."""
    with override_settings(
        CACHES=caches_for(f"redis://127.0.0.1:{free_port()}/0", **mutex_options)
    ):
        yield


@contextmanager
def dedicated(
    *extra_args: str, options: dict[str, Any] | None = None, **mutex_options: Any
) -> Iterator[RedisServer]:
    """Point the default cache at a private redis-server this test may kill or stop."""
    with RedisServer(extra_args=list(extra_args)) as server:
        try:
            with override_settings(CACHES=caches_for(server.url, options, **mutex_options)):
                yield server
        finally:
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)


def timed(func: Any) -> tuple[BaseException | None, float]:
    """Call ``func``; return the exception it raised (or None) and the seconds it took."""
    started = time.monotonic()
    try:
        func()
    except BaseException as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


# -- unreachable: fail fast ----------------------------------------------------------


def test_with_block_raises_backend_unavailable_promptly():
    ran = []

    def enter() -> None:
        with mutex("inventory"):
            ran.append(1)

    with unreachable():
        error, elapsed = timed(enter)
    assert isinstance(error, LockBackendUnavailable)
    assert error.name == "inventory"
    assert "inventory" in str(error)
    assert elapsed < PROMPT
    assert ran == []


def test_decorated_function_raises_backend_unavailable_and_does_not_run():
    ran = []

    @mutex("order:{order_id}")
    def process(order_id: int) -> None:
        ran.append(order_id)

    with unreachable(), pytest.raises(LockBackendUnavailable, match="order:3"):
        process(3)
    assert ran == []


def test_async_with_raises_backend_unavailable_promptly():
    async def main() -> None:
        async with mutex("inventory"):
            pytest.fail("the body must not run")

    with unreachable():
        error, elapsed = timed(lambda: asyncio.run(main()))
    assert isinstance(error, LockBackendUnavailable)
    assert elapsed < PROMPT


def test_explicit_acquire_raises_even_when_fail_open():
    with unreachable(FAIL_OPEN=True), pytest.raises(LockBackendUnavailable):
        Mutex("inventory").acquire()


def test_explicit_aacquire_raises_even_when_fail_open():
    with unreachable(FAIL_OPEN=True), pytest.raises(LockBackendUnavailable):
        asyncio.run(Mutex("inventory").aacquire())


@pytest.mark.parametrize(
    "call",
    [
        lambda: held_locks(),
        lambda: reset("inventory"),
        lambda: reset_all(),
        lambda: Mutex("inventory").locked(),
        lambda: Mutex("inventory").owner(),
    ],
    ids=["held_locks", "reset", "reset_all", "locked", "owner"],
)
def test_inspection_raises_backend_unavailable(call):
    with unreachable(), pytest.raises(LockBackendUnavailable) as raised:
        call()
    # The message is shown to people (demo page, admin, `locks`): it names the
    # cache, and a lock only when the call was about one.
    message = str(raised.value)
    assert message.startswith("Redis for cache 'default' is unavailable")
    assert "'*'" not in message
    assert ("'inventory'" in message) == (raised.value.name == "inventory")


@pytest.mark.parametrize(
    "call",
    [
        lambda: held_locks(),
        lambda: reset("inventory"),
        lambda: reset_semaphore("exports"),
        lambda: reset_all(),
    ],
    ids=["held_locks", "reset", "reset_semaphore", "reset_all"],
)
def test_inspection_of_an_unreachable_cluster_raises_backend_unavailable(call):
    # A Cluster client connects as it is built, raising redis-py's
    # RedisClusterException (not a RedisError) when no seed node answers.
    with unreachable(CLUSTER=True), pytest.raises(LockBackendUnavailable) as raised:
        call()
    assert str(raised.value).startswith("Redis for cache 'default' is unavailable")


# -- FAIL_OPEN ---------------------------------------------------------------------------


def test_fail_open_runs_with_block_unlocked_and_warns(caplog):
    ran = []
    with (
        unreachable(FAIL_OPEN=True),
        caplog.at_level(logging.WARNING, "django_redis_mutex"),
        mutex("inventory") as lock,
    ):
        ran.append(lock.token)
    assert ran == [None]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("inventory" in r.getMessage() for r in warnings)


def test_fail_open_runs_decorated_function_unlocked():
    @mutex("order:{order_id}")
    def process(order_id: int) -> int:
        return order_id * 2

    with unreachable(FAIL_OPEN=True):
        assert process(21) == 42


def test_fail_open_runs_async_with_body_and_async_decorator():
    @mutex("order:{order_id}")
    async def process(order_id: int) -> int:
        async with mutex("inner"):
            return order_id * 2

    with unreachable(FAIL_OPEN=True):
        assert asyncio.run(process(21)) == 42


def test_fail_open_still_raises_body_exception():
    with unreachable(FAIL_OPEN=True), pytest.raises(KeyError, match="body"), mutex("inventory"):
        raise KeyError("body")


# -- Redis dies or hangs under a running client -------------------------------------------


def test_exit_raises_backend_unavailable_when_redis_died_during_successful_body():
    with dedicated() as server:

        def run() -> None:
            with mutex("inventory", watchdog=False):
                server.kill()

        error, elapsed = timed(run)
    assert isinstance(error, LockBackendUnavailable)
    assert "inventory" in str(error)
    assert elapsed < PROMPT


def test_fail_open_exit_logs_instead_of_raising_when_redis_died(caplog):
    with (
        dedicated(FAIL_OPEN=True) as server,
        caplog.at_level(logging.ERROR, "django_redis_mutex"),
        mutex("inventory", watchdog=False) as lock,
    ):
        server.kill()
    assert lock.token is not None  # kept for a retry; the lease ends by itself
    assert any("inventory" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_fail_open_leaving_a_block_whose_redis_died_logs_for_every_kind(caplog, kind):
    # FAIL_OPEN treats a failed release alike for every kind: the body ran
    # under its lock or permit, and the lease ends by itself.
    with (
        dedicated(FAIL_OPEN=True) as server,
        caplog.at_level(logging.ERROR, "django_redis_mutex"),
    ):
        guard = (
            mutex("exports", watchdog=False)
            if kind == "lock"
            else semaphore("exports", 2, watchdog=False)
        )
        with guard as held:
            server.kill()
    assert held.token is not None  # kept for a retry; the lease ends by itself
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"Could not release {kind} 'exports'" in message for message in errors), errors


def test_waiter_fails_promptly_when_redis_dies_during_its_wait():
    with dedicated() as server:
        holder = Mutex("inventory", watchdog=False)
        assert holder.acquire()
        outcome: dict[str, Any] = {}

        def wait_for_it() -> None:
            outcome["error"], outcome["elapsed"] = timed(
                lambda: Mutex("inventory", timeout=30).acquire()
            )

        thread = threading.Thread(target=wait_for_it)
        thread.start()
        deadline = time.monotonic() + 5
        while held_locks()[0].waiters == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.kill()
        thread.join(10)
    assert isinstance(outcome["error"], LockBackendUnavailable)
    assert outcome["elapsed"] < 5


def test_hung_redis_gives_backend_unavailable_after_socket_timeout():
    with dedicated(options=cache_options(socket_timeout=0.5)) as server:
        # A pooled connection exists before the hang, as in a running app.
        assert Mutex("warmup", watchdog=False).acquire()
        server.process.send_signal(signal.SIGSTOP)
        try:
            error, elapsed = timed(lambda: Mutex("inventory").acquire())
        finally:
            server.process.send_signal(signal.SIGCONT)
    assert isinstance(error, LockBackendUnavailable)
    assert 0.4 <= elapsed < 3.0


def test_locks_work_again_after_redis_restarts():
    with dedicated() as server:
        assert Mutex("before", watchdog=False).acquire()
        server.restart()
        lock = Mutex("after")
        assert lock.acquire()
        assert lock.owned()
        lock.release()


def test_watchdog_keeps_a_hold_alive_across_a_brief_outage():
    # The lock survives the restart on disk; the renewer must retry, not give up.
    with (
        dedicated("--appendonly", "yes", "--appendfsync", "always") as server,
        mutex("inventory", ttl=2.0) as lock,
    ):
        server.restart()
        deadline = time.monotonic() + 4.0  # twice the lease
        while time.monotonic() < deadline:
            assert lock.owned()
            time.sleep(0.1)
        assert not lock.lost


# -- A release that failed while Redis was down can be retried; the body's own exception wins. ---


def test_release_failing_while_redis_is_down_can_be_retried_when_it_is_back():
    # appendfsync always: the lock survives the kill, as on a real restart.
    with dedicated_redis("--appendonly", "yes", "--appendfsync", "always") as (server, _client):
        lock = Mutex("payment", watchdog=False)
        assert lock.acquire()
        token = lock.token
        server.kill()
        with pytest.raises(LockBackendUnavailable, match="payment"):
            lock.release()
        assert lock.token == token
        server.start()
        # The retry releases it, or finds that the background give-back did.
        lock.release()
        assert lock.token is None
        assert not lock.locked()


def test_exit_keeps_body_exception_when_redis_is_down():
    with (
        dedicated_redis() as (server, _client),
        pytest.raises(KeyError, match="from the body"),
        mutex("victim", watchdog=False),
    ):
        server.kill()
        raise KeyError("from the body")


def test_fail_open_runs_a_semaphore_block_without_a_permit_and_warns(caplog):
    ran = []
    with (
        unreachable(FAIL_OPEN=True),
        caplog.at_level(logging.WARNING, "django_redis_mutex"),
        semaphore("exports", 2) as permit,
    ):
        ran.append(permit.token)
    assert ran == [None]
    assert any(
        "exports" in r.getMessage() and "FAIL_OPEN" in r.getMessage() for r in caplog.records
    )


def test_fail_open_runs_a_decorated_async_semaphore_function():
    @semaphore("tenant:{tenant_id}", 1)
    async def export(tenant_id: int) -> str:
        return f"exported {tenant_id}"

    with unreachable(FAIL_OPEN=True):
        assert asyncio.run(export(7)) == "exported 7"


def test_without_fail_open_a_semaphore_block_raises_and_never_runs():
    ran = []
    with unreachable(), pytest.raises(LockBackendUnavailable), semaphore("exports", 2):
        ran.append(True)
    assert ran == []


def test_a_master_demoted_to_replica_makes_acquire_raise_backend_unavailable():
    # A plain client keeps talking to its URL after a failover demoted that
    # server: every lock write is answered READONLY, and nothing was written.
    with RedisServer() as new_master, dedicated() as demoted:
        client = redis.Redis(port=demoted.port)
        try:
            client.replicaof("127.0.0.1", new_master.port)
            wait_until(lambda: client.info("replication")["role"] == "slave", 10, "the demotion")
            with pytest.raises(LockBackendUnavailable, match="read only replica"):
                Mutex("inventory").acquire()
            with pytest.raises(LockBackendUnavailable), mutex("inventory"):
                pass
            assert client.dbsize() == 0
        finally:
            client.close()


# -- A call whose reply never came leaves nothing held once Redis answers again. -------------


def _handle(kind: str) -> Any:
    """A lock or a one-permit semaphore "slow" with an 8 s lease and no watchdog."""
    if kind == "lock":
        return Mutex("slow", ttl=8, watchdog=False)
    return Semaphore("slow", 1, ttl=8, watchdog=False)


@contextmanager
def busy(server: RedisServer, seconds: float) -> Iterator[None]:
    """Keep ``server`` busy (DEBUG SLEEP on a connection of its own) for ``seconds``.

    Enter once it no longer answers; leave once it answers again.
    """
    sleeper = redis.Redis(port=server.port)
    # No retries: a ping that times out means the server is asleep.
    pinger = redis.Redis(port=server.port, socket_timeout=0.1, retry=Retry(NoBackoff(), 0))
    thread = threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", seconds))
    thread.start()

    def asleep() -> bool:
        try:
            pinger.ping()
        except redis.TimeoutError:
            return True
        return False

    try:
        wait_until(asleep, 5, "the server to fall asleep")
        yield
    finally:
        thread.join(seconds + 10)
        sleeper.close()
        pinger.close()


def _acquired_by_another(kind: str) -> float:
    """Return how long another owner waited for "slow" (it must get it within 4 s)."""
    started = time.monotonic()
    other = _handle(kind)
    assert other.acquire(timeout=4.0), "still held by the call that timed out"
    waited = time.monotonic() - started
    other.release()
    return waited


@pytest.mark.parametrize("driven", ["sync", "async"])
@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_an_acquire_whose_reply_timed_out_holds_nothing_once_redis_answers_again(
    kind: str, driven: str
) -> None:
    # The server runs the ACQUIRE it had read once it wakes: without a give-back
    # the lock or permit went to a token nobody had, for its whole 8 s lease.
    with dedicated("--enable-debug-command", "yes", options=cache_options(socket_timeout=0.5)) as (
        server
    ):
        if driven == "sync":
            warm = _handle(kind)  # scripts loaded, a connection in the pool
            assert warm.acquire()
            warm.release()
            with busy(server, 3.0), pytest.raises(LockBackendUnavailable):
                _handle(kind).acquire()
        else:

            async def main() -> None:
                warm = _handle(kind)
                assert await warm.aacquire()
                await warm.arelease()
                with busy(server, 3.0), pytest.raises(LockBackendUnavailable):
                    await _handle(kind).aacquire()

            asyncio.run(main())
        # The server answers again.
        assert _acquired_by_another(kind) < 2.0


@pytest.mark.parametrize("driven", ["sync", "async"])
@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_release_redis_never_answered_is_given_back_and_can_still_be_retried(
    kind: str, driven: str
) -> None:
    # Writes paused past the socket timeout: the RELEASE parked at the server
    # is dropped with its connection, and the lock or permit stayed held for
    # its whole 8 s lease although its owner had left.
    with dedicated(options=cache_options(socket_timeout=0.5)) as server:
        pauser = redis.Redis(port=server.port)
        holder = _handle(kind)

        async def arelease() -> None:
            await holder.arelease()

        def release() -> None:
            if driven == "sync":
                holder.release()
            else:
                asyncio.run(arelease())

        assert holder.acquire()
        pauser.client_pause(1500, all=False)
        paused = time.monotonic()
        with pytest.raises(LockBackendUnavailable):
            release()
        assert holder.token is not None  # kept for a retry
        pauser.set("writes-flow", 1)  # parked until the pause ends
        resumed = time.monotonic()
        assert resumed - paused < 3.0
        assert _acquired_by_another(kind) < 2.0
        release()  # the caller's retry finds it given back: no LockNotOwned, no LockLost
        assert holder.token is None
        pauser.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_give_back_after_the_commit_that_redis_never_answered_is_retried(kind: str) -> None:
    # A lock kept for its transaction is given back by the COMMIT's hook; Redis
    # not answering then must not leave it held for its whole lease.
    with dedicated(options=cache_options(socket_timeout=0.5)) as server:
        pauser = redis.Redis(port=server.port)
        with transaction.atomic():
            with _handle(kind):
                pass
            pauser.client_pause(1500, all=False)
            paused = time.monotonic()
        pauser.set("writes-flow", 1)  # parked until the pause ends
        assert time.monotonic() - paused < 3.0
        assert _acquired_by_another(kind) < 2.0
        pauser.close()


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_an_acquisition_cancelled_while_redis_sleeps_holds_nothing_once_it_wakes(
    kind: str,
) -> None:
    # Cancelled (twice) with its ACQUIRE in flight to a sleeping Redis: the
    # in-flight call times out, and so does the give-back sent after it. Redis
    # then wakes and grants the lock to the token nobody has; only a give-back
    # retried in the background frees it before its 8 s lease ends.
    with dedicated("--enable-debug-command", "yes", options=cache_options(socket_timeout=0.5)) as (
        server
    ):

        async def main() -> None:
            warm = _handle(kind)
            assert await warm.aacquire()
            await warm.arelease()
            with busy(server, 2.0):
                task = asyncio.ensure_future(_handle(kind).aacquire())
                await asyncio.sleep(0.1)  # its script is on its way to the sleeping server
                task.cancel()
                for _ in range(3):
                    await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        assert _acquired_by_another(kind) < 2.0


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_waiter_whose_connection_was_killed_is_not_handed_the_lock_for_its_lease(
    kind: str,
) -> None:
    # The waiter's blocking wait fails (its connection killed) while writes
    # are paused past the socket timeout, so its give-back fails too. Unless
    # that give-back is retried, the next release hands the lock to a waiter
    # that has left, for its 4 s hand-over lease.
    with dedicated(options=cache_options(socket_timeout=0.5)) as server:
        killer = redis.Redis(port=server.port)
        holder = _handle(kind)
        assert holder.acquire()
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                _handle(kind).acquire(timeout=10)
            except LockBackendUnavailable as exc:
                failed.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(
            lambda: any(c.get("cmd") == "blpop" for c in killer.client_list()),
            10,
            "the waiter blocked on its wake-up list",
        )
        killer.client_pause(1500, all=False)
        killer.client_kill_filter(_type="normal", skipme=True)
        waiter.join(10)
        assert failed, "the waiter should have seen its connection go"
        killer.set("writes-flow", 1)  # parked until the pause ends
        holder.release()
        assert _acquired_by_another(kind) < 2.0
        killer.close()


def test_a_client_built_while_caches_change_is_never_kept_for_the_new_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A background thread (the watchdog, a give-back) builds a client from the
    # old settings; CACHES changes before it is stored. Stored, it would send
    # every later caller's locks to the old server.
    from django_redis_mutex import client as clients

    old_port, new_port = free_port(), free_port()
    built, go_on = threading.Event(), threading.Event()
    real_new_client = clients._new_client

    def slow_new_client(alias: str) -> Any:
        made = real_new_client(alias)
        if threading.current_thread() is not threading.main_thread():
            built.set()
            assert go_on.wait(10)
        return made

    monkeypatch.setattr(clients, "_new_client", slow_new_client)
    with override_settings(CACHES=caches_for(f"redis://127.0.0.1:{old_port}/0")):
        background = threading.Thread(target=clients.get_client, args=("default",))
        background.start()
        assert built.wait(10)
        with override_settings(CACHES=caches_for(f"redis://127.0.0.1:{new_port}/0")):
            go_on.set()
            background.join(10)
            port = clients.get_client("default").connection_pool.connection_kwargs["port"]
    assert port == new_port


def test_a_give_back_on_an_alias_no_longer_configured_stops_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Settings changed under a pending give-back: its alias is gone for good,
    # so retrying until the lease ends would only log the same error again.
    from django_redis_mutex import giveback, scripts
    from django_redis_mutex.driver import Script
    from django_redis_mutex.keys import LockKeys

    def steps() -> Any:
        keys = LockKeys.for_name("tests", "gone")
        yield Script("no-such-alias", scripts.RELEASE, keys.script_keys, ["token"])

    caplog.set_level(logging.INFO, logger="django_redis_mutex")
    giveback.give_back_later("lock 'gone'", steps, lease=30.0)
    assert wait_until(
        lambda: any("Stopped trying to give back" in r.getMessage() for r in caplog.records),
        timeout=10,
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "django_redis_mutex"]
    [told] = [m for m in messages if "lock 'gone'" in m]
    assert told.startswith(
        "Stopped trying to give back lock 'gone': Cache alias 'no-such-alias' is not configured"
    )
