"""Mutex: the handle on one named lock; acquire, wait, release, extend and inspect it.

The handle holds its settings, where the lock lives (:mod:`~.topology` or
:mod:`~.quorum`) and what it holds (:mod:`~.levels`). Acquiring is
:mod:`~.acquisition`'s and ending a hold :mod:`~.release`'s; each Redis
operation is written once, as steps that the sync methods drive with blocking
calls and their ``a``-prefixed async twins on the event loop (see
:mod:`~.driver`), so a sync holder blocks an async contender and vice versa.
Waiting is wake-on-release: a waiter blocks on its own list until the
releasing script hands it the lock, never a fixed sleep.

State is kept per acquisition (:class:`~django_redis_mutex.holds.Hold`), never
in one field of the handle: nesting, a handle shared by threads and a hold
lost under a nested block each keep their own record.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured

from . import acquisition, scripts
from .block import LockBlock
from .client import backend_errors, namespace
from .conf import (
    DEFAULT,
    MutexSettings,
    get_settings,
    resolve_using,
    validate_flag,
    validate_ttl,
)
from .driver import AsyncDriver, Steps, run_steps
from .exceptions import LockContended, LockNotOwned
from .holds import Attempt, Hold
from .keys import LockKeys, validate_label, validate_name
from .levels import Levels
from .owners import Owner
from .quorum import Quorum, quorum_members
from .release import arelease, held_or_raise, release
from .replicated import ReplicatedRedis
from .scripts import lease_ms
from .topology import OneRedis
from .watchdog import declare_lost, get_watchdog

__all__ = ["DEFAULT", "Mutex", "QuorumMutex"]

T = TypeVar("T")


class Mutex(LockBlock):
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
    # Set by mutex() and semaphore() to the name template the handle was
    # built from; None: the name is the class (see lock_class).
    _lock_class: str | None = None

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
        where, members = resolve_using(using)
        # A quorum named by a list is set up through its first master's alias.
        using = members[0] if members and not isinstance(using, str) else where
        self.using = using
        config = get_settings(using)
        self.settings: MutexSettings = config
        self.lease: float = config.ttl if ttl is DEFAULT else validate_ttl(ttl)
        self.blocking, self.timeout = acquisition.wait_params(
            blocking, timeout, config.blocking, config.timeout
        )
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
        self._where: OneRedis
        if members is not None:
            self._where = Quorum(self, members)
        elif config.wait_replicas:
            self._where = ReplicatedRedis(self)
        else:
            self._where = OneRedis(self)
        self._levels = Levels()

    def __repr__(self) -> str:
        state = f"fence={self.fence}" if self._current() is not None else "unlocked"
        return f"<{type(self).__name__} {self.name!r} using={self._using_shown()!r} {state}>"

    def _using_shown(self) -> str | list[str]:
        return list(self.aliases) if self.quorum > 1 else self.using

    @property
    def lock_class(self) -> str:
        """The class of this lock for lock-order checking: its name template, else its name.

        A handle that :func:`~django_redis_mutex.mutex` builds for
        ``"product:{pk}"`` is of class ``"product:{pk}"`` whatever the pk; one
        built from a callable name, of the callable's qualified name. Set it on
        a handle built directly to group it with others (see :doc:`lock-order`).

        .. versionadded:: 0.3.0
        """
        return self._lock_class or self.name

    @lock_class.setter
    def lock_class(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"lock_class must be a non-empty str, not {value!r}.")
        self._lock_class = value

    @property
    def _stats_class(self) -> tuple[str, str] | None:
        """What this lock's contention figures count under (its kind and class), or None."""
        if self.settings.stats:
            return self.kind, self.lock_class
        return None

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
        return self._levels.last_failure().error(self.name, self.using, self._stats_class)

    # -- where the lock lives, and what it asks for ---------------------------

    def _keys_on(self, alias: str) -> LockKeys:
        """Return this handle's keys in ``alias``'s namespace (a semaphore's are its own)."""
        return LockKeys.for_name(namespace(alias), self.name)

    def _acquire_args(self, attempt: Attempt, join: bool) -> list[Any]:
        """Return ACQUIRE's (or ACQUIRE_SHARED's) ARGV for ``attempt``.

        An attempt's first place in line spares the script clearing a wake-up
        list its new token cannot have; every later one (a check-in, a return
        to the line after a hand-over that lapsed) clears it.
        """
        joining = 0
        if join:
            joining = 1 if attempt.joined else 2
            attempt.joined = True
        return [
            attempt.token,
            lease_ms(self.lease),
            attempt.owner_json,
            joining,
            *self._limit_args,
        ]

    # -- acquire -------------------------------------------------------------

    def _refused(self, attempt: Attempt, reply: list[Any]) -> None:
        # The holder's owner record stays raw until an error needs it: a
        # waiter is refused on every check-in, and parsing it each time is waste.
        # ACQUIRE also says how long the holder has had the lock (ms), for
        # the Retry-After estimate.
        held = int(reply[4]) if len(reply) > 4 else -1
        attempt.refused(int(reply[1]), reply[2] if len(reply) > 2 else None, held)

    def acquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Acquire the lock; return True on success, False if it stayed contended.

        ``blocking`` and ``timeout`` default to the handle's settings;
        ``timeout=None`` waits forever. Raise LockBackendUnavailable when Redis
        cannot be reached.
        """
        return acquisition.acquire(self, blocking, timeout) is not None

    async def aacquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Async twin of :meth:`acquire`; never blocks the event loop."""
        return (await acquisition.aacquire(self, blocking, timeout)) is not None

    # -- release -------------------------------------------------------------

    def release(self) -> None:
        """Release the lock (or one nesting level of it).

        Raise LockNotOwned when this handle does not hold it, including when its
        hold expired or was taken; another owner's lock is never touched. The
        handle keeps its token until Redis confirmed, so a failed release can be
        retried; the watchdog stops renewing it, so a release never retried
        ends with the lease instead of being renewed forever.
        """
        release(self, held_or_raise(self, "release"))

    async def arelease(self) -> None:
        """Async twin of :meth:`release`; a cancelled release can be retried too."""
        await arelease(self, held_or_raise(self, "release"))

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
        return held_or_raise(self, "extend"), self.lease if ttl is None else validate_ttl(ttl)

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


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated, use {new}: everywhere else ttl is the lease length.",
        DeprecationWarning,
        stacklevel=3,
    )


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
