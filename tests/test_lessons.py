"""One test per trap that earlier Redis lock libraries fell into.

Each test is named for the behaviour that avoids the trap; the section
comments say which trap (and the library issue that reported it). Faults are
real: a dedicated redis-server is paused, killed and restarted on its own port.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.cache import caches
from django.test import override_settings
from redis.crc import key_slot

from django_redis_mutex import (
    LockBackendUnavailable,
    LockLost,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
    reset,
    reset_all,
    signals,
)
from django_redis_mutex.testing import RedisServer
from django_redis_mutex.watchdog import get_watchdog

from .conftest import cache_options, caches_with, wait_until


@contextmanager
def dedicated_redis(*extra_args: str) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """Point the default cache at a private redis-server this test may pause or kill."""
    with RedisServer(extra_args=list(extra_args)) as server:
        entries = copy.deepcopy(settings.CACHES)
        entries["default"]["LOCATION"] = server.url
        client = redis.Redis(port=server.port)
        try:
            with override_settings(CACHES=entries):
                yield server, client
        finally:
            client.close()


def take_and_release(lock: Mutex) -> None:
    """Wait for ``lock`` as a queued waiter, then let it go (so no hold outlives the test)."""
    if lock.acquire():
        lock.release()


# -- 1. Release without an owner check ------------------------------------------


def test_release_after_expiry_keeps_new_owners_lock():
    old = Mutex("ledger", ttl=0.1, watchdog=False)
    assert old.acquire()
    assert wait_until(lambda: not old.locked())
    new = Mutex("ledger", watchdog=False)
    assert in_other_thread(new.acquire)
    with pytest.raises(LockNotOwned):
        old.release()
    assert new.owned()
    new.release()


# -- 2. Token in threading.local ------------------------------------------------


def test_tasks_on_one_thread_do_not_share_a_token():
    async def other_task(name: str) -> tuple[bool, bool]:
        intruder = Mutex(name)
        got = await intruder.aacquire(blocking=False)
        try:
            await intruder.arelease()
            released = True
        except LockNotOwned:
            released = False
        return got, released

    async def main() -> tuple[bool, bool, bool]:
        async with mutex("shared-thread") as lock:
            got, released = await asyncio.create_task(other_task("shared-thread"))
            return got, released, await lock.aowned()

    assert asyncio.run(main()) == (False, False, True)


def test_lock_can_be_released_from_another_thread():
    lock = Mutex("handover")
    assert lock.acquire()
    thread = threading.Thread(target=lock.release)
    thread.start()
    thread.join(10)
    assert not lock.locked()
    assert lock.token is None


# -- 3. Forgetting the token before the release round trip ----------------------


def test_cancelled_async_release_keeps_token_so_retry_works():
    with dedicated_redis() as (_server, client):

        async def main() -> tuple[str | None, bool, bool]:
            lock = Mutex("payment", watchdog=False)
            assert await lock.aacquire()
            client.client_pause(5000, all=False)  # hold writes (EVALSHA) at the server
            try:
                releasing = asyncio.create_task(lock.arelease())
                # Cancel only once the release is in flight, parked at the server.
                deadline = time.monotonic() + 5
                while not any(c.get("cmd") == "evalsha" for c in client.client_list()):
                    assert time.monotonic() < deadline, "the release never reached Redis"
                    await asyncio.sleep(0.005)
                releasing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await releasing
            finally:
                client.client_unpause()
            token_after_cancel = lock.token
            still_held = await lock.aowned()
            await lock.arelease()  # the retry
            return token_after_cancel, still_held, await lock.alocked()

        token, still_held, locked_after_retry = asyncio.run(main())
    assert token is not None
    assert still_held
    assert not locked_after_retry


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
        assert lock.owned()
        lock.release()
        assert not lock.locked()


# -- 4. Raising from __exit__ over the user's own exception --------------------


def test_exit_keeps_body_exception_when_lock_was_lost():
    with pytest.raises(KeyError, match="from the body"), mutex("victim", watchdog=False):
        reset("victim")
        raise KeyError("from the body")


def test_exit_keeps_body_exception_when_redis_is_down():
    with (
        dedicated_redis() as (server, _client),
        pytest.raises(KeyError, match="from the body"),
        mutex("victim", watchdog=False),
    ):
        server.kill()
        raise KeyError("from the body")


# -- 5. Keys in different cluster slots -------------------------------------------


@pytest.mark.parametrize("name", ["plain", "{tag}", "}{", "a{b}c", "*?[x]", "with space\n", "%7B"])
def test_every_key_of_one_lock_hashes_to_one_slot(name, raw, mutex_prefix):
    with mutex(name) as lock:
        waiter = threading.Thread(target=take_and_release, args=(Mutex(name, timeout=10),))
        waiter.start()
        assert wait_until(lambda: held_locks()[0].waiters == 1)
        stored = [k for k in raw.scan_iter(match="*") if mutex_prefix.encode() in k]
        named = [
            lock.keys.lock,
            lock.keys.fence,
            lock.keys.queue,
            lock.keys.leases,
            lock.keys.waiting,
            lock.keys.wake_prefix + (lock.token or ""),
        ]
    waiter.join(5)
    assert len(stored) == 5  # lock, fence, queue, leases, waiting
    slots = {key_slot(k) for k in stored} | {key_slot(k.encode()) for k in named}
    assert len(slots) == 1


# -- 6. KEYS in production ----------------------------------------------------------


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


# -- 7. Lost wake-ups -------------------------------------------------------------


def test_waiter_behind_a_dead_holder_is_woken_at_its_ttl_expiry():
    dead = Mutex("orphaned", ttl=0.5, watchdog=False)
    assert dead.acquire()  # and never released: its owner "died"
    started = time.monotonic()
    waiter = Mutex("orphaned", timeout=10)
    assert waiter.acquire()
    assert time.monotonic() - started < 2.0
    waiter.release()


def test_releasing_owner_cannot_barge_ahead_of_a_waiter():
    holder = Mutex("fair")
    assert holder.acquire()
    got = threading.Event()
    waiter = Mutex("fair", timeout=10)

    def wait_for_it() -> None:
        if waiter.acquire():
            got.set()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    assert wait_until(lambda: held_locks()[0].waiters == 1)
    holder.release()
    assert holder.acquire(blocking=False) is False
    assert got.wait(5)
    thread.join(5)
    waiter.release()


# -- 9. Renewal that dies or outlives its lock -------------------------------------


def test_watchdog_stops_on_not_owner_and_tells_the_holder():
    lost: list[str] = []

    def on_lost(sender: str, name: str, **kwargs: Any) -> None:
        lost.append(name)

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockLost, match="watched"), mutex("watched", ttl=0.3) as lock:
            hold = lock._hold
            assert reset("watched")
            assert wait_until(lambda: lock.lost, timeout=3)
            assert not get_watchdog().watching(hold)
            assert not lock.locked()  # never re-created by a renewal
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert lost == ["watched"]


def test_watchdog_stops_renewing_after_release():
    with mutex("brief", ttl=0.3) as lock:
        hold = lock._hold
        assert get_watchdog().watching(hold)
    assert not get_watchdog().watching(hold)


# -- 10. Unlimited renewal hides a hung holder -------------------------------------


def test_max_hold_stops_renewal_of_a_hung_holder(caplog):
    with override_settings(CACHES=caches_with(MAX_HOLD=0.4)):
        hung = Mutex("hung", ttl=0.3)
        with caplog.at_level(logging.WARNING, logger="django_redis_mutex"):
            assert hung.acquire()
            assert wait_until(lambda: not hung.locked(), timeout=5)
    assert any("hung" in r.getMessage() and "MAX_HOLD" in r.getMessage() for r in caplog.records)
    assert Mutex("hung", watchdog=False).acquire(blocking=False)


# -- 11. Namespace leaks ------------------------------------------------------------


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


# -- 12. Encoding -------------------------------------------------------------------


def test_client_with_decode_responses_works():
    entries = caches_with()
    entries["default"]["OPTIONS"] = {
        **entries["default"].get("OPTIONS", {}),
        **cache_options(decode_responses=True),
    }
    with override_settings(CACHES=entries):
        with mutex("decoded", ttl=20, label="utf-8 ✓") as lock:
            assert lock.owned()
            assert 15 < lock.time_left() <= 20
            lock.extend(25)
            assert (owner := Mutex("decoded").owner()) is not None and owner.label == "utf-8 ✓"
            [held] = held_locks()
            assert held.name == "decoded" and held.fence == lock.fence
            assert in_other_thread(lambda: Mutex("decoded").acquire(blocking=False)) is False
        assert not lock.locked()


def test_async_client_with_decode_responses_works():
    entries = caches_with()
    entries["default"]["OPTIONS"] = {
        **entries["default"].get("OPTIONS", {}),
        **cache_options(decode_responses=True),
    }

    async def main() -> tuple[bool, float, bool]:
        async with mutex("decoded", ttl=20) as lock:
            owned, left = await lock.aowned(), await lock.atime_left()
        return owned, left, await lock.alocked()

    with override_settings(CACHES=entries):
        owned, left, locked_after = asyncio.run(main())
    assert owned and 15 < left <= 20 and not locked_after


def in_other_thread(func: Any) -> Any:
    """Run ``func`` in a new thread (another lock owner) and return its result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(func()))
    thread.start()
    thread.join(10)
    return result[0]


# -- 13. Failover loses locks: fencing tokens ------------------------------------------


def test_fence_keeps_growing_after_its_counter_expired(raw):
    with mutex("fenced") as lock:
        first = lock.fence
        fence_key = lock.keys.fence
    raw.delete(fence_key)  # as if unused past the counter's retention
    with mutex("fenced") as lock:
        assert lock.fence > first
