"""Mutex: acquire, wait, release, extend and inspect one named lock.

Each operation is written once, as a generator of steps (see
:mod:`django_redis_mutex.driver`) that the sync methods drive with blocking
calls and their ``a``-prefixed async twins drive on the event loop; a sync
holder therefore blocks an async contender and vice versa, and both follow the
same rules. Waiting is wake-on-release: a waiter blocks on its own list until
the releasing script hands it the lock, bounded by the holder's remaining lease
and the caller's deadline, never a fixed sleep.

State is kept per acquisition (:class:`~django_redis_mutex.holds.Hold`), never
in one field of the handle: a handle holds a stack of levels (a nested level
repeats its hold), so nesting, a handle shared by threads and a hold lost under
a nested block each keep their own record.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from django.core.exceptions import ImproperlyConfigured
from redis import exceptions as redis_errors

from . import scripts, signals
from .client import backend_errors, namespace
from .conf import (
    DEFAULT,
    MutexSettings,
    get_settings,
    refuse_timeout_without_blocking,
    validate_flag,
    validate_timeout,
    validate_ttl,
)
from .driver import (
    AsyncDriver,
    Pop,
    Sleep,
    Steps,
    run_in_child,
    run_steps,
)
from .exceptions import (
    LockBackendUnavailable,
    LockContended,
    LockLost,
    LockNotOwned,
    LockUpgradeRefused,
)
from .giveback import give_back_later
from .holds import (
    Attempt,
    Hold,
    awaiting_hold,
    close_scope,
    current_owner,
    open_scope,
    owner_metadata,
    scoped_hold,
)
from .kept import keep_for_transaction, lost_while_kept, still_kept
from .keys import LockKeys, validate_label, validate_name
from .levels import Levels
from .owners import Owner
from .quorum import Quorum, quorum_members
from .scripts import WAIT_LEASE, lease_ms
from .topology import Grant, OneRedis
from .watchdog import declare_if_lapsed, declare_lost, get_watchdog

__all__ = ["DEFAULT", "Mutex", "QuorumMutex"]

T = TypeVar("T")

logger = logging.getLogger("django_redis_mutex")


class Mutex:
    """A handle on one named distributed lock.

    A handle holds at most one acquisition per owner at a time, nested as often
    as needed (reentrant). Its token lives on the handle, so it can be released
    from another thread. Create one handle per critical section, or use
    :func:`django_redis_mutex.mutex`, which does so for you.
    """

    # What this handle takes, in messages, log lines and signals ("lock", or
    # "semaphore" for a permit of a Semaphore), and the extra arguments of its
    # acquisitions (a semaphore's limit).
    kind: str = "lock"
    _limit_args: tuple[int, ...] = ()
    _kind_signal: dict[str, str] = {}

    def __init__(
        self,
        name: str,
        *,
        using: str | Sequence[str] = "default",
        ttl: float = DEFAULT,
        timeout: float | None = DEFAULT,
        blocking: bool = DEFAULT,
        watchdog: bool = DEFAULT,
        reentrant: bool = True,
        label: str | None = None,
        shared: bool = False,
        release_at_block_end: bool = False,
    ) -> None:
        self.name: str = validate_name(name)
        #: True for a shared (read) lock: any number of shared holders at once,
        #: none while an exclusive holder has it.
        self.shared: bool = validate_flag("shared", shared)
        self._acquire_script = scripts.ACQUIRE_SHARED if self.shared else scripts.ACQUIRE
        # A list of aliases, or an alias whose MUTEX block names a QUORUM, puts
        # the lock on a quorum of masters; its settings are that alias's, or
        # the first member's.
        members = quorum_members(using)
        if isinstance(using, (list, tuple)):
            using = members[0] if members else using[0] if len(using) == 1 else using
        if not isinstance(using, str):
            raise TypeError(f"using must be a cache alias (a string), not {type(using).__name__}.")
        self.using = using
        config = get_settings(using)
        self.settings: MutexSettings = config
        self.lease: float = config.ttl if ttl is DEFAULT else validate_ttl(ttl)
        self.timeout: float | None = (
            config.timeout if timeout is DEFAULT else validate_timeout(timeout)
        )
        self.blocking: bool = (
            config.blocking if blocking is DEFAULT else validate_flag("blocking", blocking)
        )
        refuse_timeout_without_blocking(blocking, timeout)
        self.watchdog: bool = (
            config.watchdog if watchdog is DEFAULT else validate_flag("watchdog", watchdog)
        )
        self.reentrant: bool = validate_flag("reentrant", reentrant)
        #: True to give the lock back when its block ends even inside a database
        #: transaction (by default it is kept until the transaction ends).
        self.release_at_block_end: bool = validate_flag(
            "release_at_block_end", release_at_block_end
        )
        self.label = validate_label(label)
        self.keys = self._keys_on(using)
        self._where: OneRedis = OneRedis(self) if members is None else Quorum(self, members)
        self._levels = Levels()

    def __repr__(self) -> str:
        state = f"fence={self.fence}" if self._current() is not None else "unlocked"
        return f"<{type(self).__name__} {self.name!r} using={self._using_shown()!r} {state}>"

    def _using_shown(self) -> str | list[str]:
        return list(self.aliases) if self.quorum > 1 else self.using

    @property
    def aliases(self) -> tuple[str, ...]:
        """The cache aliases of every Redis the lock lives on (one, or a quorum's masters)."""
        return self._where.aliases

    @property
    def quorum(self) -> int:
        """How many of :attr:`aliases` must grant a hold (1 on one Redis)."""
        return self._where.quorum

    # -- state ---------------------------------------------------------------

    def _current(self) -> Hold | None:
        """Return the hold this handle acts on: the latest of the current owner, else the latest."""
        return self._levels.current()

    @property
    def _hold(self) -> Hold | None:
        return self._current()

    @property
    def token(self) -> str | None:
        """The random owner token of the current hold, or None."""
        hold = self._current()
        return hold.token if hold is not None else None

    @property
    def fence(self) -> int | None:
        """The fencing token of the current hold: larger than every earlier one of this name."""
        hold = self._current()
        return hold.fence if hold is not None else None

    @property
    def lost(self) -> bool:
        """True if the current hold is known to be no longer ours."""
        hold = self._current()
        return hold is not None and hold.lost

    def contended(self) -> LockContended:
        """Return the error describing the calling owner's last failed acquisition of this handle.

        Each thread or asyncio task sharing the handle is told about its own
        failure (holder, ``retry_after``, ``waited``), never about another's
        that came after it. An owner with no failure of its own on record
        (one that ran ``aacquire()`` in a task of its own, say) gets the
        handle's latest.
        """
        return self._levels.last_failure().error(self.name)

    # -- where the lock lives, and what it asks for ---------------------------

    def _keys_on(self, alias: str) -> LockKeys:
        """Return this handle's keys in ``alias``'s namespace (a semaphore's are its own)."""
        return LockKeys.for_name(namespace(alias), self.name)

    def _acquire_args(self, attempt: Attempt, join: bool) -> list[Any]:
        """Return ACQUIRE's (or ACQUIRE_SHARED's) ARGV for ``attempt``."""
        return [
            attempt.token,
            lease_ms(self.lease),
            attempt.owner_json,
            1 if join else 0,
            *self._limit_args,
        ]

    # -- acquire -------------------------------------------------------------

    def _wait_params(self, blocking: bool, timeout: float | None) -> tuple[bool, float | None]:
        return wait_params(blocking, timeout, self.blocking, self.timeout)

    def _nest_candidate(self) -> Hold | None:
        """Return the hold a new level may join: this owner's on this handle, or an open scope's.

        Reentrancy never outlives the block or call that created it: another
        handle joins a hold only inside the ``with`` block (or decorated call)
        of the same owner that holds it.
        """
        hold: Hold | None = awaiting_hold(self._where.targets())
        if hold is not None:
            # Our own block ended earlier in this still-open transaction: the
            # lock is ours until it ends, reentrant or not.
            return self._joinable(hold)
        if not self.reentrant:
            return None
        hold = self._levels.of_owner()
        if hold is None:
            hold = scoped_hold(self._where.targets())
        if hold is None or hold.lost or hold.releasing or not hold.active:
            return None
        return self._joinable(hold)

    def _joinable(self, hold: Hold) -> Hold:
        """Return ``hold`` if this handle may join it: never exclusively into a shared hold."""
        if hold.shared and not self.shared:
            raise LockUpgradeRefused(
                f"Cannot take lock {self.name!r} exclusively inside a shared hold of it by "
                "the same owner: that would wait for the other shared holders, and two "
                "owners upgrading at once would wait for each other forever. Release the "
                "shared hold first, or take the lock exclusively from the start.",
                name=self.name,
            )
        return hold

    def _acquisition_steps(self, attempt: Attempt) -> Steps[Grant | None]:
        """Return the steps of a new acquisition, telling ``lock_waiting`` receivers if any."""
        steps = self._where.acquire_steps(attempt)
        if attempt.blocking and signals.lock_waiting.receivers:
            return _told_waits(steps, self.using, self.name)
        return steps

    def _start(self, blocking: bool, timeout: float | None) -> Attempt:
        """Start a new acquisition by the calling owner (its thread, or its task)."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        # A shared token starts with "s", which no hex token does: the scripts
        # tell shared holders and waiters from exclusive ones by it.
        token = (
            "s" + self._where.token_prefix + secrets.token_hex(16)
            if self.shared
            else self._where.token_prefix + secrets.token_hex(16)
        )
        return Attempt(token, blocking, started, deadline, owner_metadata(self.label))

    def _refused(self, attempt: Attempt, reply: list[Any]) -> None:
        # The holder's owner record stays raw until an error needs it: a
        # waiter is refused on every check-in, and parsing it each time is waste.
        attempt.refused(int(reply[1]), reply[2] if len(reply) > 2 else None)

    def _note_contention(self, attempt: Attempt) -> None:
        """Keep a failed attempt's contention as its owner's, for :meth:`contended`."""
        contention = attempt.contention._replace(waited=time.monotonic() - attempt.started)
        self._levels.failed(contention)
        if signals.lock_contended.receivers:
            error = contention.error(self.name)
            signals.lock_contended.send(
                sender=self.using,
                name=self.name,
                wait=error.waited,
                retry_after=error.retry_after,
                owner=error.owner,
                shared=self.shared,
                **self._kind_signal,
            )

    def _adopt(self, token: str, grant: Grant, owner: object = None) -> Hold:
        """Record a new acquisition as this handle's top level and start renewing it.

        ``owner`` defaults to the code running now (an async acquisition
        adopts in its child task, on behalf of the caller's task).
        """
        hold = Hold(
            alias=self.using,
            name=self.name,
            keys=self.keys,
            token=token,
            fence=grant.fence,
            ttl=self.lease,
            owner=current_owner() if owner is None else owner,
            targets=self._where.targets(),
            quorum=self._where.quorum,
            drift=self._where.drift,
            max_hold=self.settings.max_hold,
            raise_on_lost=self.settings.raise_on_lost,
            successor=grant.successor,
            kind=self.kind,
        )
        for alias, (sent, lease) in grant.leases.items():
            hold.confirm(alias, sent, lease)
        self._levels.add(hold)
        if self.watchdog:
            get_watchdog().watch(hold)
        return hold

    def _announce(self, hold: Hold, started: float) -> None:
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(
                sender=self.using,
                name=self.name,
                fence=hold.fence,
                wait=time.monotonic() - started,
                shared=self.shared,
                **self._kind_signal,
            )

    def _short(self, hold: Hold) -> bool:
        """True when a hand-over's short lease must be lengthened now (no watchdog will)."""
        return not self.watchdog and any(lease.ttl < self.lease for lease in hold.leases.values())

    def acquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Acquire the lock; return True on success, False if it stayed contended.

        ``blocking`` and ``timeout`` default to the handle's settings;
        ``timeout=None`` waits forever. Raise LockBackendUnavailable when Redis
        cannot be reached.
        """
        return self._acquire(blocking, timeout) is not None

    def _acquire(self, blocking: bool, timeout: float | None) -> Hold | None:
        blocking, timeout = self._wait_params(blocking, timeout)
        hold = self._nest_candidate()
        if hold is not None and (hold.valid() or self._run(self._where.confirm_steps(hold))):
            self._levels.nest(hold)
            return hold
        attempt = self._start(blocking, timeout)
        token, started = attempt.token, attempt.started
        while True:
            with _acquisition_errors(self.name, self.using, started):
                try:
                    grant = run_steps(self._acquisition_steps(attempt))
                except (redis_errors.TimeoutError, LockBackendUnavailable):
                    # Redis is not answering: a cancel now would wait out another
                    # socket timeout, so it is left to the background.
                    self._abandon_later(token)
                    raise
                except BaseException:
                    self._abandon(token)
                    raise
            # Outside backend_errors: an error of a signal receiver is not Redis's.
            if grant is None:
                self._note_contention(attempt)
                return None
            hold = self._adopt(token, grant)
            if self._still_granted(hold):
                break
        self._levels.succeeded()
        try:
            self._announce(hold, started)
        except BaseException:
            # The caller never gets the lock, so nothing would release it.
            self._give_back(hold)
            raise
        if self._short(hold):
            try:
                self.extend()
            except BaseException:
                self._give_back(hold)  # as in _aacquire
                raise
        return hold

    def _still_granted(self, hold: Hold) -> bool:
        """Return True if a new hold may be entered; else give it back (the caller queues again).

        The wake-up was checked against the hand-over lease, but the process
        or event loop may have stalled after that check, before the hold was
        adopted and watched: if its local bound is spent, the lock may be the
        next waiter's already. Redis is asked (EXTEND to the full lease), a
        quorum hold counts only on its validity.
        """
        if hold.valid():
            return True
        get_watchdog().unwatch(hold)
        try:
            kept = not hold.strict and self._run(self._where.extend_steps(hold, self.lease))
        except BaseException:
            self._give_back(hold)
            raise
        if not kept:
            self._give_back(hold)
            return False
        return self._renew_from_now(hold)

    async def _astill_granted(self, hold: Hold) -> bool:
        """Async twin of :meth:`_still_granted`."""
        if hold.valid():
            return True
        get_watchdog().unwatch(hold)
        try:
            kept = not hold.strict and await self._arun(self._where.extend_steps(hold, self.lease))
        except BaseException:
            await asyncio.shield(self._agive_back(hold))
            raise
        if not kept:
            await asyncio.shield(self._agive_back(hold))
            return False
        return self._renew_from_now(hold)

    def _renew_from_now(self, hold: Hold) -> bool:
        """Watch ``hold`` again once Redis confirmed it; return True."""
        if self.watchdog:
            get_watchdog().watch(hold)
        return True

    def _abandon_later(self, token: str) -> None:
        """Leave the line and give back the lock from the background, once Redis answers.

        The script whose reply timed out may still run when Redis is
        responsive again, granting the lock (or a place in line) to a token
        nobody has; that lock would stay held for its whole lease.
        """
        give_back_later(
            f"{self.kind} {self.name!r}",
            lambda: self._where.abandon_steps(token),
            max(self.lease, WAIT_LEASE),
        )

    def _abandon(self, token: str) -> None:
        try:
            run_steps(self._where.abandon_steps(token))
        except Exception as exc:  # the interrupt that brought us here is what propagates
            self._abandon_failed(token, exc)

    def _abandon_failed(self, token: str, exc: Exception) -> None:
        # Leaving the line did not land (a cut connection, a Redis asleep): a
        # script in flight, or the next release, may still hand the lock to
        # this token, which nobody has. Retry until Redis answers.
        logger.warning(
            "Could not leave the wait queue of %s %r (retrying in the background): %s",
            self.kind,
            self.name,
            exc,
        )
        self._abandon_later(token)

    async def aacquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Async twin of :meth:`acquire`; never blocks the event loop."""
        return (await self._aacquire(blocking, timeout)) is not None

    async def _aacquire(self, blocking: bool, timeout: float | None) -> Hold | None:
        blocking, timeout = self._wait_params(blocking, timeout)
        hold = self._nest_candidate()
        if hold is not None and (hold.valid() or await self._arun(self._where.confirm_steps(hold))):
            self._levels.nest(hold)
            return hold
        attempt = self._start(blocking, timeout)
        started = attempt.started
        while True:
            with _acquisition_errors(self.name, self.using, started):
                adopted = await self._acquire_in_child(attempt)
            if adopted is None:
                self._note_contention(attempt)
                return None
            hold = adopted
            # No await between this check and the body but a confirming one.
            if await self._astill_granted(hold):
                break
        self._levels.succeeded()
        try:
            self._announce(hold, started)
        except BaseException:
            await asyncio.shield(self._agive_back(hold))
            raise
        if self._short(hold):
            try:
                await self.aextend()
            except BaseException:
                # Cancelled or failed while lengthening a hand-over's lease: the
                # caller never gets the lock, so nothing else would give it back.
                await asyncio.shield(self._agive_back(hold))
                raise
        return hold

    async def _acquire_in_child(self, attempt: Attempt) -> Hold | None:
        """Run the acquisition with :func:`~.driver.run_in_child`: a cancel is never lost.

        The hold is adopted (and watched) in the child, as Redis's answer is
        read: the watchdog renews it from that moment, even if the caller's
        loop stalls before the caller runs again.
        """
        owner = current_owner()
        token = attempt.token
        adopted: list[Hold] = []

        def adopting() -> Steps[Grant | None]:
            grant = yield from self._acquisition_steps(attempt)
            if grant is not None:
                adopted.append(self._adopt(token, grant, owner))
            return grant

        async def abandon() -> None:
            if adopted:
                self._forget(adopted[0])
            await self._aabandon(token)

        try:
            await run_in_child(
                adopting(), abandon, (redis_errors.TimeoutError, LockBackendUnavailable)
            )
        except (redis_errors.TimeoutError, LockBackendUnavailable):
            self._abandon_later(token)  # as in _acquire
            raise
        return adopted[0] if adopted else None

    async def _aabandon(self, token: str) -> None:
        try:
            await AsyncDriver().run(self._where.abandon_steps(token))
        except Exception as exc:
            self._abandon_failed(token, exc)

    # -- release -------------------------------------------------------------

    def _forget(self, hold: Hold, *, unwatched: bool = False) -> None:
        """End ``hold`` locally: no renewal, no level of this handle, nothing nests into it."""
        if not unwatched:
            get_watchdog().unwatch(hold)
        hold.active = False
        self._levels.remove(hold)

    def _give_back(self, hold: Hold) -> None:
        """Release a hold the caller will never see (best effort; its lease ends anyway)."""
        self._forget(hold)
        try:
            run_steps(self._where.release_steps(hold))
        except Exception as exc:
            logger.warning("Could not give back %s %r: %s", self.kind, self.name, exc)

    async def _agive_back(self, hold: Hold) -> None:
        self._forget(hold)
        try:
            await AsyncDriver().run(self._where.release_steps(hold))
        except Exception as exc:
            logger.warning("Could not give back %s %r: %s", self.kind, self.name, exc)

    def _release_failed_locally(self, hold: Hold) -> None:
        # The release may have reached Redis with only its reply lost: stop
        # renewing, and never let anything nest into this hold again. The level
        # stays, so the release can be retried.
        get_watchdog().unwatch(hold)
        hold.releasing = True
        self._levels.nest(hold)
        # Called while the failure propagates. Redis not answering may also
        # mean the release never ran (dropped with its connection), and a
        # cancel may have cut it before it was sent (its connection still being
        # made): the owner has left, so the background gives the lock back
        # until Redis answers, unless the caller's own retry does first.
        if isinstance(sys.exc_info()[1], (LockBackendUnavailable, asyncio.CancelledError)):
            give_back_later(
                f"{self.kind} {self.name!r} (fence {hold.fence})",
                lambda: self._where.release_steps(hold),
                hold.ttl,
                lambda: hold.active,
            )

    def _held_or_raise(self, action: str) -> Hold:
        hold = self._current()
        if hold is None or not hold.active:
            raise LockNotOwned(
                f"Cannot {action} {self.kind} {self.name!r}: this handle does not hold it.",
                name=self.name,
            )
        return hold

    def _finish(self, hold: Hold, released: bool, databases: tuple[str, ...] = ()) -> None:
        """Forget the hold after Redis answered the release (the watchdog had let go before)."""
        if not released and hold.releasing:
            # A retry of a release that failed: that release (only its reply
            # lost) or the background give-back after it may have freed the
            # lock first. It was let go, not lost.
            released = True
        self._forget(hold, unwatched=True)
        held = time.monotonic() - hold.acquired_at
        if released:
            if signals.lock_released.receivers:
                signals.lock_released.send(
                    sender=self.using,
                    name=self.name,
                    fence=hold.fence,
                    held=held,
                    shared=hold.shared,
                    databases=databases,
                    **self._kind_signal,
                )
            return
        declare_lost(hold, "it was no longer held by this owner at release")
        raise LockNotOwned(
            f"{hold.describe()} was no longer held at release: "
            "it expired, was reset, or was taken by another owner.",
            name=self.name,
        )

    def release(self) -> None:
        """Release the lock (or one nesting level of it).

        Raise LockNotOwned when this handle does not hold it, including when its
        hold expired or was taken; another owner's lock is never touched. The
        handle keeps its token until Redis confirmed, so a failed release can be
        retried; the watchdog stops renewing it, so a release never retried
        ends with the lease instead of being renewed forever.
        """
        self._release(self._held_or_raise("release"))

    def _release(self, hold: Hold) -> None:
        if self._levels.drop(hold):
            return
        kept = keep_for_transaction(self, hold)
        if kept is not None:
            if kept and not run_steps(self._where.mark_steps(hold, kept)):
                lost_while_kept(self, hold)
            if still_kept(hold):
                return
        # Stop renewing first: a renewal answered after our release would
        # otherwise report the lock as lost.
        get_watchdog().unwatch(hold)
        try:
            released = self._run(self._where.release_steps(hold))
        except BaseException:
            self._release_failed_locally(hold)
            raise
        self._finish(hold, released)

    async def arelease(self) -> None:
        """Async twin of :meth:`release`; a cancelled release can be retried too."""
        await self._arelease(self._held_or_raise("release"))

    async def _arelease(self, hold: Hold) -> None:
        if self._levels.drop(hold):
            return
        kept = keep_for_transaction(self, hold)
        if kept is not None:
            if kept and not await AsyncDriver().run(self._where.mark_steps(hold, kept)):
                lost_while_kept(self, hold)
            if still_kept(hold):
                return
        get_watchdog().unwatch(hold)
        try:
            released = await self._arun(self._where.release_steps(hold))
        except BaseException:
            self._release_failed_locally(hold)
            raise
        self._finish(hold, released)

    # -- extend and inspect --------------------------------------------------

    def _extended(self, hold: Hold, ttl: float, ok: bool) -> None:
        if not ok:
            declare_lost(hold, "extend found it held by another owner or gone")
            raise LockNotOwned(
                f"Cannot extend {self.kind} {self.name!r}: it is no longer held by this handle.",
                name=self.name,
            )
        hold.ttl = ttl
        get_watchdog().poke(hold)

    def extend(self, ttl: float | None = None) -> None:
        """Set the remaining lease to ``ttl`` seconds (default: the handle's ttl).

        Later watchdog renewals keep to the new length. Raise LockNotOwned if
        the lock is no longer ours.
        """
        hold, ttl = self._extending(ttl)
        self._extended(hold, ttl, self._run(self._where.extend_steps(hold, ttl)))

    async def aextend(self, ttl: float | None = None) -> None:
        """Async twin of :meth:`extend`."""
        hold, ttl = self._extending(ttl)
        self._extended(hold, ttl, await self._arun(self._where.extend_steps(hold, ttl)))

    def _extending(self, ttl: float | None) -> tuple[Hold, float]:
        return self._held_or_raise("extend"), self.lease if ttl is None else validate_ttl(ttl)

    def _run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` with blocking calls, Redis's failures raised as ours."""
        with backend_errors(self.name, self.using):
            return run_steps(steps)

    async def _arun(self, steps: Steps[T]) -> T:
        """Drive ``steps`` on the event loop, Redis's failures raised as ours."""
        with backend_errors(self.name, self.using):
            return await AsyncDriver().run(steps)

    def time_left(self) -> float:
        """Return the seconds left on this handle's lease (asks Redis), 0.0 if it holds none."""
        return self._run(self._where.time_left_steps(self._current()))

    async def atime_left(self) -> float:
        """Async twin of :meth:`time_left`."""
        return await self._arun(self._where.time_left_steps(self._current()))

    def owned(self) -> bool:
        """Return True if this handle holds the lock right now (asks Redis)."""
        return self._run(self._where.owned_steps(self._current()))

    async def aowned(self) -> bool:
        """Async twin of :meth:`owned`."""
        return await self._arun(self._where.owned_steps(self._current()))

    def locked(self) -> bool:
        """Return True if anyone holds the lock right now."""
        return self._run(self._where.holder_steps()) is not None

    async def alocked(self) -> bool:
        """Async twin of :meth:`locked`."""
        return await self._arun(self._where.holder_steps()) is not None

    def ttl(self) -> float:
        """Deprecated name of :meth:`time_left` (``ttl=`` is the lease length)."""
        _renamed("Mutex.ttl()", "Mutex.time_left()")
        return self.time_left()

    async def attl(self) -> float:
        """Deprecated name of :meth:`atime_left`."""
        _renamed("Mutex.attl()", "Mutex.atime_left()")
        return await self.atime_left()

    def owner(self) -> Owner | None:
        """Return who holds the lock (host, pid, thread, label), or None if free.

        For a lock held shared, one of its shared holders (see
        :func:`~django_redis_mutex.held_locks` for all of them).
        """
        return self._run(self._where.holder_steps()) or None

    async def aowner(self) -> Owner | None:
        """Async twin of :meth:`owner`."""
        return await self._arun(self._where.holder_steps()) or None

    # -- context manager -----------------------------------------------------
    #
    # ``with`` and ``async with`` raise LockContended when the lock cannot be
    # had, honour FAIL_OPEN, and on the way out raise LockLost only when the
    # body succeeded: an exception already propagating is never replaced. Each
    # block opens a scope that other handles of the same owner may nest into
    # until the block ends, and its exit leaves exactly the level it entered.

    def _enter_failed_open(self, exc: LockBackendUnavailable) -> None:
        if not self.settings.fail_open:
            raise exc
        logger.warning(
            "FAIL_OPEN: running %r unlocked because Redis is unavailable: %s", self.name, exc
        )
        self._levels.enter(None, None)

    def __enter__(self) -> Mutex:
        try:
            hold = self._acquire(DEFAULT, DEFAULT)
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
            return self
        if hold is None:
            raise self.contended()
        self._levels.enter(hold, open_scope(hold))
        return self

    async def __aenter__(self) -> Mutex:
        try:
            hold = await self._aacquire(DEFAULT, DEFAULT)
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
            return self
        if hold is None:
            raise self.contended()
        self._levels.enter(hold, open_scope(hold))
        return self

    def _leaving(self) -> Hold | None:
        """Pop the block being left; return its hold (None if it ran unlocked)."""
        block = self._levels.leave()
        if block is None or block.hold is None:
            return None
        if block.scope is not None:
            close_scope(block.scope)
        hold = block.hold
        declare_if_lapsed(hold)
        return hold

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        hold = self._leaving()
        if hold is None:
            return False  # ran unlocked under FAIL_OPEN
        try:
            self._release(hold)
        except LockNotOwned:
            self._lost_on_exit(hold, body_failed=exc_type is not None)
        except LockBackendUnavailable as error:
            self._release_failed(error, body_failed=exc_type is not None)
        else:
            if hold.lost and not hold.active:
                self._lost_on_exit(hold, body_failed=exc_type is not None)
        return False

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        hold = self._leaving()
        if hold is None:
            return False
        try:
            # Shielded: a task cancelled while leaving the block still releases
            # its lock (the release finishes in the background).
            await asyncio.shield(self._arelease(hold))
        except LockNotOwned:
            self._lost_on_exit(hold, body_failed=exc_type is not None)
        except LockBackendUnavailable as error:
            self._release_failed(error, body_failed=exc_type is not None)
        else:
            if hold.lost and not hold.active:
                self._lost_on_exit(hold, body_failed=exc_type is not None)
        return False

    def _lost_on_exit(self, hold: Hold, *, body_failed: bool) -> None:
        message = (
            f"{hold.describe()} was lost while the block ran: "
            f"{hold.lost_reason or 'it expired, was reset, or was taken'}."
        )
        if body_failed or not hold.raise_on_lost:
            logger.error(message)
            return
        raise LockLost(message, name=self.name)

    def _release_failed(self, error: LockBackendUnavailable, *, body_failed: bool) -> None:
        # The lease still ends by itself; the hold stays on the handle for a retry.
        if body_failed or self.settings.fail_open:
            logger.error("Could not release %s %r: %s", self.kind, self.name, error)
            return
        raise error


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated, use {new}: everywhere else ttl is the lease length.",
        DeprecationWarning,
        stacklevel=3,
    )


class _acquisition_errors(backend_errors):
    """``backend_errors`` around a new acquisition; also tells ``lock_unavailable`` receivers."""

    __slots__ = ("started",)

    def __init__(self, name: str, alias: str, started: float) -> None:
        # No super().__init__(): this sits on every acquisition.
        self.name = name
        self.alias = alias
        self.started = started

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None or not signals.lock_unavailable.receivers:
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
        wait = time.monotonic() - self.started
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


def wait_params(
    blocking: Any, timeout: Any, default_blocking: bool, default_timeout: float | None
) -> tuple[bool, float | None]:
    """Resolve an acquire()'s ``blocking`` and ``timeout`` (DEFAULT: the handle's) or raise.

    Shared by locks and semaphores, so both refuse the same bad combinations
    with the same message.
    """
    if blocking is DEFAULT:
        blocking = default_blocking
    else:
        blocking = validate_flag("blocking", blocking)
        refuse_timeout_without_blocking(blocking, timeout)
    timeout = default_timeout if timeout is DEFAULT else validate_timeout(timeout)
    return blocking, timeout


class QuorumMutex(Mutex):
    """Deprecated: every :class:`Mutex` lives on a quorum when ``using`` names one.

    Kept so that code written when a quorum lock had a class of its own still
    runs: it builds a Mutex that must be on a quorum.
    """

    def __init__(self, name: str, *, using: Any = "default", **options: Any) -> None:
        warnings.warn(
            "QuorumMutex is deprecated: Mutex(name, using=[...]) is a quorum lock.",
            DeprecationWarning,
            stacklevel=2,
        )
        if quorum_members(using) is None:
            raise ImproperlyConfigured(f"QuorumMutex {name!r}: {using!r} names no quorum.")
        super().__init__(name, using=using, **options)
