"""Mutex: acquire, wait, release, extend and inspect one named lock.

The synchronous methods and their ``a``-prefixed async twins share keys,
scripts and state, so a sync holder blocks an async contender and vice versa.
Every Redis operation is one round trip: a Lua script (acquire, release,
extend, cancel) or a plain command. Waiting is wake-on-release: a waiter
blocks on its own list until the releasing script hands it the lock, bounded
by the holder's remaining lease and the caller's deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

from redis import exceptions as redis_errors

from . import scripts, signals
from .client import backend_errors, get_async_client, get_client, namespace
from .conf import MutexSettings, get_settings, validate_timeout, validate_ttl
from .exceptions import LockBackendUnavailable, LockContended, LockLost, LockNotOwned
from .holds import (
    Hold,
    current_hold,
    current_owner,
    decode,
    forget_hold,
    owner_metadata,
    remember_hold,
)
from .keys import LockKeys, validate_name
from .scripts import HANDOFF_LEASE, WAIT_LEASE
from .watchdog import get_watchdog

__all__ = ["DEFAULT", "Mutex"]

logger = logging.getLogger("django_redis_mutex")


class _Default:
    """Sentinel: take the value from the alias's MUTEX settings."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()

# Margin added to a wait capped by the holder's lease, so the waiter wakes just
# after the key expired rather than just before.
_EXPIRY_MARGIN = 0.002
# Redis's default timer tick (hz 10): the resolution of a blocking pop's timeout.
_REDIS_TICK = 0.1


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class Mutex:
    """A handle on one named distributed lock.

    A handle holds at most one acquisition at a time (nested reentrantly as
    often as needed); its token lives on the handle, so it can be released
    from another thread. Create one handle per critical section, or use
    :func:`django_redis_mutex.mutex`, which does so for you.
    """

    def __new__(cls, name: str, *, using: str | Sequence[str] = "default", **options: Any) -> Mutex:
        # A list of aliases, or an alias whose MUTEX block names a QUORUM, makes
        # a Redlock-style quorum lock with the same interface.
        if cls is Mutex and _wants_quorum(using):
            from .quorum import QuorumMutex

            return super().__new__(QuorumMutex)
        return super().__new__(cls)

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
    ) -> None:
        self.name: str = validate_name(name)
        if isinstance(using, (list, tuple)) and len(using) == 1:
            using = using[0]
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
            config.blocking if blocking is DEFAULT else _flag("blocking", blocking)
        )
        if blocking is False and timeout is not DEFAULT and timeout is not None:
            raise ValueError("A timeout cannot be given for a non-blocking lock (blocking=False).")
        self.watchdog: bool = (
            config.watchdog if watchdog is DEFAULT else _flag("watchdog", watchdog)
        )
        self.reentrant: bool = _flag("reentrant", reentrant)
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a string or None, not {type(label).__name__}.")
        self.label = label
        self.keys = LockKeys.for_name(namespace(using), self.name)
        self._hold: Hold | None = None
        self._depth = 0
        self._contention: tuple[int, Any, float] = (0, None, 0.0)
        self._failed_open = False
        self._owner_json: str | None = None

    def __repr__(self) -> str:
        state = f"fence={self.fence}" if self._hold is not None else "unlocked"
        return f"<Mutex {self.name!r} using={self.using!r} {state}>"

    # -- state ---------------------------------------------------------------

    @property
    def token(self) -> str | None:
        """The random owner token of the current hold, or None."""
        return self._hold.token if self._hold is not None else None

    @property
    def fence(self) -> int | None:
        """The fencing token of the current hold: larger than every earlier one of this name."""
        return self._hold.fence if self._hold is not None else None

    @property
    def lost(self) -> bool:
        """True if the watchdog found that the current hold is no longer ours."""
        return self._hold is not None and self._hold.lost

    def contended(self) -> LockContended:
        """Return the error describing the last failed acquisition of this handle."""
        pttl, owner, waited = self._contention
        retry_after = max(1, math.ceil(pttl / 1000)) if pttl > 0 else 1
        if not isinstance(owner, dict):
            owner = _owner_dict(owner) if owner else None
        return LockContended(self.name, retry_after=retry_after, owner=owner, waited=waited)

    # -- acquire -------------------------------------------------------------

    def _wait_params(self, blocking: bool, timeout: float | None) -> tuple[bool, float | None]:
        if blocking is DEFAULT:
            blocking = self.blocking
        else:
            blocking = _flag("blocking", blocking)
            if not blocking and timeout is not DEFAULT and timeout is not None:
                raise ValueError("A timeout cannot be given for a non-blocking acquire.")
        timeout = self.timeout if timeout is DEFAULT else validate_timeout(timeout)
        return blocking, timeout

    def _begin(
        self, blocking: bool, timeout: float | None
    ) -> tuple[bool, float, float | None, str] | None:
        """Start an acquisition: None if it nests into a hold we already have,
        else (blocking, start time, deadline, a fresh owner token)."""
        blocking, timeout = self._wait_params(blocking, timeout)
        if self._nest():
            return None
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        self._owner_json = None
        return blocking, started, deadline, secrets.token_hex(16)

    def _nest(self) -> bool:
        """Join the current owner's hold on this lock, if reentrancy allows."""
        if self._hold is not None and self._hold.active:
            # A handle shared by two threads (or copied into a forked child)
            # nests only for the owner that holds it.
            if not self.reentrant or self._hold.owner != current_owner():
                return False
            hold: Hold | None = self._hold
        elif self.reentrant:
            hold = current_hold(self.using, self.keys.lock)
        else:
            return False
        if hold is None or hold.lost or hold.expires_at <= time.monotonic():
            return False
        hold.depth += 1
        self._hold = hold
        self._depth += 1
        return True

    def _acquire_args(self, token: str, join: bool) -> list[Any]:
        # The owner record is taken once per acquire, in the caller's own
        # thread or task (a wait may run in a child task).
        if self._owner_json is None:
            self._owner_json = owner_metadata(self.label)
        return [token, _ms(self.lease), self._owner_json, self.name, 1 if join else 0]

    def _cancel_args(self, token: str) -> list[Any]:
        return [token, self.name]

    def _wait_slice(
        self, deadline: float | None, pttl: int, socket_timeout: Any
    ) -> tuple[float, bool]:
        """Return how long to wait now, and whether to sleep locally instead of blocking on Redis.

        The wait ends at the deadline, at the holder's expiry, or at a lease
        check-in. Redis ends a blocking pop only on its timer tick (every
        1000/hz ms), so the last tick before a holder's expiry is slept here
        and the waiter checks in right after the key expired.
        """
        wait = WAIT_LEASE / 2
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
        local = False
        if pttl > 0:
            expiry = pttl / 1000 + _EXPIRY_MARGIN
            if expiry <= _REDIS_TICK:
                wait, local = min(wait, expiry), True
            else:
                wait = min(wait, expiry - _REDIS_TICK)
        if socket_timeout:
            # A blocking pop longer than the socket timeout would be cut as a failure.
            wait = min(wait, float(socket_timeout) * 0.8)
        return max(wait, 0.001), local

    def _granted(
        self, token: str, fence: Any, started: float, lease_left: float | None = None
    ) -> bool:
        """Record a new hold; return True if the caller must extend it now.

        ``lease_left`` is set when the lock was handed over with a shorter lease
        than ours: the watchdog lengthens it soon, or without a watchdog the
        caller extends it at once.
        """
        hold = Hold(
            alias=self.using,
            name=self.name,
            keys=self.keys,
            token=token,
            fence=int(fence),
            ttl=self.lease,
            owner=current_owner(),
            max_hold=self.settings.max_hold,
            raise_on_lost=self.settings.raise_on_lost,
        )
        short = lease_left if lease_left is not None and lease_left < self.lease else None
        hold.expires_at = hold.acquired_at + (self.lease if short is None else short)
        hold.targets, hold.quorum = self._hold_targets()
        self._hold = hold
        self._depth = 1
        remember_hold(hold)
        if self.watchdog:
            get_watchdog().watch(hold, first_renewal=None if short is None else short / 3)
        if signals.lock_acquired.receivers:
            try:
                signals.lock_acquired.send(
                    sender=self.using,
                    name=self.name,
                    fence=hold.fence,
                    wait=hold.acquired_at - started,
                )
            except BaseException:
                # The caller never gets the lock, so nothing would release it.
                self._give_back(hold)
                raise
        return short is not None and not self.watchdog

    def _hold_targets(self) -> tuple[tuple[tuple[str, str], ...], int]:
        """Return where a hold of this handle lives, and how many places must agree."""
        return ((self.using, self.keys.lock),), 1

    def _refused(self, reply: list[Any], started: float) -> None:
        # The holder's owner record stays raw until an error needs it: a
        # waiter is refused on every check-in, and parsing it each time is waste.
        owner = reply[2] if len(reply) > 2 else None
        self._contention = (int(reply[1]), owner, time.monotonic() - started)

    def _note_contention(self) -> None:
        if signals.lock_contended.receivers:
            error = self.contended()
            signals.lock_contended.send(
                sender=self.using,
                name=self.name,
                wait=error.waited,
                retry_after=error.retry_after,
                owner=error.owner,
            )

    def acquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Acquire the lock; return True on success, False if it stayed contended.

        ``blocking`` and ``timeout`` default to the handle's settings;
        ``timeout=None`` waits forever. Raise LockBackendUnavailable when Redis
        cannot be reached.
        """
        begun = self._begin(blocking, timeout)
        if begun is None:
            return True
        blocking, started, deadline, token = begun
        client = get_client(self.using)
        with backend_errors(self.name, self.using):
            reply = scripts.run(
                client, scripts.ACQUIRE, self.keys.script_keys, self._acquire_args(token, blocking)
            )
            if reply[0] == 1:
                granted = (reply[1], None)
            else:
                self._refused(reply, started)
                if not blocking:
                    self._note_contention()
                    return False
                granted = self._wait_or_abandon(client, token, deadline, reply, started)
        # Outside backend_errors: an error of a signal receiver is not Redis's.
        if granted is None:
            self._contention = (*self._contention[:2], time.monotonic() - started)
            self._note_contention()
            return False
        if self._granted(token, granted[0], started, lease_left=granted[1]):
            self.extend()
        return True

    def _wait_or_abandon(
        self, client: Any, token: str, deadline: float | None, reply: list[Any], started: float
    ) -> Any:
        """Run :meth:`_wait`, leaving the queue cleanly if the wait is interrupted."""
        try:
            return self._wait(client, token, deadline, reply, started)
        except redis_errors.TimeoutError:
            # Redis is not answering: a cancel would wait out another
            # socket timeout. Our queue slot lapses after WAIT_LEASE.
            raise
        except BaseException:
            self._abandon(client, token)
            raise

    def _wait(
        self, client: Any, token: str, deadline: float | None, reply: list[Any], started: float
    ) -> Any:
        """Block until we hold the lock or the deadline passes.

        Return (fence, seconds of lease it came with, or None for our full
        lease), or None when the deadline passed without the lock.
        """
        wake_key = self.keys.wake_prefix + token
        socket_timeout = _socket_timeout(client)
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                final = scripts.run(
                    client, scripts.CANCEL, self.keys.script_keys, self._cancel_args(token)
                )
                return (final[1], HANDOFF_LEASE) if final[0] == 1 else None
            wait, local = self._wait_slice(deadline, reply[1], socket_timeout)
            if local:
                time.sleep(wait)
            elif popped := client.blpop([wake_key], timeout=wait):
                return popped[1], HANDOFF_LEASE
            # Woken by our own timer: check in (keeps our place) and retry.
            reply = scripts.run(
                client, scripts.ACQUIRE, self.keys.script_keys, self._acquire_args(token, True)
            )
            if reply[0] == 1:
                return reply[1], (int(reply[2]) / 1000 if len(reply) > 2 else None)
            self._refused(reply, started)

    def _abandon(self, client: Any, token: str) -> None:
        """Leave the queue after an interrupted wait, releasing the lock if it was handed over."""
        try:
            final = scripts.run(
                client, scripts.CANCEL, self.keys.script_keys, self._cancel_args(token)
            )
            if final[0] == 1:
                scripts.run(
                    client, scripts.RELEASE, self.keys.script_keys, self._release_args(token)
                )
        except Exception as exc:  # the interrupt that brought us here is what propagates
            logger.warning("Could not leave the wait queue of lock %r: %s", self.name, exc)

    async def aacquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Async twin of :meth:`acquire`; never blocks the event loop."""
        begun = self._begin(blocking, timeout)
        if begun is None:
            return True
        blocking, started, deadline, token = begun
        with backend_errors(self.name, self.using):
            client = await get_async_client(self.using)
            reply = await scripts.arun(
                client, scripts.ACQUIRE, self.keys.script_keys, self._acquire_args(token, blocking)
            )
            if reply[0] == 1:
                granted = (reply[1], None)
            else:
                self._refused(reply, started)
                if not blocking:
                    self._note_contention()
                    return False
                granted = await self._await_in_child(client, token, deadline, reply, started)
        if granted is None:
            self._contention = (*self._contention[:2], time.monotonic() - started)
            self._note_contention()
            return False
        if self._granted(token, granted[0], started, lease_left=granted[1]):
            await self.aextend()
        return True

    async def _await_in_child(
        self, client: Any, token: str, deadline: float | None, reply: list[Any], started: float
    ) -> Any:
        """Run the wait in a child task, so a cancellation of the caller is never lost.

        redis-py sends through ``asyncio.wait_for``, which before Python 3.12
        can swallow a cancel() landing just as a send completes; a waiter would
        then sit out its timeout and might take the lock for a task that is
        gone. Waiting on the child with ``asyncio.wait`` always sees the cancel,
        and ``stop`` ends the child even if its own cancel was swallowed.
        """
        stop = asyncio.Event()
        child = asyncio.ensure_future(self._await(client, token, deadline, reply, started, stop))
        try:
            await asyncio.wait({child})
        except BaseException:
            stop.set()
            child.cancel()
            try:
                await asyncio.shield(asyncio.wait({child}))
            finally:
                # Even if cancelled again here: leave the queue, and release a
                # lock that was handed over meanwhile.
                if child.done() and not child.cancelled():
                    child.exception()  # retrieved, so asyncio does not warn
                await asyncio.shield(self._aabandon(client, token))
            raise
        try:
            return child.result()
        except redis_errors.TimeoutError:
            # Redis is not answering: a cancel would wait out another socket
            # timeout. Our queue slot lapses after WAIT_LEASE.
            raise
        except BaseException:
            await asyncio.shield(self._aabandon(client, token))
            raise

    async def _await(
        self,
        client: Any,
        token: str,
        deadline: float | None,
        reply: list[Any],
        started: float,
        stop: asyncio.Event,
    ) -> Any:
        wake_key = self.keys.wake_prefix + token
        socket_timeout = _socket_timeout(client)
        while True:
            if stop.is_set():
                raise asyncio.CancelledError(f"Waiting for lock {self.name!r} was cancelled.")
            if deadline is not None and time.monotonic() >= deadline:
                final = await scripts.arun(
                    client, scripts.CANCEL, self.keys.script_keys, self._cancel_args(token)
                )
                return (final[1], HANDOFF_LEASE) if final[0] == 1 else None
            wait, local = self._wait_slice(deadline, reply[1], socket_timeout)
            if local:
                await asyncio.sleep(wait)
            elif popped := await client.blpop([wake_key], timeout=wait):
                return popped[1], HANDOFF_LEASE
            if stop.is_set():
                raise asyncio.CancelledError(f"Waiting for lock {self.name!r} was cancelled.")
            reply = await scripts.arun(
                client, scripts.ACQUIRE, self.keys.script_keys, self._acquire_args(token, True)
            )
            if reply[0] == 1:
                return reply[1], (int(reply[2]) / 1000 if len(reply) > 2 else None)
            self._refused(reply, started)

    async def _aabandon(self, client: Any, token: str) -> None:
        try:
            final = await scripts.arun(
                client, scripts.CANCEL, self.keys.script_keys, self._cancel_args(token)
            )
            if final[0] == 1:
                await scripts.arun(
                    client, scripts.RELEASE, self.keys.script_keys, self._release_args(token)
                )
        except Exception as exc:
            logger.warning("Could not leave the wait queue of lock %r: %s", self.name, exc)

    # -- release -------------------------------------------------------------

    def _release_args(self, token: str) -> list[Any]:
        return [token]

    def _give_back(self, hold: Hold) -> None:
        """Release a hold the caller will never see (best effort; its lease ends anyway)."""
        get_watchdog().unwatch(hold)
        forget_hold(hold)
        self._hold = None
        self._depth = 0
        for alias, lock_key in hold.targets:
            try:
                scripts.run(get_client(alias), scripts.RELEASE, [lock_key], [hold.token])
            except Exception as exc:
                logger.warning("Could not give back lock %r on %r: %s", self.name, alias, exc)

    @staticmethod
    def _release_failed_locally(hold: Hold) -> None:
        # The release may have reached Redis with only its reply lost: stop
        # renewing, and never let a nested acquire join this hold again
        # without asking Redis. The token stays, so the release can be retried.
        get_watchdog().unwatch(hold)
        hold.expires_at = -math.inf

    def _held_or_raise(self, action: str) -> Hold:
        hold = self._hold
        if hold is None or not hold.active:
            raise LockNotOwned(
                f"Cannot {action} lock {self.name!r}: this handle does not hold it.",
                name=self.name,
            )
        return hold

    def _unnest(self, hold: Hold) -> bool:
        """Leave one nesting level; return True if an outer level still holds the lock."""
        if hold.depth > 1:
            hold.depth -= 1
            self._depth -= 1
            if self._depth == 0:
                self._hold = None
            return True
        return False

    def _finish(self, hold: Hold, released: int) -> None:
        """Forget the hold after Redis answered the release (``released`` is the script reply)."""
        get_watchdog().unwatch(hold)
        forget_hold(hold)
        self._hold = None
        self._depth = 0
        held = time.monotonic() - hold.acquired_at
        if released:
            if signals.lock_released.receivers:
                signals.lock_released.send(
                    sender=self.using, name=self.name, fence=hold.fence, held=held
                )
            return
        first = hold.mark_lost("it was no longer held by this owner at release")
        if first and signals.lock_lost.receivers:
            signals.lock_lost.send(sender=self.using, name=self.name, fence=hold.fence, held=held)
        raise LockNotOwned(
            f"Lock {self.name!r} (fence {hold.fence}) was no longer held at release: "
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
        hold = self._held_or_raise("release")
        if self._unnest(hold):
            return
        # Stop renewing first: a renewal answered after our release would
        # otherwise report the lock as lost.
        get_watchdog().unwatch(hold)
        try:
            with backend_errors(self.name, self.using):
                released = scripts.run(
                    get_client(self.using),
                    scripts.RELEASE,
                    self.keys.script_keys,
                    self._release_args(hold.token),
                )
        except BaseException:
            self._release_failed_locally(hold)
            raise
        self._finish(hold, released)

    async def arelease(self) -> None:
        """Async twin of :meth:`release`; a cancelled release can be retried too."""
        hold = self._held_or_raise("release")
        if self._unnest(hold):
            return
        get_watchdog().unwatch(hold)
        try:
            with backend_errors(self.name, self.using):
                client = await get_async_client(self.using)
                released = await scripts.arun(
                    client, scripts.RELEASE, self.keys.script_keys, self._release_args(hold.token)
                )
        except BaseException:
            self._release_failed_locally(hold)
            raise
        self._finish(hold, released)

    # -- extend and inspect --------------------------------------------------

    def _extended(self, hold: Hold, ttl: float, ok: int) -> None:
        if not ok:
            hold.mark_lost("extend found it held by another owner or gone")
            raise LockNotOwned(
                f"Cannot extend lock {self.name!r}: it is no longer held by this handle.",
                name=self.name,
            )
        hold.ttl = ttl
        hold.renew_at = time.monotonic() + ttl / 3
        hold.expires_at = time.monotonic() + ttl

    def extend(self, ttl: float | None = None) -> None:
        """Set the remaining lease to ``ttl`` seconds (default: the handle's ttl).

        Later watchdog renewals keep to the new length. Raise LockNotOwned if
        the lock is no longer ours.
        """
        ttl = self.lease if ttl is None else validate_ttl(ttl)
        hold = self._held_or_raise("extend")
        with backend_errors(self.name, self.using):
            ok = scripts.run(
                get_client(self.using), scripts.EXTEND, [self.keys.lock], [hold.token, _ms(ttl)]
            )
        self._extended(hold, ttl, ok)

    async def aextend(self, ttl: float | None = None) -> None:
        """Async twin of :meth:`extend`."""
        ttl = self.lease if ttl is None else validate_ttl(ttl)
        hold = self._held_or_raise("extend")
        with backend_errors(self.name, self.using):
            ok = await scripts.arun(
                (await get_async_client(self.using)),
                scripts.EXTEND,
                [self.keys.lock],
                [hold.token, _ms(ttl)],
            )
        self._extended(hold, ttl, ok)

    def _state_from(self, token: Any, pttl: int) -> float:
        hold = self._hold
        if hold is None or decode(token) != hold.token or pttl < 0:
            return 0.0
        return pttl / 1000

    def ttl(self) -> float:
        """Return the seconds left on this handle's hold, or 0.0 if it holds nothing."""
        if self._hold is None:
            return 0.0
        with backend_errors(self.name, self.using):
            pipe = get_client(self.using).pipeline(transaction=False)
            pipe.hget(self.keys.lock, "token")
            pipe.pttl(self.keys.lock)
            token, pttl = pipe.execute()
        return self._state_from(token, pttl)

    async def attl(self) -> float:
        """Async twin of :meth:`ttl`."""
        if self._hold is None:
            return 0.0
        with backend_errors(self.name, self.using):
            pipe = (await get_async_client(self.using)).pipeline(transaction=False)
            pipe.hget(self.keys.lock, "token")
            pipe.pttl(self.keys.lock)
            token, pttl = await pipe.execute()
        return self._state_from(token, pttl)

    def owned(self) -> bool:
        """Return True if this handle holds the lock right now (asks Redis)."""
        if self._hold is None:
            return False
        with backend_errors(self.name, self.using):
            token = get_client(self.using).hget(self.keys.lock, "token")
        return decode(token) == self._hold.token

    async def aowned(self) -> bool:
        """Async twin of :meth:`owned`."""
        if self._hold is None:
            return False
        with backend_errors(self.name, self.using):
            token = await (await get_async_client(self.using)).hget(self.keys.lock, "token")
        return decode(token) == self._hold.token

    def locked(self) -> bool:
        """Return True if anyone holds the lock right now."""
        with backend_errors(self.name, self.using):
            return bool(get_client(self.using).exists(self.keys.lock))

    async def alocked(self) -> bool:
        """Async twin of :meth:`locked`."""
        with backend_errors(self.name, self.using):
            return bool(await (await get_async_client(self.using)).exists(self.keys.lock))

    def owner(self) -> dict[str, Any] | None:
        """Return the holder's metadata (host, pid, thread, label), or None if free."""
        with backend_errors(self.name, self.using):
            raw = get_client(self.using).hget(self.keys.lock, "owner")
        return _owner_dict(raw)

    async def aowner(self) -> dict[str, Any] | None:
        """Async twin of :meth:`owner`."""
        with backend_errors(self.name, self.using):
            raw = await (await get_async_client(self.using)).hget(self.keys.lock, "owner")
        return _owner_dict(raw)

    # -- context manager -----------------------------------------------------
    #
    # ``with`` and ``async with`` raise LockContended when the lock cannot be
    # had, honour FAIL_OPEN, and on the way out raise LockLost only when the
    # body succeeded: an exception already propagating is never replaced.

    def _enter_failed_open(self, exc: LockBackendUnavailable) -> None:
        if not self.settings.fail_open:
            raise exc
        self._failed_open = True
        logger.warning(
            "FAIL_OPEN: running %r unlocked because Redis is unavailable: %s", self.name, exc
        )

    def __enter__(self) -> Mutex:
        self._failed_open = False
        try:
            acquired = self.acquire()
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
            return self
        if not acquired:
            raise self.contended()
        return self

    async def __aenter__(self) -> Mutex:
        self._failed_open = False
        try:
            acquired = await self.aacquire()
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
            return self
        if not acquired:
            raise self.contended()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._hold is None:
            return False  # ran unlocked under FAIL_OPEN
        hold = self._hold
        try:
            self.release()
        except LockNotOwned:
            self._lost_on_exit(hold, body_failed=exc_type is not None)
        except LockBackendUnavailable as error:
            self._release_failed(error, body_failed=exc_type is not None)
        else:
            if hold.lost and not hold.active:
                self._lost_on_exit(hold, body_failed=exc_type is not None)
        return False

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._hold is None:
            return False
        hold = self._hold
        try:
            # Shielded: a task cancelled while leaving the block still releases
            # its lock (the release finishes in the background).
            await asyncio.shield(self.arelease())
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
            f"Lock {self.name!r} (fence {hold.fence}) was lost while the block ran: "
            f"{hold.lost_reason or 'it expired, was reset, or was taken'}."
        )
        if body_failed or not hold.raise_on_lost:
            logger.error(message)
            return
        raise LockLost(message, name=self.name)

    def _release_failed(self, error: LockBackendUnavailable, *, body_failed: bool) -> None:
        # The lease still ends by itself; the hold stays on the handle for a retry.
        if body_failed or self.settings.fail_open:
            logger.error("Could not release lock %r: %s", self.name, error)
            return
        raise error


def _owner_dict(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    import json

    try:
        value = json.loads(decode(raw))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _socket_timeout(client: Any) -> Any:
    """Return the socket timeout a client reads with (a pool's, or a cluster's nodes')."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return pool.connection_kwargs.get("socket_timeout")
    nodes = getattr(client, "nodes_manager", None)
    kwargs = getattr(nodes, "connection_kwargs", None) or getattr(client, "connection_kwargs", {})
    return kwargs.get("socket_timeout")


def _wants_quorum(using: object) -> bool:
    if isinstance(using, (list, tuple)):
        return len(using) > 1
    if isinstance(using, str):
        return get_settings(using).quorum is not None
    return False


def _flag(what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}.")
    return value
