"""Semaphores of a quorum (Redlock) alias: listed and reset like its locks, on every master.

The masters and aliases are those of ``test_quorum_reset``: ``m1``..``m3``, with
``m3`` in a namespace of its own (another KEY_PREFIX), and ``q`` naming them as
its QUORUM. A permit counts as held when as many masters hold it as its
a quorum semaphore needs for its limit; every test looks at the semaphore's
hash on each master directly.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.test import Client

from django_redis_mutex import (
    LockBackendUnavailable,
    LockError,
    LockNotOwned,
    Mutex,
    Semaphore,
    held_locks,
    held_semaphores,
    reset_semaphore,
)
from django_redis_mutex.client import namespace
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisServer

from .helpers import wait_until
from .test_quorum_reset import (  # noqa: F401  (fixtures)
    ALIASES,
    LIST_URL,
    QUORUM,
    STEP,
    _messages,
    held,
    hold,
    locks,
    locks_error,
    masters,
    quorum,
    stays,
    superuser,
)

RESET_SEMAPHORE_URL = LIST_URL + "reset-semaphore/"


@pytest.fixture
def permits(quorum: list[RedisServer]) -> Iterator[list[Semaphore]]:  # noqa: F811
    """Permits a test takes; those still held are given back before the aliases go."""
    handles: list[Semaphore] = []
    yield handles
    for handle in handles:
        with contextlib.suppress(LockError):
            handle.release()


def take(permits: list[Semaphore], name: str, limit: int, **options: Any) -> Semaphore:
    """Take a permit of ``name`` at once (default: on the quorum alias, no watchdog)."""
    options.setdefault("using", QUORUM)
    handle = Semaphore(name, limit, ttl=60, watchdog=False, **options)
    assert handle.acquire(blocking=False)
    permits.append(handle)
    return handle


def semaphore_key(alias: str, name: str) -> str:
    """The hash of semaphore ``name`` on master ``alias``, in that master's own namespace."""
    return LockKeys.for_semaphore(namespace(alias), name).lock


def permits_on_masters(masters: list[RedisServer], name: str) -> list[Any]:  # noqa: F811
    """Return the permit tokens of ``name`` on each master (a set; "down" for a killed one)."""
    found: list[Any] = []
    for alias, server in zip(ALIASES, masters, strict=True):
        if server.process is None:
            found.append("down")
            continue
        client = redis.Redis(port=server.port, socket_timeout=2, decode_responses=True)
        try:
            fields = client.hkeys(semaphore_key(alias, name))
        finally:
            client.close()
        found.append({field[2:] for field in fields if field.startswith("r:")})
    return found


# -- held_semaphores() ------------------------------------------------------------------------


def test_held_semaphores_lists_quorum_permits_with_owners_fences_and_limit(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
    held: list[Mutex],  # noqa: F811
) -> None:
    nightly = take(permits, "exports", 3, label="nightly export")
    hourly = take(permits, "exports", 3, label="hourly export")
    take(permits, "exports", 3, using="m1")  # on one master only: not the quorum's
    hold(held, "exports")  # a lock of that name is another thing

    [found] = held_semaphores(QUORUM)

    assert (found.name, found.limit, found.waiters) == ("exports", 3, 0)
    by_token = {holder.token: holder for holder in found.holders}
    assert by_token.keys() == {nightly.token, hourly.token}
    for handle, label in ((nightly, "nightly export"), (hourly, "hourly export")):
        assert handle.token is not None
        holder = by_token[handle.token]
        assert (holder.owner.label, holder.fence) == (label, handle.fence)
        assert 0 < holder.time_left <= 60
    assert {h.token for s in held_semaphores(ALIASES) for h in s.holders} == by_token.keys()
    assert [h.name for h in held_locks(QUORUM)] == ["exports"]
    # Listing one member stays allowed: it reads that master alone.
    assert [len(h.holders) for h in held_semaphores("m1")] == [3]


def test_a_permit_counts_on_as_many_masters_as_its_quorum_semaphore_needs(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    # Three masters: a limit of one needs two of them, a limit of two all three.
    single = take(permits, "single", 1)
    pair = take(permits, "pair", 2)
    client = redis.Redis(port=quorum[2].port, socket_timeout=2)
    try:
        for handle in (single, pair):
            client.hdel(semaphore_key("m3", handle.name), f"r:{handle.token}")
    finally:
        client.close()

    assert [(h.name, h.limit) for h in held_semaphores(QUORUM)] == [("single", 1)]


# -- reset_semaphore() ------------------------------------------------------------------------


def test_reset_semaphore_frees_every_master_and_a_waiter_gets_the_permit(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    stuck = take(permits, "exports", 1)
    assert permits_on_masters(quorum, "exports") == [{stuck.token}] * 3
    waiter = Semaphore("exports", 1, using=QUORUM, ttl=60, watchdog=False, timeout=STEP)
    got: dict[str, bool] = {}
    thread = threading.Thread(target=lambda: got.update(acquired=waiter.acquire()))
    thread.start()
    try:
        stays(lambda: "acquired" not in got, 0.3, "the waiter got a permit still held")
        assert reset_semaphore("exports", using=QUORUM) == 1
        wait_until(lambda: "acquired" in got, STEP, "the waiter to get the freed permit")
    finally:
        thread.join(STEP)
    permits.append(waiter)

    assert got["acquired"] is True
    assert all(stuck.token not in tokens for tokens in permits_on_masters(quorum, "exports"))
    [found] = held_semaphores(QUORUM)
    assert [holder.token for holder in found.holders] == [waiter.token]
    with pytest.raises(LockNotOwned):
        stuck.release()


def test_one_master_down_still_lists_and_resets_a_quorum_semaphore(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    permit = take(permits, "batch", 1)
    quorum[2].kill()

    [found] = held_semaphores(QUORUM)
    assert [holder.token for holder in found.holders] == [permit.token]
    assert reset_semaphore("batch", using=QUORUM) == 1

    # The dead master's copy is one of three: it cannot make the two a permit needs.
    assert permits_on_masters(quorum, "batch") == [set(), set(), "down"]
    assert held_semaphores(QUORUM) == []


def test_two_masters_down_neither_lists_nor_claims_a_reset(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    take(permits, "ledger", 1)
    quorum[0].kill()
    quorum[1].kill()

    with pytest.raises(LockBackendUnavailable, match=r"list the semaphores .* 2 of 3 Redis"):
        held_semaphores(QUORUM)
    with pytest.raises(LockBackendUnavailable, match="semaphore may still be held") as failure:
        reset_semaphore("ledger", using=QUORUM)
    assert failure.value.name == "ledger"
    message, out = locks_error("--using", QUORUM, "--reset-semaphore", "ledger")
    assert "2 of 3 Redis masters could not be reached" in message, message
    assert "Reset" not in out


def test_member_alias_is_refused_a_semaphore_reset(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    permit = take(permits, "inventory", 1)
    refusal = "Cache alias 'm1' is a member of quorum 'q'; reset the semaphore through 'q'"

    with pytest.raises(ValueError, match=refusal):
        reset_semaphore("inventory", using="m1")
    message, _out = locks_error("--using", "m1", "--reset-semaphore", "inventory")
    assert message.startswith(refusal), message

    assert permits_on_masters(quorum, "inventory") == [{permit.token}] * 3


# -- manage.py locks ----------------------------------------------------------------------------


def test_command_lists_and_resets_quorum_semaphores(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
) -> None:
    permit = take(permits, "exports", 2, label="nightly export")

    lines = locks("--using", QUORUM).splitlines()
    assert lines[-3:-1] == ["Semaphores in cache 'q':", "  exports  1/2 permits held"]
    assert lines[-1].startswith("    nightly export ")
    [entry] = json.loads(locks("--using", QUORUM, "--json"))
    assert (entry["kind"], entry["name"], entry["limit"]) == ("semaphore", "exports", 2)
    assert [holder["token"] for holder in entry["holders"]] == [permit.token]

    out = locks("--using", QUORUM, "--reset-semaphore", "exports")

    assert out.splitlines() == ["Reset semaphore 'exports': freed 1 permit."]
    assert permits_on_masters(quorum, "exports") == [set()] * 3


# -- the admin ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin_lists_and_resets_a_quorum_semaphore_on_every_master(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
    superuser: Client,  # noqa: F811
) -> None:
    take(permits, "exports", 2, label="nightly export")

    page = superuser.get(LIST_URL, {"using": QUORUM})
    [row] = page.context["semaphores"]
    assert (row["name"], row["limit"], row["held"]) == ("exports", 2, 1)
    assert [holder["label"] for holder in row["holders"]] == ["nightly export"]
    confirm = superuser.get(row["reset_url"])
    assert [r["name"] for r in confirm.context["semaphores"]] == ["exports"]

    response = superuser.post(
        RESET_SEMAPHORE_URL, {"using": QUORUM, "name": "exports"}, follow=True
    )

    assert _messages(response) == ["Reset semaphore “exports”: freed 1 permit."]
    assert response.context["semaphores"] == []
    assert permits_on_masters(quorum, "exports") == [set()] * 3
    assert LogEntry.objects.count() == 1


@pytest.mark.django_db
def test_admin_refuses_to_reset_a_semaphore_through_a_member_alias(
    quorum: list[RedisServer],  # noqa: F811
    permits: list[Semaphore],
    superuser: Client,  # noqa: F811
) -> None:
    permit = take(permits, "exports", 1)
    for send in (superuser.get, superuser.post):
        response = send(RESET_SEMAPHORE_URL, {"using": "m2", "name": "exports"}, follow=True)
        [message] = _messages(response)
        assert message.startswith("Cache alias 'm2' is a member of quorum 'q'"), message
        assert "reset the semaphore through 'q'" in message
    assert permits_on_masters(quorum, "exports") == [{permit.token}] * 3
    assert not LogEntry.objects.exists()
