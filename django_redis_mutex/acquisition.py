"""Acquiring a lock: join a hold of the same owner, or start, wait and adopt a new one.

An acquisition's Redis traffic is its topology's steps (see
:mod:`django_redis_mutex.topology`); this module drives them and decides what
the handle does with the answer: record the hold and have the watchdog renew
it, make sure a hold granted before a stall is still ours before its owner
enters, and leave the line, or give back a grant nobody will see, when the
caller fails, times out or is cancelled. :func:`acquire` and :func:`aacquire`
take the same decisions, one with blocking calls, the other on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Literal, Protocol

from redis import exceptions as redis_errors

from . import lockorder, signals, stats
from .client import backend_errors
from .conf import DEFAULT, refuse_timeout_without_blocking, validate_flag, validate_timeout
from .driver import AsyncDriver, Pop, Sleep, Steps, run_in_child, run_steps
from .exceptions import LockBackendUnavailable, LockDeadlock, LockUpgradeRefused
from .giveback import give_back_later
from .holds import Attempt, Hold, awaiting_hold, current_owner, owner_metadata, scoped_hold
from .release import Handle, agive_back, forget, give_back
from .scripts import WAIT_LEASE
from .topology import Grant
from .watchdog import get_watchdog

__all__ = ["aacquire", "acquire", "start", "wait_params"]

logger = logging.getLogger("django_redis_mutex")


class AcquiringHandle(Handle, Protocol):
    """What acquiring asks of the lock handle beyond ending a hold (see lock.Mutex)."""

    reentrant: bool
    blocking: bool
    timeout: float | None

    @property
    def lock_class(self) -> str: ...

    @property
    def _stats_class(self) -> tuple[str, str] | None: ...

    def extend(self, ttl: float | None = None) -> None: ...

    async def aextend(self, ttl: float | None = None) -> None: ...


def wait_params(
    blocking: Any, timeout: Any, default_blocking: bool, default_timeout: float | None
) -> tuple[bool, float | None]:
    """Resolve an acquire()'s ``blocking`` and ``timeout`` (DEFAULT: the handle's) or raise."""
    if blocking is DEFAULT:
        blocking = default_blocking
    else:
        blocking = validate_flag("blocking", blocking)
        refuse_timeout_without_blocking(blocking, timeout)
    timeout = default_timeout if timeout is DEFAULT else validate_timeout(timeout)
    return blocking, timeout


def acquire(lock: AcquiringHandle, blocking: Any, timeout: Any) -> Hold | None:
    """Acquire ``lock`` for the calling owner; return its hold, or None if it stayed contended."""
    blocking, timeout = wait_params(blocking, timeout, lock.blocking, lock.timeout)
    hold = _nest_candidate(lock)
    if hold is not None and (hold.valid() or lock._run(lock._where.confirm_steps(hold))):
        lock._levels.nest(hold)  # a reentrant join: no new lock order
        return hold
    attempt = start(lock, blocking, timeout)
    token = attempt.token
    while True:
        with _acquisition_errors(lock, attempt):
            try:
                grant = run_steps(_acquisition_steps(lock, attempt))
            except (redis_errors.TimeoutError, LockBackendUnavailable):
                # Redis is not answering: a cancel now would wait out another
                # socket timeout, so it is left to the background.
                _abandon_later(lock, token)
                raise
            except BaseException:
                _abandon(lock, token)
                raise
        # Outside backend_errors: an error of a signal receiver is not Redis's.
        if grant is None:
            _note_contention(lock, attempt)
            return None
        hold = _adopt(lock, token, grant)
        if _still_granted(lock, hold):
            break
    lock._levels.succeeded()
    try:
        _announce(lock, hold, attempt)
        if _short(lock, hold):
            lock.extend()
    except BaseException:
        # The caller never gets the lock, so nothing else would give it back.
        give_back(lock, hold)
        raise
    return hold


async def aacquire(lock: AcquiringHandle, blocking: Any, timeout: Any) -> Hold | None:
    """Async twin of :func:`acquire`; never blocks the event loop."""
    blocking, timeout = wait_params(blocking, timeout, lock.blocking, lock.timeout)
    hold = _nest_candidate(lock)
    if hold is not None and (hold.valid() or await lock._arun(lock._where.confirm_steps(hold))):
        lock._levels.nest(hold)
        return hold
    attempt = start(lock, blocking, timeout)
    while True:
        with _acquisition_errors(lock, attempt):
            adopted = await _acquire_in_child(lock, attempt)
        if adopted is None:
            _note_contention(lock, attempt)
            return None
        hold = adopted
        # No await between this check and the body but a confirming one.
        if await _astill_granted(lock, hold):
            break
    lock._levels.succeeded()
    try:
        _announce(lock, hold, attempt)
        if _short(lock, hold):
            await lock.aextend()
    except BaseException:
        # Cancelled or failed while lengthening a hand-over's lease: the
        # caller never gets the lock, so nothing else would give it back.
        await asyncio.shield(agive_back(lock, hold))
        raise
    return hold


def start(lock: AcquiringHandle, blocking: bool, timeout: float | None) -> Attempt:
    """Start a new acquisition by the calling owner (its thread, or its task)."""
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    # A shared token starts with "s", which no hex token does: the scripts
    # tell shared holders and waiters from exclusive ones by it.
    token = lock._where.token_prefix + secrets.token_hex(16)
    if lock.shared:
        token = "s" + token
    return Attempt(token, blocking, started, deadline, owner_metadata(lock.label))


def _nest_candidate(lock: AcquiringHandle) -> Hold | None:
    """Return the hold a new level may join: this owner's on this handle, or an open scope's.

    Reentrancy never outlives the block or call that created it: another
    handle joins a hold only inside the ``with`` block (or decorated call)
    of the same owner that holds it.
    """
    hold: Hold | None = awaiting_hold(lock._where.targets())
    if hold is not None:
        # Our own block ended earlier in this still-open transaction: the
        # lock is ours until it ends, reentrant or not.
        return _joinable(lock, hold)
    if not lock.reentrant:
        return None
    hold = lock._levels.of_owner()
    if hold is None:
        hold = scoped_hold(lock._where.targets())
    if hold is None or hold.lost or hold.releasing or not hold.active:
        return None
    return _joinable(lock, hold)


def _joinable(lock: AcquiringHandle, hold: Hold) -> Hold:
    """Return ``hold`` if ``lock`` may join it: never exclusively into a shared hold."""
    if hold.shared and not lock.shared:
        raise LockUpgradeRefused(
            f"Cannot take lock {lock.name!r} exclusively inside a shared hold of it by "
            "the same owner: that would wait for the other shared holders, and two "
            "owners upgrading at once would wait for each other forever. Release the "
            "shared hold first, or take the lock exclusively from the start.",
            name=lock.name,
        )
    return hold


def _acquisition_steps(lock: AcquiringHandle, attempt: Attempt) -> Steps[Grant | None]:
    """Return the steps of a new acquisition, telling ``lock_waiting`` receivers if any."""
    steps = lock._where.acquire_steps(attempt)
    if attempt.blocking and signals.lock_waiting.receivers:
        return _told_waits(steps, lock.using, lock.name)
    return steps


def _note_contention(lock: AcquiringHandle, attempt: Attempt) -> None:
    """Keep a failed attempt's contention as its owner's, for ``Mutex.contended()``."""
    contention = attempt.contention._replace(waited=time.monotonic() - attempt.started)
    lock._levels.failed(contention)
    counted = lock._stats_class
    if counted is not None:
        stats.count(lock.using, counted, stats.CONTENDED)
    if signals.lock_contended.receivers:
        error = contention.error(lock.name, lock.using, counted)
        signals.send_about(
            signals.lock_contended,
            lock,
            wait=error.waited,
            retry_after=error.retry_after,
            owner=error.owner,
        )


def _note_deadlock(lock: AcquiringHandle, attempt: Attempt, error: LockDeadlock) -> None:
    """Tell of a wait ended to break a deadlock: as a timeout, then ``lock_deadlock``."""
    _note_contention(lock, attempt)
    counted = lock._stats_class
    if counted is not None:
        stats.count(lock.using, counted, stats.DEADLOCKED)
    signals.send_about(
        signals.lock_deadlock, lock, wait=error.waited, owner=error.owner, cycle=error.cycle
    )


def _adopt(lock: AcquiringHandle, token: str, grant: Grant, owner: object = None) -> Hold:
    """Record a new acquisition as the handle's top level and start renewing it.

    ``owner`` defaults to the code running now (an async acquisition
    adopts in its child task, on behalf of the caller's task).
    """
    hold = Hold(
        alias=lock.using,
        name=lock.name,
        keys=lock.keys,
        token=token,
        fence=grant.fence,
        ttl=lock.lease,
        owner=current_owner() if owner is None else owner,
        targets=lock._where.targets(),
        quorum=lock._where.quorum,
        drift=lock._where.drift,
        max_hold=lock.settings.max_hold,
        raise_on_lost=lock.settings.raise_on_lost,
        successor=grant.successor,
        kind=lock.kind,
        counted_as=lock._stats_class,
    )
    for alias, (sent, lease) in grant.leases.items():
        hold.confirm(alias, sent, lease)
    lock._levels.add(hold)
    if lock.watchdog:
        get_watchdog().watch(hold)
    return hold


def _announce(lock: AcquiringHandle, hold: Hold, attempt: Attempt) -> None:
    """Tell lock-order checking, the contention figures and ``lock_acquired`` receivers."""
    if lockorder.checking:
        lockorder.taken(hold, lock.kind, lock.lock_class)
    counted = hold.counted_as
    if counted is None and not signals.lock_acquired.receivers:
        return
    wait = time.monotonic() - attempt.started
    waited = attempt.was_refused
    if counted is not None:
        stats.acquired(lock.using, counted, wait, waited)
    signals.send_about(signals.lock_acquired, lock, fence=hold.fence, wait=wait, waited=waited)


def _short(lock: AcquiringHandle, hold: Hold) -> bool:
    """True when a hand-over's short lease must be lengthened now (no watchdog will)."""
    return not lock.watchdog and any(lease.ttl < lock.lease for lease in hold.leases.values())


def _lapsed(lock: AcquiringHandle, hold: Hold) -> Steps[bool] | None:
    """Return the steps that make a lapsed new hold ours again, or None if it is valid.

    The wake-up was checked against the hand-over lease, but the process or
    event loop may have stalled after that check, before the hold was adopted
    and watched: if its local bound is spent, the lock may be the next
    waiter's already. Redis is asked (EXTEND to the full lease); a quorum
    hold counts only on its validity, so it is given back.
    """
    if hold.valid():
        return None
    get_watchdog().unwatch(hold)
    return lock._where.extend_steps(hold, lock.lease)


def _still_granted(lock: AcquiringHandle, hold: Hold) -> bool:
    """Return True if a new hold may be entered; else give it back (the caller queues again)."""
    steps = _lapsed(lock, hold)
    if steps is None:
        return True
    kept = False
    try:
        kept = not hold.strict and lock._run(steps)
    finally:
        if not kept:
            give_back(lock, hold)
    if kept and lock.watchdog:
        get_watchdog().watch(hold)
    return kept


async def _astill_granted(lock: AcquiringHandle, hold: Hold) -> bool:
    """Async twin of :func:`_still_granted`."""
    steps = _lapsed(lock, hold)
    if steps is None:
        return True
    kept = False
    try:
        kept = not hold.strict and await lock._arun(steps)
    finally:
        if not kept:
            await asyncio.shield(agive_back(lock, hold))
    if kept and lock.watchdog:
        get_watchdog().watch(hold)
    return kept


def _abandon_later(lock: AcquiringHandle, token: str) -> None:
    """Leave the line and give back the lock from the background, once Redis answers.

    The script whose reply timed out may still run when Redis is
    responsive again, granting the lock (or a place in line) to a token
    nobody has; that lock would stay held for its whole lease.
    """
    give_back_later(
        f"{lock.kind} {lock.name!r}",
        lambda: lock._where.abandon_steps(token),
        max(lock.lease, WAIT_LEASE),
    )


def _abandon(lock: AcquiringHandle, token: str) -> None:
    try:
        run_steps(lock._where.abandon_steps(token))
    except Exception as exc:  # the interrupt that brought us here is what propagates
        _abandon_failed(lock, token, exc)


def _abandon_failed(lock: AcquiringHandle, token: str, exc: Exception) -> None:
    # Leaving the line did not land (a cut connection, a Redis asleep): a
    # script in flight, or the next release, may still hand the lock to
    # this token, which nobody has. Retry until Redis answers.
    logger.warning(
        "Could not leave the wait queue of %s %r (retrying in the background): %s",
        lock.kind,
        lock.name,
        exc,
    )
    _abandon_later(lock, token)


async def _acquire_in_child(lock: AcquiringHandle, attempt: Attempt) -> Hold | None:
    """Run the acquisition with :func:`~.driver.run_in_child`: a cancel is never lost.

    The hold is adopted (and watched) in the child, as Redis's answer is
    read: the watchdog renews it from that moment, even if the caller's
    loop stalls before the caller runs again.
    """
    owner = current_owner()
    token = attempt.token
    adopted: list[Hold] = []

    def adopting() -> Steps[Grant | None]:
        grant = yield from _acquisition_steps(lock, attempt)
        if grant is not None:
            adopted.append(_adopt(lock, token, grant, owner))
        return grant

    async def abandon() -> None:
        if adopted:
            forget(lock, adopted[0])
        try:
            await AsyncDriver().run(lock._where.abandon_steps(token))
        except Exception as exc:
            _abandon_failed(lock, token, exc)

    try:
        await run_in_child(adopting(), abandon, (redis_errors.TimeoutError, LockBackendUnavailable))
    except (redis_errors.TimeoutError, LockBackendUnavailable):
        _abandon_later(lock, token)  # as in acquire()
        raise
    return adopted[0] if adopted else None


class _acquisition_errors(backend_errors):
    """``backend_errors`` around a new acquisition; also tells of its deadlock or failure.

    A wait ended to break a deadlock is noted (as a timeout, then
    ``lock_deadlock``), and a Redis failure told to ``lock_unavailable``
    receivers.
    """

    __slots__ = ("attempt", "lock")

    def __init__(self, lock: AcquiringHandle, attempt: Attempt) -> None:
        # No super().__init__(): this sits on every acquisition.
        self.name = lock.name
        self.alias = lock.using
        self.lock = lock
        self.attempt = attempt

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, LockDeadlock):
            # Out of line already, like a wait that timed out.
            _note_deadlock(self.lock, self.attempt, exc)
            return False
        if not signals.lock_unavailable.receivers:
            return super().__exit__(exc_type, exc, tb)
        try:
            super().__exit__(exc_type, exc, tb)
        except LockBackendUnavailable as error:
            self._tell(error)
            raise
        if isinstance(exc, LockBackendUnavailable):  # raised by the steps (a quorum lock)
            self._tell(exc)
        return False

    def _tell(self, error: LockBackendUnavailable) -> None:
        wait = time.monotonic() - self.attempt.started
        for receiver, failure in signals.lock_unavailable.send_robust(
            sender=self.alias, name=self.name, wait=wait, error=error
        ):
            if isinstance(failure, Exception):
                logger.error("lock_unavailable receiver %r failed: %r", receiver, failure)


def _told_waits(steps: Steps[Grant | None], alias: str, name: str) -> Steps[Grant | None]:
    """Pass ``steps`` through, sending ``lock_waiting`` when they first block and when they end.

    An acquisition waits from its first blocking step (a pop on its wake-up
    list, or a sleep) to its end however it ends: granted, timed out,
    cancelled, or Redis failing. The drivers always close the steps, so the
    end is told even when they stop early.
    """
    waiting = False
    try:
        op = next(steps)
        while True:
            if not waiting and isinstance(op, (Pop, Sleep)):
                waiting = True
                _tell_waiting(alias, name, True)
            op = steps.send((yield op))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()
        if waiting:
            _tell_waiting(alias, name, False)


def _tell_waiting(alias: str, name: str, waiting: bool) -> None:
    # Robust: a failing gauge must not cost a waiter its place or its lock.
    for receiver, error in signals.lock_waiting.send_robust(
        sender=alias, name=name, waiting=waiting
    ):
        if isinstance(error, Exception):
            logger.error("lock_waiting receiver %r failed: %r", receiver, error)
