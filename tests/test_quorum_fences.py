"""Fences of a quorum lock keep growing when the majority changes, with no round of their own.

A quorum hold's fence is the largest its granting masters handed out; it
rides as a floor for every master's fence counter on the hold's renewals, its
release and an operator's reset. To see the floor at work, one master's
counter is set a minute ahead of the clocks (as a master whose clock runs
ahead would leave it): the hold's fence comes from that master, and after it
is gone the next majority, of the two others, must still hand out a larger
one.
"""

from __future__ import annotations

import pytest
import redis

from django_redis_mutex import Mutex, mutex, reset, reset_all
from django_redis_mutex.client import namespace
from django_redis_mutex.introspection import listed_locks, reset_listed
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisServer
from django_redis_mutex.watchdog import get_watchdog

from .helpers import wait_until
from .test_quorum import ALIASES, masters, quorum_caches  # noqa: F401  (fixtures)

AHEAD_US = 60_000_000


def run_ahead(server: RedisServer, alias: str, name: str) -> int:
    """Set ``name``'s fence counter on ``server`` a minute ahead of its clock; return it."""
    client = redis.Redis.from_url(server.url)
    seconds, micros = client.time()
    ahead = seconds * 1_000_000 + micros + AHEAD_US
    client.set(LockKeys.for_name(namespace(alias), name).fence, ahead, px=3_600_000)
    client.close()
    return ahead


def evalsha_calls(server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url)
    stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
    client.close()
    return int(stats["calls"])


def test_an_uncontended_quorum_cycle_is_two_rounds(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    with mutex("two-rounds", using=ALIASES):
        pass  # the masters load the scripts
    before = [evalsha_calls(server) for server in quorum_caches]
    with mutex("two-rounds", using=ALIASES) as lock:
        assert lock.fence is not None
    after = [evalsha_calls(server) for server in quorum_caches]
    # One script to acquire and one to release on each master: no fence round.
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 2, 2]


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_release_raises_the_next_majoritys_fence(
    quorum_caches: list[RedisServer],  # noqa: F811
    shared: bool,
) -> None:
    ahead = run_ahead(quorum_caches[0], "r1", "released")
    with mutex("released", shared=shared, using=ALIASES) as first:
        first_fence = first.fence
    assert first_fence is not None and first_fence > ahead

    quorum_caches[0].kill()
    with mutex("released", using=ALIASES) as second:
        assert second.fence is not None and second.fence > first_fence


def test_a_renewal_raises_the_fence_before_a_dead_holders_lease_ends(
    quorum_caches: list[RedisServer],  # noqa: F811
) -> None:
    run_ahead(quorum_caches[0], "r1", "renewed")
    first = Mutex("renewed", using=ALIASES, ttl=0.8)
    assert first.acquire()
    hold = first._current()
    assert hold is not None and first.fence is not None
    wait_until(
        lambda: (
            all(lease.sent > hold.acquired_at for lease in hold.leases.values())
            and len(hold.leases) == len(ALIASES)
        ),
        10,
        "a renewal on every master",
    )
    # The holder dies: no release, no more renewals; its lease runs out.
    assert get_watchdog().unwatch(hold)
    quorum_caches[0].kill()

    second = Mutex("renewed", using=ALIASES, timeout=10)
    assert second.acquire()
    try:
        assert second.fence is not None and second.fence > first.fence
    finally:
        second.release()


def reset_listed_hold(name: str) -> bool:
    (listed,) = [entry for entry in listed_locks(using=ALIASES) if entry.held.name == name]
    return reset_listed(listed, using=ALIASES)


RESETS = {
    "reset": lambda name: reset(name, using=ALIASES),
    "reset_all": lambda name: reset_all(using=ALIASES) == 1,
    "reset_listed": reset_listed_hold,
}


@pytest.mark.parametrize("how", list(RESETS))
def test_a_reset_raises_the_next_majoritys_fence(
    quorum_caches: list[RedisServer],  # noqa: F811
    how: str,
) -> None:
    run_ahead(quorum_caches[0], "r1", "reset")
    first = Mutex("reset", using=ALIASES, watchdog=False, ttl=30)
    assert first.acquire()
    first_fence = first.fence
    assert first_fence is not None

    assert RESETS[how]("reset")
    quorum_caches[0].kill()
    with mutex("reset", using=ALIASES) as second:
        assert second.fence is not None and second.fence > first_fence
