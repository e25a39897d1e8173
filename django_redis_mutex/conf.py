"""Read and validate the ``MUTEX`` block of a ``settings.CACHES`` entry.

The defaults live here and nowhere else. Settings are read when a lock is
built, never at import time, and the parsed result is cached per alias until
Django reports that ``CACHES`` changed (so ``override_settings`` works).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypedDict, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

__all__ = [
    "DEFAULT",
    "DEFAULTS",
    "LockOptions",
    "MutexSettings",
    "check_bounds",
    "get_settings",
    "refuse_timeout_without_blocking",
    "validate_flag",
    "validate_timeout",
    "validate_ttl",
]


T = TypeVar("T", int, float)


class _Default:
    """Sentinel: take the value from the alias's MUTEX settings."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


class LockOptions(TypedDict, total=False):
    """The keyword arguments of ``Mutex``, ``mutex()``, ``Semaphore`` and ``semaphore()``.

    Each is described on :class:`~django_redis_mutex.Mutex`; one left out
    takes the cache alias's ``MUTEX`` default.
    """

    using: str | Sequence[str]
    ttl: float
    timeout: float | None
    blocking: bool
    watchdog: bool
    reentrant: bool
    label: str | None
    release_at_block_end: bool


DEFAULTS: dict[str, Any] = {
    "TTL": 30,
    "TIMEOUT": 10,
    "BLOCKING": True,
    "WATCHDOG": True,
    "PREFIX": "mutex",
    "FAIL_OPEN": False,
    "RAISE_ON_LOST": True,
    "MAX_HOLD": None,
    "QUORUM": None,
    # The deadline of one request to one master of a quorum lock: small
    # against the TTL, so a master that hangs costs the others nothing.
    "QUORUM_TIMEOUT": 0.05,
    "CLUSTER": False,
    # OpenTelemetry spans and metrics for this alias's locks (see telemetry.py);
    # lock names become attributes only when asked, as they may be many or private.
    "TELEMETRY": False,
    "TELEMETRY_NAMES": False,
    # An acquisition succeeds only once this many replicas acknowledged its
    # write (Redis WAIT), within WAIT_TIMEOUT seconds; 0 turns it off.
    "WAIT_REPLICAS": 0,
    "WAIT_TIMEOUT": 1.0,
    # Refuse to lock on a Redis that may evict keys (maxmemory with a policy
    # other than noeviction), or whose policy cannot be read (see eviction.py).
    "REQUIRE_NOEVICTION": False,
    # Contention figures per lock class, counted in memory and written to Redis
    # from a background thread once per STATS_FLUSH_INTERVAL seconds (see stats.py).
    "STATS": False,
    "STATS_FLUSH_INTERVAL": 10,
    # Seconds a wait lasts before it looks for a cycle of waits through it
    # (see deadlock.py); None turns deadlock detection off.
    "DEADLOCK_TIMEOUT": 1.0,
}

# The shortest and longest STATS_FLUSH_INTERVAL: more often than twice a second
# is a Redis round trip per process for nothing; the figures are kept an hour.
STATS_FLUSH_BOUNDS = (0.5, 600.0)

# A lease longer than a year is a bug in the caller, not a lock.
MAX_TTL = 365 * 24 * 3600  # seconds (a year)
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")


@dataclass(frozen=True)
class MutexSettings:
    """The lock defaults of one cache alias, validated."""

    alias: str
    ttl: float
    timeout: float | None
    blocking: bool
    watchdog: bool
    prefix: str
    fail_open: bool
    raise_on_lost: bool
    max_hold: float | None
    quorum: tuple[str, ...] | None = None
    quorum_timeout: float = 0.05
    cluster: bool = False
    telemetry: bool = False
    telemetry_names: bool = False
    wait_replicas: int = 0
    wait_timeout: float = 1.0
    require_noeviction: bool = False
    stats: bool = False
    stats_flush_interval: float = 10.0
    deadlock_timeout: float | None = 1.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_ttl(value: object, *, what: str = "ttl") -> float:
    """Return ``value`` as seconds if it is a usable lease length, else raise."""
    if not _is_number(value):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}.")
    ttl = float(value)  # type: ignore[arg-type]
    if math.isnan(ttl) or math.isinf(ttl):
        raise ValueError(f"{what} must be a finite number of seconds, not {ttl}.")
    return check_bounds(what, ttl, 0.001, MAX_TTL, value, " seconds")


def check_bounds(what: str, value: T, low: float, high: float, given: object, unit: str = "") -> T:
    """Return ``value`` if it lies within ``low`` and ``high``, else raise a ValueError."""
    if value < low:
        raise ValueError(f"{what} must be at least {low}{unit}, got {given!r}.")
    if value > high:
        raise ValueError(f"{what} must be at most {high}{unit}, got {given!r}.")
    return value


def validate_flag(what: str, value: object) -> bool:
    """Return ``value`` if it is True or False, else raise TypeError naming ``what``."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {type(value).__name__}.")
    return value


def refuse_timeout_without_blocking(blocking: object, timeout: object) -> None:
    """Raise when a timeout is given with ``blocking=False``: one of them is a mistake.

    ``timeout=None`` (or left out) is not a timeout given.
    """
    if blocking is False and timeout is not None and timeout is not DEFAULT:
        raise ValueError("A timeout cannot be given with blocking=False (it would never wait).")


def validate_timeout(value: object, *, what: str = "timeout") -> float | None:
    """Return seconds to wait (``None`` for forever) or raise on a bad value."""
    if value is None:
        return None
    if not _is_number(value):
        raise TypeError(f"{what} must be a number of seconds or None, not {type(value).__name__}.")
    timeout = float(value)  # type: ignore[arg-type]
    if math.isnan(timeout):
        raise ValueError(f"{what} must be a number of seconds or None, not NaN.")
    if timeout < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}.")
    if math.isinf(timeout):
        return None
    return timeout


def _validate_bool(alias: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX'][{key!r}] must be True or False, got {value!r}."
        )
    return value


def _wrap(alias: str, key: str, check: Any, value: object) -> Any:
    try:
        return check(value, what=f"CACHES[{alias!r}]['MUTEX'][{key!r}]")
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(str(exc)) from exc


def validate_prefix(alias: str, prefix: object) -> str:
    """Check PREFIX can be used as the first part of every lock key."""
    where = f"CACHES[{alias!r}]['MUTEX']['PREFIX']"
    if not isinstance(prefix, str) or not prefix:
        raise ImproperlyConfigured(f"{where} must be a non-empty string, got {prefix!r}.")
    if not _PREFIX_RE.match(prefix):
        raise ImproperlyConfigured(
            f"{where} may only contain letters, digits and _ . : - (got {prefix!r}); "
            "braces or glob characters would break hash tags and key scans."
        )
    if prefix.isdigit():
        # The cache's own keys are "<KEY_PREFIX>:<VERSION>:<key>"; an all-digit
        # PREFIX could make a lock key equal a cache key.
        raise ImproperlyConfigured(f"{where} must not be all digits (got {prefix!r}).")
    return prefix


def validate_aliases(value: object, *, what: str = "using") -> tuple[str, ...]:
    """Return a list of cache aliases for a quorum lock as a tuple, or raise."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{what} must be a cache alias or a list of them, not {type(value).__name__}."
        )
    if not value:
        raise ValueError(f"{what} must name at least one cache alias.")
    for alias in value:
        if not isinstance(alias, str) or not alias:
            raise TypeError(f"{what} must contain cache aliases (strings), got {alias!r}.")
    if len(set(value)) != len(value):
        raise ValueError(f"{what} names a cache alias twice: {list(value)!r}.")
    return tuple(value)


def resolve_using(using: object) -> tuple[str, tuple[str, ...] | None]:
    """Return (the alias, None) for one Redis, or (a label, the masters) for a quorum.

    ``using`` is a cache alias (a quorum when its MUTEX block names a
    QUORUM) or a list of aliases (a quorum when it has two or more; a list of
    one is that alias). Every public entry point reads it here, so a lock, a
    listing and a reset agree on where a name lives.
    """
    if isinstance(using, (list, tuple)):
        aliases = validate_aliases(using)
        if len(aliases) == 1:
            return aliases[0], None
        return ", ".join(aliases), aliases
    if not isinstance(using, str):
        raise TypeError(
            f"using must be a cache alias or a list of them, not {type(using).__name__}."
        )
    return using, get_settings(using).quorum


def _validate_quorum(alias: str, value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    aliases = _wrap(alias, "QUORUM", validate_aliases, value)
    if len(aliases) < 2:
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX']['QUORUM'] must name at least two independent Redis "
            "aliases (three or more, an odd number, is the useful case)."
        )
    return tuple(aliases)


def _validate_telemetry_names(alias: str, value: object, telemetry: bool) -> bool:
    names = _validate_bool(alias, "TELEMETRY_NAMES", value)
    if names and not telemetry:
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX']['TELEMETRY_NAMES'] has no effect without "
            "'TELEMETRY': True."
        )
    return names


def _validate_wait_replicas(alias: str, merged: dict[str, Any]) -> tuple[int, float]:
    where = f"CACHES[{alias!r}]['MUTEX']"
    replicas = merged["WAIT_REPLICAS"]
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ImproperlyConfigured(
            f"{where}['WAIT_REPLICAS'] must be a whole number of replicas, 0 or more "
            f"(0: do not wait), got {replicas!r}."
        )
    timeout = _wrap(alias, "WAIT_TIMEOUT", validate_ttl, merged["WAIT_TIMEOUT"])
    if not replicas:
        return 0, timeout
    for key in ("QUORUM", "CLUSTER"):
        if merged[key]:
            raise ImproperlyConfigured(
                f"{where}['WAIT_REPLICAS'] cannot be combined with {key}: replica "
                "acknowledgement is for one master and its replicas."
            )
    if timeout >= merged["TTL"]:
        raise ImproperlyConfigured(
            f"{where}['WAIT_TIMEOUT'] must be shorter than the TTL ({merged['TTL']!r} s), "
            f"got {merged['WAIT_TIMEOUT']!r}: the lease would run out while the replicas "
            "are awaited."
        )
    return replicas, timeout


def _validate_require_noeviction(alias: str, merged: dict[str, Any]) -> bool:
    required = _validate_bool(alias, "REQUIRE_NOEVICTION", merged["REQUIRE_NOEVICTION"])
    if required and merged["QUORUM"]:
        # A quorum alias's locks live on its members, whose own MUTEX blocks count.
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX']['REQUIRE_NOEVICTION'] has no effect on a QUORUM "
            "alias: set it in the MUTEX block of each member alias."
        )
    return required


def _validate_flush_interval(value: object, *, what: str) -> float:
    if not _is_number(value):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}.")
    interval = float(value)  # type: ignore[arg-type]
    if math.isnan(interval):
        raise ValueError(f"{what} must be a number of seconds, not NaN.")
    return check_bounds(what, interval, *STATS_FLUSH_BOUNDS, value, " seconds")


def _validate_deadlock_timeout(alias: str, value: object) -> float | None:
    where = f"CACHES[{alias!r}]['MUTEX']['DEADLOCK_TIMEOUT']"
    if value is None:
        return None
    if not _is_number(value) or math.isnan(value) or math.isinf(value):  # type: ignore[arg-type]
        raise ImproperlyConfigured(
            f"{where} must be a finite number of seconds, or None to turn deadlock "
            f"detection off, got {value!r}."
        )
    if value <= 0:  # type: ignore[operator]
        raise ImproperlyConfigured(
            f"{where} must be more than 0 seconds (None turns deadlock detection off), "
            f"got {value!r}."
        )
    return float(value)  # type: ignore[arg-type]


def parse_settings(alias: str, block: object) -> MutexSettings:
    """Validate one ``MUTEX`` block and merge it over the defaults."""
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX'] must be a dict, got {type(block).__name__}."
        )
    unknown = sorted(set(block) - set(DEFAULTS))
    if unknown:
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}]['MUTEX'] has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys are {', '.join(DEFAULTS)}."
        )
    merged = {**DEFAULTS, **block}
    max_hold = merged["MAX_HOLD"]
    telemetry = _validate_bool(alias, "TELEMETRY", merged["TELEMETRY"])
    ttl = _wrap(alias, "TTL", validate_ttl, merged["TTL"])
    wait_replicas, wait_timeout = _validate_wait_replicas(alias, {**merged, "TTL": ttl})
    return MutexSettings(
        alias=alias,
        ttl=ttl,
        timeout=_wrap(alias, "TIMEOUT", validate_timeout, merged["TIMEOUT"]),
        blocking=_validate_bool(alias, "BLOCKING", merged["BLOCKING"]),
        watchdog=_validate_bool(alias, "WATCHDOG", merged["WATCHDOG"]),
        prefix=validate_prefix(alias, merged["PREFIX"]),
        fail_open=_validate_bool(alias, "FAIL_OPEN", merged["FAIL_OPEN"]),
        raise_on_lost=_validate_bool(alias, "RAISE_ON_LOST", merged["RAISE_ON_LOST"]),
        max_hold=None if max_hold is None else _wrap(alias, "MAX_HOLD", validate_ttl, max_hold),
        quorum=_validate_quorum(alias, merged["QUORUM"]),
        quorum_timeout=_wrap(alias, "QUORUM_TIMEOUT", validate_ttl, merged["QUORUM_TIMEOUT"]),
        cluster=_validate_bool(alias, "CLUSTER", merged["CLUSTER"]),
        telemetry=telemetry,
        telemetry_names=_validate_telemetry_names(alias, merged["TELEMETRY_NAMES"], telemetry),
        wait_replicas=wait_replicas,
        wait_timeout=wait_timeout,
        require_noeviction=_validate_require_noeviction(alias, merged),
        stats=_validate_bool(alias, "STATS", merged["STATS"]),
        stats_flush_interval=_wrap(
            alias, "STATS_FLUSH_INTERVAL", _validate_flush_interval, merged["STATS_FLUSH_INTERVAL"]
        ),
        deadlock_timeout=_validate_deadlock_timeout(alias, merged["DEADLOCK_TIMEOUT"]),
    )


def cache_entry(alias: object) -> dict[str, Any]:
    """Return ``settings.CACHES[alias]`` or raise naming the missing alias."""
    from django.conf import settings

    if not isinstance(alias, str):
        raise TypeError(f"using must be a cache alias (a string), not {type(alias).__name__}.")
    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        known = ", ".join(map(repr, caches)) or "none"
        raise ImproperlyConfigured(
            f"Cache alias {alias!r} is not configured in settings.CACHES (configured: {known})."
        )
    entry: dict[str, Any] = caches[alias]
    return entry


@cache
def get_settings(alias: str) -> MutexSettings:
    """Return the validated lock defaults of cache ``alias``."""
    return parse_settings(alias, cache_entry(alias).get("MUTEX"))


@receiver(setting_changed)
def _clear_on_caches_change(*, setting: str, **kwargs: Any) -> None:
    if setting == "CACHES":
        get_settings.cache_clear()
