"""Semaphore: at most ``limit`` holders of one name at once, each permit its own lease.

A permit is a token in the semaphore's ``holders`` sorted set, scored by the
millisecond (server clock) its lease ends; every script first drops the holders
whose lease ended, so a holder that died gives its permit back when its lease
ends, and not before. Keys and scripts: :mod:`django_redis_mutex.semaphore_scripts`.

Waiting is first in, first out: a waiter takes a place in the ``queue`` sorted
set and blocks on its own wake-up list; a script that frees a permit hands it
to the first live waiter in line and the client wakes that waiter (a second
step, since the waiter's list is not among the freeing script's keys). A
waiter also checks in every half wait lease and when the first holder's lease
ends, so a lost wake-up or a dead holder costs it at most that long.

Each operation is written once as steps (see :mod:`django_redis_mutex.driver`)
driven by the sync methods and by their ``a``-prefixed async twins.

A permit held with ``watchdog=True`` is renewed by the lock watchdog
(:mod:`django_redis_mutex.watchdog`): the lane of its cache alias renews it a
third into its lease with :data:`~.semaphore_scripts.SEM_EXTEND` (which never
re-creates a permit whose lease ended), in the same pipeline as the locks due
on that Redis, and stops at ``MAX_HOLD``. A permit found gone is marked lost
and ``lock_lost`` is sent with ``kind="semaphore"``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache, wraps
from typing import Any, ClassVar, Literal, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured
from redis import exceptions as redis_errors

from . import scripts
from .atomic_requests import RequestTransactions
from .client import backend_errors, get_client, namespace, server_ms
from .conf import get_settings, validate_flag, validate_timeout, validate_ttl
from .decorators import EnteredHandles, MutexContext
from .driver import REDIS_TICK, AsyncDriver, Pop, Script, Steps, run_in_child, run_steps
from .exceptions import LockBackendUnavailable, LockContended, LockLost, LockNotOwned
from .giveback import give_back_later
from .holds import Lease, decode, owner_metadata
from .keys import escape_name, glob_escape, unescape_name, validate_label, validate_name
from .lock import DEFAULT, wait_params
from .owners import Owner, mark_transaction, parse_owner
from .scripts import WAIT_LEASE, lease_ms
from .semaphore_scripts import (
    SEM_ACQUIRE,
    SEM_CANCEL,
    SEM_EXTEND,
    SEM_MARK_TRANSACTION,
    SEM_RELEASE,
    SEM_RESET,
    SEM_WAKE,
)
from .transactions import TransactionWait, open_transactions, warn_if_read_before
from .watchdog import announce_lost, get_watchdog

__all__ = [
    "HeldSemaphore",
    "Semaphore",
    "SemaphoreContext",
    "SemaphoreHolder",
    "SemaphoreKeys",
    "held_semaphores",
    "reset_semaphore",
    "semaphore",
    "semaphore_lines",
    "validate_limit",
]

logger = logging.getLogger("django_redis_mutex")

F = TypeVar("F", bound=Callable[..., Any])

# A semaphore's limit travels with every call; this bounds a typo, not a design.
MAX_LIMIT = 1_000_000
# Margin added to a wait capped by the first holder's lease, so the waiter
# checks in just after it ended rather than just before.
_EXPIRY_MARGIN = 0.005


def validate_limit(limit: object) -> int:
    """Return ``limit`` if it is a usable number of permits, else raise TypeError/ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"Semaphore limit must be an int, not {type(limit).__name__}.")
    if limit < 1:
        raise ValueError(f"Semaphore limit must be at least 1, got {limit}.")
    if limit > MAX_LIMIT:
        raise ValueError(f"Semaphore limit must be at most {MAX_LIMIT}, got {limit}.")
    return limit


# -- keys -----------------------------------------------------------------------


@dataclass(frozen=True)
class SemaphoreKeys:
    """The keys of one semaphore (layout in :mod:`~.semaphore_scripts`)."""

    base: str
    holders: str
    owners: str
    queue: str
    leases: str
    waiting: str
    limit: str
    # KEYS[1..6] of every script but SEM_WAKE.
    script_keys: tuple[str, str, str, str, str, str]

    @classmethod
    def for_name(cls, ns: str, name: str) -> SemaphoreKeys:
        return _semaphore_keys(ns, name)

    @classmethod
    def for_base(cls, base: str) -> SemaphoreKeys:
        holders, owners, queue, leases, waiting, limit = (f"{base}:{part}" for part in _PARTS)
        return cls(
            base=base,
            holders=holders,
            owners=owners,
            queue=queue,
            leases=leases,
            waiting=waiting,
            limit=limit,
            script_keys=(holders, owners, queue, leases, waiting, limit),
        )

    def wake(self, token: str) -> str:
        """Return the wake-up list of waiter ``token``."""
        return f"{self.base}:wake:{token}"

    def with_wake(self, token: str) -> tuple[str, ...]:
        """Return :attr:`script_keys` plus the wake-up list of ``token`` (KEYS[7])."""
        return (*self.script_keys, self.wake(token))


_PARTS = ("holders", "owners", "queue", "leases", "waiting", "limit")


@lru_cache(maxsize=4096)
def _semaphore_keys(ns: str, name: str) -> SemaphoreKeys:
    return SemaphoreKeys.for_base(f"{ns}:semaphore:{{{escape_name(name)}}}")


def _semaphore_pattern(ns: str) -> str:
    return glob_escape(ns) + ":semaphore:{*}:holders"


# -- steps shared by sync and async ---------------------------------------------


def _wake_steps(alias: str, keys: SemaphoreKeys, woken: list[Any]) -> Steps[None]:
    """Wake the waiters a script handed permits to (best effort: a check-in makes up)."""
    for raw in woken:
        token = decode(raw)
        yield Script(alias, SEM_WAKE, (keys.holders, keys.wake(token)), [token], best_effort=True)


@dataclass(eq=False)
class _Permit:
    """One permit a handle holds, as the watchdog renews it (a ``watchdog.Renewable``).

    Its lease is bounded from when the command that granted or renewed it was
    sent, as a lock's hold is.
    """

    alias: str
    name: str
    token: str
    keys: tuple[str, ...]  # KEYS[1..6] of SEM_EXTEND
    limit: int
    ttl: float  # the lease renewals ask for
    acquired_at: float
    max_hold: float | None
    # The waiter first in line when the permit was granted: the release
    # declares its wake-up list, to wake it in the same script.
    successor: str | None = None
    quorum: int = 1
    active: bool = True
    # A release failed with Redis not answering: the background gives it back.
    releasing: bool = False
    lost: bool = False
    lost_reason: str = ""
    expires_at: float = -math.inf
    targets: tuple[tuple[str, str], ...] = ()
    leases: dict[str, Lease] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    retry_at: dict[str, float] = field(default_factory=dict)

    kind: ClassVar[str] = "semaphore"
    strict: ClassVar[bool] = False  # one Redis: a late renewal that finds us proves we kept it

    def __post_init__(self) -> None:
        self.targets = ((self.alias, self.keys[0]),)

    @property
    def doomed(self) -> bool:
        return bool(self.refused)

    def confirm(self, alias: str, sent: float, ttl: float) -> None:
        previous = self.leases.get(alias)
        if previous is None or sent >= previous.sent:
            self.leases[alias] = Lease(sent, ttl)  # the command sent last set the expiry
            self.expires_at = sent + ttl
        self.retry_at.pop(alias, None)

    def refuse(self, alias: str) -> None:
        self.leases.pop(alias, None)
        self.refused.add(alias)
        self.expires_at = -math.inf

    def failed(self, alias: str, retry_at: float) -> None:
        self.retry_at[alias] = retry_at

    def valid(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.expires_at

    def next_renewal(self, alias: str) -> float:
        if alias in self.refused:
            return math.inf
        lease = self.leases.get(alias)
        due = 0.0
        if lease is not None and not lease.renew_now:
            due = lease.sent + min(lease.ttl, self.ttl) / 3
        return max(due, self.retry_at.get(alias, 0.0))

    def mark_lost(self, reason: str) -> bool:
        if self.lost:
            return False
        self.lost, self.lost_reason = True, reason
        return True

    def renewal(self, key: str, ttl: float) -> tuple[scripts.LuaScript, tuple[str, ...], list[Any]]:
        return SEM_EXTEND, self.keys, [self.token, lease_ms(ttl), self.limit]

    def describe(self) -> str:
        return f"A permit of semaphore {self.name!r}"

    def lost_signal(self, held: float) -> dict[str, Any]:
        # A permit has no fence; kind tells receivers it is not a lock.
        return {"name": self.name, "fence": None, "held": held, "kind": "semaphore"}


class Semaphore:
    """A counting semaphore: at most ``limit`` holders of ``name`` at once.

    Use it as ``with Semaphore("exports", 3):``, ``async with``, or through
    ``acquire()``/``release()`` and their async twins. Arguments left out take
    the cache alias's ``MUTEX`` defaults (``TTL``, ``TIMEOUT``, ``BLOCKING``,
    ``WATCHDOG``). One handle holds at most one permit at a time.

    Every holder of one name should pass the same ``limit``: each call
    enforces the limit it is given, so a call with a smaller limit waits until
    the holders fall below it, never evicting anyone.
    """

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        using: str = "default",
        ttl: float = DEFAULT,
        timeout: float | None = DEFAULT,
        blocking: bool = DEFAULT,
        watchdog: bool = DEFAULT,
        label: str | None = None,
        release_at_block_end: bool = False,
    ) -> None:
        self.name = validate_name(name)
        self.limit = validate_limit(limit)
        #: True to give the permit back when its block ends even inside a
        #: database transaction (by default it is kept until the transaction ends).
        self.release_at_block_end = validate_flag("release_at_block_end", release_at_block_end)
        if not isinstance(using, str):
            raise TypeError(
                f"A semaphore lives on one cache alias: using must be a string, "
                f"not {type(using).__name__}."
            )
        self.label = validate_label(label)
        settings = get_settings(using)
        if settings.quorum:
            raise ImproperlyConfigured(
                f"Semaphore {self.name!r} cannot use cache {using!r}: its MUTEX block names a "
                "QUORUM, and a semaphore lives on one Redis (a master with replicas, "
                "Sentinel or Cluster). Use one of the quorum's member aliases."
            )
        if settings.wait_replicas:
            # Granting a permit without the replica acknowledgement the alias
            # asks for would let a failover hand it out twice, unannounced.
            raise ImproperlyConfigured(
                f"Semaphore {self.name!r} cannot use cache {using!r}: its MUTEX block sets "
                f"WAIT_REPLICAS ({settings.wait_replicas}), and semaphore permits are not "
                "acknowledged by replicas. Use a cache alias without WAIT_REPLICAS for "
                "semaphores, or a Mutex (exclusive or shared), which waits for the replicas."
            )
        self.fail_open = settings.fail_open
        # One entry per entered block: True when it runs unlocked (FAIL_OPEN).
        self._unlocked_blocks: list[bool] = []
        self.using = using
        self.ttl = settings.ttl if ttl is DEFAULT else validate_ttl(ttl)
        self.timeout = settings.timeout if timeout is DEFAULT else validate_timeout(timeout)
        self.blocking = (
            settings.blocking if blocking is DEFAULT else validate_flag("blocking", blocking)
        )
        if blocking is False and timeout is not DEFAULT and timeout is not None:
            raise ValueError("A timeout cannot be given for a non-blocking semaphore.")
        self.watchdog = (
            settings.watchdog if watchdog is DEFAULT else validate_flag("watchdog", watchdog)
        )
        self.max_hold = settings.max_hold
        self.raise_on_lost = settings.raise_on_lost
        self.keys = SemaphoreKeys.for_name(namespace(using), self.name)
        self._permit: _Permit | None = None
        # Set while an acquisition runs, so a handle shared by threads takes one permit.
        self._acquiring = False
        self._state = threading.Lock()
        # ms until the first holder's lease ends, and the wait, at the last refusal.
        self._contention = (0, 0.0)

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} using={self.using!r}>"

    @property
    def token(self) -> str | None:
        """The token of the permit this handle holds, or None."""
        permit = self._permit
        return None if permit is None else permit.token

    @property
    def lost(self) -> bool:
        """True when this handle's permit is known to be gone (the watchdog found it so)."""
        permit = self._permit
        return permit is not None and permit.lost

    # -- acquisition ----------------------------------------------------------

    def _wait_params(self, blocking: bool, timeout: float | None) -> tuple[bool, float | None]:
        return wait_params(blocking, timeout, self.blocking, self.timeout)

    def _acquire_steps(
        self, token: str, owner: str, blocking: bool, deadline: float | None
    ) -> Steps[tuple[float, str | None] | None]:
        """Take a permit; return the send time of the granting call and the waiter then
        first in line (or None), or None if refused."""
        keys = self.keys
        args = [token, lease_ms(self.ttl), owner, 1 if blocking else 0, self.limit]
        longest = WAIT_LEASE / 2
        while True:
            sent, reply = yield Script(self.using, SEM_ACQUIRE, keys.with_wake(token), args)
            yield from _wake_steps(self.using, keys, reply[2:])
            if int(reply[0]) == 1:
                return cast(float, sent), decode(reply[1]) or None
            first_ends = int(reply[1])
            self._contention = (first_ends, 0.0)
            if not blocking:
                return None
            now = time.monotonic()
            wait = longest
            if first_ends >= 0:  # 0: the first lease ends within the millisecond
                wait = min(wait, first_ends / 1000 + _EXPIRY_MARGIN)
            if deadline is not None:
                if now >= deadline:
                    yield from self._cancel_steps(token)
                    return None
                wait = min(wait, deadline - now)
            # A wake-up or not, the loop checks in: the script says what is ours.
            yield Pop(self.using, keys.wake(token), max(wait, REDIS_TICK / 10), longest)

    def _cancel_steps(self, token: str) -> Steps[None]:
        _, woken = yield Script(
            self.using, SEM_CANCEL, self.keys.with_wake(token), [token, self.limit]
        )
        yield from _wake_steps(self.using, self.keys, list(woken or []))

    def _start(self) -> tuple[str, str]:
        with self._state:
            if self._permit is not None or self._acquiring:
                raise RuntimeError(
                    f"{self!r} already holds or is acquiring a permit; one handle holds one "
                    "permit at a time (use another Semaphore handle for another)."
                )
            self._acquiring = True
        # The owner record is taken in the caller's own thread or task.
        return secrets.token_hex(16), owner_metadata(self.label)

    def _adopt(self, token: str, granted: tuple[float, str | None], started: float) -> None:
        sent, successor = granted
        permit = _Permit(
            alias=self.using,
            name=self.name,
            token=token,
            keys=self.keys.script_keys,
            limit=self.limit,
            ttl=self.ttl,
            acquired_at=started,
            max_hold=self.max_hold,
            successor=successor,
        )
        permit.confirm(self.using, sent, self.ttl)
        with self._state:
            self._permit = permit
        if self.watchdog:
            get_watchdog().watch(permit)

    def _refused(self, started: float) -> None:
        self._contention = (self._contention[0], time.monotonic() - started)

    def contended(self) -> LockContended:
        """Return the LockContended error describing the last refusal."""
        first_ends, waited = self._contention
        retry_after = max(1, math.ceil(first_ends / 1000)) if first_ends > 0 else 1
        return LockContended(self.name, retry_after=retry_after, waited=waited)

    def acquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Take a permit; return True on success, False if none came free in time.

        ``timeout=None`` waits forever. Raise LockBackendUnavailable when Redis
        cannot be reached.
        """
        blocking, timeout = self._wait_params(blocking, timeout)
        token, owner = self._start()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            with backend_errors(self.name, self.using):
                try:
                    granted = run_steps(self._acquire_steps(token, owner, blocking, deadline))
                except redis_errors.TimeoutError:
                    # Redis is not answering: a cancel now would wait out
                    # another socket timeout, so it is left to the background.
                    self._abandon_later(token)
                    raise
                except BaseException:
                    self._abandon(token)
                    raise
            if granted is None:
                self._refused(started)
                return False
            self._adopt(token, granted, started)
            return True
        finally:
            self._acquiring = False

    def _abandon_later(self, token: str) -> None:
        """Leave the line and give back the permit from the background, once Redis answers.

        The SEM_ACQUIRE whose reply timed out may still run when Redis is
        responsive again, granting a permit (or a place in line) to a token
        nobody has; that permit would stay held for its whole lease.
        """
        give_back_later(
            f"a permit of semaphore {self.name!r}",
            lambda: self._cancel_steps(token),
            max(self.ttl, WAIT_LEASE),
        )

    def _abandon(self, token: str) -> None:
        try:
            run_steps(self._cancel_steps(token))
        except Exception as exc:  # the interrupt that brought us here is what propagates
            self._abandon_failed(token, exc)

    def _abandon_failed(self, token: str, exc: Exception) -> None:
        # As a lock's: a permit may still be granted to this token nobody has.
        logger.warning(
            "Could not leave the line of semaphore %r (retrying in the background): %s",
            self.name,
            exc,
        )
        self._abandon_later(token)

    async def aacquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Async twin of :meth:`acquire`; never blocks the event loop."""
        blocking, timeout = self._wait_params(blocking, timeout)
        token, owner = self._start()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            with backend_errors(self.name, self.using):
                try:
                    granted = await run_in_child(
                        self._acquire_steps(token, owner, blocking, deadline),
                        lambda: self._aabandon(token),
                        (redis_errors.TimeoutError, LockBackendUnavailable),
                    )
                except (redis_errors.TimeoutError, LockBackendUnavailable):
                    self._abandon_later(token)  # as in acquire()
                    raise
            if granted is None:
                self._refused(started)
                return False
            self._adopt(token, granted, started)
            return True
        finally:
            self._acquiring = False

    async def _aabandon(self, token: str) -> None:
        try:
            await AsyncDriver().run(self._cancel_steps(token))
        except Exception as exc:
            self._abandon_failed(token, exc)

    # -- release --------------------------------------------------------------

    def _release_steps(self, permit: _Permit) -> Steps[bool]:
        keys: tuple[str, ...] = self.keys.script_keys
        args: list[Any] = [permit.token, self.limit]
        if permit.successor is not None:
            keys = self.keys.with_wake(permit.successor)
            args.append(permit.successor)
        _, reply = yield Script(self.using, SEM_RELEASE, keys, args)
        yield from _wake_steps(self.using, self.keys, reply[1:])
        return int(reply[0]) == 1

    def _not_held(self) -> LockNotOwned:
        return LockNotOwned(f"Semaphore {self.name!r} is not held by this handle.", name=self.name)

    def _taken_permit(self) -> _Permit:
        with self._state:
            permit = self._permit
        if permit is None:
            raise LockNotOwned(
                f"Semaphore {self.name!r} is not held by this handle.", name=self.name
            )
        # A released permit is not lost: stop renewing it before asking Redis.
        get_watchdog().unwatch(permit)
        return permit

    def _release_failed(self, permit: _Permit) -> None:
        """Give the permit back from the background after a release Redis did not answer.

        The release may never have run (dropped with its connection): the
        owner has left, so the permit is given back until Redis answers, unless
        the caller's own retry does first. It is never renewed meanwhile.
        """
        permit.releasing = True
        give_back_later(
            f"a permit of semaphore {self.name!r}",
            lambda: self._release_steps(permit),
            permit.ttl,
            lambda: permit.active,
        )

    def _released(self, permit: _Permit, held: bool) -> None:
        # A retry of a release that failed: that release (only its reply lost)
        # or the background give-back may have freed the permit first.
        held = held or permit.releasing
        permit.active = False
        with self._state:
            if self._permit is permit:
                self._permit = None
        if not held:
            announce_lost(permit, "it was no longer held at release")
            raise LockLost(
                f"Semaphore {self.name!r}: this holder's permit had already ended "
                f"(its lease ran out, or it was reset): {permit.lost_reason}.",
                name=self.name,
            )

    def _kept_for_transaction(self) -> Steps[bool]:
        """Keep the permit until this thread's open transactions end; return True if kept.

        Steps, for the marking of the holder's owner record (so listings can
        say why the permit is still taken).

        As a lock's hold (see transactions.py): given back now, the next holder
        could read rows this one has not committed yet. The handle lets go of
        it; the watchdog keeps renewing it until the transaction's end gives it
        back.
        """
        if self.release_at_block_end:
            return False
        connections = open_transactions()
        if not connections:
            return False
        with self._state:
            permit, self._permit = self._permit, None
        if permit is None:
            raise self._not_held()
        warn_if_read_before(self.name, connections, permit.acquired_at)
        wait = TransactionWait(lambda: self._release_after_transaction(permit))
        wait.add(connections)
        owner = mark_transaction(owner_metadata(self.label), wait.aliases)
        keys = (self.keys.holders, self.keys.owners)
        yield Script(self.using, SEM_MARK_TRANSACTION, keys, [permit.token, owner], True)
        return True

    def _release_after_transaction(self, permit: _Permit) -> None:
        """Give back a permit kept for a transaction that has just committed or rolled back."""
        get_watchdog().unwatch(permit)
        try:
            with backend_errors(self.name, self.using):
                held = run_steps(self._release_steps(permit))
        except LockBackendUnavailable as exc:
            permit.active = False
            logger.error(
                "Could not give back a permit of semaphore %r after its transaction ended; "
                "retrying in the background: %s",
                self.name,
                exc,
            )
            give_back_later(
                f"a permit of semaphore {self.name!r}",
                lambda: self._release_steps(permit),
                permit.ttl,
            )
            return
        permit.active = False
        if not held:
            announce_lost(permit, "it was no longer held when its transaction ended")
            logger.error(
                "A permit of semaphore %r ended before its transaction did: another holder "
                "may have entered while the transaction was open.",
                self.name,
            )

    def release(self) -> None:
        """Give the permit back. Raise LockNotOwned if this handle holds none, LockLost if
        its lease had already ended.

        Inside a database transaction the permit is kept until the transaction
        ends, unless the handle was made with ``release_at_block_end=True``.
        """
        if run_steps(self._kept_for_transaction()):
            return
        permit = self._taken_permit()
        try:
            with backend_errors(self.name, self.using):
                held = run_steps(self._release_steps(permit))
        except LockBackendUnavailable:
            self._release_failed(permit)
            raise
        self._released(permit, held)

    async def arelease(self) -> None:
        """Async twin of :meth:`release`."""
        if await AsyncDriver().run(self._kept_for_transaction()):
            return
        permit = self._taken_permit()
        try:
            with backend_errors(self.name, self.using):
                held = await AsyncDriver().run(self._release_steps(permit))
        except LockBackendUnavailable:
            self._release_failed(permit)
            raise
        self._released(permit, held)

    # -- extension ------------------------------------------------------------

    def _extend_steps(self, token: str, ttl: float) -> Steps[tuple[float, bool]]:
        sent, reply = yield Script(
            self.using, SEM_EXTEND, self.keys.script_keys, [token, lease_ms(ttl), self.limit]
        )
        return sent, int(reply) == 1

    def extend(self, ttl: float | None = None) -> None:
        """Renew the permit's lease to ``ttl`` (default: the handle's) from now.

        Raise LockNotOwned if this handle holds no permit, LockLost if its
        lease had already ended.
        """
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        with self._state:
            permit = self._permit
        if permit is None:
            raise LockNotOwned(
                f"Semaphore {self.name!r} is not held by this handle.", name=self.name
            )
        with backend_errors(self.name, self.using):
            sent, ok = run_steps(self._extend_steps(permit.token, lease))
        self._extended(permit, sent, lease, ok)

    async def aextend(self, ttl: float | None = None) -> None:
        """Async twin of :meth:`extend`."""
        lease = self.ttl if ttl is None else validate_ttl(ttl)
        with self._state:
            permit = self._permit
        if permit is None:
            raise self._not_held()
        with backend_errors(self.name, self.using):
            sent, ok = await AsyncDriver().run(self._extend_steps(permit.token, lease))
        self._extended(permit, sent, lease, ok)

    def _extended(self, permit: _Permit, sent: float, lease: float, ok: bool) -> None:
        if not ok:
            get_watchdog().unwatch(permit)
            announce_lost(permit, "extend found it gone")
            raise LockLost(
                f"Semaphore {self.name!r}: the permit's lease had ended.", name=self.name
            )
        permit.confirm(self.using, sent, lease)
        permit.ttl = lease  # later renewals keep to the new length
        get_watchdog().poke(permit)

    # -- with / async with ----------------------------------------------------

    def __enter__(self) -> Semaphore:
        try:
            acquired = self.acquire()
        except LockBackendUnavailable as unavailable:
            return self._enter_unlocked(unavailable)
        if not acquired:
            raise self.contended()
        self._unlocked_blocks.append(False)
        return self

    async def __aenter__(self) -> Semaphore:
        try:
            acquired = await self.aacquire()
        except LockBackendUnavailable as unavailable:
            return self._enter_unlocked(unavailable)
        if not acquired:
            raise self.contended()
        self._unlocked_blocks.append(False)
        return self

    def _enter_unlocked(self, unavailable: LockBackendUnavailable) -> Semaphore:
        """Run the block without a permit when the alias is FAIL_OPEN, as a lock's block does."""
        if not self.fail_open:
            raise unavailable
        logger.warning(
            "FAIL_OPEN: running %r without a semaphore permit because Redis is unavailable: %s",
            self.name,
            unavailable,
        )
        self._unlocked_blocks.append(True)
        return self

    def _left_unlocked(self) -> bool:
        """Note that a block ends; return True if it ran without a permit (FAIL_OPEN)."""
        return bool(self._unlocked_blocks) and self._unlocked_blocks.pop()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._left_unlocked():
            return False
        try:
            self.release()
        except LockLost as lost:
            self._lost_on_exit(lost, body_failed=exc is not None)
        except Exception as error:
            if exc is None:
                raise
            # Never replace the body's own exception.
            logger.error("Could not release semaphore %r: %s", self.name, error)
        return False

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._left_unlocked():
            return False
        try:
            # Shielded, as a lock's block is: a task cancelled while leaving
            # still gives its permit back (the release finishes in the
            # background) instead of keeping it for the rest of its lease.
            await asyncio.shield(self.arelease())
        except LockLost as lost:
            self._lost_on_exit(lost, body_failed=exc is not None)
        except Exception as error:
            if exc is None:
                raise
            logger.error("Could not release semaphore %r: %s", self.name, error)
        return False

    def _lost_on_exit(self, lost: LockLost, *, body_failed: bool) -> None:
        # As a lock's block: the body's own exception, or RAISE_ON_LOST off,
        # turns the loss into a log line.
        if body_failed or not self.raise_on_lost:
            logger.error("%s", lost)
            return
        raise lost


# -- semaphore(): with, async with, decorator -----------------------------------


class SemaphoreContext:
    """What :func:`semaphore` returns; see there."""

    def __init__(self, name: str | Callable[..., str], limit: int, **options: Any) -> None:
        # Name templates are filled exactly as for mutex().
        self._names = MutexContext(name)
        self._name = name
        self._limit = validate_limit(limit)
        if options.get("label") is not None:
            validate_label(options["label"])
        validate_flag("release_at_block_end", options.get("release_at_block_end", False))
        if options.get("ttl", DEFAULT) is not DEFAULT:
            validate_ttl(options["ttl"])
        if options.get("timeout", DEFAULT) is not DEFAULT:
            validate_timeout(options["timeout"])
            if options.get("blocking") is False and options["timeout"] is not None:
                raise ValueError("A timeout cannot be given for a non-blocking semaphore.")
        self._options = options
        self._entered: EnteredHandles[Semaphore] = EnteredHandles(self)

    def __repr__(self) -> str:
        return f"<semaphore {self._name!r} limit={self._limit}>"

    def _handle(self, name: str) -> Semaphore:
        return Semaphore(name, self._limit, **self._options)

    def _literal(self) -> Semaphore:
        if callable(self._name):
            raise TypeError(
                "A callable semaphore name is only filled when semaphore() decorates a "
                "function; in a with block pass the name itself."
            )
        return self._handle(self._name)

    def __enter__(self) -> Semaphore:
        handle = self._literal().__enter__()
        self._entered.push(handle)
        return handle

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return self._entered.pop().__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Semaphore:
        handle = await self._literal().__aenter__()
        self._entered.push(handle)
        return handle

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return await self._entered.pop().__aexit__(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"semaphore() decorates a callable, not {type(func).__name__}.")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError("semaphore() does not decorate generator functions.")
        if inspect.iscoroutinefunction(func):

            @wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                name = self._names.name_for(func, args, kwargs)
                if not name:
                    return await func(*args, **kwargs)
                async with self._handle(name):
                    return await func(*args, **kwargs)

            return cast(F, async_inner)

        # As mutex(): a view under ATOMIC_REQUESTS opens its transaction inside.
        transactions = RequestTransactions(func)

        @wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            name = self._names.name_for(func, args, kwargs)
            if not name:
                return func(*args, **kwargs)  # a call the function itself refuses
            with self._handle(name), transactions.opened(args):
                return func(*args, **kwargs)

        transactions.mark(inner)
        return cast(F, inner)


def semaphore(
    name: str | Callable[..., str],
    limit: int,
    *,
    using: str = "default",
    ttl: float = DEFAULT,
    timeout: float | None = DEFAULT,
    blocking: bool = DEFAULT,
    watchdog: bool = DEFAULT,
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
                {"token": h.token, "owner": h.owner.as_dict(), "time_left": h.time_left}
                for h in self.holders
            ],
        }


def _semaphore_bases(client: Any, ns: str) -> Iterator[str]:
    seen: set[str] = set()
    for raw in client.scan_iter(match=_semaphore_pattern(ns), count=500, _type="zset"):
        key = decode(raw)
        if key not in seen:
            seen.add(key)
            yield key[: -len(":holders")]


def held_semaphores(using: str = "default") -> list[HeldSemaphore]:
    """Return the semaphores of ``using`` with permits held now, each with its holders."""
    ns = namespace(using)
    with backend_errors(None, using):
        client = get_client(using)
        found = []
        # Leases are scored by the server clock. One clock for the whole listing
        # (a cluster answers TIME from one node; its nodes' clocks agree closely).
        now_ms = server_ms(client.time())
        for base in _semaphore_bases(client, ns):
            keys = SemaphoreKeys.for_base(base)
            pipe = client.pipeline(transaction=False)
            pipe.zrange(keys.holders, 0, -1, withscores=True)
            pipe.hgetall(keys.owners)
            pipe.get(keys.limit)
            pipe.zcard(keys.queue)
            scored, owners, limit, waiters = pipe.execute()
            owners = {decode(k): decode(v) for k, v in owners.items()}
            holders = [
                SemaphoreHolder(
                    token=decode(token),
                    owner=parse_owner(owners.get(decode(token))) or Owner(),
                    time_left=(score - now_ms) / 1000,
                )
                for token, score in scored
                if score > now_ms
            ]
            if not holders:
                continue
            name = unescape_name(base[len(ns) + len(":semaphore:{") : -1])
            found.append(
                HeldSemaphore(
                    name=name,
                    limit=int(limit) if limit is not None else None,
                    holders=holders,
                    waiters=int(waiters),
                )
            )
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
    keys = SemaphoreKeys.for_name(namespace(using), name)

    def steps() -> Steps[int]:
        _, reply = yield Script(using, SEM_RESET, keys.script_keys, [])
        yield from _wake_steps(using, keys, reply[1:])
        return int(reply[0])

    with backend_errors(name, using):
        return run_steps(steps())


# The scripts this module runs, for tools that preload or inspect them.
SCRIPTS: tuple[scripts.LuaScript, ...] = (
    SEM_ACQUIRE,
    SEM_CANCEL,
    SEM_EXTEND,
    SEM_MARK_TRANSACTION,
    SEM_RELEASE,
    SEM_RESET,
    SEM_WAKE,
)
