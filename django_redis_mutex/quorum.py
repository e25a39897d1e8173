"""QuorumMutex: one lock across several independent Redis masters (Redlock).

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

Fencing tokens: the fence of a hold is the largest fence the granting masters
handed out, and it is then written to every master as a floor; any later
majority overlaps this one, so its fence is larger still.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from . import scripts
from .conf import get_settings, validate_aliases
from .driver import Each, Fanned, Sleep, Steps
from .exceptions import LockBackendUnavailable
from .holds import Hold, decode, owner_metadata
from .keys import LockKeys
from .lock import Grant, Mutex
from .owners import Owner, mark_transaction, parse_owner

__all__ = ["QuorumMutex", "quorum_of"]

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


def _quorum_aliases(using: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(using, (list, tuple)):
        return validate_aliases(using)
    quorum = get_settings(using).quorum
    assert quorum is not None  # Mutex.__new__ only sends such aliases here
    return quorum


class QuorumMutex(Mutex):
    """A :class:`Mutex` held on a majority of independent Redis masters.

    Built by ``Mutex(name, using=["r1", "r2", "r3"])`` or ``mutex(...)`` with
    the same ``using``, or with an alias whose ``MUTEX`` block has
    ``"QUORUM": [...]``. Settings (TTL, TIMEOUT, QUORUM_TIMEOUT, ...) come from
    that alias, or from the first alias of the list.

    Its reads count masters: :meth:`~Mutex.owned` while a majority hold this
    handle's token, :meth:`~Mutex.time_left` until fewer than a majority still
    hold its lease, :meth:`~Mutex.locked` and :meth:`~Mutex.owner` for one
    owner holding a majority. Like every quorum operation they ask the masters
    all at once, each within QUORUM_TIMEOUT, and raise LockBackendUnavailable
    when too few answer to make a majority.
    """

    token_prefix = "q"

    def __init__(self, name: str, *, using: Any = "default", **options: Any) -> None:
        aliases = _quorum_aliases(using)
        super().__init__(name, using=using if isinstance(using, str) else aliases[0], **options)
        self.aliases = aliases
        for alias in aliases:
            if get_settings(alias).wait_replicas:
                raise ImproperlyConfigured(
                    f"Quorum lock {self.name!r} cannot use cache {alias!r}: its MUTEX "
                    "block sets WAIT_REPLICAS, which is for one master and its replicas, "
                    "not for a quorum of masters."
                )
        self.quorum = self._quorum_of(len(aliases))
        self.member_keys = {alias: self._keys_on(alias) for alias in aliases}
        self.master_timeout = self.settings.quorum_timeout

    def __repr__(self) -> str:
        state = f"fence={self.fence}" if self._current() is not None else "unlocked"
        return f"<QuorumMutex {self.name!r} using={list(self.aliases)!r} {state}>"

    def _quorum_of(self, members: int) -> int:
        """Return how many masters must grant a hold: a majority.

        Any two majorities share a master, which admits an exclusive holder
        only alone: so an exclusive hold excludes every other hold, shared or
        not, while shared holds may overlap.
        """
        return quorum_of(members)

    def _targets(self) -> tuple[tuple[str, str], ...]:
        return tuple((alias, self.member_keys[alias].lock) for alias in self.aliases)

    def _majority(self) -> tuple[int, float]:
        return self.quorum, self.lease * CLOCK_DRIFT_FACTOR + 0.002

    def _unavailable(self, errors: dict[str, BaseException], what: str) -> LockBackendUnavailable:
        detail = "; ".join(f"{alias}: {exc}" for alias, exc in errors.items())
        return LockBackendUnavailable(
            f"Cannot {what} quorum lock {self.name!r}: {len(errors)} of {len(self.aliases)} "
            f"Redis masters are unavailable ({detail}).",
            name=self.name,
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

    def _judge(self, fanned: Fanned, started: float) -> Grant | None:
        """Return the grant if a majority granted the lock with validity left, else None."""
        granted: dict[str, int] = {}
        pttl, owner = 0, None
        for alias, reply in fanned.replies.items():
            if not isinstance(reply, list):  # the fence alone: granted
                granted[alias] = int(reply)
            elif reply[0] == 1:
                granted[alias] = int(reply[1])
            else:
                pttl = max(pttl, int(reply[1]))
                owner = owner or parse_owner(reply[2] or None)
        _quorum, drift = self._majority()
        # Validity: the lease counted from when the requests were sent, less
        # the time they took and the clock drift allowance.
        valid_until = fanned.sent + self.lease - drift
        if len(granted) >= self.quorum and time.monotonic() < valid_until:
            return Grant(
                max(granted.values()), {alias: (fanned.sent, self.lease) for alias in granted}
            )
        self._contention = (pttl, owner, time.monotonic() - started)
        return None

    def _unless_held_alone(self, grant: Grant, fanned: Fanned) -> Steps[Grant | None]:
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
        self._contention = (int(reply[1]), reply[2] or None, self._contention[2])
        return None

    def _retry_delay(self, deadline: float | None) -> float:
        delay = random.uniform(*RETRY_DELAY)
        pttl = self._contention[0]
        if pttl > 0:
            delay = min(delay, pttl / 1000)
        if deadline is not None:
            delay = min(delay, max(deadline - time.monotonic(), 0.0))
        return delay

    def _acquire_steps(
        self, token: str, blocking: bool, deadline: float | None, started: float
    ) -> Steps[Grant | None]:
        # Quorum waiters never queue, so a release never hands over to one; a
        # plain lock of the same name queued on one master is woken by its own
        # check-in.
        release_all = self._each(scripts.RELEASE, _queue_keys, [token])
        acquire = self._each(
            self._acquire_script,
            lambda keys: keys.with_wake(token),
            self._acquire_args(token, False),
        )
        while True:
            fanned = yield acquire
            grant = self._judge(fanned, started)
            if grant is not None and len(grant.leases) < len(fanned.replies):
                grant = yield from self._unless_held_alone(grant, fanned)
            if grant is None:
                # Undo on every master: one whose reply was lost may have granted it.
                yield release_all
                if self._too_many_down(fanned.errors):
                    raise self._unavailable(fanned.errors, "acquire")
            else:
                floor = yield self._each(scripts.RAISE_FENCE, _fence_key, [grant.fence])
                if self._too_many_down(floor.errors):
                    # Without the floor on a majority, a later majority could
                    # hand out a smaller fence: give the lock back instead.
                    yield release_all
                    raise self._unavailable(floor.errors, "record the fence of")
                return grant
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return None
            yield Sleep(self._retry_delay(deadline))

    def _abandon_steps(self, token: str) -> Steps[None]:
        yield self._each(scripts.RELEASE, _queue_keys, [token])

    # -- release, extend, confirm ------------------------------------------------

    def _release_steps(self, hold: Hold) -> Steps[bool]:
        fanned = yield self._each(scripts.RELEASE, _queue_keys, [hold.token])
        if len(fanned.errors) >= self.quorum:
            # Too few masters answered to tell; the leases end by themselves.
            raise self._unavailable(fanned.errors, "release")
        released = sum(1 for reply in fanned.replies.values() if reply)
        # Masters that did not answer may still hold our key until it expires;
        # the hold was ours unless the answering ones show a majority lost it.
        return released + len(fanned.errors) >= self.quorum

    def _mark_steps(self, hold: Hold, databases: list[str]) -> Steps[bool]:
        """Mark the owner record on every master at once, each within QUORUM_TIMEOUT.

        Return False when too few masters still hold our key for a majority.
        """
        owner = mark_transaction(owner_metadata(self.label), databases)
        fanned = yield self._each(scripts.MARK_TRANSACTION, _lock_key, [hold.token, owner])
        marked = sum(1 for reply in fanned.replies.values() if reply)
        return marked + len(fanned.errors) >= self.quorum

    def _extend_steps(self, hold: Hold, ttl: float) -> Steps[bool]:
        fanned = yield self._each(scripts.EXTEND, _lock_key, [hold.token, scripts.lease_ms(ttl)])
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
        for holder, pttl, owner, mine, shared, owners in fanned.replies.values():
            holders = {decode(holder): decode(owner)} if holder else {}
            holders.update(zip(map(decode, shared), map(decode, owners), strict=True))
            states.append(_State(holders, int(pttl), int(mine)))
        return states

    def _time_left_steps(self) -> Steps[float]:
        """Return the seconds until fewer than a majority of masters still hold our lease."""
        hold = self._current()
        if hold is None:
            return 0.0
        states = yield from self._states_steps(hold.token)
        mine = sorted((state.mine for state in states if state.mine > 0), reverse=True)
        return mine[self.quorum - 1] / 1000 if len(mine) >= self.quorum else 0.0

    def _owned_steps(self) -> Steps[bool]:
        """Return True if a majority of masters hold this handle's hold."""
        hold = self._current()
        if hold is None:
            return False
        states = yield from self._states_steps(hold.token)
        return sum(1 for state in states if state.mine > 0) >= self.quorum

    def _holder_steps(self) -> Steps[Owner | Literal[""] | None]:
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
    """What one master says of a quorum lock: its holders' owners, pttl, the caller's ms left."""

    holders: dict[str, str]
    pttl: int
    mine: int


def _queue_keys(keys: LockKeys) -> tuple[str, ...]:
    return keys.script_keys


def _lock_key(keys: LockKeys) -> tuple[str, ...]:
    return (keys.lock,)


def _fence_key(keys: LockKeys) -> tuple[str, ...]:
    return (keys.fence,)


Mutex.quorum_class = QuorumMutex
