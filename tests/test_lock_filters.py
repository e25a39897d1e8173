"""Selecting held locks by holder and age, and resetting exactly the acquisition that was listed.

``LockFilter`` and ``parse_duration`` are pure and are tested on values;
``listed_locks`` and ``reset_listed`` run against the session's real Redis,
and on a quorum of three aliases there (each with its own KEY_PREFIX).
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import override_settings

from django_redis_mutex import HeldLock, LockBackendUnavailable, LockError, Mutex, Owner
from django_redis_mutex.filters import FilterError, LockFilter, parse_duration
from django_redis_mutex.introspection import held_locks, listed_locks, reset_listed
from django_redis_mutex.testing import free_port

from .helpers import wait_until

# -- durations -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("2.5", 2.5),
        ("0", 0),
        ("90s", 90),
        ("10m", 600),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1d12h", 129600),
        ("1h0m5s", 3605),
        (" 1H 30M ", 5400),
    ],
)
def test_duration_is_seconds_or_numbers_with_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", " ", "10x", "1m30h", "h", "-5", "inf", "nan", "1e3", "10ms", "1.5.2s", "٣s"]
)
def test_bad_duration_is_refused_saying_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_duration(text)
    assert str(raised.value) == (
        f"{text!r} is not a duration: write seconds (90) or numbers with the units "
        "d, h, m and s, largest first (90s, 10m, 2h, 1h30m)."
    )


# -- matching --------------------------------------------------------------------------


def held(held_for: float = 1.0, **owner: Any) -> HeldLock:
    return HeldLock(
        name="n",
        owner=Owner(**owner),
        acquired_at=datetime.now(timezone.utc) - timedelta(seconds=held_for),
        time_left=10.0,
        fence=1,
        waiters=0,
    )


WEB1 = held(host="web1.example", pid=40, thread="MainThread", label="deploy")


def test_empty_filter_matches_every_lock_and_is_false() -> None:
    assert not LockFilter()
    assert LockFilter().matches(WEB1)
    assert LockFilter().matches(held())
    assert LockFilter().describe() == "every lock"


@pytest.mark.parametrize(
    ("lock_filter", "expected"),
    [
        (LockFilter(host="web1.example"), True),
        (LockFilter(host="WEB1.Example"), True),  # host names ignore case
        (LockFilter(host="web1"), False),  # exact, not a prefix
        (LockFilter(pid=40), True),
        (LockFilter(pid=41), False),
        (LockFilter(label="deploy"), True),
        (LockFilter(label="Deploy"), False),  # labels are exact
        (LockFilter(label="dep"), False),
        (LockFilter(host="web1.example", pid=40, label="deploy"), True),
        (LockFilter(host="web1.example", pid=41, label="deploy"), False),
    ],
)
def test_filter_matches_when_every_given_field_matches(
    lock_filter: LockFilter, expected: bool
) -> None:
    assert lock_filter.matches(WEB1) is expected


def test_older_than_matches_locks_held_at_least_that_long() -> None:
    assert LockFilter(older_than=60).matches(held(held_for=61))
    assert not LockFilter(older_than=60).matches(held(held_for=59))
    assert LockFilter(older_than=0).matches(held(held_for=0))


def test_owner_without_the_field_never_matches_a_filter_on_it() -> None:
    unknown = held()  # an owner record that was damaged or missing
    for lock_filter in (LockFilter(host="web1"), LockFilter(pid=1), LockFilter(label="x")):
        assert not lock_filter.matches(unknown)


def test_filter_describes_itself_for_a_person() -> None:
    lock_filter = LockFilter.from_strings(host="web1", pid="12", label="nightly", older_than="90m")
    assert lock_filter == LockFilter(host="web1", pid=12, label="nightly", older_than=5400)
    assert lock_filter.describe() == "host 'web1', pid 12, label 'nightly', older than 1 h 30 min"


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"host": ""}, "host", "is empty; give a value to match."),
        ({"label": " "}, "label", "is empty; give a value to match."),
        ({"pid": True}, "pid", "True is not a process id: give a whole number of at least 1."),
        ({"pid": 0}, "pid", "0 is not a process id: give a whole number of at least 1."),
        ({"pid": "12"}, "pid", "'12' is not a process id: give a whole number of at least 1."),
        ({"older_than": -1.0}, "older_than", "-1.0 is not a duration: give seconds, at least 0."),
        (
            {"older_than": math.nan},
            "older_than",
            "nan is not a duration: give seconds, at least 0.",
        ),
        ({"older_than": "10m"}, "older_than", "'10m' is not a duration: give seconds, at least 0."),
        ({"host": 3}, "host", "must be text, not int."),
    ],
)
def test_bad_filter_value_is_refused_naming_the_filter(
    fields: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises(FilterError) as raised:
        LockFilter(**fields)
    assert (raised.value.field, raised.value.problem) == (field, problem)
    assert str(raised.value) == f"{field}: {problem}"


@pytest.mark.parametrize("pid", ["abc", "-3", "4.0", "²", "12345678901", ""])
def test_pid_text_must_be_a_whole_number(pid: str) -> None:
    with pytest.raises(FilterError) as raised:
        LockFilter.from_strings(pid=pid)
    assert raised.value.field == "pid"


# -- resetting what was listed -----------------------------------------------------------


@pytest.fixture
def handles() -> Iterator[list[Mutex]]:
    """Handles a test acquires; whatever is still held at the end is released."""
    taken: list[Mutex] = []
    yield taken
    for handle in taken:
        with contextlib.suppress(LockError):
            handle.release()


def take(handles: list[Mutex], name: str, **options: Any) -> Mutex:
    lock = Mutex(name, watchdog=False, **options)
    assert lock.acquire(blocking=False)
    handles.append(lock)
    return lock


def test_listed_lock_carries_the_token_of_its_holder_but_never_shows_it(
    handles: list[Mutex],
) -> None:
    lock = take(handles, "report")
    [listed] = listed_locks()
    [held_now] = held_locks()
    # time_left moves between two reads; the acquisition is the same.
    assert (listed.held.name, listed.held.fence, listed.held.owner) == (
        held_now.name,
        held_now.fence,
        held_now.owner,
    )
    assert listed.token == lock.token
    assert lock.token not in repr(listed)


def test_reset_listed_releases_the_listed_holder(handles: list[Mutex]) -> None:
    lock = take(handles, "report")
    [listed] = listed_locks()
    assert reset_listed(listed) is True
    assert held_locks() == []
    assert not lock.owned()


def test_reset_listed_leaves_a_lock_that_changed_hands(handles: list[Mutex]) -> None:
    first = take(handles, "report")
    [listed] = listed_locks()
    first.release()
    second = take(handles, "report")
    assert reset_listed(listed) is False
    assert second.owned()


def test_reset_listed_hands_the_lock_to_the_first_waiter(handles: list[Mutex]) -> None:
    take(handles, "report")
    [listed] = listed_locks()
    waiter = Mutex("report", timeout=10, watchdog=False)
    got = threading.Event()
    thread = threading.Thread(target=lambda: waiter.acquire() and got.set())
    thread.start()
    wait_until(lambda: held_locks()[0].waiters == 1, what="the waiter to queue")
    assert reset_listed(listed) is True
    assert got.wait(5)
    thread.join(5)
    handles.append(waiter)
    assert waiter.owned()


@pytest.fixture
def quorum(settings: Any) -> str:
    """Add masters m1..m3 on the session Redis (each its own KEY_PREFIX) and quorum alias q."""
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        **{alias: {**default, "KEY_PREFIX": alias} for alias in ("m1", "m2", "m3")},
        "q": {**default, "MUTEX": {**default["MUTEX"], "QUORUM": ["m1", "m2", "m3"]}},
    }
    return "q"


def test_reset_listed_on_a_quorum_releases_on_every_master(
    quorum: str, handles: list[Mutex]
) -> None:
    take(handles, "report", using=quorum)
    [listed] = listed_locks(quorum)
    assert listed.held.masters == 3
    assert reset_listed(listed, quorum) is True
    assert [held_locks(alias) for alias in ("m1", "m2", "m3")] == [[], [], []]


def test_reset_listed_on_a_quorum_leaves_a_lock_that_changed_hands(
    quorum: str, handles: list[Mutex]
) -> None:
    first = take(handles, "report", using=quorum)
    [listed] = listed_locks(quorum)
    first.release()
    second = take(handles, "report", using=quorum)
    assert reset_listed(listed, quorum) is False
    assert [h.masters for h in held_locks(quorum)] == [3]
    assert second.owned()


def test_reset_listed_on_a_quorum_with_a_majority_down_fails_naming_them(
    quorum: str, handles: list[Mutex]
) -> None:
    lock = take(handles, "report", using=quorum)
    [listed] = listed_locks(quorum)
    caches = copy.deepcopy(django_settings.CACHES)
    for alias in ("m2", "m3"):
        caches[alias]["LOCATION"] = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(CACHES=caches), pytest.raises(LockBackendUnavailable) as raised:
        reset_listed(listed, quorum)
    assert "2 of 3 Redis masters could not be reached (m2: " in str(raised.value)
    assert "Nothing was reported as released" in str(raised.value)
    # m1 was reset; m2 and m3 were never reached and still hold it: a majority.
    assert held_locks("m1") == []
    assert [h.name for h in held_locks("m2")] == ["report"]
    assert lock.owned()


def test_reset_listed_through_a_quorum_member_is_refused(quorum: str, handles: list[Mutex]) -> None:
    take(handles, "report", using="m1")
    [listed] = listed_locks("m1")
    with pytest.raises(ValueError, match="member of quorum 'q'"):
        reset_listed(listed, "m1")
    assert [h.name for h in held_locks("m1")] == ["report"]
