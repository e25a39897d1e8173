"""Contention figures per lock class: counted in memory, written to Redis in the background.

Turned on per cache alias with ``"STATS": True`` in its ``MUTEX`` block. For
each lock class (the name template a lock was built from, ``product:{pk}``,
else its name) and each minute, a process counts its acquisitions, those that
had to wait for another holder, those that gave up, the holds lost and the
deadlocks, and keeps its wait and hold times in a histogram of log-sized
buckets (eight to a doubling, so any time is known within 5 %).

Nothing here sends a Redis command on the lock's path: an acquisition or a
release adds to a dict under a process-wide lock, and a background thread
writes what was counted every ``STATS_FLUSH_INTERVAL`` seconds (and at exit,
and when :func:`flush` is called), in one pipeline per Redis: ``HINCRBY`` on the
hash of each minute (see :func:`~django_redis_mutex.keys.stats_key`), which
expires an hour after its minute ends. A flush that fails (Redis down) is
logged and its counts are kept for the next one, up to a bound, so a lock
cycle never pays for it. Readers (:func:`read_stats`: the ``locks --stats``
command, the admin's Contention page, the toolbar panel) merge the minutes and
take the percentiles from the merged histograms.

The hold times also give :func:`retry_after` its estimate of how long a
refused caller should wait (see :doc:`contention`).

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from redis.exceptions import RedisError

from .client import backend_errors, get_client, namespace
from .conf import get_settings
from .exceptions import LockBackendUnavailable
from .keys import stats_key

__all__ = [
    "RETENTION",
    "WINDOW",
    "ClassStats",
    "StatsReport",
    "flush",
    "read_stats",
    "retry_after",
]

logger = logging.getLogger("django_redis_mutex")

#: Seconds of one stored window of figures.
WINDOW = 60
#: Seconds a window's figures are kept after it ends.
RETENTION = 3600
# The minutes of hold times a Retry-After estimate looks at.
HISTORY_WINDOWS = 15
# Histogram buckets: bucket 0 holds everything up to _SMALLEST seconds, bucket
# b the times in (_SMALLEST * 2**((b-1)/8), _SMALLEST * 2**(b/8)]; the last
# one (about 1.9 h) everything longer.
_PER_DOUBLING = 8
_SMALLEST = 1e-4
_LAST_BUCKET = _PER_DOUBLING * 26
# Windows x classes kept in memory between flushes: a Redis down for long, or
# a project with endless distinct names, drops the excess (logged once).
MAX_PENDING = 20_000

# The figures of one class in one window, as the hash's field prefixes:
# "<code>|<lock class>", the histograms "<code><bucket>|<lock class>".
_COUNTERS = {"a": "acquired", "w": "waited", "c": "contended", "l": "lost", "d": "deadlocks"}
_WAITS, _HOLDS = "W", "H"
# A semaphore's fields start with this mark ("sa|jobs"), so that a semaphore
# and a lock of the same name are counted apart whatever the names hold.
_SEMAPHORE = "s"

#: What a figure is counted under: the kind of lock ("lock" or "semaphore")
#: and its lock class.
Counted = tuple[str, str]


def bucket(seconds: float) -> int:
    """Return the histogram bucket of a duration."""
    if seconds <= _SMALLEST:
        return 0
    return min(_LAST_BUCKET, math.ceil(math.log2(seconds / _SMALLEST) * _PER_DOUBLING))


def bucket_bounds(index: int) -> tuple[float, float]:
    """Return the durations (seconds) bucket ``index`` covers, lower excluded."""
    if index <= 0:
        return 0.0, _SMALLEST
    upper = math.inf if index >= _LAST_BUCKET else _SMALLEST * 2 ** (index / _PER_DOUBLING)
    return _SMALLEST * 2 ** ((index - 1) / _PER_DOUBLING), upper


def _middle(index: int) -> float:
    """Return the duration a bucket stands for: its geometric middle."""
    if index <= 0:
        return _SMALLEST
    return _SMALLEST * 2 ** ((min(index, _LAST_BUCKET) - 0.5) / _PER_DOUBLING)


def quantile(histogram: dict[int, int], q: float) -> float | None:
    """Return the ``q`` quantile (0 to 1) of a bucket histogram, in seconds; None if empty."""
    total = sum(histogram.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= rank:
            return _middle(index)
    return _middle(max(histogram))


class _Figures:
    """What one process counted for one class in one window, not yet written."""

    __slots__ = ("counts", "holds", "waits")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.waits: Counter[int] = Counter()
        self.holds: Counter[int] = Counter()

    def add(self, other: _Figures) -> None:
        self.counts.update(other.counts)
        self.waits.update(other.waits)
        self.holds.update(other.holds)

    def fields(self, counted: Counted) -> Iterator[tuple[str, int]]:
        """Yield the (hash field, count) pairs that record these figures."""
        kind, lock_class = counted
        mark = "" if kind == "lock" else _SEMAPHORE
        for code, count in self.counts.items():
            yield f"{mark}{code}|{lock_class}", count
        for prefix, histogram in ((_WAITS, self.waits), (_HOLDS, self.holds)):
            for index, count in histogram.items():
                yield f"{mark}{prefix}{index}|{lock_class}", count


# (alias, window start, what is counted) -> figures not yet written to Redis.
_Key = tuple[str, int, Counted]
_guard = threading.Lock()
_pending: dict[_Key, _Figures] = {}
_dropped = False
# The aliases whose figures are awaited, with their flush interval and last flush.
_intervals: dict[str, float] = {}
_last_flush: dict[str, float] = {}
_flusher: threading.Thread | None = None
_stop = threading.Event()
# Set when an alias starts counting: the flusher picks up its interval at once.
_wake = threading.Event()
# Per alias: the hold histograms of the last minutes, read back from Redis by
# the flusher for the aliases a refused caller asked an estimate for.
_history: dict[str, dict[Counted, dict[int, int]]] = {}
_history_wanted: set[str] = set()


def _after_fork_in_child() -> None:
    # The child starts with nothing to write (the parent writes its own
    # counts) and no flusher: the parent's thread does not exist here.
    global _guard, _pending, _flusher, _stop, _wake
    _guard = threading.Lock()
    _pending = {}
    _flusher = None
    _stop = threading.Event()
    _wake = threading.Event()
    _history.clear()
    _history_wanted.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _figures(alias: str, counted: Counted) -> _Figures | None:
    """Return the pending figures of a class in this window; call with the guard held."""
    global _dropped, _flusher
    key = (alias, int(time.time()) // WINDOW * WINDOW, counted)
    figures = _pending.get(key)
    if figures is None:
        if len(_pending) >= MAX_PENDING:
            if not _dropped:
                _dropped = True
                logger.warning(
                    "Lock contention figures dropped: %d windows of lock classes wait to be "
                    "written to Redis already.",
                    len(_pending),
                )
            return None
        figures = _pending[key] = _Figures()
    if alias not in _intervals:
        _intervals[alias] = get_settings(alias).stats_flush_interval
        # The first write comes one interval after the first count.
        _last_flush.setdefault(alias, time.monotonic())
        _wake.set()
    if _flusher is None:
        # The background writer of this process.
        _flusher = threading.Thread(
            target=_run_flusher, args=(_stop, _wake), name="django_redis_mutex stats", daemon=True
        )
        _flusher.start()
    return figures


def acquired(alias: str, counted: Counted, wait: float, waited: bool) -> None:
    """Count an acquisition taking ``wait`` s (``waited``: refused first)."""
    with _guard:
        figures = _figures(alias, counted)
        if figures is not None:
            figures.counts["a"] += 1
            if waited:
                figures.counts["w"] += 1
            figures.waits[bucket(wait)] += 1


def released(alias: str, counted: Counted, held: float) -> None:
    """Count a hold that lasted ``held`` seconds."""
    with _guard:
        figures = _figures(alias, counted)
        if figures is not None:
            figures.holds[bucket(held)] += 1


#: What :func:`count` counts: an acquisition that gave up (its wait is not a
#: lock's wait), a hold lost before its release, an acquisition ended to break
#: a deadlock (see deadlock.py).
CONTENDED, LOST, DEADLOCKED = "c", "l", "d"


def count(alias: str, counted: Counted, event: str) -> None:
    """Count one ``event`` (CONTENDED, LOST or DEADLOCKED) of a class."""
    with _guard:
        figures = _figures(alias, counted)
        if figures is not None:
            figures.counts[event] += 1


# -- writing ---------------------------------------------------------------


def _take(aliases: set[str] | None) -> dict[_Key, _Figures]:
    """Remove and return the pending figures of ``aliases`` (all when None)."""
    global _pending, _dropped
    with _guard:
        if aliases is None:
            taken, _pending = _pending, {}
        else:
            taken = {key: f for key, f in _pending.items() if key[0] in aliases}
            for key in taken:
                del _pending[key]
        _dropped = False
    return taken


def _give_back(figures: dict[_Key, _Figures]) -> None:
    """Put figures a flush could not write back, for the next flush; drop the expired."""
    oldest = int(time.time()) - RETENTION
    with _guard:
        for key, kept in figures.items():
            if key[1] < oldest:
                continue
            mine = _pending.get(key)
            if mine is None:
                if len(_pending) >= MAX_PENDING:
                    continue
                _pending[key] = kept
            else:
                mine.add(kept)


def flush(using: str | None = None) -> int:
    """Write the figures counted so far to Redis now; return how many fields were written.

    ``using`` names one cache alias (default: every alias with figures).
    Raise LockBackendUnavailable (or the RedisError of an error reply) when a
    Redis cannot take them: they are kept for the next flush.
    """
    taken = _take(None if using is None else {using})
    by_alias: dict[str, dict[_Key, _Figures]] = {}
    for key, figures in taken.items():
        by_alias.setdefault(key[0], {})[key] = figures
    written = 0
    failure: BaseException | None = None
    for alias, of_alias in by_alias.items():
        try:
            written += _write(alias, of_alias)
        except ImproperlyConfigured as exc:  # the alias went away with a settings change
            logger.warning("Lock contention figures of cache %r dropped: %s", alias, exc)
        except (LockBackendUnavailable, RedisError) as exc:
            _give_back(of_alias)
            failure = failure or exc
        _last_flush[alias] = time.monotonic()
    if failure is not None:
        raise failure
    return written


def _write(alias: str, figures: dict[_Key, _Figures]) -> int:
    """Send one alias's figures in one pipeline: HINCRBY per field, one expiry per window."""
    space = namespace(alias)
    with backend_errors(None, alias):
        pipe = get_client(alias).pipeline(transaction=False)
        windows: set[int] = set()
        written = 0
        for (_alias, window, counted), of_window in figures.items():
            key = stats_key(space, window)
            windows.add(window)
            for name, count in of_window.fields(counted):
                pipe.hincrby(key, name, count)
                written += 1
        for window in windows:
            pipe.expireat(stats_key(space, window), window + WINDOW + RETENTION)
        pipe.execute()
    return written


def _flush_due() -> None:
    """Flush each alias whose interval has passed; read back the hold times asked for."""
    now = time.monotonic()
    with _guard:
        intervals = list(_intervals.items())
    for alias, every in intervals:
        if now - _last_flush.get(alias, 0.0) < every:
            continue
        try:
            flush(alias)
        except (LockBackendUnavailable, RedisError) as exc:
            logger.warning("Could not write lock contention figures of cache %r: %s", alias, exc)
    for alias in list(_history_wanted):
        try:
            _history[alias] = _read_holds(alias)
        except (LockBackendUnavailable, RedisError, ImproperlyConfigured) as exc:
            logger.debug("Could not read lock hold times of cache %r: %s", alias, exc)


def _run_flusher(stop: threading.Event, wake: threading.Event) -> None:
    global _flusher
    try:
        while not stop.is_set():
            wake.wait(min(list(_intervals.values()), default=10.0))
            wake.clear()
            if not stop.is_set():
                _flush_due()
    finally:
        # An unexpected error ends the thread with its traceback; the next
        # count starts another.
        if _flusher is threading.current_thread():
            _flusher = None


@atexit.register
def _flush_at_exit() -> None:
    _stop.set()
    _wake.set()
    if _pending:
        try:
            flush()
        except (LockBackendUnavailable, RedisError) as exc:
            # Logged, not raised: the process is ending, and its counts with it.
            logger.warning("Could not write lock contention figures at exit: %s", exc)


@receiver(setting_changed)
def _forget_intervals(*, setting: str, **kwargs: Any) -> None:
    # Read again from the new settings at the next count of each alias.
    if setting == "CACHES":
        with _guard:
            _intervals.clear()


# -- reading ---------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _windows(minutes: int, now: float | None = None) -> list[int]:
    """Return the starts of the last ``minutes`` windows, oldest first, this one included."""
    current = int(time.time() if now is None else now) // WINDOW * WINDOW
    return [current - WINDOW * back for back in range(minutes - 1, -1, -1)]


def _read_windows(alias: str, windows: list[int]) -> list[dict[str, int]]:
    """Return the hash of each window, as {field: count}, in the order given."""
    space = namespace(alias)
    with backend_errors(None, alias):
        pipe = get_client(alias).pipeline(transaction=False)
        for window in windows:
            pipe.hgetall(stats_key(space, window))
        replies = pipe.execute()
    return [{_text(k): int(v) for k, v in (reply or {}).items()} for reply in replies]


def _parse_field(name: str) -> tuple[str, int | None, Counted] | None:
    """Return (code, bucket or None, what is counted) of a hash field, or None if not one."""
    head, sep, lock_class = name.partition("|")
    kind = "lock"
    if head.startswith(_SEMAPHORE):
        head, kind = head[1:], "semaphore"
    if not sep or not head:
        return None
    if head in _COUNTERS:
        return head, None, (kind, lock_class)
    if head[0] in (_WAITS, _HOLDS) and head[1:].isdigit():
        return head[0], int(head[1:]), (kind, lock_class)
    return None


@dataclass
class ClassStats:
    """The figures of one lock class over the windows read."""

    lock_class: str
    #: "lock" (exclusive or shared) or "semaphore".
    kind: str = "lock"
    acquired: int = 0
    waited: int = 0
    contended: int = 0
    lost: int = 0
    deadlocks: int = 0
    waits: dict[int, int] = field(default_factory=dict, repr=False)
    holds: dict[int, int] = field(default_factory=dict, repr=False)
    #: Per window read, oldest first: acquisitions that waited or gave up.
    per_window: list[int] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        """The class as the listings show it: a semaphore's says so."""
        return self.lock_class if self.kind == "lock" else f"{self.lock_class} (semaphore)"

    @property
    def contention(self) -> int:
        """Acquisitions that met the lock held: those that waited, and those that gave up."""
        return self.waited + self.contended

    @property
    def waited_share(self) -> float:
        """The share (0 to 1) of acquisitions that had to wait."""
        return self.waited / self.acquired if self.acquired else 0.0

    @property
    def wait_p50(self) -> float | None:
        return quantile(self.waits, 0.5)

    @property
    def wait_p99(self) -> float | None:
        return quantile(self.waits, 0.99)

    @property
    def hold_p50(self) -> float | None:
        return quantile(self.holds, 0.5)

    @property
    def hold_p99(self) -> float | None:
        return quantile(self.holds, 0.99)

    def as_dict(self) -> dict[str, Any]:
        """Return the figures as plain values (seconds for times, None when unknown)."""
        return {
            "lock_class": self.lock_class,
            "kind": self.kind,
            "acquired": self.acquired,
            "waited": self.waited,
            "waited_share": round(self.waited_share, 4),
            "contended": self.contended,
            "lost": self.lost,
            "deadlocks": self.deadlocks,
            "wait_p50": self.wait_p50,
            "wait_p99": self.wait_p99,
            "hold_p50": self.hold_p50,
            "hold_p99": self.hold_p99,
            "per_window": list(self.per_window),
        }


@dataclass(frozen=True)
class StatsReport:
    """The contention figures of one cache alias: the windows read and each class's figures."""

    alias: str
    #: The start of each window read (epoch seconds), oldest first.
    windows: tuple[int, ...]
    #: Hottest first: most contention, then most acquisitions.
    classes: tuple[ClassStats, ...]

    def hottest(self, count: int) -> tuple[ClassStats, ...]:
        """Return the ``count`` classes with the most contention (and some of it)."""
        return tuple(c for c in self.classes[:count] if c.contention or c.acquired)


def read_stats(using: str = "default", minutes: int = 60) -> StatsReport:
    """Return the contention figures of cache ``using`` over its last ``minutes`` windows.

    Only figures already flushed are read: call :func:`flush` first to see
    this process's latest. Raise LockBackendUnavailable when Redis is down.
    """
    if not isinstance(minutes, int) or isinstance(minutes, bool) or not 1 <= minutes <= 60:
        raise ValueError(f"minutes must be a whole number from 1 to 60, got {minutes!r}.")
    windows = _windows(minutes)
    hashes = _read_windows(using, windows)
    classes: dict[Counted, ClassStats] = {}
    for position, fields in enumerate(hashes):
        for name, count in fields.items():
            parsed = _parse_field(name)
            if parsed is None:
                continue
            code, index, counted = parsed
            figures = classes.get(counted)
            if figures is None:
                figures = classes[counted] = ClassStats(
                    counted[1], kind=counted[0], per_window=[0] * len(windows)
                )
            if index is not None:
                histogram = figures.waits if code == _WAITS else figures.holds
                histogram[index] = histogram.get(index, 0) + count
                continue
            attribute = _COUNTERS[code]
            setattr(figures, attribute, getattr(figures, attribute) + count)
            if code in ("w", "c"):
                figures.per_window[position] += count
    ranked = sorted(
        classes.values(), key=lambda c: (-c.contention, -c.acquired, c.lock_class, c.kind)
    )
    return StatsReport(using, tuple(windows), tuple(ranked))


def _read_holds(alias: str) -> dict[Counted, dict[int, int]]:
    """Return the hold histogram of every class over the last HISTORY_WINDOWS minutes."""
    report = read_stats(alias, HISTORY_WINDOWS)
    return {(c.kind, c.lock_class): c.holds for c in report.classes if c.holds}


# -- the Retry-After estimate ----------------------------------------------

#: The quantile of the holds longer than the holder's so far that a refused
#: caller is told to wait for (see :doc:`contention`).
RETRY_QUANTILE = 0.9


def _recent_holds(alias: str, counted: Counted) -> dict[int, int]:
    """Return the hold histogram of a class: read back from Redis, plus what is not written yet."""
    merged = dict(_history.get(alias, {}).get(counted, {}))
    oldest = int(time.time()) - HISTORY_WINDOWS * WINDOW
    with _guard:
        for (pending_alias, window, pending_class), figures in _pending.items():
            if pending_alias == alias and pending_class == counted and window >= oldest:
                for index, count in figures.holds.items():
                    merged[index] = merged.get(index, 0) + count
    return merged


def retry_after(alias: str, counted: Counted | None, pttl_ms: int, held_ms: int) -> int:
    """Return the seconds a caller refused a lock should wait before trying again.

    ``pttl_ms``: what is left of the holder's lease (0 or less: not known);
    ``held_ms``: how long the holder has had the lock (negative: not known).
    The estimate is the ``RETRY_QUANTILE`` of this class's recent holds that
    lasted longer than the holder's so far, minus the holder's time so far,
    never more than the lease left and at least 1 s: 1 s when the holder has
    had the lock longer than any recent hold (by its history it is due).
    With no recent hold of the class known, a hold that has lasted t is taken
    to last about t more (as likely shorter as longer), so callers told again
    and again back off, doubling their waits; the lease left only when the
    holder's time so far is not known either.
    """
    lease_left = max(1, math.ceil(pttl_ms / 1000)) if pttl_ms > 0 else 1
    if counted is None or held_ms < 0:
        return lease_left
    _history_wanted.add(alias)
    holds = _recent_holds(alias, counted)
    held = held_ms / 1000
    if not holds:
        return max(1, min(lease_left, math.ceil(held)))
    longer = {i: n for i, n in holds.items() if bucket_bounds(i)[1] > held}
    expected = quantile(longer, RETRY_QUANTILE)
    if expected is None:
        return 1
    return max(1, min(lease_left, math.ceil(expected - held)))
