"""Bad input fails loudly, naming the problem; odd names stay contained.

A wrong type is a TypeError, a wrong value a ValueError, a wrong setting
ImproperlyConfigured (and a system check error). Names full of glob, brace or
whitespace characters are still just names: each locks exactly itself, inside
this app's namespace and its Redis Cluster slot.

The first half pins individual behaviours; the second walks the input space
as tables, one per kind of input (names, ttl and timeout values on every
surface that takes them, cache aliases, and the ``locks`` command in-process
and as a real subprocess), so a gap shows up as a missing or failing row. Each
row either fails with a typed error whose message names the problem, leaving
the lock namespace empty, or yields a lock that stays where it belongs.
"""

from __future__ import annotations

import copy
import io
import math
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.conf import settings as django_settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.test import override_settings
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from redis.crc import key_slot

from django_redis_mutex import (
    LockBackendUnavailable,
    LockContended,
    LockError,
    LockLost,
    LockNotOwned,
    LockNotReplicated,
    LockUpgradeRefused,
    Mutex,
    Owner,
    Semaphore,
    StaleFence,
    held_locks,
    mutex,
    reset,
    reset_all,
    semaphore,
    skip_if_locked,
)
from django_redis_mutex.testing import free_port

from .helpers import ROOT, caches_with, take_and_release, wait_until


def caches_plus(alias: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of settings.CACHES with one more alias."""
    caches = copy.deepcopy(settings.CACHES)
    caches[alias] = entry
    return caches


LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}

HOSTILE_NAMES = [
    "with space",
    "star*",
    "question?",
    "bracket[ab]",
    "brace{",
    "brace}",
    "{tag}",
    "}{",
    "percent%7B",
    "new\nline",
    "back\\slash",
    "*",
    "ünïcødé ✓",
]


# -- names ----------------------------------------------------------------------


def test_empty_name_is_a_value_error():
    with pytest.raises(ValueError, match="empty"):
        mutex("")
    with pytest.raises(ValueError, match="empty"):
        Mutex("")


@pytest.mark.parametrize("name", [None, 42, b"bytes", ["list"]])
def test_non_string_name_is_a_type_error(name):
    with pytest.raises(TypeError, match="string"):
        Mutex(name)


def test_non_string_non_callable_name_in_mutex_is_a_type_error():
    with pytest.raises(TypeError, match="string"):
        mutex(42)  # type: ignore[arg-type]


def test_overlong_name_is_a_value_error():
    with pytest.raises(ValueError, match="1024"):
        Mutex("x" * 1025)


def test_unencodable_name_is_a_value_error():
    with pytest.raises(ValueError, match="UTF-8"):
        Mutex("lone surrogate \ud800")


def test_callable_name_returning_non_string_is_a_type_error():
    @mutex(lambda order_id: order_id)
    def process(order_id: int) -> None:
        pytest.fail("the body must not run")

    with pytest.raises(TypeError, match="int"):
        process(5)


def test_template_missing_argument_is_decorated_fine_and_fails_at_call():
    @mutex("order:{missing}")
    def process(order_id: int) -> None:
        pytest.fail("the body must not run")

    with pytest.raises(ValueError, match=r"\{missing\}"):
        process(1)


def test_template_positional_placeholder_is_a_value_error():
    @mutex("order:{0}")
    def process(order_id: int) -> None:
        pytest.fail("the body must not run")

    with pytest.raises(ValueError, match="positional"):
        process(1)


def test_template_missing_attribute_is_a_value_error_naming_template():
    class Product:
        pk = 1

        @mutex("product:{self.sku}")
        def restock(self) -> None:
            pytest.fail("the body must not run")

    with pytest.raises(ValueError, match=r"product:\{self\.sku\}"):
        Product().restock()


def test_decorating_a_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        mutex("x")(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "build",
    [
        lambda: mutex("x", tiemout=3),
        lambda: semaphore("x", 2, tiemout=3),
        lambda: semaphore("x", 2, shared=True),
    ],
    ids=["mutex-typo", "semaphore-typo", "semaphore-shared"],
)
def test_an_unknown_keyword_is_refused_when_the_decorator_is_built(build: Any) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        build()


def test_skip_if_locked_is_not_a_with_block() -> None:
    with pytest.raises(TypeError, match="cannot be skipped"), skip_if_locked("x"):
        pytest.fail("the body must not run")


def test_callable_name_in_with_block_is_a_type_error():
    with pytest.raises(TypeError, match="callable"), mutex(lambda: "x"):
        pytest.fail("the body must not run")


# -- ttl, timeout, flags, label ------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1, -0.5, float("nan"), float("inf"), float("-inf")])
def test_unusable_ttl_is_a_value_error(ttl):
    with pytest.raises(ValueError, match="ttl"):
        mutex("x", ttl=ttl)
    with pytest.raises(ValueError, match="ttl"):
        Mutex("x", ttl=ttl)


@pytest.mark.parametrize("ttl", ["30", None, True, [30]])
def test_non_number_ttl_is_a_type_error(ttl):
    with pytest.raises(TypeError, match="ttl"):
        mutex("x", ttl=ttl)
    with pytest.raises(TypeError, match="ttl"):
        Mutex("x", ttl=ttl)


@pytest.mark.parametrize("timeout", [-1, -0.001, float("nan"), float("-inf")])
def test_negative_or_nan_timeout_is_a_value_error(timeout):
    with pytest.raises(ValueError, match="timeout"):
        mutex("x", timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        Mutex("x", timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        Mutex("x").acquire(timeout=timeout)


@pytest.mark.parametrize("timeout", ["10", True, b"1"])
def test_non_number_timeout_is_a_type_error(timeout):
    with pytest.raises(TypeError, match="timeout"):
        mutex("x", timeout=timeout)
    with pytest.raises(TypeError, match="timeout"):
        Mutex("x", timeout=timeout)


def test_infinite_timeout_means_wait_forever():
    assert Mutex("x", timeout=float("inf")).timeout is None


def test_blocking_false_with_timeout_fails_when_mutex_is_built():
    with pytest.raises(ValueError, match="blocking=False"):
        mutex("x", blocking=False, timeout=5)


def test_a_timeout_with_blocking_false_is_refused_with_one_message_everywhere():
    from django_redis_mutex import Semaphore, semaphore

    refusals = [
        lambda: mutex("x", blocking=False, timeout=5),
        lambda: Mutex("x", blocking=False, timeout=5),
        lambda: semaphore("x", 2, blocking=False, timeout=5),
        lambda: Semaphore("x", 2, blocking=False, timeout=5),
        lambda: Mutex("x").acquire(blocking=False, timeout=5),
        lambda: Semaphore("x", 2).acquire(blocking=False, timeout=5),
    ]
    messages = set()
    for refuse in refusals:
        with pytest.raises(ValueError) as refused:
            refuse()
        messages.add(str(refused.value))
    assert messages == {"A timeout cannot be given with blocking=False (it would never wait)."}
    # A timeout of None is no timeout given.
    assert Mutex("x", blocking=False, timeout=None).timeout is None


@pytest.mark.parametrize("option", ["blocking", "watchdog", "reentrant"])
def test_non_bool_flag_is_a_type_error(option):
    with pytest.raises(TypeError, match=option):
        Mutex("x", **{option: "yes"})


def test_non_string_label_is_a_type_error():
    with pytest.raises(TypeError, match="label"):
        Mutex("x", label=7)  # type: ignore[arg-type]


def test_extend_with_bad_ttl_is_a_value_error():
    with mutex("x") as lock, pytest.raises(ValueError, match="ttl"):
        lock.extend(0)


# -- cache aliases and settings -----------------------------------------------


def test_unknown_cache_alias_is_improperly_configured_naming_it():
    with pytest.raises(ImproperlyConfigured, match="'nope'"):
        Mutex("x", using="nope")
    with pytest.raises(ImproperlyConfigured, match="'nope'"), mutex("x", using="nope"):
        pytest.fail("the body must not run")


def test_non_string_alias_is_a_type_error():
    with pytest.raises(TypeError, match="alias"):
        Mutex("x", using=3)  # type: ignore[arg-type]


USING_ENTRY_POINTS = [
    pytest.param(lambda using: Mutex("x", using=using), id="Mutex"),
    pytest.param(lambda using: Semaphore("x", 2, using=using), id="Semaphore"),
    pytest.param(lambda using: held_locks(using=using), id="held_locks"),
    pytest.param(lambda using: reset("x", using=using), id="reset"),
]


@pytest.mark.parametrize("enter", USING_ENTRY_POINTS)
@pytest.mark.parametrize(
    ("using", "error", "message"),
    [
        ([], ValueError, "using must name at least one cache alias"),
        (["default", "default"], ValueError, "names a cache alias twice"),
        (["default", 3], TypeError, "must contain cache aliases"),
        (3, TypeError, "using must be a cache alias or a list of them, not int"),
        (None, TypeError, "using must be a cache alias or a list of them, not NoneType"),
    ],
    ids=["empty-list", "alias-twice", "not-an-alias", "int", "none"],
)
def test_every_entry_point_reads_using_alike(
    enter: Callable[[Any], object], using: Any, error: type[Exception], message: str, raw: Any
) -> None:
    # A lock, a listing and a reset must agree on where a name lives, so
    # they refuse the same bad `using` with the same words, touching nothing.
    before = sorted(raw.keys("*"))
    with pytest.raises(error, match=re.escape(message)):
        enter(using)
    assert sorted(raw.keys("*")) == before


def test_non_redis_cache_is_improperly_configured_naming_alias():
    with (
        override_settings(CACHES=caches_plus("local", LOCMEM)),
        pytest.raises(ImproperlyConfigured, match=r"'local'.*not a Redis cache"),
        mutex("x", using="local"),
    ):
        pytest.fail("the body must not run")


def test_unknown_mutex_key_is_improperly_configured_naming_key():
    with (
        override_settings(CACHES=caches_with(TTL_SECONDS=5)),
        pytest.raises(ImproperlyConfigured, match="TTL_SECONDS"),
    ):
        Mutex("x")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("TTL", 0),
        ("TTL", "30"),
        ("TTL", float("nan")),
        ("TIMEOUT", -1),
        ("TIMEOUT", "10"),
        ("BLOCKING", "yes"),
        ("WATCHDOG", 1),
        ("FAIL_OPEN", None),
        ("RAISE_ON_LOST", "no"),
        ("MAX_HOLD", 0),
        ("MAX_HOLD", "1h"),
        ("PREFIX", ""),
        ("PREFIX", "has space"),
        ("PREFIX", "glob*"),
        ("PREFIX", "{tag}"),
        ("PREFIX", "123"),
    ],
)
def test_bad_mutex_value_is_improperly_configured_naming_key(key, value):
    with (
        override_settings(CACHES=caches_with(**{key: value})),
        pytest.raises(ImproperlyConfigured, match=key),
    ):
        Mutex("x")


def test_mutex_block_that_is_not_a_dict_is_improperly_configured():
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"] = ["TTL", 5]
    with override_settings(CACHES=caches), pytest.raises(ImproperlyConfigured, match="dict"):
        Mutex("x")


def test_system_check_reports_bad_mutex_value():
    with override_settings(CACHES=caches_with(TTL=-1)):
        errors = [e for e in run_checks() if e.id.startswith("django_redis_mutex.")]
    assert [e.id for e in errors] == ["django_redis_mutex.E002"]
    assert "TTL" in errors[0].msg


def test_system_check_reports_unknown_mutex_key():
    with override_settings(CACHES=caches_with(TTL_SECONDS=5)):
        errors = [e for e in run_checks() if e.id.startswith("django_redis_mutex.")]
    assert [e.id for e in errors] == ["django_redis_mutex.E002"]
    assert "TTL_SECONDS" in errors[0].msg


def test_system_check_reports_mutex_block_on_non_redis_cache():
    with override_settings(CACHES=caches_plus("local", {**LOCMEM, "MUTEX": {}})):
        errors = [e for e in run_checks() if e.id.startswith("django_redis_mutex.")]
    assert [e.id for e in errors] == ["django_redis_mutex.E001"]
    assert "'local'" in errors[0].msg


def test_system_check_reports_quorum_members_that_are_missing_or_not_redis():
    caches = caches_plus("local", {**LOCMEM})
    caches["default"]["MUTEX"] = {
        **caches["default"]["MUTEX"],
        "QUORUM": ["default", "local", "gone"],
    }
    with override_settings(CACHES=caches):
        errors = [e for e in run_checks() if e.id.startswith("django_redis_mutex.")]
    assert [e.id for e in errors] == ["django_redis_mutex.E003"] * 2
    assert "'local'" in errors[0].msg and "not a Redis cache" in errors[0].msg
    assert "'gone'" in errors[1].msg and "not configured" in errors[1].msg


def test_system_check_warns_about_a_lower_case_mutex_key():
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["mutex"] = {"TTL": 5}
    with override_settings(CACHES=caches):
        messages = [e for e in run_checks() if e.id.startswith("django_redis_mutex.")]
    assert [e.id for e in messages] == ["django_redis_mutex.W001"]
    assert "'mutex'" in messages[0].msg


def test_check_command_fails_on_bad_settings():
    with (
        override_settings(CACHES=caches_with(BLOCKING="sometimes")),
        pytest.raises(SystemCheckError, match=r"django_redis_mutex\.E002"),
    ):
        call_command("check")


def test_system_check_passes_on_good_settings():
    assert [e for e in run_checks() if e.id.startswith("django_redis_mutex.")] == []


# -- hostile names ----------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_name_locks_exactly_that_name(name):
    with mutex(name) as lock:
        assert lock.name == name
        assert [h.name for h in held_locks()] == [name]
        assert Mutex(name).locked()
    assert not Mutex(name).locked()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_name_keys_stay_in_namespace(name, raw, mutex_prefix):
    before = set(raw.scan_iter(match="*"))
    with mutex(name):
        written = set(raw.scan_iter(match="*")) - before
    assert written, "the lock wrote no key"
    assert all(k.startswith(f"tests:{mutex_prefix}:".encode()) for k in written)


def test_hostile_waiter_keys_stay_in_namespace(raw, mutex_prefix):
    name = "*{x}?\n"
    before = set(raw.scan_iter(match="*"))
    with mutex(name):
        thread = threading.Thread(target=take_and_release, args=(Mutex(name, timeout=10),))
        thread.start()
        assert wait_until(lambda: held_locks()[0].waiters == 1)
        written = set(raw.scan_iter(match="*")) - before
    thread.join(5)
    assert len(written) == 4  # lock, fence, queue, waiting
    assert all(k.startswith(f"tests:{mutex_prefix}:".encode()) for k in written)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("a*", "ab"),
        ("a?", "ab"),
        ("a[b]", "ab"),
        ("a b", "ab"),
        ("a{", "a%7B"),
        ("a}", "a%7D"),
        ("a%", "a%25"),
        ("a\nb", "ab"),
        ("{a}", "a"),
    ],
)
def test_names_differing_by_special_characters_are_distinct_locks(first, second):
    with mutex(first, blocking=False), mutex(second, blocking=False):
        assert sorted(h.name for h in held_locks()) == sorted([first, second])


def test_reset_of_glob_name_leaves_matching_names_alone():
    others = [Mutex(n, watchdog=False) for n in ("ab", "abc", "a")]
    for lock in others:
        assert lock.acquire()
    assert reset("a*") is False
    assert all(lock.owned() for lock in others)


def test_reset_all_counts_hostile_names_once_each():
    locks = [Mutex(n, watchdog=False) for n in HOSTILE_NAMES]
    for lock in locks:
        assert lock.acquire()
    assert reset_all() == len(HOSTILE_NAMES)
    assert held_locks() == []


# == the tables ======================================================================


@dataclass(frozen=True)
class Fails:
    """A row's verdict: this exception, with a message matching ``match``."""

    exc: type[BaseException]
    match: str


@dataclass(frozen=True)
class Works:
    """A row's verdict: accepted, normalised to ``value``."""

    value: Any = None


def row(case_id: str, *values: Any) -> Any:
    return pytest.param(*values, id=case_id)


def lock_keys_in(raw: redis.Redis, namespace: str) -> list[bytes]:
    """Return every key under ``namespace`` (escaped for SCAN: prefixes are plain)."""
    return sorted(raw.scan_iter(match=f"{namespace}:*"))


def assert_one_slot(keys: list[bytes]) -> None:
    slots = {key_slot(k) for k in keys}
    assert len(slots) == 1, f"keys of one lock span slots {slots}: {keys!r}"


# -- names -------------------------------------------------------------------

NAME_ROWS = [
    row("empty", "", Fails(ValueError, "must not be empty")),
    row("1024-chars", "n" * 1024, Works()),
    row("1025-chars", "n" * 1025, Fails(ValueError, "1025 characters long; the limit is 1024")),
    row("emoji", "lock 🔒🚀👩‍👩‍👧", Works()),
    row("rtl-hebrew", "שלום עולם", Works()),
    row("rtl-override", "\u202eevil\u202c", Works()),
    row("combining-marks", "e\u0301\u0302\u0303", Works()),
    row("nul", "\x00", Works()),
    row("nul-inside", "a\x00b", Works()),
    row("del", "\x7f", Works()),
    row("lone-surrogate", "x\ud800", Fails(ValueError, "cannot be encoded as UTF-8")),
    row("glob-all", "*?[]\\", Works()),
    row("glob-star", "*", Works()),
    row("glob-class", "[a-z]", Works()),
    row("backslash", "\\", Works()),
    row("open-brace", "{", Works()),
    row("close-brace", "}", Works()),
    row("empty-tag", "{}", Works()),
    row("inverted-braces", "a}b{c", Works()),
    row("escaped-brace-literal", "%7B", Works()),
    row("percent", "%", Works()),
    row("newline", "\n", Works()),
    row("crlf-inside", "a\r\nb", Works()),
    row("tab", "\t", Works()),
    row("space", " ", Works()),
    row("padded", "  padded  ", Works()),
    row("none", None, Fails(TypeError, "must be a string, not NoneType")),
    row("int", 1, Fails(TypeError, "must be a string, not int")),
    row("bytes", b"x", Fails(TypeError, "must be a string, not bytes")),
    row("list", ["a"], Fails(TypeError, "must be a string, not list")),
]


@pytest.mark.parametrize(("name", "verdict"), NAME_ROWS)
def test_name_row(name: Any, verdict: Fails | Works, raw: redis.Redis, mutex_prefix: str) -> None:
    """Reject a bad name on both constructors, or lock exactly that name in one slot."""
    namespace = f"tests:{mutex_prefix}"
    if isinstance(verdict, Fails):
        with pytest.raises(verdict.exc, match=verdict.match):
            Mutex(name)
        with pytest.raises(verdict.exc, match=verdict.match):
            mutex(name)
        assert lock_keys_in(raw, namespace) == []
        return
    before = set(raw.scan_iter(match="*"))
    lock = Mutex(name, watchdog=False)
    assert lock.acquire(blocking=False)
    try:
        written = sorted(set(raw.scan_iter(match="*")) - before)
        assert written, "the lock wrote no key"
        assert all(k.startswith(f"{namespace}:".encode()) for k in written), written
        assert_one_slot(written)
        assert [h.name for h in held_locks()] == [name]
    finally:
        lock.release()
    assert raw.exists(lock.keys.lock) == 0
    assert held_locks() == []


# -- ttl and timeout ------------------------------------------------------------

NAN = float("nan")
INF = float("inf")

TTL_ROWS = [
    row("ttl-0", 0, Fails(ValueError, "at least 0.001")),
    row("ttl-neg", -1, Fails(ValueError, "at least 0.001")),
    row("ttl-nan", NAN, Fails(ValueError, "finite")),
    row("ttl-inf", INF, Fails(ValueError, "finite")),
    row("ttl-1e12", 1e12, Fails(ValueError, "at most")),
    row("ttl-str", "5", Fails(TypeError, "number of seconds, not str")),
    row("ttl-bool", True, Fails(TypeError, "number of seconds, not bool")),
    row("ttl-none", None, Fails(TypeError, "number of seconds, not NoneType")),
    row("ttl-sub-ms", 0.0005, Fails(ValueError, "at least 0.001")),
    row("ttl-1ms", 0.001, Works(0.001)),
    row("ttl-int", 5, Works(5.0)),
]

TIMEOUT_ROWS = [
    row("timeout-0", 0, Works(0.0)),
    row("timeout-neg", -1, Fails(ValueError, "must not be negative")),
    row("timeout-nan", NAN, Fails(ValueError, "not NaN")),
    row("timeout-inf", INF, Works(None)),
    row("timeout-1e12", 1e12, Works(1e12)),
    row("timeout-str", "5", Fails(TypeError, "number of seconds or None, not str")),
    row("timeout-bool", True, Fails(TypeError, "number of seconds or None, not bool")),
    row("timeout-none", None, Works(None)),
    row("timeout-sub-ms", 0.0005, Works(0.0005)),
]

# (option name for Mutex/mutex, key in the MUTEX block, value, verdict)
OPTION_ROWS = [pytest.param("ttl", "TTL", *p.values, id=p.id) for p in TTL_ROWS] + [
    pytest.param("timeout", "TIMEOUT", *p.values, id=p.id) for p in TIMEOUT_ROWS
]


def lock_value(lock: Mutex, option: str) -> Any:
    return lock.lease if option == "ttl" else lock.timeout


# A lease this short can run out between two lines of a test, so a row below it
# is proven by the lease lapsing on its own rather than by listing the lock.
LAPSING_LEASE = 0.05


def lapses(option: str, verdict: Works) -> bool:
    return option == "ttl" and verdict.value < LAPSING_LEASE


def name_is_free_once_the_lease_lapses() -> None:
    """Another owner takes "x" with nobody releasing it: the short lease was used."""
    other = Mutex("x", timeout=5, reentrant=False, watchdog=False)
    assert other.acquire()
    other.release()


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual)
    else:
        assert actual == expected


@pytest.mark.parametrize(("option", "key", "value", "verdict"), OPTION_ROWS)
def test_option_row_on_mutex_class(
    option: str, key: str, value: Any, verdict: Fails | Works, namespace_keys: Any
) -> None:
    """Reject a bad ttl/timeout given to Mutex(...), or take it as the lock's own value."""
    if isinstance(verdict, Fails):
        with pytest.raises(verdict.exc, match=verdict.match) as info:
            Mutex("x", **{option: value})
        assert str(info.value).startswith(option)
        assert namespace_keys() == []
        return
    lock = Mutex("x", watchdog=False, **{option: value})
    assert_same(lock_value(lock, option), verdict.value)
    assert lock.acquire()
    if lapses(option, verdict):
        name_is_free_once_the_lease_lapses()
        with pytest.raises(LockNotOwned):
            lock.release()
    else:
        assert [h.name for h in held_locks()] == ["x"]
        lock.release()
    assert held_locks() == []


@pytest.mark.parametrize(("option", "key", "value", "verdict"), OPTION_ROWS)
def test_option_row_on_mutex_function(
    option: str, key: str, value: Any, verdict: Fails | Works, namespace_keys: Any
) -> None:
    """Reject a bad ttl/timeout when mutex(...) is built, before any lock exists."""
    if isinstance(verdict, Fails):
        with pytest.raises(verdict.exc, match=verdict.match) as info:
            mutex("x", **{option: value})
        assert str(info.value).startswith(option)
        assert namespace_keys() == []
        return
    if lapses(option, verdict):
        with pytest.raises(LockLost), mutex("x", watchdog=False, **{option: value}) as lock:
            assert_same(lock_value(lock, option), verdict.value)
            name_is_free_once_the_lease_lapses()
    else:
        with mutex("x", watchdog=False, **{option: value}) as lock:
            assert_same(lock_value(lock, option), verdict.value)
            assert [h.name for h in held_locks()] == ["x"]
    assert held_locks() == []


@pytest.mark.parametrize(("option", "key", "value", "verdict"), OPTION_ROWS)
def test_option_row_in_settings_block(
    option: str, key: str, value: Any, verdict: Fails | Works, namespace_keys: Any
) -> None:
    """Reject a bad TTL/TIMEOUT setting as ImproperlyConfigured naming the key, or use it."""
    with override_settings(CACHES=caches_with(**{key: value})):
        if isinstance(verdict, Fails):
            with pytest.raises(ImproperlyConfigured, match=rf"\['{key}'\] .*{verdict.match}"):
                Mutex("x")
            assert namespace_keys() == []
            return
        lock = Mutex("x", watchdog=False)
        assert_same(lock_value(lock, option), verdict.value)
        assert lock.acquire()
        if lapses(option, verdict):
            name_is_free_once_the_lease_lapses()
            with pytest.raises(LockNotOwned):
                lock.release()
        else:
            lock.release()
    assert held_locks() == []


@pytest.mark.parametrize("timeout", [0, 0.0005], ids=["timeout-0", "timeout-sub-ms"])
def test_tiny_timeout_on_held_lock_gives_up_at_once(timeout: float) -> None:
    with mutex("x", watchdog=False):
        started = time.monotonic()
        assert Mutex("x", timeout=timeout, reentrant=False).acquire() is False
        assert time.monotonic() - started < 1.0


# -- cache aliases ------------------------------------------------------------------


def caches_with_alias(kind: str) -> dict[str, Any]:
    """Return settings.CACHES plus the alias a row names ("nope" stays missing)."""
    caches = copy.deepcopy(django_settings.CACHES)
    if kind == "local":
        caches["local"] = dict(LOCMEM)
    elif kind == "down":
        caches["down"] = {
            **caches["default"],
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
        }
    return caches


ALIAS_ROWS = [
    row("missing", "nope", Fails(ImproperlyConfigured, r"Cache alias 'nope' is not configured")),
    row(
        "locmem",
        "local",
        Fails(ImproperlyConfigured, r"Cache alias 'local' uses BACKEND .*not a Redis cache"),
    ),
    row(
        "redis-down",
        "down",
        Fails(LockBackendUnavailable, r"Redis for cache 'down' is unavailable"),
    ),
]


def _acquire(alias: str) -> object:
    return Mutex("x", using=alias).acquire()


def _with_block(alias: str) -> object:
    with mutex("x", using=alias):
        pytest.fail("the body must not run")
    return None


ALIAS_OPERATIONS: list[Any] = [
    pytest.param(_acquire, id="Mutex.acquire"),
    pytest.param(_with_block, id="with-mutex"),
    pytest.param(lambda alias: held_locks(using=alias), id="held_locks"),
    pytest.param(lambda alias: reset("x", using=alias), id="reset"),
    pytest.param(lambda alias: reset_all(using=alias), id="reset_all"),
]


@pytest.mark.parametrize("operation", ALIAS_OPERATIONS)
@pytest.mark.parametrize(("alias", "verdict"), ALIAS_ROWS)
def test_alias_row(
    alias: str, verdict: Fails, operation: Callable[[str], object], namespace_keys: Any
) -> None:
    """Fail with the app's own error naming the alias, never a raw redis-py error."""
    with (
        override_settings(CACHES=caches_with_alias(alias)),
        pytest.raises(verdict.exc, match=verdict.match) as info,
    ):
        operation(alias)
    assert not isinstance(info.value, redis.RedisError)
    assert namespace_keys() == []


# -- manage.py locks ------------------------------------------------------------------


def locks(*args: str) -> str:
    out = io.StringIO()
    call_command("locks", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


COMMAND_ERROR_ROWS = [
    row("unknown-alias", ["--using", "nope"], r"Cache alias 'nope' is not configured"),
    row("locmem-alias", ["--using", "local"], r"'local' uses BACKEND .*not a Redis cache"),
    row("redis-down", ["--using", "down"], r"Redis for cache 'down' is unavailable: "),
    row("reset-empty-name", ["--reset", ""], r"Lock name must not be empty"),
    row(
        "reset-surrogate-name",
        ["--reset", "x\ud800"],
        r"cannot be encoded as UTF-8",
    ),
]


@pytest.mark.parametrize(("args", "match"), COMMAND_ERROR_ROWS)
def test_locks_command_error_row_in_process(
    args: list[str], match: str, namespace_keys: Any
) -> None:
    """Turn every bad argument into a CommandError naming the problem."""
    caches = caches_with_alias("local")
    caches.update({k: v for k, v in caches_with_alias("down").items() if k == "down"})
    with override_settings(CACHES=caches), pytest.raises(CommandError, match=match):
        locks(*args)
    assert namespace_keys() == []


def test_locks_command_conflicting_flags_in_process_is_a_command_error(
    namespace_keys: Any,
) -> None:
    with pytest.raises(CommandError, match="--reset-all: not allowed with argument --reset"):
        locks("--reset", "a", "--reset-all", "--noinput")
    assert namespace_keys() == []


def test_locks_command_reset_all_on_empty_namespace_reports_zero() -> None:
    assert locks("--reset-all", "--noinput") == "Released 0 locks in cache 'default'.\n"


@pytest.fixture
def glob_and_plain_held() -> Iterator[tuple[Mutex, Mutex]]:
    star, plain = Mutex("a*", watchdog=False), Mutex("abc", watchdog=False)
    assert star.acquire(blocking=False)
    assert plain.acquire(blocking=False)
    yield star, plain
    reset_all()


def test_locks_command_reset_of_glob_name_releases_only_that_name(
    glob_and_plain_held: tuple[Mutex, Mutex],
) -> None:
    assert locks("--reset", "a*") == "Released 'a*'.\n"
    assert [h.name for h in held_locks()] == ["abc"]
    star, plain = glob_and_plain_held
    assert not star.owned()
    assert plain.owned()


# The locks command as an operator runs it: a real process, real argv, real exit code.


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Return a runner of ``python -m django locks ...`` with a "local" and a "down" alias."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    (tmp_path / "bad_input_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        "CACHES = {\n"
        "    **CACHES,  # noqa: F405\n"
        f"    'local': {LOCMEM!r},\n"
        f"    'down': {{**CACHES['default'], 'LOCATION': {dead!r}}},  # noqa: F405\n"
        "}\n"
    )
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="bad_input_settings",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "django", "locks", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


CLI_ERROR_ROWS = [p for p in COMMAND_ERROR_ROWS if p.id != "reset-surrogate-name"]


@pytest.mark.parametrize(("args", "match"), CLI_ERROR_ROWS)
def test_locks_cli_error_row_is_one_line_exit_1(
    args: list[str], match: str, cli: Any, namespace_keys: Any
) -> None:
    """Print one ``CommandError:`` line on stderr, nothing on stdout, exit 1, no traceback."""
    result = cli(*args)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("CommandError: ")
    assert re.search(match, line), line
    assert namespace_keys() == []


def test_locks_cli_conflicting_flags_is_a_usage_error_without_traceback(
    cli: Any, namespace_keys: Any
) -> None:
    """Reject conflicting flags the argparse way: usage, one error line, exit 2."""
    result = cli("--reset", "a", "--reset-all", "--noinput")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [ln for ln in result.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1
    assert "--reset-all: not allowed with argument --reset" in errors[0]
    assert namespace_keys() == []


def test_locks_cli_reset_all_noinput_on_empty_namespace_prints_zero(cli: Any) -> None:
    result = cli("--reset-all", "--noinput")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Released 0 locks in cache 'default'.\n"


def test_locks_cli_reset_of_glob_name_releases_only_that_name(
    glob_and_plain_held: tuple[Mutex, Mutex], cli: Any
) -> None:
    result = cli("--reset", "a*")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Released 'a*'.\n"
    assert [h.name for h in held_locks()] == ["abc"]
    star, plain = glob_and_plain_held
    assert not star.owned()
    assert plain.owned()


# -- property: any name is just a name --------------------------------------------------

NAMES = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)


def keys_of(raw: redis.Redis, lock: Mutex) -> list[bytes]:
    """Return the keys belonging to ``lock`` (its escaped ``{name}`` tag is unique)."""
    lock_key = lock.keys.lock
    return sorted(raw.scan_iter(match=_glob_literal(lock_key) + "*"))


def _glob_literal(text: str) -> str:
    return text.translate(str.maketrans({c: "\\" + c for c in "*?[]\\"}))


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(first=NAMES, second=NAMES)
def test_any_two_names_are_independent_contained_locks(
    first: str, second: str, raw: redis.Redis, mutex_prefix: str
) -> None:
    assume(first != second)
    namespace = f"tests:{mutex_prefix}:".encode()
    before = set(raw.scan_iter(match="*"))
    one = Mutex(first, watchdog=False)
    two = Mutex(second, watchdog=False)
    assert one.acquire(blocking=False)
    try:
        assert [h.name for h in held_locks()] == [first]
        assert two.acquire(blocking=False), f"{first!r} blocked {second!r}"
        try:
            assert sorted(h.name for h in held_locks()) == sorted([first, second])
            for lock in (one, two):
                keys = keys_of(raw, lock)
                assert lock.keys.lock.encode() in keys
                assert all(k.startswith(namespace) for k in keys)
                assert_one_slot(keys)
            written = set(raw.scan_iter(match="*")) - before
            assert all(k.startswith(namespace) for k in written)
        finally:
            two.release()
    finally:
        one.release()
    assert raw.exists(one.keys.lock, two.keys.lock) == 0
    assert held_locks() == []


# -- Every key of one lock hashes to one Redis Cluster slot, whatever the name. ----


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
            lock.keys.waiting,
            lock.keys.wake_prefix + (lock.token or ""),
        ]
    waiter.join(5)
    assert len(stored) == 4  # lock, fence, queue, waiting
    slots = {key_slot(k) for k in stored} | {key_slot(k.encode()) for k in named}
    assert len(slots) == 1


@pytest.mark.parametrize(
    "error",
    [
        LockContended("orders", retry_after=3, owner=Owner(host="web1", pid=7), waited=1.5),
        LockLost("lost it", name="orders"),
        LockNotOwned("not ours", name="orders"),
        LockBackendUnavailable("down", name="orders"),
        LockNotReplicated("orders", alias="default", acknowledged=0, required=2, timeout=0.5),
        LockUpgradeRefused("no upgrade", name="orders"),
        StaleFence("orders", fence=5, current=9, target="row 1"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_every_lock_error_survives_pickling_with_its_message_and_fields(error: LockError) -> None:
    # Celery result backends and multiprocessing pools pickle a task's exception.
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert vars(restored) == vars(error)
