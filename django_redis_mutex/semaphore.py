"""Semaphore: at most ``limit`` holders of one name at once, each permit its own lease.

A semaphore is the lock engine's shared kind with a bound: each permit is a
shared holder's record (its own lease, renewed by the watchdog, and its own
fencing token), and the scripts admit no more shared holders than the limit
the caller gives, which the semaphore's hash keeps for the releases and
resets that hand permits on. Waiting, hand-off, reentrancy, transactions,
``FAIL_OPEN``, signals and the watchdog are the lock's own (see
:mod:`django_redis_mutex.lock`): only the keys (``<namespace>:semaphore:{...}``,
see :mod:`django_redis_mutex.keys`) and the limit differ.

Signals are the lock's, with ``kind="semaphore"`` among their arguments.

.. versionadded:: 0.1.0
.. versionchanged:: 0.3.0
   Built on the lock engine: permits carry fences, and a handle shared by
   threads takes one permit per thread, as a lock handle takes one hold each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .client import namespace
from .conf import LockOptions, check_bounds
from .decorators import MutexContext

# Listed and reset with the locks, by the same functions; importable from here too.
from .introspection import (
    HeldSemaphore,
    SemaphoreHolder,
    held_semaphores,
    reset_semaphore,
    semaphore_lines,
)
from .keys import LockKeys
from .lock import Mutex

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "HeldSemaphore",
    "Semaphore",
    "SemaphoreContext",
    "SemaphoreHolder",
    "held_semaphores",
    "reset_semaphore",
    "semaphore",
    "semaphore_lines",
    "validate_limit",
]

# A semaphore's limit travels with every call; this bounds a typo, not a design.
MAX_LIMIT = 1_000_000


def validate_limit(limit: object) -> int:
    """Return ``limit`` if it is a usable number of permits, else raise TypeError/ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"Semaphore limit must be an int, not {type(limit).__name__}.")
    return check_bounds("Semaphore limit", limit, 1, MAX_LIMIT, limit)


class Semaphore(Mutex):
    """A counting semaphore: at most ``limit`` holders of ``name`` at once.

    Use it as ``with Semaphore("exports", 3):``, ``async with``, or through
    ``acquire()``/``release()`` and their async twins. Arguments left out take
    the cache alias's ``MUTEX`` defaults (``TTL``, ``TIMEOUT``, ``BLOCKING``,
    ``WATCHDOG``). Like a lock handle, one handle holds at most one permit per
    thread or task, and a nested block of the same owner joins it.

    Every holder of one name should pass the same ``limit``: each call
    enforces the limit it is given, so a call with a smaller limit waits until
    the holders fall below it, never evicting anyone.
    """

    kind = "semaphore"
    _kind_signal = {"kind": "semaphore"}

    def __init__(self, name: str, limit: int, **options: Unpack[LockOptions]) -> None:
        #: How many holders may hold this semaphore at once.
        self.limit: int = validate_limit(limit)
        self._limit_args = (self.limit,)
        super().__init__(name, shared=True, **options)

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} using={self._using_shown()!r}>"

    def _keys_on(self, alias: str) -> LockKeys:
        return LockKeys.for_semaphore(namespace(alias), self.name)

    @property
    def ttl(self) -> float:  # type: ignore[override]
        """The lease of each permit, in seconds (``lease`` on a lock handle)."""
        return self.lease


# -- semaphore(): with, async with, decorator -----------------------------------


class SemaphoreContext(MutexContext):
    """What :func:`semaphore` returns; see there."""

    _factory = "semaphore()"
    _accepted = LockOptions.__optional_keys__

    def __init__(self, name: str | Callable[..., str], limit: int, **options: Any) -> None:
        self._limit = validate_limit(limit)
        super().__init__(name, **options)

    def __repr__(self) -> str:
        return f"<semaphore {self._name!r} limit={self._limit}>"

    def _new(self, name: str) -> Semaphore:
        return Semaphore(name, self._limit, **self._options)


def semaphore(
    name: str | Callable[..., str], limit: int, **options: Unpack[LockOptions]
) -> SemaphoreContext:
    """Let at most ``limit`` holders of ``name`` run a block or a function at once.

    Use it as ``with semaphore("exports", 3):``, ``async with ...``, or as
    ``@semaphore("tenant:{tenant_id}", 2)`` on a sync or async function. Raise
    LockContended when no permit comes free in time, LockLost when the permit
    ended while a successful body ran, LockBackendUnavailable when Redis
    cannot be reached. Inside a database transaction a permit is kept until
    the transaction ends, unless ``release_at_block_end=True`` (see
    :doc:`transactions`).
    """
    return SemaphoreContext(name, limit, **options)
