"""Reads of a lock (owned, locked, owner, time_left): one answer, sync or async, hung master or not.

Each read is written once as steps driven by both the sync method and its
async twin, so the two give the same answers on a plain lock, a shared hold
and a quorum lock. A quorum reads every master at once, each within
QUORUM_TIMEOUT: a master that hangs costs a read that short deadline, not its
socket timeout, and the two others still make a majority.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redis_mutex import LockBackendUnavailable, Mutex
from django_redis_mutex.testing import RedisServer

from .test_quorum import ALIASES, masters, quorum_caches  # noqa: F401  (fixtures)


@pytest.fixture
def hung_masters_deadline(
    quorum_caches: list[RedisServer],  # noqa: F811  (the imported fixture)
) -> Iterator[list[RedisServer]]:
    """The quorum's masters with the default per-master deadline (QUORUM_TIMEOUT, 0.05 s).

    The quorum fixture lengthens it (LOADED_QUORUM_TIMEOUT); these tests measure
    that a hung master costs that deadline, not the socket timeout.
    """
    caches = copy.deepcopy(settings.CACHES)
    for alias in ALIASES:
        caches[alias]["MUTEX"].pop("QUORUM_TIMEOUT")
    with override_settings(CACHES=caches):
        yield quorum_caches


READS = ("owned", "locked", "owner", "time_left")
FREE = {"owned": False, "locked": False, "owner": None, "time_left": 0.0}
LEASE = 30.0


def read(lock: Mutex, what: str, way: str) -> tuple[Any, float]:
    """Return the answer of ``lock.<what>()`` (or its async twin) and the seconds it took."""
    started = time.monotonic()
    answer = getattr(lock, what)() if way == "sync" else asyncio.run(getattr(lock, "a" + what)())
    return answer, time.monotonic() - started


def read_all(lock: Mutex, way: str) -> dict[str, tuple[Any, float]]:
    return {what: read(lock, what, way) for what in READS}


def answers(timed: dict[str, tuple[Any, float]]) -> dict[str, Any]:
    return {what: answer for what, (answer, _took) in timed.items()}


def assert_held_by_this_process(holder: dict[str, Any], bystander: dict[str, Any]) -> None:
    """Check what the holding handle and another handle of the same name read."""
    assert holder["owned"] is True and holder["locked"] is True
    assert holder["owner"].pid == os.getpid() and holder["owner"].label == "reader"
    assert 0 < holder["time_left"] <= LEASE
    assert bystander == {**holder, "owned": False, "time_left": 0.0}


@pytest.fixture(params=["plain", "shared", "quorum"])
def options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The options of a lock of each kind (a quorum one on three fresh masters)."""
    if request.param == "quorum":
        request.getfixturevalue("quorum_caches")
        return {"using": ALIASES}
    return {"shared": request.param == "shared"}


def test_sync_and_async_reads_agree(options: dict[str, Any]) -> None:
    holder = Mutex("agreed", ttl=LEASE, watchdog=False, label="reader", **options)
    bystander = Mutex("agreed", **options)
    assert holder.acquire()
    try:
        held = {
            way: (answers(read_all(holder, way)), answers(read_all(bystander, way)))
            for way in ("sync", "async")
        }
    finally:
        holder.release()
    free = {way: answers(read_all(holder, way)) for way in ("sync", "async")}

    (sync_holder, sync_bystander), (async_holder, async_bystander) = held.values()
    assert_held_by_this_process(sync_holder, sync_bystander)
    assert_held_by_this_process(async_holder, async_bystander)
    # Read after the sync ones, of a lease nothing renews.
    assert async_holder["time_left"] <= sync_holder["time_left"]
    assert free["sync"] == free["async"] == FREE


@pytest.mark.parametrize("way", ["sync", "async"])
def test_quorum_reads_answer_from_the_majority_while_one_master_hangs(
    hung_masters_deadline: list[RedisServer],
    way: str,
) -> None:
    holder = Mutex("hung-reads", using=ALIASES, ttl=LEASE, watchdog=False, label="reader")
    bystander = Mutex("hung-reads", using=ALIASES)
    assert holder.acquire()
    hung_masters_deadline[2].pause()
    try:
        from_holder = read_all(holder, way)
        from_bystander = read_all(bystander, way)
    finally:
        hung_masters_deadline[2].resume()
        holder.release()

    assert_held_by_this_process(answers(from_holder), answers(from_bystander))
    # Each read waited QUORUM_TIMEOUT (0.05 s) for the hung master, never its
    # socket timeout; the bound is generous for a loaded machine.
    socket_timeout = settings.CACHES[ALIASES[2]]["OPTIONS"]["SOCKET_TIMEOUT"]
    took = [took for timed in (from_holder, from_bystander) for _answer, took in timed.values()]
    assert max(took) < socket_timeout / 2, took


@pytest.mark.parametrize("way", ["sync", "async"])
def test_quorum_reads_fail_fast_and_clearly_when_two_masters_hang(
    hung_masters_deadline: list[RedisServer],
    way: str,
) -> None:
    holder = Mutex("two-hung-reads", using=ALIASES, ttl=LEASE, watchdog=False)
    assert holder.acquire()
    hung_masters_deadline[0].pause()
    hung_masters_deadline[1].pause()
    took: dict[str, float] = {}
    try:
        for what in READS:
            started = time.monotonic()
            with pytest.raises(LockBackendUnavailable, match=r"inspect .* 2 of 3"):
                read(holder, what, way)
            took[what] = time.monotonic() - started
    finally:
        hung_masters_deadline[0].resume()
        hung_masters_deadline[1].resume()
        holder.release()
    socket_timeout = settings.CACHES[ALIASES[0]]["OPTIONS"]["SOCKET_TIMEOUT"]
    assert max(took.values()) < socket_timeout / 2, took
