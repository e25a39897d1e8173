"""Waking a waiter that a script handed the lock to but could not wake itself.

A script may push a waiter's wake-up only when that waiter's list is among its
KEYS (see :mod:`django_redis_mutex.scripts`). When it is not (a release whose
holder did not know who would be next, a cancel or reset, an acquisition
that found an expired lock with waiters), the script hands the lock over and
returns the new holder's token; the steps here then send :data:`~.scripts.WAKE`
for it. That second step is best effort: if it is lost (Redis unreachable,
the client gone), the waiter's next check-in finds the lock already granted
to it, at most half a wait lease later.

Like the lock's own steps, these yield what to run and do no I/O (see
:mod:`django_redis_mutex.driver`), so sync and async callers share them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import scripts
from .driver import Script, Steps
from .holds import decode
from .keys import LockKeys

__all__ = [
    "Wakeup",
    "handed_to",
    "parse_wakeup",
    "read_state_steps",
    "release_steps",
    "reset_steps",
    "wake_steps",
]


def handed_to(reply: Any) -> list[str]:
    """Return the waiters a RELEASE, RESET, ACQUIRE or CANCEL reply says the caller must wake.

    Those scripts answer with text exactly when they handed the lock to
    waiters they could not wake: one token, or several space-separated when a
    run of shared waiters got it together; every other answer is a number or ''.
    """
    if isinstance(reply, (bytes, str)):
        return decode(reply).split()
    return []


def wake_steps(alias: str, keys: LockKeys, token: str) -> Steps[None]:
    """Push the wake-up of waiter ``token``, if the lock is still its own (best effort)."""
    yield Script(
        alias,
        scripts.WAKE,
        (keys.lock, keys.queue, keys.wake(token)),
        [token],
        best_effort=True,
    )


def _woken(alias: str, keys: LockKeys, reply: Any) -> Steps[None]:
    for head in handed_to(reply):
        yield from wake_steps(alias, keys, head)


def read_state_steps(alias: str, keys: LockKeys, token: str = "") -> Steps[list[Any]]:
    """Return what READ_STATE says of the lock on ``alias``, and of ``token``'s hold."""
    _sent, state = yield Script(alias, scripts.READ_STATE, (keys.lock,), [token])
    return list(state)


def reset_steps(alias: str, keys: LockKeys, floor: int | None = None) -> Steps[int]:
    """Force-release the lock on ``alias``, handing it to the first waiter; return how many held it.

    One for an exclusive holder; for a shared lock or a semaphore, its holders.
    ``floor``: on a quorum, the largest fence of the masters' holders, which
    the fence counter is raised to first (see quorum.py).
    """
    args = [] if floor is None else [floor]
    _sent, (holders, woken) = yield Script(alias, scripts.RESET, keys.script_keys, args)
    yield from _woken(alias, keys, woken)
    return int(holders)


def release_steps(alias: str, keys: LockKeys, token: str, floor: int | None = None) -> Steps[bool]:
    """Release the lock on ``alias`` as the holder of ``token``; return True if it held it.

    For the operator's tools, which know no successor: a waiter the lock goes
    to is woken by WAKE. ``floor`` as for :func:`reset_steps`.
    """
    args = [token] if floor is None else [token, "", floor]
    _sent, done = yield Script(alias, scripts.RELEASE, keys.script_keys, args)
    yield from _woken(alias, keys, done)
    return bool(done)


class Wakeup(NamedTuple):
    """What a waiter's wake-up says: its fence, and who was next in line behind it then."""

    fence: int
    successor: str | None


def parse_wakeup(value: Any) -> Wakeup:
    """Return the wake-up popped from a waiter's list (``"<fence>|<successor token>"``)."""
    fence, _, successor = decode(value).partition("|")
    return Wakeup(int(fence), successor or None)
