"""Locks on a real three-primary Redis Cluster (a lock alias with MUTEX ``CLUSTER: True``).

Each lock's keys share one hash tag, so every script runs on the one primary
serving that slot; locks of different names land on different primaries, and
the inspection tools (``held_locks``, ``reset_all``, ``manage.py locks``) must
SCAN every primary to see them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
from collections.abc import Iterator

import pytest
import redis
from django.core.management import CommandError, call_command
from redis.crc import key_slot

from django_redis_mutex import LockNotOwned, Mutex, held_locks, mutex, reset, reset_all
from django_redis_mutex.client import namespace
from django_redis_mutex.keys import LockKeys, escape_name
from django_redis_mutex.testing import RedisClusterServers

from .helpers import await_until, wait_until
from .topologies import (
    SectionWorkers,
    cluster_entry,
    extra_caches,
    names_on_every_primary,
    primary_port_of_slot,
)

ALIAS = "cluster"

# Names that would move keys apart, or out of the namespace, if the hash tag
# were taken from the user's text: braces of every shape, escapes, glob and
# separator characters, non-ASCII, control characters, the longest name.
HOSTILE_NAMES = [
    "{user1000}.following",
    "a{b}c",
    "x}y{z",
    "{}",
    "{",
    "}",
    "}{",
    "{{}}",
    "%7B",
    "%25%7D",
    "q*?[]\\",
    "order:42:wake:x",
    "}:wake:{",
    "name with spaces\tand\nnewlines",
    "名前:ü",
    "n" * 1024,
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(primaries=3) as running:
        yield running


@pytest.fixture
def cluster_caches(
    cluster: RedisClusterServers, mutex_prefix: str
) -> Iterator[RedisClusterServers]:
    """Add the lock alias ``cluster`` on the running cluster, in this test's namespace."""
    with extra_caches({ALIAS: cluster_entry(cluster, mutex_prefix)}):
        yield cluster


def node_holding(cluster: RedisClusterServers, key: str) -> int:
    """Return the port of the primary that actually stores ``key`` (asked node by node)."""
    holders = []
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        try:
            if client.exists(key):
                holders.append(node.port)
        except redis.ResponseError:  # MOVED: another primary serves the key's slot
            continue
        finally:
            client.close()
    assert len(holders) == 1, f"{key!r} is stored on {holders}"
    return holders[0]


# -- keys and slots ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_every_key_of_a_lock_shares_one_slot(name: str) -> None:
    keys = LockKeys.for_name("tests:mutex", name)
    every_key = [*keys.script_keys, keys.wake_prefix + "0123456789abcdef0123456789abcdef"]

    slots = {key_slot(key.encode()) for key in every_key}

    assert slots == {key_slot(escape_name(name).encode())}


def test_braces_inside_a_name_do_not_choose_its_slot() -> None:
    # Were "{user1000}" taken as the tag, both names would share one slot.
    first = LockKeys.for_name("tests:mutex", "{user1000}.following").lock
    second = LockKeys.for_name("tests:mutex", "{user1000}.followers").lock

    assert key_slot(first.encode()) != key_slot(second.encode())


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_lock_with_a_hostile_name_excludes_and_hands_over_on_the_cluster(
    cluster_caches: RedisClusterServers, name: str
) -> None:
    holder = Mutex(name, using=ALIAS)
    assert holder.acquire()
    assert not Mutex(name, using=ALIAS, reentrant=False).acquire(blocking=False)
    handed: list[int] = []
    waiter_started = threading.Event()

    def wait_for_it() -> None:
        waiter = Mutex(name, using=ALIAS, timeout=10)
        waiter_started.set()
        if waiter.acquire():  # blocks on its wake key, in the lock's slot
            handed.append(waiter.fence or 0)
            waiter.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    assert waiter_started.wait(5)
    wait_until(lambda: any(h.waiters for h in held_locks(using=ALIAS)), 5, "the waiter to queue")
    first_fence = holder.fence or 0
    holder.release()
    thread.join(10)

    assert len(handed) == 1 and handed[0] > first_fence
    assert held_locks(using=ALIAS) == []


def test_locks_of_different_names_live_on_different_primaries(
    cluster_caches: RedisClusterServers,
) -> None:
    cluster = cluster_caches
    names = names_on_every_primary(cluster)
    locks = [Mutex(name, using=ALIAS) for name in names]
    for lock in locks:
        assert lock.acquire()

    ports = {node_holding(cluster, lock.keys.lock) for lock in locks}

    assert ports == {node.port for node in cluster.nodes}
    for lock in locks:
        lock.release()


# -- inspection and reset across primaries -----------------------------------------------------


@pytest.fixture
def one_lock_per_primary(cluster_caches: RedisClusterServers) -> Iterator[list[Mutex]]:
    """Hold one lock on each primary of the cluster; release what is still held afterwards."""
    names = names_on_every_primary(cluster_caches)
    locks = [Mutex(name, using=ALIAS, label="spread") for name in names]
    for lock in locks:
        assert lock.acquire()
    yield locks
    for lock in locks:
        if lock.token is not None:
            with contextlib.suppress(LockNotOwned):  # reset by the test
                lock.release()


def test_held_locks_finds_locks_on_every_primary(one_lock_per_primary: list[Mutex]) -> None:
    found = held_locks(using=ALIAS)

    assert [h.name for h in found] == sorted(lock.name for lock in one_lock_per_primary)
    assert {h.fence for h in found} == {lock.fence for lock in one_lock_per_primary}
    assert all(h.owner.label == "spread" for h in found)


def test_locks_command_lists_locks_on_every_primary(one_lock_per_primary: list[Mutex]) -> None:
    out = io.StringIO()

    call_command("locks", "--using", ALIAS, stdout=out)

    text = out.getvalue()
    assert all(lock.name in text for lock in one_lock_per_primary)
    assert f"3 locks held in cache '{ALIAS}'." in text


def test_locks_command_reset_all_releases_locks_on_every_primary(
    one_lock_per_primary: list[Mutex],
) -> None:
    out = io.StringIO()

    call_command("locks", "--reset-all", "--noinput", "--using", ALIAS, stdout=out)

    assert f"Released 3 locks in cache '{ALIAS}'." in out.getvalue()
    assert held_locks(using=ALIAS) == []
    assert not any(lock.owned() for lock in one_lock_per_primary)


def test_locks_command_reset_releases_named_locks_on_their_primaries(
    one_lock_per_primary: list[Mutex],
) -> None:
    first, second, kept = one_lock_per_primary
    out = io.StringIO()

    with pytest.raises(CommandError, match=r"^No lock 'never-held' is held in cache "):
        call_command(
            "locks", "--reset", first.name, second.name, "never-held", "--using", ALIAS, stdout=out
        )

    assert f"Released {first.name!r}." in out.getvalue()
    assert f"Released {second.name!r}." in out.getvalue()
    assert [h.name for h in held_locks(using=ALIAS)] == [kept.name]


def test_reset_all_touches_only_lock_keys_on_every_primary(
    one_lock_per_primary: list[Mutex], cluster_caches: RedisClusterServers
) -> None:
    client = redis.cluster.RedisCluster.from_url(cluster_caches.url)
    # Cache entries of the same project in the locks' own slots, so on every primary.
    entries = [f"tests:1:{{{lock.name}}}" for lock in one_lock_per_primary]
    try:
        for key in entries:
            client.set(key, "cached")

        released = reset_all(using=ALIAS)

        assert released == 3
        assert held_locks(using=ALIAS) == []
        assert [client.get(key) for key in entries] == [b"cached"] * 3
    finally:
        for key in entries:
            client.delete(key)
        client.close()


def test_reset_hands_a_cluster_lock_to_its_waiter(cluster_caches: RedisClusterServers) -> None:
    holder = Mutex("reset-me", using=ALIAS)
    assert holder.acquire()
    granted = threading.Event()

    def wait_for_it() -> None:
        waiter = Mutex("reset-me", using=ALIAS, timeout=10)
        if waiter.acquire():
            granted.set()
            waiter.release()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: any(h.waiters for h in held_locks(using=ALIAS)), 5, "the waiter to queue")

    assert reset("reset-me", using=ALIAS) is True
    assert granted.wait(5)
    thread.join(5)
    with pytest.raises(LockNotOwned, match="reset-me"):
        holder.release()


def test_shared_holders_hand_over_to_a_writer_and_back_on_the_cluster(
    cluster_caches: RedisClusterServers,
) -> None:
    first = Mutex("shared-on-cluster", using=ALIAS, shared=True)
    second = Mutex("shared-on-cluster", using=ALIAS, shared=True)
    assert first.acquire() and second.acquire()
    reader_fences = [first.fence or 0, second.fence or 0]
    # The reads behind these take the server clock, never inside a cluster pipeline.
    assert first.owned() and first.locked() and first.time_left() > 0
    assert first.owner() is not None
    [listed] = held_locks(using=ALIAS)
    assert listed.shared and len(listed.holders) == 2
    entered: list[tuple[str, int]] = []

    def take(tag: str, shared: bool) -> None:
        lock = Mutex("shared-on-cluster", using=ALIAS, shared=shared, timeout=10)
        if lock.acquire():  # blocks on its wake key, in the lock's slot
            entered.append((tag, lock.fence or 0))
            lock.release()

    writer = threading.Thread(target=take, args=("writer", False))
    writer.start()
    wait_until(lambda: held_locks(using=ALIAS)[0].waiters == 1, 5, "the writer to queue")
    reader = threading.Thread(target=take, args=("reader", True))
    reader.start()
    wait_until(lambda: held_locks(using=ALIAS)[0].waiters == 2, 5, "the reader to queue")
    first.release()
    assert entered == []
    second.release()
    writer.join(10)
    reader.join(10)

    assert [tag for tag, _ in entered] == ["writer", "reader"]
    assert min(reader_fences) > 0 and entered[0][1] > max(reader_fences)
    assert held_locks(using=ALIAS) == []


# -- renewal and async -------------------------------------------------------------------------


def test_watchdog_renews_locks_on_every_primary(cluster_caches: RedisClusterServers) -> None:
    names = names_on_every_primary(cluster_caches)
    locks = [Mutex(name, using=ALIAS, ttl=0.8) for name in names]
    for lock in locks:
        assert lock.acquire()

    threading.Event().wait(2.4)  # three leases: only renewals can keep the locks

    try:
        assert all(lock.owned() and lock.time_left() > 0 for lock in locks)
        assert not any(
            Mutex(name, using=ALIAS, reentrant=False).acquire(blocking=False) for name in names
        )
    finally:
        for lock in locks:
            lock.release()


def test_async_lock_excludes_and_hands_over_on_the_cluster(
    cluster_caches: RedisClusterServers,
) -> None:
    async def main() -> tuple[bool, int, int]:
        holder = Mutex("async-job", using=ALIAS)
        assert await holder.aacquire()
        refused = await Mutex("async-job", using=ALIAS, reentrant=False).aacquire(blocking=False)
        first_fence = holder.fence or 0

        async def wait_for_it() -> int:
            async with mutex("async-job", using=ALIAS, timeout=10) as waiter:
                return waiter.fence or 0

        waiting = asyncio.create_task(wait_for_it())
        await await_until(
            lambda: any(h.waiters for h in held_locks(using=ALIAS)), 5, "the waiter to queue"
        )
        await holder.arelease()
        return refused, first_fence, await asyncio.wait_for(waiting, 10)

    refused, first_fence, handed_fence = asyncio.run(main())

    assert refused is False
    assert handed_fence > first_fence
    assert held_locks(using=ALIAS) == []


def test_sync_holder_excludes_async_contender_on_the_cluster(
    cluster_caches: RedisClusterServers,
) -> None:
    with mutex("mixed", using=ALIAS):
        other = asyncio.run(Mutex("mixed", using=ALIAS).aacquire(blocking=False))

    assert other is False


def test_cluster_lock_keys_carry_the_alias_namespace(
    cluster_caches: RedisClusterServers, mutex_prefix: str
) -> None:
    with mutex("inventory", using=ALIAS) as lock:
        stored = node_holding(cluster_caches, lock.keys.lock)

    assert lock.keys.lock == f"{namespace(ALIAS)}:{{inventory}}"
    assert namespace(ALIAS) == f"tests:{mutex_prefix}"
    port_of = primary_port_of_slot(cluster_caches)
    assert stored == port_of(key_slot(b"inventory"))


# -- many processes ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_processes_exclude_each_other_on_every_primary(
    cluster_caches: RedisClusterServers, mutex_prefix: str, raw: redis.Redis, use_async: bool
) -> None:
    names = names_on_every_primary(cluster_caches, per_primary=2, stem=f"many-{use_async}")
    workers = SectionWorkers(
        raw,
        {ALIAS: cluster_entry(cluster_caches, mutex_prefix)},
        ALIAS,
        workers=3,
        threads=3,
        names=names,
        iterations=40,
        hold=0.001,
        use_async=use_async,
    )
    try:
        workers.start()
        history = workers.finish()
    finally:
        workers.close()

    assert len(history) == 3 * 3 * 40
    assert history.violations() == []
    assert history.counter_violations(workers.counters()) == []
    assert set(history.names()) == set(names)  # every primary served sections
    assert history.lost() == []
