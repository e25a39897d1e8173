"""Choose held locks by holder and age: one filter for the ``locks`` command and the admin.

An operator reclaiming the locks of one host after a deploy, or of one stuck
process, selects them with a :class:`LockFilter` (host, pid, label, held for
longer than a duration). The command's ``--host``/``--pid``/``--label``/
``--older-than`` and the admin's filter fields build the same filter from
text with :meth:`LockFilter.from_strings`, so both read and match a value the
same way and refuse a bad one with the same message.

.. versionadded:: 0.1
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from .display import duration
from .introspection import HeldLock, ListedLock, held_shared, seconds_since
from .owners import Owner

__all__ = ["FILTER_FIELDS", "FilterError", "LockFilter", "parse_duration"]

# The filters, in the order they are shown; each is a LockFilter field.
FILTER_FIELDS = ("host", "pid", "label", "older_than")

_NUMBER = r"[0-9]+(?:\.[0-9]+)?"  # ASCII digits: \d also takes other scripts' digits
_SECONDS = re.compile(rf"{_NUMBER}")
_UNITS = re.compile(
    rf"(?:(?P<d>{_NUMBER})d)?(?:(?P<h>{_NUMBER})h)?(?:(?P<m>{_NUMBER})m)?(?:(?P<s>{_NUMBER})s)?"
)
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


class FilterError(ValueError):
    """A filter value that cannot select locks: ``field`` names the filter, ``problem`` says why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def parse_duration(text: str) -> float:
    """Return the seconds written in ``text``, else raise ValueError saying how to write them.

    Accepts plain seconds (``90``, ``2.5``) or numbers with units, largest
    first: ``d``, ``h``, ``m``, ``s`` (``90s``, ``10m``, ``2h``, ``1h30m``,
    ``1d12h``). Case and spaces are ignored.
    """
    if not isinstance(text, str):
        raise TypeError(f"A duration must be a string, not {type(text).__name__}.")
    compact = "".join(text.split()).lower()
    if _SECONDS.fullmatch(compact):
        return float(compact)
    match = _UNITS.fullmatch(compact)
    if compact and match:
        return sum(
            float(value) * _UNIT_SECONDS[unit]
            for unit, value in match.groupdict().items()
            if value is not None
        )
    raise ValueError(
        f"{text!r} is not a duration: write seconds (90) or numbers with the units "
        "d, h, m and s, largest first (90s, 10m, 2h, 1h30m)."
    )


_NOT_A_PID = "is not a process id: give a whole number of at least 1."


def _text_filter(field: str, value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise FilterError(field, f"must be text, not {type(value).__name__}.")
    if not value.strip():
        # A blank filter must not quietly widen a reset to every lock.
        raise FilterError(field, "is empty; give a value to match.")
    return value


@dataclass(frozen=True)
class LockFilter:
    """Which held locks to select; a lock matches when it matches every filter that is set.

    ``host`` matches the owner's host name exactly, ignoring case; ``pid``
    the owner's process id (on any host: combine it with ``host``); ``label``
    the owner's label exactly; ``older_than`` (seconds) a lock held for at
    least that long, by this machine's clock. An empty filter matches every
    lock. A lock whose owner record lacks a field never matches a filter on it.
    """

    host: str | None = None
    pid: int | None = None
    label: str | None = None
    older_than: float | None = None

    def __post_init__(self) -> None:
        _text_filter("host", self.host)
        _text_filter("label", self.label)
        if self.pid is not None and (
            not isinstance(self.pid, int) or isinstance(self.pid, bool) or self.pid < 1
        ):
            raise FilterError("pid", f"{self.pid!r} {_NOT_A_PID}")
        if self.older_than is not None and (
            not isinstance(self.older_than, (int, float))
            or isinstance(self.older_than, bool)
            or not math.isfinite(self.older_than)
            or self.older_than < 0
        ):
            raise FilterError(
                "older_than", f"{self.older_than!r} is not a duration: give seconds, at least 0."
            )

    @classmethod
    def from_strings(
        cls,
        *,
        host: str | None = None,
        pid: str | None = None,
        label: str | None = None,
        older_than: str | None = None,
    ) -> LockFilter:
        """Return the filter written as text (command-line options, query parameters).

        None leaves a filter unset; an empty string is refused, so that a
        blank value never widens a selection to every lock. Raise
        :class:`FilterError` naming the filter and the problem.
        """
        pid_number: int | None = None
        if pid is not None:
            text = (_text_filter("pid", pid) or "").strip()
            # ASCII digits only (str.isdigit also takes "²"), and few enough for int().
            if not (text.isascii() and text.isdigit() and len(text) <= 10):
                raise FilterError("pid", f"{pid!r} {_NOT_A_PID}")
            pid_number = int(text)
        seconds: float | None = None
        if older_than is not None:
            text = _text_filter("older_than", older_than) or ""
            try:
                seconds = parse_duration(text)
            except ValueError as exc:
                raise FilterError("older_than", str(exc)) from exc
        return cls(host=host, pid=pid_number, label=label, older_than=seconds)

    def __bool__(self) -> bool:
        """Return True if any filter is set (an empty filter selects every lock)."""
        return any(getattr(self, field.name) is not None for field in fields(self))

    def matches(self, held: HeldLock) -> bool:
        """Return True if ``held`` passes every filter that is set.

        A lock held shared passes when any of its holders does.
        """
        if held.shared:
            return any(self._matches(h.owner, seconds_since(h.acquired_at)) for h in held.holders)
        return self._matches(held.owner, held.held_for)

    def select(self, listed: ListedLock) -> ListedLock | None:
        """Return ``listed`` narrowed to the holders this filter matches, or None if none does.

        A reset of the result releases only those holders of a lock held
        shared: reclaiming one host's holds leaves the other hosts' alone.
        An empty filter returns ``listed`` whole (a semaphore is never filtered).
        """
        if not self:
            return listed
        held = listed.held
        if not held.shared:
            return listed if self.matches(held) else None
        kept = [
            (token, holder)
            for token, holder in zip(listed.token.split(), held.holders, strict=True)
            if self._matches(holder.owner, seconds_since(holder.acquired_at))
        ]
        return held_shared(held.name, kept, held.waiters, held.masters) if kept else None

    def narrow(self, listed: list[ListedLock]) -> list[ListedLock]:
        """Return the locks of ``listed`` this filter selects, each narrowed by :meth:`select`."""
        if not self:
            return listed  # every lock, whole: no copy of a long listing
        return [chosen for item in listed if (chosen := self.select(item)) is not None]

    def _matches(self, owner: Owner, held_for: float) -> bool:
        if self.host is not None and (
            owner.host is None or owner.host.casefold() != self.host.casefold()
        ):
            return False
        if self.pid is not None and owner.pid != self.pid:
            return False
        if self.label is not None and owner.label != self.label:
            return False
        return self.older_than is None or held_for >= self.older_than

    def describe(self) -> str:
        """Describe the filters that are set: ``host 'web1', older than 10 min 00 s``."""
        parts = []
        if self.host is not None:
            parts.append(f"host {self.host!r}")
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.label is not None:
            parts.append(f"label {self.label!r}")
        if self.older_than is not None:
            parts.append(f"older than {duration(self.older_than)}")
        return ", ".join(parts) or "every lock"
