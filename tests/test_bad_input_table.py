"""Bad input, tried systematically: one table per kind of input, every row a verdict.

tests/test_bad_input.py pins individual behaviours; this module walks the
input space row by row (names, ttl and timeout values on every surface that
takes them, cache aliases, and the ``locks`` command in-process and as a real
subprocess) so a gap shows up as a missing or failing row. Each row either
fails with a typed error whose message names the problem, leaving the lock
namespace empty, or yields a lock that stays inside its namespace and its
Redis Cluster slot.
"""

from __future__ import annotations

import copy
import io
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from redis.crc import key_slot

from django_redis_mutex import Mutex, held_locks, mutex, reset, reset_all
from django_redis_mutex.exceptions import LockBackendUnavailable, LockLost, LockNotOwned
from django_redis_mutex.testing import free_port

from .conftest import ROOT, caches_with

LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


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
