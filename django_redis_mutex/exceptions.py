"""Errors raised by django-redis-mutex.

Every error a caller can act on has its own class, and each carries the name of
the lock it is about, so a log line or a 503 page can say which lock it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .owners import Owner


class LockError(Exception):
    """Base class of every error this app raises about a lock."""

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the message and attributes, not by calling __init__
        # again: subclasses take keyword-only arguments, and these errors
        # cross process boundaries (Celery results, multiprocessing pools).
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[LockError], args: tuple[Any, ...], state: dict[str, Any]) -> LockError:
    """Recreate a pickled LockError without calling its __init__."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class LockContended(LockError):
    """The lock is held by another owner and could not be acquired in time.

    ``retry_after`` is the number of whole seconds (at least 1) until the
    holder's lease runs out, suitable for an HTTP ``Retry-After`` header.
    ``owner`` is the holder's metadata (host, pid, thread, label) when known.
    """

    def __init__(
        self,
        name: str,
        *,
        retry_after: int = 1,
        owner: Owner | None = None,
        waited: float = 0.0,
    ) -> None:
        holder = f" by {owner}" if owner else ""
        super().__init__(f"Lock {name!r} is held{holder}; retry after {retry_after}s.", name=name)
        self.retry_after = retry_after
        self.owner = owner
        self.waited = waited


class LockDeadlock(LockContended):
    """Waiting for the lock would never end: its holder waits, directly or through others, for us.

    The acquisition was one wait of a cycle of waits (each waiting for a lock
    the next one holds) and was chosen to end, as a timeout ends a wait: it
    left the line and holds nothing of this lock. The locks the caller already
    holds are still held until it releases them (a ``with`` block or a
    decorated call does so as this error unwinds it), which lets the others of
    the cycle go on. ``cycle`` describes the waits found, in order, starting
    with this one. See :doc:`deadlocks`.

    .. versionadded:: 0.3.0
    """

    def __init__(
        self,
        name: str,
        *,
        cycle: tuple[str, ...] = (),
        retry_after: int = 1,
        owner: Owner | None = None,
        waited: float = 0.0,
    ) -> None:
        super().__init__(name, retry_after=retry_after, owner=owner, waited=waited)
        self.cycle = tuple(cycle)
        found = ", which waits for ".join(self.cycle) or "its holder waits for us"
        self.args = (
            f"Deadlock waiting for lock {name!r}: {found}. This wait, the youngest of the "
            "cycle, was ended: release the locks held before retrying.",
        )


class LockLost(LockError):
    """A hold ended without our release: it expired, was reset, or was taken.

    Raised when leaving a ``with`` block (or a decorated call) whose body
    succeeded but whose lock was no longer ours, because the work done inside
    may have overlapped another owner's.
    """


class LockUpgradeRefused(LockError):
    """An exclusive acquisition nested inside a shared hold of the same lock by the same owner.

    Turning a shared hold into an exclusive one would wait for every other
    shared holder, and two owners doing so at once would wait for each other
    forever; release the shared hold first, or take the lock exclusively from
    the start.

    .. versionadded:: 0.2
    """


class LockNotOwned(LockError):
    """``release()`` or ``extend()`` was called on a handle that does not hold the lock."""


class LockBackendUnavailable(LockError):
    """Redis could not be reached, or did not answer within the socket timeout."""


class LockNotReplicated(LockBackendUnavailable):
    """Too few replicas acknowledged an acquisition within ``WAIT_TIMEOUT``; it was given back.

    ``acknowledged`` replicas confirmed the lock's write, ``required`` were
    asked for (``WAIT_REPLICAS``) on cache ``alias``. The lock was released
    (handed on to the next waiter, as a release does) before this was raised.

    .. versionadded:: 0.1
    """

    def __init__(
        self, name: str, *, alias: str, acknowledged: int, required: int, timeout: float
    ) -> None:
        super().__init__(
            f"Lock {name!r} on cache {alias!r} was acknowledged by {acknowledged} "
            f"replica(s) within {timeout:g}s, {required} required (WAIT_REPLICAS); "
            "it was given back.",
            name=name,
        )
        self.alias = alias
        self.acknowledged = acknowledged
        self.required = required
        self.timeout = timeout


class StaleFence(LockError):
    """A fenced write was refused: a later holder of the lock already wrote the row.

    The writer's hold ended without its knowing (a pause longer than its lease,
    a reset, a Redis failover) and a newer holder, whose fencing token is
    larger, has written since; nothing was changed. ``fence`` is the refused
    token, ``current`` the token of the write the row holds now, ``name`` the
    lock's name when the write was given the lock itself (else None).
    """

    def __init__(
        self,
        name: str | None,
        *,
        fence: int,
        current: int,
        target: str = "the row",
    ) -> None:
        by = f"lock {name!r} fence {fence}" if name is not None else f"fence {fence}"
        super().__init__(
            f"Fenced write to {target} refused: {by} is older than fence {current}, "
            "which a later holder already wrote.",
            name=name,
        )
        self.fence = fence
        self.current = current
        self.target = target
