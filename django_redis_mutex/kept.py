"""Keeping a lock until the database transaction around its block ends.

When the block of a lock (of any kind) ends while the thread's connection is
inside ``transaction.atomic()``, the lock is kept, renewed by the watchdog,
and given back right after the outermost transaction of every alias with one
open commits or rolls back: given back at the block's end, the next holder
could read the rows before our COMMIT and overwrite them. How a commit or a
rollback is noticed is :mod:`django_redis_mutex.transactions`' business; this
module decides what the handle does with its hold.
"""

from __future__ import annotations

import logging
from typing import Protocol

from . import signals
from .client import backend_errors
from .driver import run_steps
from .exceptions import LockBackendUnavailable
from .giveback import give_back_later
from .holds import Hold, await_transaction, transaction_ended
from .topology import OneRedis
from .transactions import TransactionWait, open_transactions, warn_if_read_before
from .watchdog import declare_if_lapsed, declare_lost, get_watchdog

__all__ = ["keep_for_transaction", "lost_while_kept", "release_after_transaction", "still_kept"]

logger = logging.getLogger("django_redis_mutex")


class KeptHandle(Protocol):
    """What keeping a hold asks of its lock handle (see lock.Mutex)."""

    name: str
    using: str
    kind: str
    release_at_block_end: bool
    _where: OneRedis
    _kind_signal: dict[str, str]

    def _forget(self, hold: Hold, *, unwatched: bool = False) -> None: ...

    def _finish(self, hold: Hold, released: bool, databases: tuple[str, ...] = ()) -> None: ...


def keep_for_transaction(lock: KeptHandle, hold: Hold) -> list[str] | None:
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
    if signals.lock_held_for_transaction.receivers:
        signals.lock_held_for_transaction.send(
            sender=lock.using,
            name=lock.name,
            fence=hold.fence,
            databases=tuple(wait.aliases),
            shared=hold.shared,
            **lock._kind_signal,
        )
    return list(wait.aliases) if newly else []


def lost_while_kept(lock: KeptHandle, hold: Hold) -> None:
    """The lock was gone when its block ended in a transaction: tell the block."""
    _stop_keeping(hold)
    lock._finish(hold, False)  # raises LockNotOwned: the block raises LockLost


def still_kept(hold: Hold) -> bool:
    """Return True if ``hold`` is still kept as its block's exit returns, else stop keeping it.

    :func:`keep_for_transaction` found it held, but the watchdog may declare
    it lost while the exit's mark is on its way (a Redis, a master or this
    process slow or paused), and a quorum hold's validity may run out
    meanwhile, though the mark still reached a master. Kept, its block would
    exit cleanly and its transaction commit on a lock another owner may hold:
    the caller gives it back at once instead, and its block raises LockLost
    (or LockBackendUnavailable, when the give-back gets no answer).
    """
    declare_if_lapsed(hold)
    if not hold.lost:
        return True
    _stop_keeping(hold)
    return False


def _stop_keeping(hold: Hold) -> None:
    wait = hold.transaction_wait
    if wait is not None:
        wait.cancel()
    hold.transaction_wait = None
    transaction_ended(hold)


def release_after_transaction(lock: KeptHandle, hold: Hold) -> None:
    """Give back a hold kept for a transaction that has just committed or rolled back."""
    transaction_ended(hold)
    wait, hold.transaction_wait = hold.transaction_wait, None
    if hold.depth > 0 or not hold.active:
        return  # taken again by its owner and still held, or already given back
    get_watchdog().unwatch(hold)
    databases = tuple(wait.aliases) if wait is not None else ()
    try:
        with backend_errors(lock.name, lock.using):
            released = run_steps(lock._where.release_steps(hold))
    except LockBackendUnavailable as exc:
        lock._forget(hold, unwatched=True)
        logger.error(
            "Could not give back %s %r after its transaction ended; retrying in the background: %s",
            lock.kind,
            lock.name,
            exc,
        )
        # Its owner has left: nothing may keep it until its lease ends.
        give_back_later(
            f"{lock.kind} {lock.name!r} (fence {hold.fence})",
            lambda: lock._where.release_steps(hold),
            hold.ttl,
        )
        return
    if not released:
        lock._forget(hold, unwatched=True)
        declare_lost(hold, "it was no longer held by this owner when its transaction ended")
        logger.error(
            "%s was lost before its transaction ended: another owner may "
            "have entered while the transaction was open.",
            hold.describe(),
        )
        return
    lock._finish(hold, True, databases)
