"""Signals sent as locks change hands, for metrics and logging.

Each is sent with ``sender`` set to the cache alias and these keyword arguments:

``lock_acquired``
    ``name``, ``fence``, ``wait`` (seconds spent waiting), ``shared``,
    ``waited``: True when the lock was found held by someone else first, so
    the acquisition had to wait (``wait`` alone cannot tell: an uncontended
    acquisition takes a round trip too).

    .. versionchanged:: 0.3.0
       ``waited`` was added.
``lock_released``
    ``name``, ``fence``, ``held`` (seconds the lock was held), ``shared``,
    ``databases``: the aliases of the databases whose transaction the lock was
    kept for after its block ended (empty when it was given back at once).
    Sent when the lock is really given back.
``lock_held_for_transaction``
    ``name``, ``fence``, ``databases``, ``shared``: the block of a lock ended
    inside a database transaction, and the lock is kept until that transaction
    commits or rolls back (see :doc:`transactions`).
``lock_contended``
    ``name``, ``wait`` (seconds waited before giving up), ``retry_after``, ``owner``,
    ``shared``.
``lock_deadlock``
    ``name``, ``wait``, ``owner`` (the holder in the way, when known),
    ``cycle`` (the waits found, as in
    :attr:`LockDeadlock.cycle <django_redis_mutex.exceptions.LockDeadlock>`), ``shared``:
    an acquisition was chosen to end a cycle of waits and is about to raise
    :class:`~django_redis_mutex.exceptions.LockDeadlock` (see :doc:`deadlocks`). Sent
    after its ``lock_contended``, in the thread or task that acquired.
``lock_lost``
    ``name``, ``fence``, ``held`` (seconds from acquisition until the loss was
    noticed), ``shared``.
    Also sent when a semaphore permit is found gone, with the permit's fence
    and ``kind="semaphore"``; a lock's loss has no ``kind``, so tell a permit
    by ``kwargs.get("kind") == "semaphore"``.
``lock_waiting``
    ``name``, ``waiting``: ``True`` when an acquisition starts waiting for a
    lock someone else holds, ``False`` when that wait ends, however it ends
    (granted, timed out, cancelled, Redis failing). Each ``True`` is followed
    by one ``False`` from the same acquisition.
``lock_unavailable``
    ``name``, ``wait`` (seconds spent before the failure), ``error`` (the
    :class:`~django_redis_mutex.exceptions.LockBackendUnavailable` about to be
    raised, or swallowed by ``FAIL_OPEN``): an acquisition failed because Redis
    could not be reached.

``shared`` is True for a shared (read) lock, ``mutex(name, shared=True)``,
and for a semaphore's permit. A permit's ``lock_acquired``, ``lock_released``,
``lock_held_for_transaction``, ``lock_contended``, ``lock_deadlock`` and ``lock_lost`` also carry
``kind="semaphore"``.

Receivers run in the thread that acquired or released the lock, except
``lock_lost`` when the watchdog notices the loss, which runs in the watchdog
thread. Keep receivers fast: they sit on the lock's hot path. An async
acquisition sends ``lock_waiting`` from the task that runs its wait, a child
of the caller's task. Errors of ``lock_waiting``, ``lock_unavailable`` and
``lock_lost`` receivers are logged, never raised.

A signal nobody listens to costs the lock next to nothing: it is sent only
when it has receivers, and the costly arguments are built only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from django.dispatch import Signal

# The signals. ReceiverGroup is the app's own plumbing, left out of the API docs.
__all__ = [
    "lock_acquired",
    "lock_contended",
    "lock_deadlock",
    "lock_held_for_transaction",
    "lock_lost",
    "lock_released",
    "lock_unavailable",
    "lock_waiting",
]

_Receiver = TypeVar("_Receiver", bound=Callable[..., Any])

lock_acquired = Signal()
lock_released = Signal()
lock_held_for_transaction = Signal()
lock_contended = Signal()
lock_deadlock = Signal()
lock_lost = Signal()
lock_waiting = Signal()
lock_unavailable = Signal()


class _Sender(Protocol):
    using: str
    name: str
    shared: bool
    _kind_signal: dict[str, str]


def send_about(
    signal: Signal, lock: _Sender, *, shared: bool | None = None, **figures: Any
) -> None:
    """Send ``signal`` about ``lock`` if anyone listens: from its alias, with its name and kind.

    ``shared`` says whether the hold is shared; by default, whether ``lock``
    takes it shared (a shared handle that joined its owner's exclusive hold
    ends that hold, so ending a hold passes the hold's own). ``figures`` are
    what the signal carries beyond those (see above); a semaphore's permit
    adds ``kind="semaphore"``.
    """
    if signal.receivers:
        signal.send(
            sender=lock.using,
            name=lock.name,
            shared=lock.shared if shared is None else shared,
            **figures,
            **lock._kind_signal,
        )


class ReceiverGroup:
    """Receivers of these signals, connected and disconnected together under one ``dispatch_uid``.

    For the app's own listeners (telemetry, the toolbar panel), which connect
    only while they are wanted, since a signal nobody listens to costs nothing.
    """

    def __init__(self, uid: str) -> None:
        self.uid = uid
        # (signal, receiver, its dispatch_uid): one uid each, so that two
        # receivers of one signal in a group never replace each other.
        self._receivers: list[tuple[Signal, Callable[..., Any], str]] = []

    def on(self, signal: Signal) -> Callable[[_Receiver], _Receiver]:
        """Decorate a function to receive ``signal`` while the group is connected."""

        def add(receiver: _Receiver) -> _Receiver:
            uid = f"{self.uid}:{len(self._receivers)}"
            self._receivers.append((signal, receiver, uid))
            return receiver

        return add

    def connect(self) -> None:
        """Connect every receiver of the group (again: no effect)."""
        for signal, receiver, uid in self._receivers:
            signal.connect(receiver, dispatch_uid=uid)

    def disconnect(self) -> None:
        """Disconnect every receiver of the group (again: no effect)."""
        for signal, _receiver, uid in self._receivers:
            signal.disconnect(dispatch_uid=uid)

    def connected(self) -> bool:
        """Return True if the group's receivers are connected."""
        uids = {uid for _signal, _receiver, uid in self._receivers}
        return any(
            key[0] in uids for signal, _, _ in self._receivers for key, *_rest in signal.receivers
        )
