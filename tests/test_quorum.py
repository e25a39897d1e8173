"""Quorum (Redlock) locks across three independent redis-server processes."""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.test import override_settings

from django_redis_mutex import (
    LockBackendUnavailable,
    LockContended,
    Mutex,
    held_locks,
    mutex,
    signals,
    stats,
)
from django_redis_mutex.testing import RedisServer

from .helpers import wait_until
from .testapp.models import Counter
from .topologies import LOADED_QUORUM_TIMEOUT, redis_servers

ALIASES = ["r1", "r2", "r3"]


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(ALIASES)) as servers:
        yield servers


@pytest.fixture
def quorum_caches(masters: list[RedisServer], mutex_prefix: str) -> Iterator[list[RedisServer]]:
    caches = copy.deepcopy(settings.CACHES)
    for alias, server in zip(ALIASES, masters, strict=True):
        caches[alias] = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 1},
            "MUTEX": {
                "PREFIX": mutex_prefix,
                "TIMEOUT": 2,
                "QUORUM_TIMEOUT": LOADED_QUORUM_TIMEOUT,
            },
        }
    caches["locks"] = {
        **caches["r1"],
        "MUTEX": {
            "PREFIX": mutex_prefix,
            "QUORUM": ALIASES,
            "QUORUM_TIMEOUT": LOADED_QUORUM_TIMEOUT,
        },
    }
    with override_settings(CACHES=caches):
        yield masters
    for server in masters:
        if server.process is None:
            server.start()


def test_list_of_aliases_makes_a_quorum_lock(quorum_caches):
    lock = Mutex("inventory", using=ALIASES)
    assert lock.quorum == 2 and lock.aliases == tuple(ALIASES)
    assert lock.acquire()
    assert lock.owned() and lock.locked()
    assert (owner := lock.owner()) is not None and owner.pid == os.getpid()
    # The lock exists on every master, with the same token.
    assert [h.name for alias in ALIASES for h in held_locks(using=alias)] == ["inventory"] * 3
    lock.release()
    assert not lock.locked()
    assert all(not held_locks(using=alias) for alias in ALIASES)


def test_quorum_option_in_mutex_block(quorum_caches):
    with mutex("report", using="locks") as lock:
        assert lock.quorum == 2
        assert lock.aliases == tuple(ALIASES)
        assert Mutex("report", using=ALIASES).locked()


def test_second_owner_is_refused_with_retry_after(quorum_caches):
    with mutex("inventory", using=ALIASES, ttl=5):
        results: list[BaseException] = []

        def contender() -> None:
            try:
                with mutex("inventory", using=ALIASES, blocking=False):
                    pass
            except LockContended as exc:
                results.append(exc)

        thread = threading.Thread(target=contender)
        thread.start()
        thread.join()
        assert len(results) == 1
        assert results[0].retry_after >= 1
        assert results[0].owner is not None


def test_retry_after_counts_the_quorum_holders_time_so_far(quorum_caches):
    # With contention figures on and no hold of the class known yet, the
    # estimate is the holder's time so far, from the masters that refused.
    caches = copy.deepcopy(settings.CACHES)
    caches["locks"]["MUTEX"]["STATS"] = True
    with override_settings(CACHES=caches):
        holder = Mutex("stock:1", using="locks", ttl=30)
        assert holder.acquire()
        try:
            assert wait_until(lambda: holder.time_left() <= 27.5, timeout=10)
            contender = Mutex("stock:1", using="locks")
            assert not contender.acquire(blocking=False)
            held = 30 - holder.time_left()
            # Not the lease left (about 27 s): the 2.5 s and more held so far.
            assert 2 <= contender.contended().retry_after <= held + 2
        finally:
            holder.release()
            stats.flush()


def test_waiter_gets_the_lock_after_release(quorum_caches):
    first = Mutex("job", using=ALIASES)
    assert first.acquire()
    acquired = threading.Event()
    fences: list[int] = []

    def waiter() -> None:
        lock = Mutex("job", using=ALIASES, timeout=10)
        if lock.acquire():
            fences.append(lock.fence)
            acquired.set()
            lock.release()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not acquired.wait(0.2)
    first_fence = first.fence
    first.release()
    assert acquired.wait(5)
    thread.join()
    assert fences[0] > first_fence


def test_fences_increase_even_when_the_majority_changes(quorum_caches):
    masters = quorum_caches
    fences = []
    for down in (None, 0, 1, 2, None):
        if down is not None:
            masters[down].kill()
        with mutex("fenced", using=ALIASES) as lock:
            fences.append(lock.fence)
        if down is not None:
            masters[down].start()
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


def test_one_master_down_still_locks(quorum_caches):
    quorum_caches[1].kill()
    with mutex("inventory", using=ALIASES) as lock:
        assert lock.owned()
        assert lock.time_left() > 0


def test_two_masters_down_is_backend_unavailable(quorum_caches):
    quorum_caches[0].kill()
    quorum_caches[2].kill()
    with pytest.raises(LockBackendUnavailable, match="2 of 3 Redis masters"):
        Mutex("inventory", using=ALIASES).acquire()


def test_partial_grant_is_undone(quorum_caches):
    # Another owner holds the lock on two masters; our attempt gets only one and
    # must not leave its key behind there.
    other = Mutex("split", using=ALIASES[1:])
    assert other.quorum == 2 and other.acquire()
    lock = Mutex("split", using=ALIASES)
    assert not lock.acquire(blocking=False)
    assert held_locks(using="r1") == []
    other.release()


def test_watchdog_keeps_a_quorum_lock_past_its_ttl(quorum_caches):
    with mutex("long", using=ALIASES, ttl=0.8) as lock:
        threading.Event().wait(2.0)  # two and a half leases: only renewals keep it
        assert lock.owned()
        assert not Mutex("long", using=ALIASES, reentrant=False).acquire(blocking=False)


def test_async_quorum_lock(quorum_caches):
    async def main() -> tuple[int, bool]:
        async with mutex("async-job", using=ALIASES) as lock:
            other = await Mutex("async-job", using=ALIASES, reentrant=False).aacquire(
                blocking=False
            )
            return lock.fence, other

    fence, other = asyncio.run(main())
    assert fence > 0 and other is False


def forget_scripts(masters: list[RedisServer]) -> None:
    """Empty every master's script cache, as a restart or a failover does."""
    for server in masters:
        with redis.Redis.from_url(server.url) as client:
            client.script_flush()


def test_masters_that_forgot_the_scripts_load_them_again(quorum_caches):
    lock = Mutex("forgotten", using=ALIASES)
    forget_scripts(quorum_caches)
    assert lock.acquire()
    assert [h.name for alias in ALIASES for h in held_locks(using=alias)] == ["forgotten"] * 3
    forget_scripts(quorum_caches)
    lock.release()
    assert all(not held_locks(using=alias) for alias in ALIASES)


def test_masters_that_forgot_the_scripts_load_them_again_async(quorum_caches):
    async def main() -> list[str]:
        lock = Mutex("forgotten-async", using=ALIASES)
        forget_scripts(quorum_caches)
        assert await lock.aacquire()
        held = [h.name for alias in ALIASES for h in held_locks(using=alias)]
        forget_scripts(quorum_caches)
        await lock.arelease()
        return held

    assert asyncio.run(main()) == ["forgotten-async"] * 3
    assert all(not held_locks(using=alias) for alias in ALIASES)


def test_bad_alias_lists_are_rejected(quorum_caches):
    with pytest.raises(ValueError, match="twice"):
        Mutex("x", using=["r1", "r1"])
    with pytest.raises(TypeError, match="aliases"):
        Mutex("x", using=["r1", 3])


@pytest.mark.django_db(transaction=True)
def test_a_quorum_lock_inside_a_transaction_is_kept_until_it_ends(
    quorum_caches: list[RedisServer],
) -> None:
    def free_for_others() -> bool:
        answer: list[bool] = []

        def other() -> None:
            lock = Mutex("inventory", using="locks", blocking=False)
            answer.append(lock.acquire())
            if answer[-1]:
                lock.release()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
        return answer == [True]

    with transaction.atomic():
        with Mutex("inventory", using="locks"):
            pass
        assert not free_for_others(), "the quorum lock went back before the COMMIT"
    assert free_for_others()


@pytest.mark.django_db(transaction=True)
def test_a_quorum_lock_lost_as_its_block_ends_in_a_transaction_rolls_the_transaction_back(
    quorum_caches: list[RedisServer],
) -> None:
    # The loss lands after the exit chose to keep the lock for the transaction
    # and before it returned: two masters stop answering, the watchdog
    # declares the lock lost, and the exit's mark still reaches the third.
    # The block must not exit cleanly (here its give-back cannot be confirmed
    # either), so that the transaction rolls back instead of committing on a
    # lock another owner may hold by now.
    lost = threading.Event()

    def on_lost(sender: Any, **kwargs: Any) -> None:
        lost.set()

    def stall(sender: Any, **kwargs: Any) -> None:
        quorum_caches[1].pause()
        quorum_caches[2].pause()
        assert lost.wait(5), "the watchdog never declared the lock lost"

    signals.lock_lost.connect(on_lost)
    signals.lock_held_for_transaction.connect(stall)
    try:
        with (
            pytest.raises(LockBackendUnavailable, match="release"),
            transaction.atomic(),
            Mutex("inventory", using="locks", ttl=0.6),
        ):
            Counter.objects.create(name="inventory")
    finally:
        signals.lock_held_for_transaction.disconnect(stall)
        signals.lock_lost.disconnect(on_lost)
        quorum_caches[1].resume()
        quorum_caches[2].resume()
    assert not Counter.objects.filter(name="inventory").exists()


@pytest.mark.parametrize("plain_first", [True, False], ids=["plain-first", "quorum-first"])
def test_a_plain_lock_on_a_member_and_the_quorum_lock_of_its_name_exclude_each_other(
    quorum_caches: list[RedisServer], plain_first: bool
) -> None:
    plain = Mutex("inventory", using="r1", blocking=False)
    quorum = Mutex("inventory", using="locks", blocking=False)
    first, second = (plain, quorum) if plain_first else (quorum, plain)
    assert first.acquire()
    try:
        for _ in range(5):  # the quorum wins r2 and r3, and still gives way
            assert not second.acquire()
    finally:
        first.release()
    assert second.acquire()
    second.release()
    # Nothing of the refused quorum attempts is left on any master.
    assert all(not held_locks(using=alias) for alias in ALIASES)
