"""Record critical sections run under locks, and check the history for broken exclusion.

A *section* is one stretch of code run while a lock was held: its lock name,
the fence it was granted, when it was entered (``time.time()`` just after the
acquire returned) and left (just before the release was called), which process
and thread ran it, and whether it was *told it lost the lock* (``LockLost`` on
leaving the block, ``LockNotOwned`` from the release, or ``lock.lost``). Every
process on the machine shares that clock, so sections of different processes
can be compared.

Workers write sections with :class:`Recorder`, one JSON line each; tests read
them back with :meth:`History.load_from_worker_output` and ask
:meth:`History.violations`. A lease-based lock promises, per name:

* no two sections overlap, unless one of them was told it lost the lock (a
  holder paused past its lease, or a Redis restart that forgot every lock,
  cannot be prevented, only reported to the holder);
* fences strictly increase in the order sections were entered (again among the
  sections that were not told they lost), and no fence is handed out twice.

Sections also increment a counter with a non-atomic GET then SET, so broken
exclusion shows up a second way, as lost updates:
:meth:`History.counter_violations`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path
from typing import IO, Any

__all__ = ["History", "Recorder", "Section"]


@dataclass(frozen=True)
class Section:
    """One critical section run under lock ``name``."""

    name: str
    fence: int
    enter: float
    exit: float
    pid: int
    thread: str = ""
    #: True when the section was told it lost the lock (at exit or before).
    lost: bool = False
    #: Seconds the acquire took (the wait for the lock).
    wait: float = 0.0

    def describe(self) -> str:
        """Return a one-line description for violation messages."""
        told = ", told it lost the lock" if self.lost else ""
        return (
            f"[pid {self.pid} {self.thread} fence {self.fence} "
            f"{self.enter:.6f}..{self.exit:.6f}{told}]"
        )


_FIELDS = {f.name for f in fields(Section)}


class History:
    """The sections of a run, and the checks a correct lock must pass."""

    def __init__(self, sections: Iterable[Section] = ()) -> None:
        self.sections: list[Section] = list(sections)

    def __len__(self) -> int:
        return len(self.sections)

    def add(self, section: Section | None = None, **values: Any) -> Section:
        """Add one section, given as a Section or as its fields; return it."""
        if section is None:
            section = Section(**values)
        elif values:
            raise TypeError("Give a Section or its fields, not both.")
        self.sections.append(section)
        return section

    def load_from_worker_output(self, output: str | Path | Iterable[Mapping[str, Any]]) -> int:
        """Add the sections a worker reported; return how many were added.

        ``output`` is the worker's stdout (JSON lines; other events are
        skipped), a path to a file holding it, or already-parsed events.
        """
        if isinstance(output, Path):
            output = output.read_text()
        if isinstance(output, str):
            events: Iterable[Mapping[str, Any]] = (
                json.loads(line) for line in output.splitlines() if line.strip()
            )
        else:
            events = output
        added = 0
        for event in events:
            if event.get("event") == "section":
                self.add(**{k: v for k, v in event.items() if k in _FIELDS})
                added += 1
        return added

    def names(self) -> list[str]:
        """Return the lock names seen, sorted."""
        return sorted({s.name for s in self.sections})

    def of(self, name: str) -> list[Section]:
        """Return the sections of lock ``name`` in the order they were entered."""
        return sorted((s for s in self.sections if s.name == name), key=lambda s: s.enter)

    def lost(self) -> list[Section]:
        """Return the sections that were told they lost their lock."""
        return [s for s in self.sections if s.lost]

    def violations(self) -> list[str]:
        """Return a description of every broken guarantee; empty when the history is sound."""
        found: list[str] = []
        by_name: dict[str, list[Section]] = defaultdict(list)
        for section in self.sections:
            if section.exit < section.enter:
                found.append(
                    f"lock {section.name!r}: section {section.describe()} left before it entered"
                )
            by_name[section.name].append(section)
        for name in sorted(by_name):
            in_order = sorted(by_name[name], key=lambda s: s.enter)
            found += _overlaps(name, in_order)
            found += _fence_order(name, in_order)
        return found

    def counter_violations(self, counts: Mapping[str, int]) -> list[str]:
        """Check final counter values (lock name -> value) against the sections run.

        Every completed section incremented its lock's counter once, with a GET
        then a SET. Without lost locks the counter must equal the number of
        sections exactly. A section told it lost the lock may have overlapped
        another and had its increment overwritten (or overwritten one), so
        with such sections the counter must lie between the number of
        sections that were not told and the number of all sections.
        """
        found = []
        per_name = Counter(s.name for s in self.sections)
        told = Counter(s.name for s in self.sections if s.lost)
        for name in sorted(set(counts) | set(per_name)):
            final = counts.get(name, 0)
            high, low = per_name[name], per_name[name] - told[name]
            if not low <= final <= high:
                expected = f"{high}" if low == high else f"between {low} and {high}"
                found.append(
                    f"lock {name!r}: counter is {final} after {high} sections "
                    f"({told[name]} told they lost the lock); expected {expected}, "
                    f"so {high - final} increments were lost"
                )
        return found


def _overlaps(name: str, in_order: list[Section]) -> list[str]:
    """Report sections of one lock that overlap while neither was told it lost it."""
    found = []
    latest: Section | None = None  # the untold section reaching furthest so far
    for section in in_order:
        if section.lost:
            continue
        if latest is not None and section.enter < latest.exit:
            found.append(
                f"lock {name!r}: sections {latest.describe()} and {section.describe()} "
                f"overlap by {(latest.exit - section.enter) * 1000:.3f} ms, "
                "and neither was told it lost the lock"
            )
        if latest is None or section.exit > latest.exit:
            latest = section
    return found


def _fence_order(name: str, in_order: list[Section]) -> list[str]:
    """Report fences handed out twice, or not growing from one untold section to the next."""
    found = []
    for fence, times in Counter(s.fence for s in in_order).items():
        if times > 1:
            holders = " and ".join(s.describe() for s in in_order if s.fence == fence)
            found.append(f"lock {name!r}: fence {fence} was handed to {times} sections: {holders}")
    untold = [s for s in in_order if not s.lost]
    for before, after in pairwise(untold):
        if after.fence < before.fence:
            found.append(
                f"lock {name!r}: fence went backwards from {before.describe()} "
                f"to the later {after.describe()}"
            )
    return found


class Recorder:
    """Write sections as JSON lines (``{"event": "section", ...}``), safe across threads.

    With ``buffered=True`` the lines are kept in memory until :meth:`flush`,
    so that reporting does not slow down a timed run.
    """

    def __init__(self, stream: IO[str] | None = None, *, buffered: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.buffered = buffered
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self.buffered:
                self._lines.append(line)
                return
            self.stream.write(line)
            self.stream.flush()

    def record(self, section: Section) -> None:
        """Report one section."""
        self._write({"event": "section", **asdict(section)})

    def event(self, event: str, **data: Any) -> None:
        """Report anything else (a failure, a timeout) in the same stream and order."""
        self._write(
            {
                "event": event,
                "pid": os.getpid(),
                "t": time.time(),
                "thread": threading.current_thread().name,
                **data,
            }
        )

    def section(
        self,
        name: str,
        fence: int,
        enter: float,
        exit: float,
        *,
        lost: bool = False,
        wait: float = 0.0,
    ) -> Section:
        """Build and report a section of this process and thread; return it."""
        section = Section(
            name=name,
            fence=fence,
            enter=enter,
            exit=exit,
            pid=os.getpid(),
            thread=threading.current_thread().name,
            lost=lost,
            wait=wait,
        )
        self.record(section)
        return section

    def flush(self) -> None:
        """Write out what a buffered recorder kept back."""
        with self._lock:
            lines, self._lines = self._lines, []
            self.stream.write("".join(lines))
            self.stream.flush()
