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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .client import backend_errors, get_client, namespace, server_ms
from .decorators import MutexContext
from .driver import run_steps
from .handoff import reset_steps
from .holds import decode
from .introspection import parse_shared, scanned_keys
from .keys import LockKeys, semaphore_pattern, validate_name
from .lock import DEFAULT, Mutex
from .owners import Owner

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
    if limit < 1:
        raise ValueError(f"Semaphore limit must be at least 1, got {limit}.")
    if limit > MAX_LIMIT:
        raise ValueError(f"Semaphore limit must be at most {MAX_LIMIT}, got {limit}.")
    return limit


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

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        using: str | Sequence[str] = "default",
        ttl: float = DEFAULT,
        timeout: float | None = DEFAULT,
        blocking: bool = DEFAULT,
        watchdog: bool = DEFAULT,
        reentrant: bool = True,
        label: str | None = None,
        release_at_block_end: bool = False,
    ) -> None:
        #: How many holders may hold this semaphore at once.
        self.limit: int = validate_limit(limit)
        self._limit_args = (self.limit,)
        super().__init__(
            name,
            using=using,
            ttl=ttl,
            timeout=timeout,
            blocking=blocking,
            watchdog=watchdog,
            reentrant=reentrant,
            label=label,
            shared=True,
            release_at_block_end=release_at_block_end,
        )

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

    def __init__(self, name: str | Callable[..., str], limit: int, **options: Any) -> None:
        self._limit = validate_limit(limit)
        super().__init__(name, **options)

    def __repr__(self) -> str:
        return f"<semaphore {self._name!r} limit={self._limit}>"

    def _handle(self, name: str) -> Semaphore:
        return Semaphore(name, self._limit, **self._options)


def semaphore(
    name: str | Callable[..., str],
    limit: int,
    *,
    using: str = "default",
    ttl: float = DEFAULT,
    timeout: float | None = DEFAULT,
    blocking: bool = DEFAULT,
    watchdog: bool = DEFAULT,
    reentrant: bool = True,
    label: str | None = None,
    release_at_block_end: bool = False,
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
    return SemaphoreContext(
        name,
        limit,
        using=using,
        ttl=ttl,
        timeout=timeout,
        blocking=blocking,
        watchdog=watchdog,
        reentrant=reentrant,
        label=label,
        release_at_block_end=release_at_block_end,
    )


# -- introspection and reset ------------------------------------------------------


@dataclass(frozen=True)
class SemaphoreHolder:
    """One permit of a semaphore, as read from Redis."""

    token: str
    owner: Owner
    time_left: float
    fence: int = 0


@dataclass(frozen=True)
class HeldSemaphore:
    """One semaphore with at least one permit held, as read from Redis."""

    name: str
    limit: int | None
    holders: list[SemaphoreHolder] = field(default_factory=list)
    waiters: int = 0
    read_at: datetime = field(default_factory=lambda: datetime.now(tz=timezone.utc))

    def as_dict(self) -> dict[str, Any]:
        """Return the semaphore as plain data (for JSON output)."""
        return {
            "name": self.name,
            "limit": self.limit,
            "waiters": self.waiters,
            "holders": [
                {
                    "token": h.token,
                    "owner": h.owner.as_dict(),
                    "time_left": h.time_left,
                    "fence": h.fence,
                }
                for h in self.holders
            ],
        }


def _read_semaphores(client: Any, ns: str) -> Iterator[HeldSemaphore]:
    for batch in scanned_keys(client, semaphore_pattern(ns)):
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.hgetall(key)
            pipe.zcard(LockKeys.for_lock_key(key).queue)
        replies = pipe.execute()
        # Leases are kept as server times: read the server's clock after them.
        now_ms = server_ms(client.time())
        for index, key in enumerate(batch):
            record = {decode(k): decode(v) for k, v in replies[2 * index].items()}
            waiters = int(replies[2 * index + 1])
            name = LockKeys.for_lock_key(key).name_of(ns)
            parsed = parse_shared(name, record, waiters, now_ms)
            if parsed is None:
                continue
            tokens, held = parsed
            limit = record.get("limit", "")
            yield HeldSemaphore(
                name=name,
                limit=int(limit) if limit.isdigit() else None,
                holders=[
                    SemaphoreHolder(token, holder.owner, holder.time_left, holder.fence)
                    for token, holder in zip(tokens.split(), held.holders, strict=True)
                ],
                waiters=waiters,
            )


def held_semaphores(using: str = "default") -> list[HeldSemaphore]:
    """Return the semaphores of ``using`` with permits held now, each with its holders."""
    with backend_errors(None, using):
        found = list(_read_semaphores(get_client(using), namespace(using)))
    return sorted(found, key=lambda held: held.name)


def semaphore_lines(using: str = "default") -> list[str]:
    """Return the held semaphores of ``using`` as text lines (none when nothing is held).

    What ``manage.py locks`` prints below its table of locks.
    """
    lines = []
    for held in held_semaphores(using):
        limit = "?" if held.limit is None else str(held.limit)
        waiting = f", {held.waiters} waiting" if held.waiters else ""
        lines.append(f"  {held.name}  {len(held.holders)}/{limit} permits held{waiting}")
        for holder in held.holders:
            lines.append(f"    {holder.owner}  {holder.time_left:.1f}s left")
    if lines:
        lines.insert(0, f"Semaphores in cache {using!r}:")
    return lines


def reset_semaphore(name: str, using: str = "default") -> int:
    """Free every permit of semaphore ``name``; return how many were held.

    Waiters in line are handed the freed permits (up to the stored limit) and
    woken; a holder whose permit was freed learns it when it leaves its block
    (LockLost) or at its next renewal.
    """
    validate_name(name)
    keys = LockKeys.for_semaphore(namespace(using), name)
    with backend_errors(name, using):
        return run_steps(reset_steps(using, keys))
