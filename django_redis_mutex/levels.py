"""What one lock handle holds, per owner: its levels, its entered blocks, its last failure.

A handle may be shared by threads and asyncio tasks (its owners, see
:func:`~django_redis_mutex.holds.current_owner`). Each owner's acquisitions
are its own :class:`~django_redis_mutex.holds.Hold`; a nested level repeats
its hold, each entered ``with`` block is left by the exit of the same owner,
and a failed acquisition is reported to the owner that failed. This module
keeps that bookkeeping, guarded where owners meet, so the handle
(:mod:`django_redis_mutex.lock`) only decides.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .holds import Contention, Hold, Scope, current_owner

__all__ = ["Block", "Levels"]

# The owners whose last failure a handle keeps (see Levels.failed).
_FAILURES_KEPT = 16


@dataclass(eq=False, slots=True)
class Block:
    """One entered ``with`` block of a handle: its owner, hold (None: FAIL_OPEN) and scope."""

    owner: object
    hold: Hold | None
    scope: Scope | None


class Levels:
    """The levels, blocks and last failures of one handle's owners."""

    __slots__ = ("_blocks", "_failures", "_guard", "_levels")

    def __init__(self) -> None:
        # One entry per level held; a nested level repeats its hold.
        self._levels: list[Hold] = []
        # One entry per entered with block, so each exit leaves what its enter took.
        self._blocks: list[Block] = []
        # The last failed acquisition of each owner, latest last.
        self._failures: dict[object, Contention] = {}
        self._guard = threading.Lock()

    def current(self) -> Hold | None:
        """Return the hold to act on: the latest of the current owner, else the latest."""
        levels = self._levels
        if len(levels) <= 1:
            return levels[0] if levels else None
        owner = current_owner()
        with self._guard:
            for hold in reversed(self._levels):
                if hold.owner == owner:
                    return hold
            return self._levels[-1] if self._levels else None

    def of_owner(self) -> Hold | None:
        """Return the latest hold of the current owner, or None."""
        if not self._levels:
            return None
        owner = current_owner()
        with self._guard:
            return next((h for h in reversed(self._levels) if h.owner == owner), None)

    def add(self, hold: Hold) -> None:
        """Add a new level for ``hold`` (a new acquisition, or a nested one: see :meth:`nest`)."""
        with self._guard:
            self._levels.append(hold)

    def nest(self, hold: Hold) -> None:
        """Add one more level of ``hold``."""
        with self._guard:
            hold.depth += 1
            self._levels.append(hold)

    def drop(self, hold: Hold) -> bool:
        """Leave one level of ``hold``; return True if another level still holds it."""
        with self._guard:
            for i in range(len(self._levels) - 1, -1, -1):
                if self._levels[i] is hold:
                    del self._levels[i]
                    break
            hold.depth -= 1
            return hold.depth > 0

    def remove(self, hold: Hold) -> None:
        """Drop every level of ``hold`` (a release has usually dropped the last already)."""
        if self._levels:
            with self._guard:
                self._levels = [level for level in self._levels if level is not hold]

    # -- with blocks -------------------------------------------------------------

    def enter(self, hold: Hold | None, scope: Scope | None) -> None:
        """Record a block the current owner entered (``hold`` None: it runs unlocked)."""
        with self._guard:
            self._blocks.append(Block(current_owner(), hold, scope))

    def leave(self) -> Block | None:
        """Pop the block being left: the current owner's latest, else the latest of all.

        A block is normally left by the owner that entered it; an async
        generator closed by another task leaves it from there.
        """
        owner = current_owner()
        with self._guard:
            for i in range(len(self._blocks) - 1, -1, -1):
                if self._blocks[i].owner == owner:
                    return self._blocks.pop(i)
            return self._blocks.pop() if self._blocks else None

    # -- failures ----------------------------------------------------------------

    def failed(self, contention: Contention) -> None:
        """Keep ``contention`` as the current owner's last failure, for ``contended()``.

        Kept per owner: a thread-local would be shared by the asyncio tasks of
        one thread, and a context variable is meant to be made once per
        process, not per handle. An owner's entry goes when it next acquires,
        and at most ``_FAILURES_KEPT`` owners are kept, oldest out first, so
        threads and tasks that failed and ended never make a long-lived handle
        grow.
        """
        owner = current_owner()
        with self._guard:
            kept = self._failures
            kept.pop(owner, None)  # back in last: the latest
            kept[owner] = contention
            if len(kept) > _FAILURES_KEPT:
                del kept[next(iter(kept))]

    def last_failure(self) -> Contention:
        """Return the current owner's last failure (else the handle's latest, else none).

        An ``aacquire()`` run in a task of its own (``asyncio.wait_for`` before
        Python 3.12 does that) failed as another owner: its caller gets the
        latest failure.
        """
        owner = current_owner()
        with self._guard:
            contention = self._failures.get(owner)
            if contention is None and self._failures:
                contention = next(reversed(self._failures.values()))
        return contention or Contention()

    def succeeded(self) -> None:
        """Forget the current owner's last failure: it has the lock now."""
        if self._failures:
            owner = current_owner()
            with self._guard:
                self._failures.pop(owner, None)
