"""Where a lock lives: the steps of each operation on one Redis.

A lock handle (:class:`~django_redis_mutex.lock.Mutex`, and the semaphore
built on it) decides who holds what; the object here decides how each
operation talks to the Redis the lock lives on: acquire with its wait in line
and hand-off, cancel, release, extend, mark for a transaction, and the reads.
:class:`OneRedis` serves one Redis (a master with its replicas, Sentinel or
Cluster); :class:`~django_redis_mutex.quorum.Quorum` a quorum of independent
masters, with the same calls. Every kind (exclusive, shared, a semaphore's
permit) runs on both: the kind is in the handle's token, script and limit.

Each operation is written once, as a generator of steps (see
:mod:`django_redis_mutex.driver`), which the sync and the async drivers run.
"""

from __future__ import annotations

import time
from typing import Any, Literal, NamedTuple, Protocol

from . import deadlock, scripts
from .conf import MutexSettings
from .driver import REDIS_TICK, Pop, Script, Sleep, Steps
from .handoff import handed_to, parse_wakeup, read_state_steps, wake_steps
from .holds import Attempt, Hold, decode, owner_metadata
from .keys import LockKeys
from .owners import Owner, mark_transaction, parse_owner
from .scripts import HANDOFF_LEASE, WAIT_LEASE, lease_ms
from .watchdog import declare_lost

__all__ = ["Grant", "LockHandle", "OneRedis"]

# Margin added to a wait capped by the holder's lease, so the waiter wakes just
# after the key expired rather than just before.
_EXPIRY_MARGIN = 0.002
# A hand-over whose lease (counted from our last refused check-in) has less
# than this share left is confirmed with Redis before the caller is told.
_CONFIRM_SHARE = 0.25


class Grant(NamedTuple):
    """What an acquisition got: the fence, per Redis the lease as (sent, seconds), the successor.

    ``successor`` is the waiter that was first in line behind us when we got
    the lock (None if nobody was): the release expects to hand over to it.
    """

    fence: int
    leases: dict[str, tuple[float, float]]
    successor: str | None = None


class LockHandle(Protocol):
    """What a topology asks of the lock handle it serves (see lock.Mutex)."""

    name: str
    using: str
    kind: str
    label: str | None
    lease: float
    settings: MutexSettings
    keys: LockKeys
    _acquire_script: scripts.LuaScript
    _limit_args: tuple[int, ...]

    def _keys_on(self, alias: str) -> LockKeys: ...

    def _acquire_args(self, attempt: Attempt, join: bool) -> list[Any]: ...

    def _refused(self, attempt: Attempt, reply: list[Any]) -> None: ...

    @property
    def _stats_class(self) -> tuple[str, str] | None: ...


class OneRedis:
    """The steps of a lock's operations on the one Redis of cache alias ``lock.using``."""

    #: How many places must agree, and the clock drift allowance in seconds.
    quorum = 1
    drift = 0.0
    # Starts every token of a hold here, after the "s" of a shared one: "q"
    # marks a quorum's, so a member tells its own holders from the quorum's.
    token_prefix = ""

    def __init__(self, lock: LockHandle) -> None:
        self.lock = lock
        self.alias = lock.using
        self.keys = lock.keys
        self.aliases: tuple[str, ...] = (lock.using,)

    def targets(self) -> tuple[tuple[str, str], ...]:
        """Return (alias, lock key) of every Redis this lock lives on."""
        return ((self.alias, self.keys.lock),)

    # -- acquire -----------------------------------------------------------------

    def _grant(self, fence: Any, sent: float, lease: float, successor: str | None = None) -> Grant:
        return Grant(int(fence), {self.alias: (sent, lease)}, successor)

    def _granted_by(self, reply: list[Any], sent: float) -> Grant:
        # {1, fence, pttl, successor}: with pttl ms left (-1: our lease; else
        # handed over earlier, with what is left of a shorter lease) and the
        # next in line.
        pttl = int(reply[2])
        lease = self.lock.lease if pttl < 0 else max(pttl, 1) / 1000
        return self._grant(reply[1], sent, lease, decode(reply[3]) or None)

    def _granted_steps(self, reply: list[Any], sent: float) -> Steps[Grant]:
        """Return the grant a {1, ...} answer carries, waking whom it says to wake first.

        ACQUIRE_SHARED may admit a run of shared waiters with the caller: their
        tokens come as a fifth item.
        """
        if len(reply) > 4:
            yield from self._wake(reply[4])
        return self._granted_by(reply, sent)

    def acquire_steps(self, attempt: Attempt) -> Steps[Grant | None]:
        """Acquire: try once; when blocking, queue and wait to be handed the lock."""
        lock = self.lock
        keys = self.keys.with_wake(attempt.token)
        sent, reply = yield Script(
            self.alias, lock._acquire_script, keys, lock._acquire_args(attempt, attempt.blocking)
        )
        if not isinstance(reply, list):  # the fence alone: ours, nobody in line
            return self._grant(reply, sent, lock.lease)
        if reply[0] == 1:
            return (yield from self._granted_steps(reply, sent))
        yield from self._wake(reply[3])
        lock._refused(attempt, reply)
        if not attempt.blocking:
            return None
        return (yield from self._wait_steps(attempt, reply, sent))

    def _wait_steps(
        self, attempt: Attempt, reply: list[Any], refused_sent: float
    ) -> Steps[Grant | None]:
        """Wait in line, looking for a deadlock past DEADLOCK_TIMEOUT (see deadlock.py).

        Only a refused acquisition gets here: one granted at once pays
        nothing for deadlock detection.
        """
        return deadlock.watched(
            self._waiting_steps(attempt, reply, refused_sent), self.lock, attempt
        )

    def _waiting_steps(
        self, attempt: Attempt, reply: list[Any], refused_sent: float
    ) -> Steps[Grant | None]:
        """Wait in line until handed the lock or the deadline passes.

        ``refused_sent`` is when the last check-in that found the lock not yet
        ours was sent: a hand-over pushed to our wake-up list happened after
        it, so its lease is counted from then.
        """
        lock = self.lock
        token, deadline = attempt.token, attempt.deadline
        keys = self.keys.with_wake(token)
        wake_key = keys[-1]
        handoff = min(lock.lease, HANDOFF_LEASE)
        # Check in often enough that a hand-over's lease, counted from the last
        # check-in, is still mostly ahead of us when we are woken.
        longest = min(WAIT_LEASE / 2, handoff / 2)
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return (yield from self._cancel_steps(token))
            wait, local = wait_slice(deadline, reply[1], now, longest)
            if local:
                yield Sleep(wait)
            else:
                popped = yield Pop(self.alias, wake_key, wait, longest)
                if popped:
                    left = refused_sent + handoff - time.monotonic()
                    if left > handoff * _CONFIRM_SHARE:
                        woken = parse_wakeup(popped[1])
                        return self._grant(woken.fence, refused_sent, handoff, woken.successor)
                    # Woken late (a paused process or loop): most of the hand-over
                    # lease may be spent; the check-in below asks Redis.
            sent, reply = yield Script(
                self.alias, lock._acquire_script, keys, lock._acquire_args(attempt, True)
            )
            if not isinstance(reply, list):
                return self._grant(reply, sent, lock.lease)
            if reply[0] == 1:
                return (yield from self._granted_steps(reply, sent))
            yield from self._wake(reply[3])
            refused_sent = sent
            lock._refused(attempt, reply)

    def _wake(self, handed: Any) -> Steps[None]:
        """Wake the waiter a script handed the lock to, if its answer ``handed`` names one.

        ACQUIRE does so when it finds the lock expired with live waiters,
        CANCEL when it leaves a free lock, RELEASE when the first in line is
        not the successor the holder expected.
        """
        for head in handed_to(handed):
            yield from wake_steps(self.alias, self.keys, head)

    def _cancel_steps(self, token: str) -> Steps[Grant | None]:
        """Leave the queue; return the grant if the lock had been handed to us just before."""
        sent, final = yield Script(
            self.alias,
            scripts.CANCEL,
            self.keys.with_wake(token),
            [token, *self.lock._limit_args],
        )
        if final[0] == 1:
            return self._granted_by(final, sent)
        if len(final) > 1:  # {0, token}: the lock was free and went to the next in line
            yield from self._wake(final[1])
        return None

    def abandon_steps(self, token: str) -> Steps[None]:
        """Leave the queue after an interrupted wait, releasing the lock if it was handed over."""
        grant = yield from self._cancel_steps(token)
        if grant is not None:
            yield from self._release_call_steps(token, grant.successor)

    # -- release, extend, mark ---------------------------------------------------

    def release_steps(self, hold: Hold) -> Steps[bool]:
        """Release ``hold``; return True if it was still ours."""
        return self._release_call_steps(hold.token, hold.successor)

    def _release_call_steps(self, token: str, successor: str | None) -> Steps[bool]:
        """Release ``token``'s lock, waking whoever it is handed to; return True if it was ours.

        The expected successor's wake-up list is declared, so the common
        hand-over wakes it in the same script; anyone else gets WAKE after.
        """
        keys: tuple[str, ...] = self.keys.script_keys
        args = [token]
        if successor is not None:
            keys, args = self.keys.with_wake(successor), [token, successor]
        _sent, released = yield Script(self.alias, scripts.RELEASE, keys, args)
        if type(released) is not int:  # a token: the waiter it went to, not woken yet
            yield from self._wake(released)
        return bool(released)

    def extend_steps(self, hold: Hold, ttl: float) -> Steps[bool]:
        """Set ``hold``'s lease to ``ttl`` from now; return False if it is no longer ours."""
        sent, ok = yield Script(
            self.alias, scripts.EXTEND, [self.keys.lock], [hold.token, lease_ms(ttl)]
        )
        if ok:
            hold.confirm(self.alias, sent, ttl)
        else:
            hold.refuse(self.alias)
        return bool(ok)

    def confirm_steps(self, hold: Hold) -> Steps[bool]:
        """Before nesting into a hold whose local bound ran out, make sure it is still ours."""
        if hold.strict:
            # A quorum hold's validity is all a holder may count on.
            declare_lost(hold, "its validity ran out before a majority of masters renewed it")
            return False
        if not (yield from self.extend_steps(hold, hold.ttl)):
            declare_lost(hold, "it was no longer held by this owner when nested into")
            return False
        return True

    def mark_steps(self, hold: Hold, databases: list[str]) -> Steps[bool]:
        """Mark the owner record: kept until the transaction on ``databases`` ends.

        Return False when Redis answered that the lock is no longer ours, so
        the block is told before its transaction commits. A mark that failed
        (logged) proves nothing either way: the hold is kept.
        """
        owner = mark_transaction(owner_metadata(self.lock.label), databases)
        _sent, marked = yield Script(
            self.alias, scripts.MARK_TRANSACTION, [self.keys.lock], [hold.token, owner], True
        )
        return bool(marked != 0)

    # -- read --------------------------------------------------------------------

    def _state_steps(self, token: str) -> Steps[list[Any]]:
        """Return what READ_STATE says of the lock, and of ``token``'s hold."""
        return read_state_steps(self.alias, self.keys, token)

    def time_left_steps(self, hold: Hold | None) -> Steps[float]:
        """Return the seconds left of ``hold``'s lease, exclusive or shared, at one instant."""
        if hold is None:
            return 0.0
        state = yield from self._state_steps(hold.token)
        return max(int(state[3]), 0) / 1000

    def owned_steps(self, hold: Hold | None) -> Steps[bool]:
        """Return True if ``hold`` holds the lock right now."""
        if hold is None:
            return False
        state = yield from self._state_steps(hold.token)
        return int(state[3]) > 0 or decode(state[0]) == hold.token

    def holder_steps(self) -> Steps[Owner | Literal[""] | None]:
        """Return the holder's owner, "" when it cannot be read, None when the lock is free.

        For a lock held shared, its first live shared holder's.
        """
        holder, _pttl, owner, _mine, _shared, owners, _fence = yield from self._state_steps("")
        if decode(holder):
            return parse_owner(decode(owner)) or ""
        if owners:
            return parse_owner(decode(owners[0])) or ""
        return None


def wait_slice(deadline: float | None, pttl: int, now: float, longest: float) -> tuple[float, bool]:
    """Return how long to wait now, and whether to sleep locally instead of blocking on Redis.

    The wait ends at the deadline, at the holder's expiry, or at a check-in.
    Redis ends a blocking pop only on its timer tick (every 1000/hz ms), so the
    last tick before a holder's expiry is slept here and the waiter checks in
    right after the key expired.
    """
    wait = longest
    if deadline is not None:
        wait = min(wait, deadline - now)
    local = False
    # PTTL answers 0 for a key with less than a millisecond left: that holder
    # expires now, not "no expiry known" (-1, -2), which would make the waiter
    # sit out a whole check-in interval after the lock came free.
    if pttl >= 0:
        expiry = pttl / 1000 + _EXPIRY_MARGIN
        if expiry <= REDIS_TICK:
            wait, local = min(wait, expiry), True
        else:
            wait = min(wait, expiry - REDIS_TICK)
    return max(wait, 0.001), local
