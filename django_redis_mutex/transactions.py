"""Keep a lock until the database transaction around its block has ended.

A lock given back when its block ends, while the thread is still inside
``transaction.atomic()``, lets the next holder read the rows before this
holder's COMMIT (or, on REPEATABLE READ, from a snapshot taken before it) and
overwrite them: exclusion of code, not of data. So a lock released inside an
open transaction stays held (the watchdog keeps renewing it) until the
outermost transaction of every database connection of this thread that has one
open has committed or rolled back, as PostgreSQL's ``pg_advisory_xact_lock``
does.

Django calls back on commit (``on_commit``) but has no rollback hook. A
rollback, though, discards the commit callbacks registered inside it: the
outermost one empties the connection's list, a savepoint's drops the entries
registered inside that savepoint, and closing the connection empties it too.
The callback registered here is referenced by that list alone, so CPython frees
it the moment Django drops it, and its ``weakref.finalize`` runs right there,
inside the rollback: the lock is given back within the same call, without
waiting for the lease. A callback dropped by a savepoint rollback while the
outer transaction goes on is registered again at the outer level.

The transactions of Django's ``TestCase`` (``pytest.mark.django_db`` without
``transaction=True``) are never committed, and nothing done inside them is seen
by another connection: they do not count, as they do not for
``atomic(durable=True)``.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "LockAfterReadWarning",
    "TransactionWait",
    "open_transactions",
    "warn_if_read_before",
    "watch_connection",
    "watch_open_connections",
]

logger = logging.getLogger("django_redis_mutex")


# Per thread: the database connections this thread has connected (Django's
# connections are per thread), filled by ``connection_created``. Asking these
# costs a lock's release a fraction of a microsecond when none is in a
# transaction, where asking Django's connection handler costs several.
_connected = threading.local()


def open_transactions() -> list[Any]:
    """Return this thread's database connections inside a transaction a lock must wait for.

    A connection whose outermost atomic block is a ``TestCase``'s is left out.
    """
    known = getattr(_connected, "connections", None)
    if not known:
        return []
    return [
        connection
        for connection in list(known)
        if connection.in_atomic_block and not _outermost_is_testcase(connection.atomic_blocks)
    ]


def _outermost_is_testcase(blocks: list[Any]) -> bool:
    """Return True if the outermost of ``blocks`` is a ``TestCase``'s atomic block."""
    return bool(blocks) and getattr(blocks[0], "_from_testcase", False)


class LockAfterReadWarning(RuntimeWarning):
    """A lock was taken inside a transaction that had already read from the database.

    The lock cannot protect what the transaction read before it: those rows
    may have been changed since by the lock's previous holder, and on
    REPEATABLE READ (MySQL's and MariaDB's default) even the reads after the
    lock see the snapshot taken at the first read. Take the lock before the
    transaction begins. Silence it with
    ``warnings.filterwarnings("ignore", category=LockAfterReadWarning)``.
    """


# Statements Django itself sends inside atomic blocks: they read no rows.
_TRANSACTION_CONTROL = ("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT", "BEGIN")


def _mark_reads(
    execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """An execute wrapper: note when a transaction ran its first query."""
    connection = context["connection"]
    if connection.in_atomic_block:
        transaction = _transaction_of(connection)
        noted = getattr(connection, "_mutex_first_query", None)
        if (noted is None or noted[0] != transaction) and not (
            isinstance(sql, str) and sql.lstrip().upper().startswith(_TRANSACTION_CONTROL)
        ):
            connection._mutex_first_query = (transaction, time.monotonic())
    return execute(sql, params, many, context)


def _transaction_of(connection: Any) -> tuple[int, Any]:
    """Return what tells the open transaction of ``connection`` from earlier ones.

    Its outermost atomic block alone does not (``@transaction.atomic`` reuses
    one for every call), so with the identity of its list of commit
    callbacks, which Django replaces whenever a transaction ends. Neither is
    kept alive here: a list held on to would keep the commit hooks of a
    rolled-back transaction from being freed (see TransactionWait).
    """
    blocks = connection.atomic_blocks
    return id(connection.run_on_commit), weakref.ref(blocks[0]) if blocks else None


def watch_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    """On ``connection_created``: let locks find ``connection`` and its transactions' reads.

    Its execute wrapper notes when each transaction first queries. It is put
    first in the connection's execute wrappers, so a wrapper that a ``with
    connection.execute_wrapper(...)`` block pushes is still the last one,
    which the block's exit pops.
    """
    known = getattr(_connected, "connections", None)
    if known is None:
        known = _connected.connections = weakref.WeakSet()
    known.add(connection)
    if _mark_reads not in connection.execute_wrappers:
        connection.execute_wrappers.insert(0, _mark_reads)


def watch_open_connections() -> None:
    """Watch the connections this thread opened before the app was ready."""
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        if connection.connection is not None:
            watch_connection(None, connection)


def warn_if_read_before(name: str, connections: list[Any], acquired_at: float) -> None:
    """Warn when one of ``connections``' transactions had queried before the lock was taken."""
    for connection in connections:
        noted = getattr(connection, "_mutex_first_query", None)
        if noted is None:
            continue
        transaction, first = noted
        if transaction == _transaction_of(connection) and first < acquired_at:
            warnings.warn(
                f"Lock {name!r} was taken inside a transaction on database "
                f"{connection.alias!r} that had already queried it: the lock does not "
                "protect what was read before it (and on REPEATABLE READ, later reads see "
                "the older snapshot). Take the lock before the transaction begins "
                "(see the Transactions page of the docs).",
                LockAfterReadWarning,
                stacklevel=5,
            )
            return


class TransactionWait:
    """Run ``give_back`` once, when every listed connection's open transaction has ended.

    Created inside the transactions, in the thread that owns the connections;
    ``give_back`` runs in that thread too, right after the COMMIT or inside the
    ROLLBACK (or when the connection is closed or its thread ends).
    """

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._waiting: set[int] = set()
        self._lock = threading.Lock()
        self._done = False
        #: The aliases of the databases waited for, for listings and log lines.
        self.aliases: list[str] = []

    @property
    def done(self) -> bool:
        """True once the lock was handed back to ``give_back``."""
        return self._done

    def cancel(self) -> None:
        """Give nothing back when the transactions end (the lock was found lost)."""
        with self._lock:
            self._done = True

    def add(self, connections: list[Any]) -> None:
        """Also wait for the transactions now open on ``connections``."""
        for connection in connections:
            if id(connection) in self._waiting:
                continue
            self._waiting.add(id(connection))
            if connection.alias not in self.aliases:
                self.aliases.append(connection.alias)
            self._register(connection)

    def _register(self, connection: Any) -> None:
        key = id(connection)
        ran = [False]  # shared with the finalizer, which must not refer to the hook

        def hook() -> None:
            ran[0] = True
            self._ended(key)

        # Only the connection's list of commit callbacks refers to the hook:
        # when Django drops it (rollback, savepoint rollback, close), the
        # finalizer runs at once. It must not keep the connection alive.
        weakref.finalize(
            hook, self._dropped, key, ran, weakref.ref(connection), list(connection.savepoint_ids)
        )
        connection.on_commit(hook)

    def _dropped(
        self, key: int, ran: list[bool], connection_ref: Any, savepoints: list[Any]
    ) -> None:
        """Run when Django let go of a commit hook: after running it, or unrun (a rollback)."""
        if ran[0]:
            return
        connection = connection_ref()  # None: the connection is gone with its thread
        # Still inside a transaction: either a savepoint we were registered in was
        # rolled back (it has been popped already, so fewer are open than at
        # registration) and the outer transaction goes on, or the connection is
        # being closed (nothing popped), which ends the transaction.
        if (
            connection is not None
            and connection.in_atomic_block
            and len(connection.savepoint_ids) < len(savepoints)
        ):
            try:
                self._register(connection)
                return
            except Exception:
                logger.exception("Could not wait for the outer transaction; giving the lock back.")
        self._ended(key)

    def _ended(self, key: int) -> None:
        with self._lock:
            self._waiting.discard(key)
            if self._waiting or self._done:
                return
            self._done = True
        try:
            self._give_back()
        except Exception:  # never into Django's commit or rollback
            logger.exception("Could not give back a lock after its transaction ended.")
