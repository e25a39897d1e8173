"""Quorum: where a lock lives on several independent Redis masters (Redlock).

Any kind of lock lives on a quorum: ``Mutex(name, using=["r1", "r2", "r3"])``,
``Mutex(..., shared=True)``, ``Semaphore(name, limit, using=[...])``, or the
same with an alias whose ``MUTEX`` block names a ``QUORUM``. The handle is the
same; :class:`Quorum` answers its operations as
:class:`~django_redis_mutex.topology.OneRedis` does for one Redis.

A lock is held when a majority of the masters granted it within its validity
window: the lease minus the time the acquisition took minus an allowance for
clock drift, counted from when the first request was sent. The masters are
asked all at once, each with its own short deadline (``QUORUM_TIMEOUT``), so
one master that hangs costs the others nothing. A hold stays valid until the
quorum-th latest lease the masters confirmed (each counted from when its
request was sent), minus drift; the watchdog renews it well before that, and a
hold whose validity runs out before a majority renewed it is lost. It is
released on every master, extended on a majority. With one of three masters
down it still works; with two down it raises LockBackendUnavailable.

Each master keeps its own queue, so a quorum lock cannot hand over inside a
release script the way a single-master lock does: a waiter retries after a
short random delay, capped by the holder's remaining lease (the Redlock
algorithm's own advice against synchronised retries).

A semaphore's permit needs more than a majority when its limit is above
one: more than ``masters * limit / (limit + 1)`` masters, so that ``limit + 1``
holders would need more grants than the masters together admit (a majority
would let three holders of a limit of two each hold a different pair of three
masters).

Fencing tokens: the fence of a hold is the largest fence the granting masters
handed out. It rides, as a floor for each master's fence counter, on every
renewal and on the release (in the same script that gives the lock back
there), and an operator's reset raises the counters to the largest fence the
masters' holders have before it frees them: no round trip of its own. A later
majority overlaps this one in a master that held the lock; when that master
stopped holding it, its counter was raised to the floor (a release, a renewal
before it expired, a reset), or the copy expired unrenewed a whole lease after
it was granted, when that master's clock (the least a fence can be) has passed
every fence of that moment unless the masters' clocks differ by more than the
lease. Either way the later fence is larger (docs/guarantees.rst).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from . import deadlock, scripts
from .conf import get_settings, resolve_using
from .driver import Each, Fanned, Sleep, Steps
from .exceptions import LockBackendUnavailable
from .holds import Attempt, Hold, decode, owner_metadata
from .keys import LockKeys
from .owners import Owner, mark_transaction, parse_owner
from .topology import Grant, LockHandle, OneRedis

__all__ = ["Quorum", "quorum_members", "quorum_of"]

# Redlock's allowance for clock drift between masters: 1% of the lease + 2 ms.
CLOCK_DRIFT_FACTOR = 0.01
# Bounds of the random delay between attempts of a blocked quorum waiter.
RETRY_DELAY = (0.005, 0.05)


def quorum_of(masters: int, limit: int = 1) -> int:
    """Return how many of ``masters`` must hold a hold of which ``limit`` may exist at once.

    A majority for one holder. For a semaphore's limit, more than
    ``masters * limit / (limit + 1)``: then ``limit + 1`` holders would need
    more grants than the masters admit together, ``limit`` each.
    """
    return masters * limit // (limit + 1) + 1


def quorum_members(using: object) -> tuple[str, ...] | None:
    """Return the masters of the quorum ``using`` names, or None for one Redis.

    A quorum is named by a list of aliases, or by an alias whose MUTEX block
    has a QUORUM (see :func:`~django_redis_mutex.conf.resolve_using`).
    """
    return resolve_using(using)[1]


class Quorum(OneRedis):
    """The steps of a lock's operations on a quorum of independent masters.

    Its reads count masters: ``owned()`` while enough masters hold this
    handle's hold, ``time_left()`` until fewer than that still hold its lease,
    ``locked()`` and ``owner()`` for one owner holding enough. Like every
    quorum operation they ask the masters all at once, each within
    QUORUM_TIMEOUT, and raise LockBackendUnavailable when too few answer.
    """

    token_prefix = "q"

    def __init__(self, lock: LockHandle, aliases: tuple[str, ...]) -> None:
        super().__init__(lock)
        for alias in aliases:
            if get_settings(alias).wait_replicas:
                raise ImproperlyConfigured(
                    f"Quorum {lock.kind} {lock.name!r} cannot use cache {alias!r}: its MUTEX "
                    "block sets WAIT_REPLICAS, which is for one master and its replicas, "
                    "not for a quorum of masters."
                )
        self.aliases = aliases
        # A majority for a lock (any two share a master, which admits a writer
        # only alone); for a semaphore, enough that no limit + 1 holders fit.
        self.quorum = quorum_of(len(aliases), lock._limit_args[0] if lock._limit_args else 1)
        self.drift = lock.lease * CLOCK_DRIFT_FACTOR + 0.002
        self.member_keys = {alias: lock._keys_on(alias) for alias in aliases}
        self.master_timeout = lock.settings.quorum_timeout
        # Deadlock detection's records and reads: on the first master by alias.
        first = min(aliases)
        self.deadlock_place = deadlock.Place(
            first, self.member_keys[first], queued=False, timeout=self.master_timeout
        )

    def targets(self) -> tuple[tuple[str, str], ...]:
        return tuple((alias, self.member_keys[alias].lock) for alias in self.aliases)

    def _unavailable(self, errors: dict[str, BaseException], what: str) -> LockBackendUnavailable:
        detail = "; ".join(f"{alias}: {exc}" for alias, exc in errors.items())
        return LockBackendUnavailable(
            f"Cannot {what} quorum {self.lock.kind} {self.lock.name!r}: "
            f"{len(errors)} of {len(self.aliases)} "
            f"Redis masters are unavailable ({detail}).",
            name=self.lock.name,
        )

    def _too_many_down(self, errors: dict[str, BaseException]) -> bool:
        """Return True when the masters that failed leave no majority."""
        return len(errors) > len(self.aliases) - self.quorum

    def _each(
        self,
        script: scripts.LuaScript,
        keys_of: Callable[[LockKeys], tuple[str, ...]],
        args: list[Any],
    ) -> Each:
        """Return the step running ``script`` on every master with the keys ``keys_of`` gives."""
        calls = tuple((alias, keys_of(self.member_keys[alias])) for alias in self.aliases)
        return Each(script, calls, args, self.master_timeout)

    # -- acquire ----------------------------------------------------------------

    def _judge(self, fanned: Fanned, attempt: Attempt) -> Grant | None:
        """Return the grant if a majority granted the lock with validity left, else None."""
        granted: dict[str, int] = {}
        pttl, owner, held = 0, None, -1
        for alias, reply in fanned.replies.items():
            if not isinstance(reply, list):  # the fence alone: granted
                granted[alias] = int(reply)
            elif reply[0] == 1:
                granted[alias] = int(reply[1])
            else:
                pttl = max(pttl, int(reply[1]))
                owner = owner or parse_owner(reply[2] or None)
                if len(reply) > 4:
                    # Each master's own clock says how long the holder has had it there.
                    held = max(held, int(reply[4]))
        # Validity: the lease counted from when the requests were sent, less
        # the time they took and the clock drift allowance.
        valid_until = fanned.sent + self.lock.lease - self.drift
        if len(granted) >= self.quorum and time.monotonic() < valid_until:
            return Grant(
                max(granted.values()),
                {alias: (fanned.sent, self.lock.lease) for alias in granted},
            )
        attempt.refused(pttl, owner, held)
        return None

    def _unless_held_alone(
        self, grant: Grant, fanned: Fanned, attempt: Attempt
    ) -> Steps[Grant | None]:
        """Return ``grant``, or None when a master that refused is held by a lock of its own.

        ``Mutex(name, using="r1")`` and the quorum lock of the same name on
        r1, r2 and r3 are one lock: the plain lock refuses while the quorum
        holds r1, and the quorum, having won r2 and r3, still gives way to a
        plain lock it finds on r1.
        """
        refused = tuple(
            (alias, (self.member_keys[alias].lock,))
            for alias in fanned.replies
            if alias not in grant.leases
        )
        asked = yield Each(scripts.HELD_ALONE, refused, [], self.master_timeout)
        alone = [alias for alias, reply in asked.replies.items() if reply == 1]
        if not alone:
            return grant
        reply = fanned.replies[alone[0]]
        attempt.contention = attempt.contention._replace(
            pttl=int(reply[1]), holder=reply[2] or None
        )
        return None

    def _retry_delay(self, attempt: Attempt) -> float:
        delay = random.uniform(*RETRY_DELAY)
        pttl = attempt.contention.pttl
        if pttl > 0:
            delay = min(delay, pttl / 1000)
        if attempt.deadline is not None:
            delay = min(delay, max(attempt.deadline - time.monotonic(), 0.0))
        return delay

    def acquire_steps(self, attempt: Attempt) -> Steps[Grant | None]:
        """Try every master until a majority grants the lock, looking for deadlocks meanwhile.

        The waits-for records live on the first master by alias (see deadlock.py).
        """
        steps = self._trying_steps(attempt)
        return deadlock.watched(steps, self.lock, attempt, self.deadlock_place)

    def _trying_steps(self, attempt: Attempt) -> Steps[Grant | None]:
        # Quorum waiters never queue, so a release never hands over to one; a
        # plain lock of the same name queued on one master is woken by its own
        # check-in.
        token, deadline = attempt.token, attempt.deadline
        release_all = self._each(scripts.RELEASE, _queue_keys, [token])
        acquire = self._each(
            self.lock._acquire_script,
            lambda keys: keys.with_wake(token),
            self.lock._acquire_args(attempt, False),
        )
        while True:
            fanned = yield acquire
            grant = self._judge(fanned, attempt)
            if grant is not None and len(grant.leases) < len(fanned.replies):
                grant = yield from self._unless_held_alone(grant, fanned, attempt)
            if grant is None:
                # Undo on every master: one whose reply was lost may have granted it.
                yield release_all
                if self._too_many_down(fanned.errors):
                    raise self._unavailable(fanned.errors, "acquire")
            else:
                return grant
            if not attempt.blocking or (deadline is not None and time.monotonic() >= deadline):
                return None
            yield Sleep(self._retry_delay(attempt))

    def abandon_steps(self, token: str) -> Steps[None]:
        yield self._each(scripts.RELEASE, _queue_keys, [token])

    # -- release, extend, confirm ------------------------------------------------

    def release_steps(self, hold: Hold) -> Steps[bool]:
        # The fence goes with it: the floor of each master's counter (see above).
        fanned = yield self._each(scripts.RELEASE, _queue_keys, [hold.token, "", hold.fence])
        if len(fanned.errors) >= self.quorum:
            # Too few masters answered to tell; the leases end by themselves.
            raise self._unavailable(fanned.errors, "release")
        released = sum(1 for reply in fanned.replies.values() if reply)
        # Masters that did not answer may still hold our key until it expires;
        # the hold was ours unless the answering ones show a majority lost it.
        return released + len(fanned.errors) >= self.quorum

    def mark_steps(self, hold: Hold, databases: list[str]) -> Steps[bool]:
        """Mark the owner record on every master at once, each within QUORUM_TIMEOUT.

        Return False when too few masters still hold our key for a majority.
        """
        owner = mark_transaction(owner_metadata(self.lock.label), databases)
        fanned = yield self._each(scripts.MARK_TRANSACTION, _lock_key, [hold.token, owner])
        marked = sum(1 for reply in fanned.replies.values() if reply)
        return marked + len(fanned.errors) >= self.quorum

    def extend_steps(self, hold: Hold, ttl: float) -> Steps[bool]:
        fanned = yield self._each(
            scripts.EXTEND, _fence_keys, [hold.token, scripts.lease_ms(ttl), hold.fence]
        )
        for alias, reply in fanned.replies.items():
            if reply:
                hold.confirm(alias, fanned.sent, ttl)
            else:
                hold.refuse(alias)
        extended = sum(1 for reply in fanned.replies.values() if reply)
        if extended < self.quorum and extended + len(fanned.errors) >= self.quorum:
            raise self._unavailable(fanned.errors, "extend")
        return extended >= self.quorum

    # -- inspect ------------------------------------------------------------------

    def _states_steps(self, token: str = "") -> Steps[list[_State]]:
        """Return what each master that answered within QUORUM_TIMEOUT says (see READ_STATE)."""
        fanned = yield self._each(scripts.READ_STATE, _lock_key, [token])
        if self._too_many_down(fanned.errors):
            raise self._unavailable(fanned.errors, "inspect")
        states = []
        for holder, _pttl, owner, mine, shared, owners, _fence in fanned.replies.values():
            holders = {decode(holder): decode(owner)} if holder else {}
            holders.update(zip(map(decode, shared), map(decode, owners), strict=True))
            states.append(_State(holders, int(mine)))
        return states

    def time_left_steps(self, hold: Hold | None) -> Steps[float]:
        """Return the seconds until fewer than a majority of masters still hold our lease."""
        if hold is None:
            return 0.0
        states = yield from self._states_steps(hold.token)
        mine = sorted((state.mine for state in states if state.mine > 0), reverse=True)
        return mine[self.quorum - 1] / 1000 if len(mine) >= self.quorum else 0.0

    def owned_steps(self, hold: Hold | None) -> Steps[bool]:
        """Return True if a majority of masters hold this handle's hold."""
        if hold is None:
            return False
        states = yield from self._states_steps(hold.token)
        return sum(1 for state in states if state.mine > 0) >= self.quorum

    def holder_steps(self) -> Steps[Owner | Literal[""] | None]:
        """Return an owner holding a majority ("" if unreadable), or None."""
        counts: dict[str, int] = {}
        owners: dict[str, str] = {}
        for state in (yield from self._states_steps()):
            for token, owner in state.holders.items():
                counts[token] = counts.get(token, 0) + 1
                owners[token] = owner
        for token, count in counts.items():
            if count >= self.quorum:
                return parse_owner(owners[token]) or ""
        return None


class _State(NamedTuple):
    """What one master says of a quorum lock: its holders' owners, the caller's ms left."""

    holders: dict[str, str]
    mine: int


def _queue_keys(keys: LockKeys) -> tuple[str, ...]:
    return keys.script_keys


def _lock_key(keys: LockKeys) -> tuple[str, ...]:
    return (keys.lock,)


def _fence_keys(keys: LockKeys) -> tuple[str, ...]:
    """The lock and its fence counter: EXTEND with a floor."""
    return (keys.lock, keys.fence)
