"""Ending a hold: given back now, from the background, or when its transaction ends.

When the block of a lock (of any kind) ends while the thread's connection is
inside ``transaction.atomic()``, the lock is kept, renewed by the watchdog,
and given back right after the outermost transaction of every alias with one
open commits or rolls back: given back at the block's end, the next holder
could read the rows before our COMMIT and overwrite them. How a commit or a
rollback is noticed is :mod:`django_redis_mutex.transactions`' business; this
module decides what the handle does with its hold.

A release whose answer never came leaves the hold on the handle for a retry,
and the background gives the lock back until Redis answers: its owner may
never retry.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from . import signals, stats
from .driver import AsyncDriver, Steps, run_steps
from .exceptions import LockBackendUnavailable, LockNotOwned
from .giveback import give_back_later
from .holds import Hold, await_transaction, transaction_ended
from .levels import Levels
from .topology import LockHandle, OneRedis
from .transactions import TransactionWait, open_transactions, warn_if_read_before
from .watchdog import declare_if_lapsed, declare_lost, get_watchdog

__all__ = [
    "Handle",
    "agive_back",
    "arelease",
    "finish",
    "forget",
    "give_back",
    "held_or_raise",
    "keep_for_transaction",
    "lost_while_kept",
    "release",
    "release_after_transaction",
    "release_failed_locally",
]

T = TypeVar("T")

logger = logging.getLogger("django_redis_mutex")


class Handle(LockHandle, Protocol):
    """What acquiring and ending a hold ask of its lock handle (see lock.Mutex)."""

    shared: bool
    watchdog: bool
    release_at_block_end: bool
    _where: OneRedis
    _levels: Levels
    _kind_signal: dict[str, str]

    def _run(self, steps: Steps[T]) -> T: ...

    async def _arun(self, steps: Steps[T]) -> T: ...


def forget(lock: Handle, hold: Hold, *, unwatched: bool = False) -> None:
    """End ``hold`` locally: no renewal, no level of this handle, nothing nests into it."""
    if not unwatched:
        get_watchdog().unwatch(hold)
    hold.active = False
    lock._levels.remove(hold)


def give_back(lock: Handle, hold: Hold) -> None:
    """Release a hold the caller will never see (best effort; its lease ends anyway)."""
    forget(lock, hold)
    try:
        run_steps(lock._where.release_steps(hold))
    except Exception as exc:
        logger.warning("Could not give back %s %r: %s", lock.kind, lock.name, exc)


async def agive_back(lock: Handle, hold: Hold) -> None:
    """Async twin of :func:`give_back`."""
    forget(lock, hold)
    try:
        await AsyncDriver().run(lock._where.release_steps(hold))
    except Exception as exc:
        logger.warning("Could not give back %s %r: %s", lock.kind, lock.name, exc)


def release(lock: Handle, hold: Hold) -> None:
    """Release one level of ``hold``: kept for an open transaction, else given back in Redis."""
    if lock._levels.drop(hold):
        return
    kept = keep_for_transaction(lock, hold)
    if kept and not run_steps(lock._where.mark_steps(hold, kept)):
        lost_while_kept(lock, hold)
    if _stays(hold, kept):
        return
    try:
        released = lock._run(lock._where.release_steps(hold))
    except BaseException:
        release_failed_locally(lock, hold)
        raise
    finish(lock, hold, released)


async def arelease(lock: Handle, hold: Hold) -> None:
    """Async twin of :func:`release`."""
    if lock._levels.drop(hold):
        return
    kept = keep_for_transaction(lock, hold)
    if kept and not await AsyncDriver().run(lock._where.mark_steps(hold, kept)):
        lost_while_kept(lock, hold)
    if _stays(hold, kept):
        return
    try:
        released = await lock._arun(lock._where.release_steps(hold))
    except BaseException:
        release_failed_locally(lock, hold)
        raise
    finish(lock, hold, released)


def _stays(hold: Hold, kept: list[str] | None) -> bool:
    """Return True if ``hold`` stays kept for its transaction, else stop renewing it.

    :func:`keep_for_transaction` found it held, but the watchdog may declare
    it lost while the exit's mark is on its way (a Redis, a master or this
    process slow or paused), and a quorum hold's validity may run out
    meanwhile, though the mark still reached a master. Kept, its block would
    exit cleanly and its transaction commit on a lock another owner may hold:
    the caller gives it back at once instead, and its block raises LockLost
    (or LockBackendUnavailable, when the give-back gets no answer).
    """
    if kept is not None:
        declare_if_lapsed(hold)
        if not hold.lost:
            return True
        _stop_keeping(hold)
    # Stop renewing first: a renewal answered after our release would
    # otherwise report the lock as lost.
    get_watchdog().unwatch(hold)
    return False


def held_or_raise(lock: Handle, action: str) -> Hold:
    """Return the hold ``action`` applies to, or raise LockNotOwned."""
    hold = lock._levels.current()
    if hold is None or not hold.active:
        raise LockNotOwned(
            f"Cannot {action} {lock.kind} {lock.name!r}: this handle does not hold it.",
            name=lock.name,
        )
    return hold


def release_failed_locally(lock: Handle, hold: Hold) -> None:
    """Keep a hold whose release failed on the handle, for a retry, and never renew it."""
    # The release may have reached Redis with only its reply lost: stop
    # renewing, and never let anything nest into this hold again. The level
    # stays, so the release can be retried.
    get_watchdog().unwatch(hold)
    hold.releasing = True
    lock._levels.nest(hold)
    # Called while the failure propagates. Redis not answering may also
    # mean the release never ran (dropped with its connection), and a
    # cancel may have cut it before it was sent (its connection still being
    # made): the owner has left, so the background gives the lock back
    # until Redis answers, unless the caller's own retry does first.
    if isinstance(sys.exc_info()[1], (LockBackendUnavailable, asyncio.CancelledError)):
        _give_back_later(lock, hold, lambda: hold.active)


def _give_back_later(lock: Handle, hold: Hold, needed: Callable[[], bool] | None = None) -> None:
    give_back_later(
        f"{lock.kind} {lock.name!r} (fence {hold.fence})",
        lambda: lock._where.release_steps(hold),
        hold.ttl,
        needed,
    )


def finish(lock: Handle, hold: Hold, released: bool, databases: tuple[str, ...] = ()) -> None:
    """Forget the hold after Redis answered the release (the watchdog had let go before)."""
    if not released and hold.releasing:
        # A retry of a release that failed: that release (only its reply
        # lost) or the background give-back after it may have freed the
        # lock first. It was let go, not lost.
        released = True
    forget(lock, hold, unwatched=True)
    if released:
        counted = hold.counted_as
        if counted is None and not signals.lock_released.receivers:
            return
        held = time.monotonic() - hold.acquired_at
        if counted is not None:
            stats.released(lock.using, counted, held)
        signals.send_about(
            signals.lock_released,
            lock,
            shared=hold.shared,
            fence=hold.fence,
            held=held,
            databases=databases,
        )
        return
    declare_lost(hold, "it was no longer held by this owner at release")
    raise LockNotOwned(
        f"{hold.describe()} was no longer held at release: "
        "it expired, was reset, or was taken by another owner.",
        name=lock.name,
    )


def keep_for_transaction(lock: Handle, hold: Hold) -> list[str] | None:
    """Keep ``hold`` until this thread's open transactions end, if any are open.

    Return None when the lock is to be given back now, else the aliases
    of the databases waited for when this made the hold wait (its owner
    record is to be marked), or [] when it was waiting already.

    Given back now, the next holder could read the rows before our COMMIT
    (or from a snapshot older than it) and overwrite them. The watchdog
    keeps renewing the lease meanwhile; the transaction's end gives the lock
    back (see transactions.py).
    """
    if lock.release_at_block_end or hold.lost:
        # A hold already lost is not kept: its release tells the block,
        # whose LockLost then rolls the transaction back.
        return None
    connections = open_transactions()
    if not connections:
        return None
    wait = hold.transaction_wait
    newly = wait is None or wait.done
    if wait is None or wait.done:
        wait = hold.transaction_wait = TransactionWait(
            lambda: release_after_transaction(lock, hold)
        )
        await_transaction(hold)
        warn_if_read_before(lock.name, connections, hold.acquired_at)
    wait.add(connections)
    signals.send_about(
        signals.lock_held_for_transaction,
        lock,
        shared=hold.shared,
        fence=hold.fence,
        databases=tuple(wait.aliases),
    )
    return list(wait.aliases) if newly else []


def lost_while_kept(lock: Handle, hold: Hold) -> None:
    """The lock was gone when its block ended in a transaction: tell the block."""
    _stop_keeping(hold)
    finish(lock, hold, False)  # raises LockNotOwned: the block raises LockLost


def _stop_keeping(hold: Hold) -> None:
    wait = hold.transaction_wait
    if wait is not None:
        wait.cancel()
    hold.transaction_wait = None
    transaction_ended(hold)


def release_after_transaction(lock: Handle, hold: Hold) -> None:
    """Give back a hold kept for a transaction that has just committed or rolled back."""
    transaction_ended(hold)
    wait, hold.transaction_wait = hold.transaction_wait, None
    if hold.depth > 0 or not hold.active:
        return  # taken again by its owner and still held, or already given back
    get_watchdog().unwatch(hold)
    databases = tuple(wait.aliases) if wait is not None else ()
    try:
        released = lock._run(lock._where.release_steps(hold))
    except LockBackendUnavailable as exc:
        forget(lock, hold, unwatched=True)
        logger.error(
            "Could not give back %s %r after its transaction ended; retrying in the background: %s",
            lock.kind,
            lock.name,
            exc,
        )
        # Its owner has left: nothing may keep it until its lease ends.
        _give_back_later(lock, hold)
        return
    if not released:
        forget(lock, hold, unwatched=True)
        declare_lost(hold, "it was no longer held by this owner when its transaction ended")
        logger.error(
            "%s was lost before its transaction ended: another owner may "
            "have entered while the transaction was open.",
            hold.describe(),
        )
        return
    finish(lock, hold, True, databases)
