"""Counting semaphores: at most ``limit`` holders, FIFO waiters, a lease per permit.

Contention runs in real OS processes (``tests/workers/semaphore_*.py``) against
the session's real redis-server; the permits themselves are read back from
Redis (the ``holders`` sorted set, scored by the server-clock ms each lease ends).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.db import transaction
from redis.crc import key_slot

from django_redis_mutex import (
    LockContended,
    LockLost,
    LockNotOwned,
    Mutex,
    Semaphore,
    held_semaphores,
    reset_semaphore,
    semaphore,
    signals,
)
from django_redis_mutex.keys import LockKeys, SharedRecord, escape_name
from django_redis_mutex.scripts import (
    ACQUIRE_SHARED,
    CANCEL,
    EXTEND,
    HANDOFF_LEASE,
    MARK_TRANSACTION,
    RELEASE,
    RESET,
    WAIT_LEASE,
    WAKE,
)
from django_redis_mutex.semaphore import MAX_LIMIT
from django_redis_mutex.testing import RedisClusterServers, RedisServer
from django_redis_mutex.watchdog import get_watchdog

from .helpers import (
    await_until,
    caches_with,
    cancel_repeatedly,
    dedicated_redis,
    forget_scripts_but,
    script_parked,
    wait_until,
)
from .proxy import Proxy
from .test_cluster import HOSTILE_NAMES
from .test_declared_keys import (  # the MONITOR-based check of the lock scripts
    KeysOf,
    Monitor,
    monitored,  # noqa: F401  (a fixture)
    script_runs,
    undeclared,
)
from .topologies import cluster_entry, extra_caches
from .worker import Worker

# Generous bounds: these tests run on a busy 2-core machine.
START_TIMEOUT = 30.0
# Lease scores seen per token, for counting renewals.
_scores: dict[str, set[float]] = {}


@pytest.fixture
def data_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a workload key of this test (outside the lock namespace)."""
    made: list[str] = []

    def key(purpose: str) -> str:
        made.append(f"semaphores:{mutex_prefix}:{purpose}")
        return made[-1]

    yield key
    if made:
        raw.delete(*made)


# The scripts a semaphore runs: the lock engine's, on the semaphore's keys.
SEMAPHORE_SCRIPTS = (ACQUIRE_SHARED, CANCEL, EXTEND, MARK_TRANSACTION, RELEASE, RESET, WAKE)


def permit_records(raw: redis.Redis, keys: LockKeys) -> dict[str, SharedRecord]:
    """Return each permit's record in the semaphore's hash, by token (ended leases included)."""
    records = {}
    for field_name, value in raw.hgetall(keys.lock).items():
        if field_name.startswith(b"r:"):
            record = SharedRecord.parse(value.decode())
            assert record is not None, value
            records[field_name.decode()[2:]] = record
    return records


def holder_tokens(raw: redis.Redis, name: str, limit: int = 1) -> list[str]:
    """Return the tokens holding a permit of ``name`` per Redis (leases not yet pruned included)."""
    records = permit_records(raw, Semaphore(name, limit).keys)
    return sorted(records, key=lambda token: records[token].ends)


def lease_end(raw: redis.Redis, keys: LockKeys, token: str) -> float | None:
    """Return the server-clock ms the permit of ``token`` ends, or None without one."""
    record = permit_records(raw, keys).get(token)
    return None if record is None else float(record.ends)


def queued(raw: redis.Redis, name: str) -> int:
    return int(raw.zcard(Semaphore(name, 1).keys.queue))


def max_overlap(sections: list[list[float]]) -> int:
    """Return the largest number of [enter, exit] intervals open at one instant."""
    edges = sorted([(s[0], 1) for s in sections] + [(s[1], -1) for s in sections])
    # At equal times an exit sorts before an enter (-1 < 1): touching is not overlapping.
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


# -- safety under contention --------------------------------------------------------------------


def test_processes_contending_never_exceed_the_limit_and_all_get_their_turns(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    inside, barrier = data_key("inside"), data_key("barrier")
    workers = [spawn("semaphore_sections.py", "pool", 3, inside, barrier, 40) for _ in range(6)]
    for worker in workers:
        worker.expect("ready", timeout=START_TIMEOUT)
    raw.rpush(barrier, *["go"] * len(workers))

    sections: list[list[float]] = []
    for worker in workers:
        sections += worker.expect("done", timeout=120)["sections"]
        assert worker.finish() == 0

    assert len(sections) == 6 * 40
    # Counted in Redis by the sections themselves, and from their time stamps.
    assert max(s[2] for s in sections) <= 3
    assert max_overlap(sections) <= 3
    # The limit was used, not just respected: more than one section ran at once.
    assert max(s[2] for s in sections) >= 2


def test_waiters_get_permits_in_the_order_they_arrived(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    first, second = Semaphore("fifo", 2, ttl=30), Semaphore("fifo", 2, ttl=30)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    go = [data_key(f"go{i}") for i in range(3)]
    waiters = []
    for i in range(3):
        waiters.append(spawn("semaphore_hold.py", "fifo", 2, 30, go[i]))
        wait_until(lambda n=i + 1: queued(raw, "fifo") == n, START_TIMEOUT, f"waiter {i} in line")

    first.release()
    token0 = waiters[0].expect("acquired")["token"]
    assert token0 in holder_tokens(raw, "fifo")
    assert queued(raw, "fifo") == 2

    second.release()
    token1 = waiters[1].expect("acquired")["token"]
    assert set(holder_tokens(raw, "fifo")) == {token0, token1}
    assert queued(raw, "fifo") == 1

    # A newcomer does not pass the waiter left in line.
    assert not Semaphore("fifo", 2).acquire(blocking=False)
    raw.rpush(go[0], "go")
    assert waiters[0].expect("released")
    token2 = waiters[2].expect("acquired")["token"]
    assert set(holder_tokens(raw, "fifo")) == {token1, token2}
    for i in (1, 2):
        raw.rpush(go[i], "go")
        waiters[i].expect("released")
        assert waiters[i].finish() == 0
    assert holder_tokens(raw, "fifo") == []


# -- leases ---------------------------------------------------------------------------------------


def test_a_killed_holders_permit_comes_back_when_its_lease_ends_and_not_before(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    ttl = 3.0
    holder = spawn("semaphore_hold.py", "killed", 1, ttl, data_key("go"))
    token = holder.expect("acquired", timeout=START_TIMEOUT)["token"]
    os.kill(holder.pid, signal.SIGKILL)
    holder.process.wait(10)
    keys = Semaphore("killed", 1).keys
    dead_lease_ends = lease_end(raw, keys, token)
    assert dead_lease_ends is not None

    # Renewed a third into each lease, so at least two thirds of one are left.
    assert not Semaphore("killed", 1).acquire(blocking=False)

    late = Semaphore("killed", 1, ttl=30)
    started = time.monotonic()
    assert late.acquire(timeout=20)
    waited = time.monotonic() - started
    late_ends = lease_end(raw, keys, late.token or "")
    assert late_ends is not None
    granted_at = late_ends - 30_000
    assert granted_at >= dead_lease_ends
    # Woken by the end of the lease (a check-in), not a whole timeout later.
    assert waited <= ttl + 2.0
    assert holder_tokens(raw, "killed") == [late.token]
    late.release()


def test_the_watchdog_keeps_a_permit_past_several_leases(raw: redis.Redis) -> None:
    ttl = 0.8
    holder = Semaphore("renewed", 1, ttl=ttl)
    assert holder.acquire(blocking=False)
    started = time.monotonic()

    def held_and_renewed() -> bool:
        # Checked on every poll: the permit never left the holders meanwhile.
        assert holder_tokens(raw, "renewed") == [holder.token]
        return renewed_count(raw, holder) >= 6

    wait_until(held_and_renewed, timeout=15, what="six renewals of the permit")
    # Six renewals, a third of a lease apart at the soonest: past two leases.
    assert time.monotonic() - started > 2 * ttl
    assert not Semaphore("renewed", 1).acquire(blocking=False)
    assert not holder.lost
    holder.release()  # no LockLost: the permit was never gone
    assert holder_tokens(raw, "renewed") == []


def test_without_the_watchdog_a_permit_ends_with_its_lease_and_release_says_so() -> None:
    holder = Semaphore("unrenewed", 1, ttl=0.3, watchdog=False)
    assert holder.acquire(blocking=False)
    other = Semaphore("unrenewed", 1, ttl=5)
    assert other.acquire(timeout=5)
    # As for a lock: release() says the permit was no longer this holder's.
    with pytest.raises(LockNotOwned, match="'unrenewed'"):
        holder.release()
    other.release()


# -- contention errors ----------------------------------------------------------------------------


def test_a_full_semaphore_raises_lock_contended_with_retry_after() -> None:
    holders = [Semaphore("full", 2, ttl=5) for _ in range(2)]
    for holder in holders:
        assert holder.acquire(blocking=False)
    with pytest.raises(LockContended) as refused, Semaphore("full", 2, blocking=False):
        pass
    assert refused.value.name == "full"
    assert 1 <= refused.value.retry_after <= 5
    started = time.monotonic()
    with pytest.raises(LockContended), semaphore("full", 2, timeout=0.3):
        pass
    assert 0.25 <= time.monotonic() - started < 3.0
    for holder in holders:
        holder.release()
    with semaphore("full", 2, blocking=False) as permit:
        assert permit.token is not None


def test_a_waiter_that_times_out_leaves_the_line(raw: redis.Redis) -> None:
    holder = Semaphore("left", 1, ttl=10)
    assert holder.acquire(blocking=False)
    assert not Semaphore("left", 1).acquire(timeout=0.3)
    assert queued(raw, "left") == 0
    holder.release()
    assert holder_tokens(raw, "left") == []


def test_release_without_a_permit_raises_lock_not_owned() -> None:
    with pytest.raises(LockNotOwned, match="'idle'"):
        Semaphore("idle", 2).release()


# -- async and decorator --------------------------------------------------------------------------


def test_async_with_admits_limit_tasks_at_once_and_the_rest_wait() -> None:
    inside = 0
    peak = 0

    async def section(both_in: asyncio.Event) -> None:
        nonlocal inside, peak
        async with Semaphore("tasks", 2, timeout=10):
            inside += 1
            peak = max(peak, inside)
            if inside == 2:
                both_in.set()
            await asyncio.wait_for(both_in.wait(), 10)
            inside -= 1

    async def main() -> tuple[bool, int]:
        both_in = asyncio.Event()
        await asyncio.gather(*(section(both_in) for _ in range(5)))
        late = Semaphore("tasks", 2)
        got = await late.aacquire(blocking=False)
        await late.arelease()
        return got, peak

    assert asyncio.run(main()) == (True, 2)


def test_async_acquire_times_out_then_succeeds_after_a_release(raw: redis.Redis) -> None:
    async def main() -> tuple[bool, bool]:
        holder = Semaphore("async", 1, ttl=10)
        assert await holder.aacquire(blocking=False)
        refused = await Semaphore("async", 1).aacquire(timeout=0.2)
        waiter = Semaphore("async", 1)
        waiting = asyncio.create_task(waiter.aacquire(timeout=10))
        await asyncio.to_thread(wait_until, lambda: queued(raw, "async") == 1)
        await holder.arelease()
        granted = await waiting
        await waiter.arelease()
        return refused, granted

    assert asyncio.run(main()) == (False, True)


def test_a_cancelled_async_waiter_leaves_the_line_and_never_keeps_a_permit(
    raw: redis.Redis,
) -> None:
    async def main() -> tuple[bool, int, bool]:
        holder = Semaphore("cancelled-wait", 1, ttl=10)
        assert await holder.aacquire(blocking=False)
        waiter = Semaphore("cancelled-wait", 1)
        waiting = asyncio.create_task(waiter.aacquire(timeout=30))
        await asyncio.to_thread(wait_until, lambda: queued(raw, "cancelled-wait") == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        left_line = queued(raw, "cancelled-wait") == 0
        await holder.arelease()
        # Nobody was handed the freed permit: a newcomer gets it at once.
        newcomer = Semaphore("cancelled-wait", 1)
        free = await newcomer.aacquire(blocking=False)
        holders = sum(len(held.holders) for held in held_semaphores())
        await newcomer.arelease()
        return left_line, holders, free and waiter.token is None

    assert asyncio.run(main()) == (True, 1, True)


def test_an_acquisition_cancelled_again_while_it_stops_never_leaves_a_permit_to_nobody(
    raw: redis.Redis,
) -> None:
    # As for a lock (tests/test_async.py): a second cancel must not let the
    # give-back overtake the SEM_ACQUIRE in flight, which would then grant a
    # permit to a token nobody has. An emptied script cache makes the
    # SEM_ACQUIRE three round trips while the give-back scripts take one.
    rng = random.Random(21)
    name = "cancelled-twice"

    async def attempt(contended: bool) -> None:
        holder = Semaphore(name, 1, ttl=8, watchdog=False)
        if contended:
            assert await holder.aacquire(blocking=False)
        forget_scripts_but(raw, CANCEL, RELEASE, WAKE)
        contender = Semaphore(name, 1, ttl=8, watchdog=False, timeout=10)
        if await cancel_repeatedly(contender.aacquire, rng):
            await contender.arelease()  # it got the permit before the cancels
        assert contender.token is None
        if contended:
            await holder.arelease()
        # No permit held, nobody in line: another holder gets it at once.
        probe = Semaphore(name, 1, ttl=8, watchdog=False)
        assert await probe.aacquire(timeout=1.0), holder_tokens(raw, name)
        await probe.arelease()

    async def main() -> None:
        for i in range(60):
            await attempt(contended=i % 2 == 1)

    asyncio.run(main())


@pytest.mark.parametrize("entered_by", ["async with", "decorator"])
def test_a_task_cancelled_while_leaving_its_block_still_gives_the_permit_back(
    entered_by: str,
) -> None:
    # The release is slowed by pausing writes at the server; the task is
    # cancelled while its SEM_RELEASE waits there. Unshielded, the cancel cut
    # the release off and the permit stayed held for the rest of its lease.
    with dedicated_redis() as (_server, client):

        async def main() -> float:
            leaving = asyncio.Event()

            async def body() -> None:
                leaving.set()
                client.client_pause(300, all=False)  # the release's write waits 0.3 s

            if entered_by == "async with":

                async def hold() -> None:
                    async with Semaphore("slow-exit", 1, ttl=8, watchdog=False):
                        await body()

            else:
                hold = semaphore("slow-exit", 1, ttl=8, watchdog=False)(body)
            task = asyncio.ensure_future(hold())
            await leaving.wait()
            await await_until(
                lambda: script_parked(client),
                what="the release to reach Redis",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            left = time.monotonic()
            probe = Semaphore("slow-exit", 1, ttl=8, watchdog=False)
            assert await probe.aacquire(timeout=6.0)
            await probe.arelease()
            return time.monotonic() - left

        # Free once the pause ends, well before the 8 s lease would have.
        assert asyncio.run(main()) < 3.0


def test_the_decorator_fills_the_name_template_per_call(raw: redis.Redis) -> None:
    seen: list[Any] = []

    @semaphore("tenant:{tenant_id}", 1, blocking=False)
    def export(tenant_id: int) -> str:
        seen.append([(held.name, held.limit, len(held.holders)) for held in held_semaphores()])
        return f"exported {tenant_id}"

    assert export(7) == "exported 7"
    assert seen == [[("tenant:7", 1, 1)]]
    busy = Semaphore("tenant:7", 1, ttl=5)
    assert busy.acquire(blocking=False)
    with pytest.raises(LockContended):
        export(7)
    assert export(8) == "exported 8"
    busy.release()


def test_the_async_decorator_holds_a_permit_while_the_coroutine_runs() -> None:
    @semaphore("job:{job}", 1, blocking=False)
    async def run(job: str) -> list[str]:
        return [held.name for held in await asyncio.to_thread(held_semaphores)]

    assert asyncio.run(run("a")) == ["job:a"]
    assert held_semaphores() == []


# -- introspection and reset ----------------------------------------------------------------------


def test_held_semaphores_lists_each_holder_with_its_owner_and_the_limit() -> None:
    first = Semaphore("listed", 3, ttl=20, label="export")
    second = Semaphore("listed", 3, ttl=20)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    (held,) = held_semaphores()
    assert held.name == "listed"
    assert held.limit == 3
    assert {h.token for h in held.holders} == {first.token, second.token}
    labels = {h.token: h.owner.label for h in held.holders}
    assert labels[first.token] == "export"
    assert all(h.owner.pid == os.getpid() for h in held.holders)
    assert all(0 < h.time_left <= 20 for h in held.holders)
    first.release()
    second.release()
    assert held_semaphores() == []


def test_reset_frees_every_permit_and_hands_them_to_the_line(raw: redis.Redis) -> None:
    holders = [Semaphore("reset", 2, ttl=30, watchdog=False) for _ in range(2)]
    for holder in holders:
        assert holder.acquire(blocking=False)
    assert reset_semaphore("reset") == 2
    assert holder_tokens(raw, "reset") == []
    for holder in holders:
        with pytest.raises(LockNotOwned):
            holder.release()
    assert reset_semaphore("reset") == 0


def test_a_reset_wakes_a_waiter_with_a_freed_permit(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    holder = Semaphore("reset-wait", 1, ttl=30, watchdog=False)
    assert holder.acquire(blocking=False)
    go = data_key("go")
    waiter = spawn("semaphore_hold.py", "reset-wait", 1, 30, go)
    wait_until(lambda: queued(raw, "reset-wait") == 1, START_TIMEOUT, "the waiter in line")
    assert reset_semaphore("reset-wait") == 1
    token = waiter.expect("acquired")["token"]
    assert holder_tokens(raw, "reset-wait") == [token]
    raw.rpush(go, "go")
    waiter.expect("released")
    assert waiter.finish() == 0


# -- keys -----------------------------------------------------------------------------------------


def test_every_key_has_an_expiry_while_held_and_waited_for_and_none_is_left_after(
    raw: redis.Redis, namespace_keys: Callable[[], list[bytes]]
) -> None:
    holder = Semaphore("expiring", 1, ttl=30)
    assert holder.acquire(blocking=False)
    waiter = Semaphore("expiring", 1)

    async def wait_then_check() -> list[tuple[bytes, int]]:
        task = asyncio.create_task(waiter.aacquire(timeout=10))
        await asyncio.to_thread(wait_until, lambda: queued(raw, "expiring") == 1)
        ttls = [(key, int(raw.pttl(key))) for key in namespace_keys()]
        await asyncio.to_thread(holder.release)
        assert await task
        await waiter.arelease()
        return ttls

    ttls = asyncio.run(wait_then_check())
    # The lock's layout: the hash of permits (and the limit), its fence, the line.
    assert {key.rsplit(b":", 1)[-1] for key, _ in ttls} >= {
        b"{expiring}",
        b"fence",
        b"queue",
        b"waiting",
    }
    assert [key for key, ms in ttls if ms <= 0] == []
    leftover = [
        (key, int(raw.pttl(key))) for key in namespace_keys() if not key.endswith(b":fence")
    ]
    assert [key for key, ms in leftover if ms <= 0] == []
    # What is left beside the fence counter (see the guarantees page) is only a
    # wake-up or the line's lapse, gone within a wait lease.
    assert all(ms <= 2000 for _, ms in leftover)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (0, ValueError, "must be at least 1, got 0"),
        (-2, ValueError, "must be at least 1, got -2"),
        (True, TypeError, "must be an int, not bool"),
        (1.5, TypeError, "must be an int, not float"),
        ("3", TypeError, "must be an int, not str"),
        (None, TypeError, "must be an int, not NoneType"),
        (MAX_LIMIT + 1, ValueError, f"must be at most {MAX_LIMIT}"),
    ],
)
def test_a_bad_limit_is_refused_naming_the_problem(
    limit: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"Semaphore limit {message}"):
        Semaphore("limits", limit)  # type: ignore[arg-type]
    with pytest.raises(error, match=f"Semaphore limit {message}"):
        semaphore("limits", limit)  # type: ignore[arg-type]


def test_bad_names_and_options_are_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        Semaphore("", 1)
    with pytest.raises(TypeError, match="must be a string"):
        Semaphore(3, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="using must be a cache alias"):
        Semaphore("x", 1, using=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="with blocking=False"):
        Semaphore("x", 1, blocking=False, timeout=2)
    with pytest.raises(ValueError, match="with blocking=False"):
        semaphore("x", 1, blocking=False, timeout=2)
    with pytest.raises(TypeError, match="ttl must be a number"):
        semaphore("x", 1, ttl="long")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blocking must be True or False"):
        Semaphore("x", 1).acquire(blocking=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only filled when semaphore"), semaphore(lambda: "x", 1):
        pass
    with pytest.raises(ValueError, match="limit must be at least 1"):
        semaphore("x", 0)


def test_an_owner_taking_its_permit_again_nests_into_it_unless_not_reentrant() -> None:
    held = Semaphore("nested", 1)
    assert held.acquire(blocking=False)
    assert held.acquire(blocking=False)  # the same owner: one more level, no second permit
    assert [len(h.holders) for h in held_semaphores()] == [1]
    held.release()
    assert [len(h.holders) for h in held_semaphores()] == [1]  # the outer level holds on
    held.release()
    assert held_semaphores() == []
    strict = Semaphore("nested", 1, reentrant=False)
    assert strict.acquire(blocking=False)
    assert not strict.acquire(blocking=False)  # its own permit is the only one
    strict.release()


# -- declared keys --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_every_key_a_semaphore_script_touches_is_declared_in_its_keys(
    monitored: tuple[RedisServer, redis.Redis],  # noqa: F811  (the imported fixture)
) -> None:
    server, raw = monitored
    names = {script.sha: script.name for script in SEMAPHORE_SCRIPTS}
    monitor = Monitor(server.port)
    try:
        for name in ("sem:a", "sem:{b}"):
            # Uncontended, renewed by the watchdog, extended by hand.
            renewed = Semaphore(name, 1, ttl=0.3)
            assert renewed.acquire(blocking=False)
            wait_until(lambda r=renewed: renewed_count(raw, r) >= 2, what="two renewals")
            renewed.extend(5)
            # A waiter that gives up (cancel), then one handed the permit (release, wake).
            assert not Semaphore(name, 1).acquire(timeout=0.2)
            waiter = Semaphore(name, 1)
            thread = threading.Thread(target=waiter.acquire, kwargs={"timeout": 10})
            thread.start()
            wait_until(lambda n=name: queued(raw, n) == 1, what="the waiter in line")
            renewed.release()
            thread.join(10)
            assert waiter.token is not None
            # A reset handing the freed permit to the next waiter.
            late = Semaphore(name, 1)
            thread = threading.Thread(target=late.acquire, kwargs={"timeout": 10})
            thread.start()
            wait_until(lambda n=name: queued(raw, n) == 1, what="the next waiter in line")
            assert reset_semaphore(name) == 1
            thread.join(10)
            assert late.token is not None
            late.release()
            # The reset took the permit of the waiter handed it above: told at its release.
            with pytest.raises((LockLost, LockNotOwned)):
                waiter.release()
            # A holder granted while another waits wakes that one inside its release.
            first = Semaphore(name, 1)
            assert first.acquire(blocking=False)
            second, third = Semaphore(name, 1), Semaphore(name, 1)
            threads = [
                threading.Thread(target=handle.acquire, kwargs={"timeout": 10})
                for handle in (second, third)
            ]
            for count, thread in enumerate(threads, start=1):
                thread.start()
                wait_until(lambda n=name, c=count: queued(raw, n) == c, what="waiters in line")
            first.release()
            threads[0].join(10)
            assert second.token is not None
            second.release()
            threads[1].join(10)
            assert third.token is not None
            third.release()
            # Kept until the COMMIT: the holder's owner record is marked.
            with transaction.atomic(), Semaphore(name, 1):
                pass
            # A lease that ends with nobody renewing it, pruned by the next acquisition.
            lapsing = Semaphore(name, 1, ttl=0.05, watchdog=False)
            assert lapsing.acquire(blocking=False)
            after = Semaphore(name, 1)
            assert after.acquire(timeout=5)
            after.release()
    finally:
        commands = monitor.stop()

    runs = script_runs(commands)
    keys_of = KeysOf(server.port)
    try:
        assert undeclared(runs, keys_of) == []
    finally:
        keys_of.close()
    ran = {names.get(run.script, run.script) for run in runs}
    assert ran >= {script.name for script in SEMAPHORE_SCRIPTS}
    # Both ways of waking a waiter ran: inside the release, and by WAKE.
    pushed_by = {
        names.get(run.script, run.script)
        for run in runs
        if any(command.name == "RPUSH" for command in run.ran)
    }
    assert pushed_by >= {"release", "wake"}


def renewed_count(raw: redis.Redis, held: Semaphore) -> int:
    """Count how often the lease of ``held`` moved (a poll of its score)."""
    score = lease_end(raw, held.keys, held.token or "")
    seen = _scores.setdefault(held.token or "", set())
    if score is not None:
        seen.add(score)
    return len(seen) - 1


def test_the_locks_command_lists_each_semaphore_with_its_holders_and_limit() -> None:
    from io import StringIO

    from django.core.management import call_command

    holder = Semaphore("reports", 4, ttl=20, label="nightly")
    assert holder.acquire(blocking=False)
    out = StringIO()
    call_command("locks", stdout=out)
    text = out.getvalue()
    assert "Semaphores in cache 'default':" in text
    assert "reports  1/4 permits held" in text
    assert "nightly" in text
    holder.release()
    out = StringIO()
    call_command("locks", stdout=out)
    assert "Semaphores" not in out.getvalue()


def test_aextend_renews_the_permit_and_refuses_one_that_ended() -> None:
    async def main() -> None:
        holder = Semaphore("aextend", 1, ttl=0.2, watchdog=False)
        assert await holder.aacquire(blocking=False)
        await holder.aextend(10)
        assert not await Semaphore("aextend", 1).aacquire(timeout=0.4)
        await holder.arelease()
        with pytest.raises(LockNotOwned):
            await holder.aextend()

    asyncio.run(main())


def test_the_middleware_answers_a_full_semaphore_with_503_and_retry_after(rf: Any) -> None:
    from django.http import HttpResponse

    from django_redis_mutex.middleware import MutexMiddleware

    @semaphore("report-view", 1, blocking=False)
    def view(request: Any) -> HttpResponse:
        return HttpResponse("report")

    middleware = MutexMiddleware(view)
    request = rf.get("/report/")
    assert view(request).content == b"report"
    busy = Semaphore("report-view", 1, ttl=6)
    assert busy.acquire(blocking=False)
    try:
        with pytest.raises(LockContended) as refused:
            view(request)
        response = middleware.process_exception(request, refused.value)
    finally:
        busy.release()
    assert response is not None
    assert response.status_code == 503
    assert 1 <= int(response["Retry-After"]) <= 6
    assert json.loads(response.content)["lock"] == "report-view"


def test_a_waiter_killed_in_line_delays_the_next_by_at_most_a_hand_off_lease(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    holder = Semaphore("dead-waiter", 1, ttl=30)
    assert holder.acquire(blocking=False)
    doomed = spawn("semaphore_hold.py", "dead-waiter", 1, 30, data_key("go-doomed"))
    wait_until(lambda: queued(raw, "dead-waiter") == 1, START_TIMEOUT, "the first waiter")
    go = data_key("go")
    survivor = spawn("semaphore_hold.py", "dead-waiter", 1, 30, go)
    wait_until(lambda: queued(raw, "dead-waiter") == 2, START_TIMEOUT, "the second waiter")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.process.wait(10)

    released = time.monotonic()
    holder.release()  # handed to the dead waiter if its place had not lapsed yet
    token = survivor.expect("acquired", timeout=20)["token"]
    assert time.monotonic() - released <= HANDOFF_LEASE + WAIT_LEASE / 2 + 3.0
    assert holder_tokens(raw, "dead-waiter") == [token]
    raw.rpush(go, "go")
    survivor.expect("released")
    assert survivor.finish() == 0


def test_threads_sharing_one_handle_each_take_their_own_permit() -> None:
    # As a lock handle: each thread (or task) holds its own acquisition, so a
    # handle shared by a thread pool is a semaphore for the pool.
    shared = Semaphore("shared-handle", 3, ttl=10)
    start, taken, done = threading.Barrier(4), threading.Barrier(4), threading.Event()
    results: dict[str, bool] = {}
    tokens: dict[str, str | None] = {}

    def take() -> None:
        start.wait()
        name = threading.current_thread().name
        results[name] = shared.acquire(timeout=1.0)
        tokens[name] = shared.token
        taken.wait()
        done.wait(20)
        if results[name]:
            shared.release()

    threads = [threading.Thread(target=take, name=f"taker-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    taken_by = wait_until(lambda: len(results) == 4 and results, what="every thread's try")
    assert sorted(taken_by.values()) == [False, True, True, True]
    (held,) = held_semaphores()
    assert sorted(h.owner.thread for h in held.holders) == sorted(
        name for name, got in results.items() if got
    )
    assert {h.token for h in held.holders} == {tokens[n] for n, got in results.items() if got}
    done.set()
    for thread in threads:
        thread.join(20)
    assert held_semaphores() == []


def test_a_holder_paused_past_its_lease_loses_its_permit_and_is_told_on_leaving(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    go = data_key("go")
    paused = spawn("semaphore_hold.py", "paused", 1, 1.0, go)
    token = paused.expect("acquired", timeout=START_TIMEOUT)["token"]
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        taker = Semaphore("paused", 1, ttl=30)
        assert taker.acquire(timeout=10)  # once the paused holder's lease ended
        assert holder_tokens(raw, "paused") == [taker.token]
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    raw.rpush(go, "go")
    assert "was lost while the block ran" in paused.expect("lost")["message"]
    assert paused.finish() == 0
    # The paused holder's renewal did not bring its permit back.
    assert holder_tokens(raw, "paused") == [taker.token]
    assert token != taker.token
    taker.release()


# -- Redis Cluster --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_every_key_of_a_semaphore_shares_one_slot(name: str) -> None:
    keys = LockKeys.for_semaphore("tests:mutex", name)
    every_key = [*keys.script_keys, keys.wake("0123456789abcdef0123456789abcdef")]
    assert {key_slot(key.encode()) for key in every_key} == {key_slot(escape_name(name).encode())}


def test_a_semaphore_on_a_redis_cluster_hands_permits_on_and_lists_them(
    mutex_prefix: str,
) -> None:
    with (
        RedisClusterServers(primaries=3) as cluster,
        extra_caches({"cluster": cluster_entry(cluster, mutex_prefix)}),
    ):
        names = ["crawl:{a}", "crawl:b", "crawl:c"]
        for name in names:
            first = Semaphore(name, 1, using="cluster", ttl=10)
            assert first.acquire(blocking=False)
            waiter = Semaphore(name, 1, using="cluster")
            thread = threading.Thread(target=waiter.acquire, kwargs={"timeout": 10})
            thread.start()
            wait_until(lambda w=waiter: w.token is not None or queued_on(w) == 1)
            assert [held.name for held in held_semaphores("cluster")] == [name]
            first.release()
            thread.join(10)
            assert waiter.token is not None
            waiter.release()
        assert held_semaphores("cluster") == []


def queued_on(handle: Semaphore) -> int:
    """Return how many wait in line for ``handle``'s semaphore, asked through its own alias."""
    from django_redis_mutex.client import get_client

    return int(get_client(handle.using).zcard(handle.keys.queue))


def test_resetting_every_lock_leaves_semaphores_alone(raw: redis.Redis) -> None:
    from django_redis_mutex import Mutex, reset_all

    holder = Semaphore("kept", 2, ttl=20)
    assert holder.acquire(blocking=False)
    assert Mutex("beside", watchdog=False).acquire(blocking=False)
    assert reset_all() == 1  # the lock, and only it
    assert holder_tokens(raw, "kept") == [holder.token]
    holder.release()


def test_max_hold_stops_renewing_a_permit_so_it_ends() -> None:
    from django.test import override_settings

    from .helpers import caches_with

    with override_settings(CACHES=caches_with(MAX_HOLD=1.2)):
        capped = Semaphore("capped", 1, ttl=0.8)
        assert capped.acquire(blocking=False)
        started = time.monotonic()
        successor = Semaphore("capped", 1, ttl=5)
        assert successor.acquire(timeout=10)
        # Renewed up to MAX_HOLD, then left to run out its last lease.
        assert time.monotonic() - started >= 1.2
        with pytest.raises(LockNotOwned):
            capped.release()
        successor.release()


# -- renewal by the lock watchdog -----------------------------------------------------------------


@pytest.fixture
def lost_signals() -> Iterator[list[dict[str, Any]]]:
    """Collect every lock_lost sent during the test: its sender and keyword arguments."""
    received: list[dict[str, Any]] = []

    def on_lost(sender: str, **kwargs: Any) -> None:
        kwargs.pop("signal")
        received.append({"sender": sender, **kwargs})

    signals.lock_lost.connect(on_lost, weak=False)
    yield received
    signals.lock_lost.disconnect(on_lost)


@pytest.fixture
def watchdog_pipelines(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Record the script SHAs of every pipeline the watchdog's lanes run, one list per pipeline."""
    sent: list[list[str]] = []
    execute = redis.client.Pipeline.execute

    def recording(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("django-redis-mutex-watchdog:"):
            sent.append([str(command[0][1]) for command in pipe.command_stack])
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", recording)
    return sent


def test_a_lock_and_a_permit_on_one_alias_are_renewed_in_one_pipeline(
    raw: redis.Redis, watchdog_pipelines: list[list[str]]
) -> None:
    ttl = 0.6
    lock = Mutex("side-by-side", ttl=ttl)
    permit = Semaphore("side-by-side", 1, ttl=ttl)
    assert lock.acquire(blocking=False)
    assert permit.acquire(blocking=False)
    # Both renewals are due a third into their leases, which started before now.
    both_due = time.monotonic() + ttl / 3
    lane = get_watchdog()._lanes["default"]
    # The lane starts no round while its condition is held: let both fall due, so
    # its next round finds them together.
    with lane._cond:
        wait_until(lambda: time.monotonic() >= both_due, what="both renewals due")
    wait_until(
        lambda: any(shas.count(EXTEND.sha) >= 2 for shas in watchdog_pipelines),
        what="one watchdog pipeline renewing the lock and the permit",
    )
    # That pipeline reached Redis: the permit's lease moved, the lock's was renewed.
    wait_until(lambda: renewed_count(raw, permit) >= 1, what="the permit's lease renewed")
    assert raw.pttl(lock.keys.lock) > ttl * 1000 / 3
    assert not permit.lost and not lock.lost
    permit.release()
    lock.release()


def test_a_permit_reset_under_its_holder_sends_lock_lost_and_its_block_raises(
    raw: redis.Redis, lost_signals: list[dict[str, Any]]
) -> None:
    with (
        pytest.raises(LockLost, match=r"'reset-under'.*was lost while the block ran"),
        semaphore("reset-under", 2, ttl=0.3) as held,
    ):
        permit = held._current()
        assert permit is not None
        assert reset_semaphore("reset-under") == 1
        wait_until(lambda: held.lost, what="the watchdog to find the permit gone")
        assert not get_watchdog().watching(permit)
        assert holder_tokens(raw, "reset-under", 2) == []  # never re-created by a renewal
    # Sent once, by the watchdog; the release that found it gone again sent nothing.
    assert len(lost_signals) == 1
    (sent,) = lost_signals
    assert sent["sender"] == "default"
    assert (sent["name"], sent["kind"], sent["fence"]) == ("reset-under", "semaphore", permit.fence)
    assert sent["held"] > 0


def test_an_async_block_whose_permit_was_reset_raises_lock_lost(
    lost_signals: list[dict[str, Any]],
) -> None:
    async def main() -> None:
        with pytest.raises(LockLost, match="'reset-async'"):
            async with semaphore("reset-async", 1, ttl=0.3) as held:
                assert reset_semaphore("reset-async") == 1
                await await_until(lambda: held.lost, what="the watchdog to find the permit gone")

    asyncio.run(main())
    assert [(s["name"], s["kind"]) for s in lost_signals] == [("reset-async", "semaphore")]


def test_with_raise_on_lost_off_a_lost_permit_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture, lost_signals: list[dict[str, Any]]
) -> None:
    from django.test import override_settings

    with (
        override_settings(CACHES=caches_with(RAISE_ON_LOST=False)),
        caplog.at_level(logging.ERROR, logger="django_redis_mutex"),
        semaphore("quiet-loss", 1, ttl=0.3) as held,
    ):
        assert reset_semaphore("quiet-loss") == 1
        wait_until(lambda: held.lost, what="the watchdog to find the permit gone")
    assert any(
        "'quiet-loss'" in r.getMessage() and "was lost" in r.getMessage() for r in caplog.records
    )
    assert [s["name"] for s in lost_signals] == ["quiet-loss"]


def test_max_hold_stops_the_watchdog_renewing_a_permit(
    raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    from django.test import override_settings

    with (
        override_settings(CACHES=caches_with(MAX_HOLD=0.6)),
        caplog.at_level(logging.WARNING, logger="django_redis_mutex"),
    ):
        capped = Semaphore("capped-lane", 1, ttl=0.3)
        assert capped.acquire(blocking=False)
        permit = capped._current()
        assert permit is not None
        wait_until(lambda: renewed_count(raw, capped) >= 1, what="a renewal before MAX_HOLD")
        wait_until(lambda: not get_watchdog().watching(permit), what="renewal to stop")
        # Left to run out its last lease: the permit comes free to another holder.
        successor = Semaphore("capped-lane", 1, ttl=5)
        assert successor.acquire(timeout=5)
    assert any(
        "semaphore 'capped-lane'" in r.getMessage() and "MAX_HOLD" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(LockNotOwned):
        capped.release()
    successor.release()


def test_a_hung_redis_stalls_only_the_permits_of_its_own_alias(
    redis_url: str, raw: redis.Redis
) -> None:
    from django.conf import settings
    from django.test import override_settings

    port = urlsplit(redis_url).port
    assert port is not None
    with Proxy(port) as proxy:
        caches = copy.deepcopy(settings.CACHES)
        caches["direct"] = copy.deepcopy(caches["default"])
        caches["default"]["LOCATION"] = proxy.url  # its socket timeout is 5 s
        with override_settings(CACHES=caches):
            stuck = Semaphore("behind-a-hung-redis", 1, ttl=0.9)
            assert stuck.acquire(blocking=False)
            healthy = Semaphore("on-a-healthy-redis", 1, using="direct", ttl=0.6)
            assert healthy.acquire(blocking=False)
            proxy.stall()
            try:
                # The hung alias's lane waits out its renewal (due 0.3 s in) for
                # seconds; the other lane renews its permit all along.
                def healthy_renewed() -> bool:
                    assert holder_tokens(raw, "on-a-healthy-redis") == [healthy.token]
                    assert renewed_count(raw, stuck) == 0  # nothing got through the stall
                    return renewed_count(raw, healthy) >= 8

                wait_until(healthy_renewed, timeout=4.5, what="renewals on the healthy alias")
                assert not healthy.lost
                healthy.release()
            finally:
                proxy.resume()
            # The hung Redis's permit ran out meanwhile, and is not brought back.
            with pytest.raises(LockNotOwned):
                stuck.release()
