"""Holds: the local record of a lock this process holds, and who holds it.

A hold is shared by every handle that entered the same lock reentrantly in one
owner. An owner is an asyncio task when code runs inside one, else a thread,
and always within one process: a child task or a forked child is a new owner.
The registry lives in a context variable, never in ``threading.local``, so
tasks that share a thread never share a hold (and therefore a token).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from .keys import LockKeys

__all__ = [
    "Hold",
    "current_hold",
    "current_owner",
    "forget_hold",
    "owner_metadata",
    "remember_hold",
]


def _running_task() -> asyncio.Task[Any] | None:
    # _get_running_loop() answers None outside a loop instead of raising, which
    # keeps this check cheap on the synchronous hot path.
    if asyncio._get_running_loop() is None:
        return None
    return asyncio.current_task()


def current_owner() -> object:
    """Return the identity of the code running now: its asyncio task, or its thread."""
    task = _running_task()
    if task is not None:
        return task
    return (os.getpid(), threading.get_ident())


@cache
def _hostname() -> str:
    return socket.gethostname()


@lru_cache(maxsize=256)
def _owner_json(pid: int, where: str, label: str | None) -> str:
    return json.dumps(
        {"host": _hostname(), "pid": pid, "thread": where, "label": label},
        separators=(",", ":"),
    )


def owner_metadata(label: str | None) -> str:
    """Return the JSON owner record stored with a lock: host, pid, thread or task, label."""
    task = _running_task()
    where = task.get_name() if task is not None else threading.current_thread().name
    return _owner_json(os.getpid(), where, label)


@dataclass(eq=False)
class Hold:
    """One acquisition of a lock, shared by the handles nested inside it."""

    alias: str
    name: str
    keys: LockKeys
    token: str
    fence: int
    ttl: float
    owner: object
    acquired_at: float = field(default_factory=time.monotonic)
    depth: int = 1
    active: bool = True
    lost: bool = False
    lost_reason: str = ""
    # When the lease runs out by this process's clock, unless renewed or
    # extended; a hold past it is never re-entered (Redis may have let it go).
    expires_at: float = float("inf")
    # Where the lock lives: (alias, lock key) per Redis master, and how many of
    # them must agree (1 for a single Redis, a majority for a quorum lock).
    targets: tuple[tuple[str, str], ...] = ()
    quorum: int = 1
    # Watchdog bookkeeping.
    renew_at: float = 0.0
    max_hold: float | None = None
    raise_on_lost: bool = True

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = ((self.alias, self.keys.lock),)

    def mark_lost(self, reason: str) -> bool:
        """Record that the lock is no longer ours; return True the first time."""
        if self.lost:
            return False
        self.lost = True
        self.lost_reason = reason
        return True


_holds: ContextVar[dict[tuple[str, str], Hold] | None] = ContextVar(
    "django_redis_mutex_holds", default=None
)


def current_hold(alias: str, lock_key: str) -> Hold | None:
    """Return the live hold the current owner has on a lock, if any."""
    holds = _holds.get()
    if not holds:
        return None
    hold = holds.get((alias, lock_key))
    if hold is None or not hold.active or hold.owner != current_owner():
        return None
    return hold


def remember_hold(hold: Hold) -> None:
    """Make ``hold`` visible to nested acquisitions by the same owner."""
    # Copy only live holds: a release that ran in another task (a shielded
    # arelease) could not drop its entry from this context.
    holds = {key: held for key, held in (_holds.get() or {}).items() if held.active}
    holds[(hold.alias, hold.keys.lock)] = hold
    _holds.set(holds)


def forget_hold(hold: Hold) -> None:
    """Mark ``hold`` as over and drop it from the current context if it is there."""
    hold.active = False
    holds = _holds.get()
    if holds and holds.get((hold.alias, hold.keys.lock)) is hold:
        holds = dict(holds)
        del holds[(hold.alias, hold.keys.lock)]
        _holds.set(holds)


def decode(value: Any) -> str:
    """Return a Redis reply as text, whatever the client's decode_responses."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
