"""Bad arguments and bad settings fail loudly, naming the problem; odd names stay contained.

A wrong type is a TypeError, a wrong value a ValueError, a wrong setting
ImproperlyConfigured (and a system check error). Names full of glob, brace or
whitespace characters are still just names: each locks exactly itself, inside
this app's namespace.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_redis_mutex import Mutex, held_locks, mutex, reset, reset_all

from .conftest import caches_with, wait_until


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


def take_and_release(lock: Mutex) -> None:
    """Wait for ``lock`` as a queued waiter, then let it go (so no hold outlives the test)."""
    if lock.acquire():
        lock.release()


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
    assert len(written) == 5  # lock, fence, queue, leases, waiting
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
