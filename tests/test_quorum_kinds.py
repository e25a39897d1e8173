"""Shared locks and semaphores on a quorum of three independent redis-server processes.

Every kind of lock runs on every topology: a shared hold and a semaphore
permit are granted by enough masters as an exclusive hold is, renewed,
released on every master, and a name means one lock or one semaphore whether
it is taken on a member alone or on the quorum.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis

from django_redis_mutex import LockBackendUnavailable, Mutex, Semaphore, mutex, semaphore
from django_redis_mutex.testing import RedisServer

from .helpers import wait_until
from .test_quorum import ALIASES, masters, quorum_caches  # noqa: F401  (fixtures)


def holders_on(server: RedisServer, handle: Mutex) -> set[str]:
    """Return the shared holders' tokens (permits) in ``handle``'s hash on one master."""
    client = redis.Redis(port=server.port, decode_responses=True)
    try:
        fields = client.hkeys(handle._keys_on("r1").lock)
    finally:
        client.close()
    return {field[2:] for field in fields if field.startswith("r:")}


def lease_ends(servers: list[RedisServer], held: Mutex) -> list[int]:
    """Return the ms (server clock) the shared lease of ``held`` ends on each of ``servers``."""
    ends = []
    for server in servers:
        client = redis.Redis(port=server.port, decode_responses=True)
        try:
            record = client.hget(held._keys_on("r1").lock, f"r:{held.token}")
        finally:
            client.close()
        assert record is not None, f"no shared record on {server.port}"
        ends.append(int(record.split("|", 1)[0]))
    return ends


def test_shared_holds_on_a_quorum_overlap_and_exclude_a_writer(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    first = Mutex("report", using=ALIASES, shared=True)
    second = Mutex("report", using="locks", shared=True)
    assert first.quorum == second.quorum == 2
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    assert first.token is not None and first.token.startswith("sq")
    assert first.fence != second.fence
    for server in quorum_caches:
        assert holders_on(server, first) == {first.token, second.token}
    assert first.owned() and second.owned() and first.locked()
    assert 0 < first.time_left() <= 30 and first.owner() is not None
    writer = Mutex("report", using=ALIASES, blocking=False)
    assert not writer.acquire()
    first.release()
    assert not writer.acquire()  # the other reader still holds
    reader_fence = second.fence
    second.release()
    assert writer.acquire()
    assert writer.fence is not None and reader_fence is not None
    assert writer.fence > reader_fence
    assert not Mutex("report", using=ALIASES, shared=True, blocking=False).acquire()
    writer.release()
    assert all(not holders_on(server, first) for server in quorum_caches)


def test_a_quorum_reader_gives_way_to_a_writer_on_one_member_and_back(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    plain_writer = Mutex("ledger", using="r1", blocking=False)
    assert plain_writer.acquire()
    reader = Mutex("ledger", using=ALIASES, shared=True, blocking=False)
    for _ in range(3):  # wins r2 and r3, still gives way to the lock on r1
        assert not reader.acquire()
    plain_writer.release()
    plain_reader = Mutex("ledger", using="r1", shared=True, blocking=False)
    assert plain_reader.acquire()
    quorum_writer = Mutex("ledger", using=ALIASES, blocking=False)
    assert not quorum_writer.acquire()  # a reader on r1 alone holds that name
    assert reader.acquire()  # readers share it, wherever they were taken
    reader.release()
    plain_reader.release()
    assert quorum_writer.acquire()
    quorum_writer.release()


def test_a_quorum_shared_hold_survives_one_master_down_and_is_renewed(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    quorum_caches[2].kill()
    # A lease long enough that a loaded machine's stall does not end it: the
    # test is about renewals reaching both live masters, not about speed.
    with mutex("slow", using=ALIASES, shared=True, ttl=0.8) as held:
        first_ends = lease_ends(quorum_caches[:2], held)
        # Renewed a third into each lease on both live masters, well past the first.
        wait_until(
            lambda: min(lease_ends(quorum_caches[:2], held)) > max(first_ends) + 1200,
            what="renewals past two leases on both live masters",
        )
        assert not held.lost
    assert all(not holders_on(server, held) for server in quorum_caches[:2])


def test_a_quorum_semaphore_admits_its_limit_and_no_more(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    permits = [Semaphore("exports", 2, using=ALIASES, blocking=False) for _ in range(3)]
    assert all(permit.quorum == 3 for permit in permits)  # a limit of two: every master
    assert permits[0].acquire() and permits[1].acquire()
    assert not permits[2].acquire()
    for server in quorum_caches:
        assert holders_on(server, permits[0]) == {permits[0].token, permits[1].token}
    permits[0].release()
    assert permits[2].acquire()
    permits[1].release()
    permits[2].release()
    assert all(not holders_on(server, permits[0]) for server in quorum_caches)


@pytest.mark.parametrize(("limit", "needed"), [(1, 2), (2, 3), (3, 3)])
def test_a_quorum_semaphore_is_granted_by_enough_masters_that_no_limit_plus_one_fit(
    quorum_caches: list[RedisServer],  # noqa: F811
    limit: int,
    needed: int,
) -> None:
    # Three masters, limit two: a majority of two per permit would let three
    # holders take the pairs (r1, r2), (r2, r3), (r1, r3), two per master.
    permit = Semaphore("pairs", limit, using=ALIASES)
    assert permit.quorum == needed
    assert needed * (limit + 1) > len(ALIASES) * limit


def test_a_quorum_semaphore_of_two_needs_every_master_and_says_so(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    quorum_caches[1].kill()
    with pytest.raises(LockBackendUnavailable, match="1 of 3 Redis masters"):
        Semaphore("exports", 2, using=ALIASES).acquire(blocking=False)
    with semaphore("exports", 1, using="locks") as held:  # a limit of one needs a majority
        live = (quorum_caches[0], quorum_caches[2])
        assert all(holders_on(server, held) == {held.token} for server in live)
        assert held.owned() and 0 < held.time_left() <= 30
        assert held.locked() and (owner := held.owner()) is not None and owner.pid > 0


def held_on(server: RedisServer, handle: Mutex) -> bool:
    """Return True if ``handle``'s lock (or semaphore) hash exists on one master."""
    client = redis.Redis(port=server.port)
    try:
        return bool(client.exists(handle._keys_on("r1").lock))
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["exclusive", "shared", "permit"])
def test_an_async_release_cancelled_as_it_fans_out_still_reaches_every_master(
    quorum_caches: list[RedisServer],  # noqa: F811
    kind: str,
) -> None:
    # On one Redis the release script is written before the first await, so a
    # cancel finds it sent; on a quorum the requests go out from tasks of their
    # own, which a cancel must not cut before they start.
    held = (
        Semaphore("fan", 2, using=ALIASES)
        if kind == "permit"
        else Mutex("fan", using=ALIASES, shared=kind == "shared")
    )

    async def main() -> list[bool]:
        assert await held.aacquire()
        release = asyncio.ensure_future(held.arelease())
        await asyncio.sleep(0)  # the release has begun to fan out
        release.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await release
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            left = [held_on(server, held) for server in quorum_caches]
            if not any(left):
                break
            await asyncio.sleep(0.02)
        return left

    assert asyncio.run(main()) == [False, False, False]
