"""Lock order: which lock classes each owner took while holding others, and where.

Like the Linux kernel's lockdep, for distributed locks in a test run. While
:data:`checking` is on, each new hold an owner (its thread, or its asyncio
task: see :func:`~django_redis_mutex.holds.current_owner`) takes while it
holds others adds the orders "held class, then new class", each kept with
the stack where it was first seen. An order whose reverse is already known
is a lock order inversion: two code paths that, run at the same time, could
each hold one lock and wait for the other, though no deadlock happened in
the run. A lock's class is the name template it was built from
(``product:{pk}``), else its name: one inversion found with two pks stands
for every pk.

Nothing here knows Django or Redis. An acquisition calls :func:`taken` when
it starts a new hold (a reentrant join of a hold its owner has already adds
no order, so it calls nothing); releasing calls nothing either: a hold that
is no longer active (given back, lost) leaves its owner's list the next time
that owner takes a lock. Off, the whole cost is the acquisition's test of
:data:`checking`. The pytest plugin turns it on (``--lock-order``) and reports
what it finds; the recorder is the process's one, like the watchdog.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback
from collections.abc import Iterable
from typing import NamedTuple, Protocol

__all__ = ["Inversion", "LockClass", "Order", "Recorder", "checking", "start", "stop", "taken"]

#: True while lock orders are recorded: the one test an acquisition makes.
checking = False

# The innermost frames shown per stack, after hiding the library's own.
_FRAMES_SHOWN = 16
# An owner list is swept for owners that hold nothing once this many are kept.
_FIRST_SWEEP = 64
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ASYNCIO_DIR = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep
_THREADING_FILE = os.path.abspath(threading.__file__)


class Held(Protocol):
    """What the recorder reads of a hold (see holds.Hold)."""

    owner: object
    active: bool
    releasing: bool


class LockClass(NamedTuple):
    """A class of locks: a kind ("lock", "semaphore") and a name template, or a name."""

    kind: str
    name: str

    def __str__(self) -> str:
        return repr(self.name) if self.kind == "lock" else f"{self.kind} {self.name!r}"


class Order(NamedTuple):
    """Where an owner first took ``then`` while holding ``first``."""

    first: LockClass
    then: LockClass
    stack: str  # formatted like a traceback, innermost last
    owner: str  # "thread MainThread", "task Task-2"
    during: str  # what ran then (the test's id), or ""

    def describe(self) -> str:
        where = f"{self.during} ({self.owner})" if self.during else self.owner
        return f"{self.first} then {self.then} at\n    {where}\n{self.stack}"


class Inversion(NamedTuple):
    """Two orders of the same two classes, ``earlier`` seen first."""

    earlier: Order
    later: Order

    def __str__(self) -> str:
        return (
            f"lock order inversion: {self.earlier.describe()}"
            f"but {self.later.describe()}"
            "Taken at the same time, these paths could each hold one lock and wait for the "
            "other. Take the two in one order everywhere."
        )


class Recorder:
    """The orders seen in this process, and the inversions among them."""

    def __init__(self, hidden: Iterable[str] = ()) -> None:
        # Frames from these files or directories are left out of the stacks shown.
        self._hidden = (_PACKAGE_DIR, _ASYNCIO_DIR, _THREADING_FILE, *hidden)
        self._guard = threading.Lock()
        # Per owner, the holds it took (a nested join adds none), oldest first.
        self._held: dict[object, list[tuple[Held, LockClass]]] = {}
        self._sweep_at = _FIRST_SWEEP
        # The first place each order was seen: one stack per ordered pair.
        self._orders: dict[tuple[LockClass, LockClass], Order] = {}
        #: Every inversion found so far, in the order found.
        self.inversions: list[Inversion] = []
        #: What runs now (the plugin sets the test's id): kept with each order.
        self.during = ""

    def taken(self, hold: Held, taken: LockClass) -> None:
        """Record that ``hold.owner`` has taken a new hold of class ``taken``."""
        with self._guard:
            held = self._holding(hold.owner)
            new = [
                (first, taken)
                for first in dict.fromkeys(cls for _, cls in held)
                if first != taken and (first, taken) not in self._orders
            ]
            held.append((hold, taken))
        if not new:
            return
        # Outside the guard: reading source lines may touch the disk.
        stack, owner, during = self._stack(), _describe_owner(), self.during
        with self._guard:
            for pair in new:
                if pair in self._orders:  # another owner saw it meanwhile
                    continue
                order = self._orders[pair] = Order(*pair, stack, owner, during)
                reverse = self._orders.get((pair[1], pair[0]))
                if reverse is not None:
                    self.inversions.append(Inversion(reverse, order))

    def orders(self) -> list[Order]:
        """Return every order seen, in the order first seen."""
        with self._guard:
            return list(self._orders.values())

    def _holding(self, owner: object) -> list[tuple[Held, LockClass]]:
        """Return ``owner``'s list of holds still held (guarded by the caller)."""
        held = self._held.get(owner)
        if held is None:
            if len(self._held) >= self._sweep_at:
                self._sweep()
            held = self._held[owner] = []
        else:
            held[:] = [entry for entry in held if _still_held(entry[0])]
        return held

    def _sweep(self) -> None:
        # Ended threads and tasks never take a lock again: forget those that
        # hold nothing, so a long run keeps about as many owners as are alive.
        self._held = {
            owner: live
            for owner, held in self._held.items()
            if (live := [entry for entry in held if _still_held(entry[0])])
        }
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._held))

    def _stack(self) -> str:
        frames = [
            frame
            for frame in traceback.extract_stack(sys._getframe(2))
            # "<frozen runpy>" and the like: the interpreter's start-up.
            if not frame.filename.startswith(self._hidden) and frame.filename[:1] != "<"
        ]
        return "".join(traceback.format_list(frames[-_FRAMES_SHOWN:]))


def _still_held(hold: Held) -> bool:
    # A hold whose release was sent (its answer lost) is let go by its owner.
    return hold.active and not hold.releasing


def _describe_owner() -> str:
    if asyncio._get_running_loop() is not None:
        task = asyncio.current_task()
        if task is not None:
            return f"task {task.get_name()}"
    return f"thread {threading.current_thread().name}"


_recorder: Recorder | None = None


def start(hidden: Iterable[str] = ()) -> Recorder:
    """Start recording lock orders in this process; return the recorder.

    ``hidden``: files and directories whose frames the stacks leave out
    (the test runner's own, say), beside this package's and asyncio's.
    """
    global _recorder, checking
    _recorder = Recorder(hidden)
    checking = True
    return _recorder


def stop() -> None:
    """Stop recording lock orders and forget them."""
    global _recorder, checking
    checking = False
    _recorder = None


def taken(hold: Held, kind: str, lock_class: str) -> None:
    """Record a new hold of the lock class ``lock_class`` by ``hold``'s owner."""
    recorder = _recorder
    if recorder is not None:
        recorder.taken(hold, LockClass(kind, lock_class))


def _after_fork_in_child() -> None:
    # The guard may have been held by a thread the child does not have.
    if _recorder is not None:
        _recorder._guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
