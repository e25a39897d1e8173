"""QuorumMutex: one lock across several independent Redis masters (Redlock).

A lock is held when a majority of the masters granted it within its validity
window: the lease minus the time the acquisition took minus an allowance for
clock drift. It is released on every master, extended on a majority, and
renewed by the same watchdog as a single-master lock (a hold is lost when a
majority no longer has it). With one of three masters down it still works;
with two down it raises LockBackendUnavailable.

Each master keeps its own queue, so a quorum lock cannot hand over inside a
release script the way a single-master lock does: a waiter retries after a
short random delay, capped by the holder's remaining lease (the Redlock
algorithm's own advice against synchronised retries).

Fencing tokens: the fence of a hold is the largest fence the granting masters
handed out, and it is then written to every master as a floor; any later
majority overlaps this one, so its fence is larger still.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from . import scripts
from .client import UNAVAILABLE, get_async_client, get_client, namespace
from .conf import validate_aliases
from .exceptions import LockBackendUnavailable
from .holds import Hold, decode
from .keys import LockKeys
from .lock import DEFAULT, Mutex, _ms, _owner_dict
from .watchdog import get_watchdog

__all__ = ["QuorumMutex"]

# Redlock's allowance for clock drift between masters: 1% of the lease + 2 ms.
CLOCK_DRIFT_FACTOR = 0.01
# Bounds of the random delay between attempts of a blocked quorum waiter.
RETRY_DELAY = (0.005, 0.05)


def _quorum_aliases(using: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(using, (list, tuple)):
        return validate_aliases(using)
    from .conf import get_settings

    quorum = get_settings(using).quorum
    assert quorum is not None  # Mutex.__new__ only sends such aliases here
    return quorum


class QuorumMutex(Mutex):
    """A :class:`Mutex` held on a majority of independent Redis masters.

    Built by ``Mutex(name, using=["r1", "r2", "r3"])`` or ``mutex(...)`` with
    the same ``using``, or with an alias whose ``MUTEX`` block has
    ``"QUORUM": [...]``. Settings (TTL, TIMEOUT, ...) come from the first alias.
    """

    def __init__(self, name: str, *, using: Any = "default", **options: Any) -> None:
        aliases = _quorum_aliases(using)
        # Defaults (TTL, TIMEOUT, FAIL_OPEN, ...) come from the alias that names
        # the QUORUM, or from the first member of an explicit list.
        super().__init__(name, using=using if isinstance(using, str) else aliases[0], **options)
        self.aliases = aliases
        self.quorum = len(aliases) // 2 + 1
        self.member_keys = {
            alias: LockKeys.for_name(namespace(alias), self.name) for alias in aliases
        }

    def __repr__(self) -> str:
        state = f"fence={self.fence}" if self._hold is not None else "unlocked"
        return f"<QuorumMutex {self.name!r} using={list(self.aliases)!r} {state}>"

    def _hold_targets(self) -> tuple[tuple[tuple[str, str], ...], int]:
        targets = tuple((alias, self.member_keys[alias].lock) for alias in self.aliases)
        return targets, self.quorum

    def _unavailable(self, errors: dict[str, BaseException], what: str) -> LockBackendUnavailable:
        detail = "; ".join(f"{alias}: {exc}" for alias, exc in errors.items())
        return LockBackendUnavailable(
            f"Cannot {what} quorum lock {self.name!r}: {len(errors)} of {len(self.aliases)} "
            f"Redis masters are unavailable ({detail}).",
            name=self.name,
        )

    # -- one round over all masters -------------------------------------------

    def _tally(
        self, replies: dict[str, Any], errors: dict[str, BaseException], started: float
    ) -> tuple[dict[str, int], int, dict[str, Any] | None]:
        granted: dict[str, int] = {}
        pttl, owner = 0, None
        for alias, reply in replies.items():
            if reply[0] == 1:
                granted[alias] = int(reply[1])
            else:
                pttl = max(pttl, int(reply[1]))
                owner = owner or _owner_dict(reply[2] or None)
        return granted, pttl, owner

    def _valid(self, attempt_started: float) -> bool:
        elapsed = time.monotonic() - attempt_started
        drift = self.lease * CLOCK_DRIFT_FACTOR + 0.002
        return self.lease - elapsed - drift > 0

    def _attempt(self, token: str) -> tuple[dict[str, Any], dict[str, BaseException]]:
        replies: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        for alias in self.aliases:
            keys = self.member_keys[alias]
            try:
                replies[alias] = scripts.run(
                    get_client(alias),
                    scripts.ACQUIRE,
                    keys.script_keys,
                    self._acquire_args(token, False),
                )
            except (*UNAVAILABLE, ResponseError) as exc:
                errors[alias] = exc
        return replies, errors

    def _each(
        self,
        script: scripts.LuaScript,
        keys_of: Any,
        args: list[Any],
        only: Sequence[str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        replies: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        for alias in only if only is not None else self.aliases:
            try:
                replies[alias] = scripts.run(get_client(alias), script, keys_of(alias), args)
            except (*UNAVAILABLE, ResponseError) as exc:
                errors[alias] = exc
        return replies, errors

    async def _aeach(
        self,
        script: scripts.LuaScript,
        keys_of: Any,
        args: list[Any],
        only: Sequence[str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        aliases = list(only if only is not None else self.aliases)

        async def one(alias: str) -> Any:
            return await scripts.arun(await get_async_client(alias), script, keys_of(alias), args)

        results = await asyncio.gather(*(one(a) for a in aliases), return_exceptions=True)
        replies: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        for alias, result in zip(aliases, results, strict=True):
            if isinstance(result, (*UNAVAILABLE, ResponseError)):
                errors[alias] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                replies[alias] = result
        return replies, errors

    def _script_keys(self, alias: str) -> list[str]:
        return self.member_keys[alias].script_keys

    def _lock_key(self, alias: str) -> list[str]:
        return [self.member_keys[alias].lock]

    def _fence_key(self, alias: str) -> list[str]:
        return [self.member_keys[alias].fence]

    # -- acquire ----------------------------------------------------------------

    def _judge(
        self,
        replies: dict[str, Any],
        errors: dict[str, BaseException],
        attempt_started: float,
        started: float,
    ) -> int | None:
        """Return the fence if a valid majority granted the lock, else None.

        Pure bookkeeping, no I/O, so the sync and async paths share it; each
        undoes a failed attempt with its own client.
        """
        granted, pttl, owner = self._tally(replies, errors, started)
        if len(granted) >= self.quorum and self._valid(attempt_started):
            return max(granted.values())
        self._contention = (pttl, owner, time.monotonic() - started)
        return None

    def _too_many_down(self, errors: dict[str, BaseException]) -> bool:
        """Return True when the masters that failed leave no majority."""
        return len(errors) > len(self.aliases) - self.quorum

    def _retry_delay(self, deadline: float | None) -> float:
        delay = random.uniform(*RETRY_DELAY)
        pttl = self._contention[0]
        if pttl > 0:
            delay = min(delay, pttl / 1000)
        if deadline is not None:
            delay = min(delay, max(deadline - time.monotonic(), 0.0))
        return delay

    def acquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Acquire the lock on a majority of masters; see :meth:`Mutex.acquire`."""
        begun = self._begin(blocking, timeout)
        if begun is None:
            return True
        blocking, started, deadline, token = begun
        release_all = (scripts.RELEASE, self._script_keys, [token])
        while True:
            attempt_started = time.monotonic()
            try:
                replies, errors = self._attempt(token)
                fence = self._judge(replies, errors, attempt_started, started)
                if fence is None:
                    # Undo on every master: one whose reply was lost may have granted it.
                    self._each(*release_all)
                    if self._too_many_down(errors):
                        raise self._unavailable(errors, "acquire")
                else:
                    _replies, errors = self._each(scripts.RAISE_FENCE, self._fence_key, [fence])
                    if self._too_many_down(errors):
                        # Without the floor on a majority, a later majority could
                        # hand out a smaller fence: give the lock back instead.
                        self._each(*release_all)
                        raise self._unavailable(errors, "record the fence of")
            except LockBackendUnavailable:
                raise
            except BaseException:
                self._each(*release_all)
                raise
            if fence is not None:
                self._granted(token, fence, started)
                return True
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                self._note_contention()
                return False
            time.sleep(self._retry_delay(deadline))

    async def aacquire(self, blocking: bool = DEFAULT, timeout: float | None = DEFAULT) -> bool:
        """Async twin of :meth:`acquire`; asks all masters at once."""
        begun = self._begin(blocking, timeout)
        if begun is None:
            return True
        blocking, started, deadline, token = begun
        release_all = (scripts.RELEASE, self._script_keys, [token])
        while True:
            attempt_started = time.monotonic()
            try:
                replies, errors = await self._aeach(
                    scripts.ACQUIRE, self._script_keys, self._acquire_args(token, False)
                )
                fence = self._judge(replies, errors, attempt_started, started)
                if fence is None:
                    await self._aeach(*release_all)
                    if self._too_many_down(errors):
                        raise self._unavailable(errors, "acquire")
                else:
                    _replies, errors = await self._aeach(
                        scripts.RAISE_FENCE, self._fence_key, [fence]
                    )
                    if self._too_many_down(errors):
                        await self._aeach(*release_all)
                        raise self._unavailable(errors, "record the fence of")
            except LockBackendUnavailable:
                raise
            except BaseException:
                await asyncio.shield(self._aeach(*release_all))
                raise
            if fence is not None:
                self._granted(token, fence, started)
                return True
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                self._note_contention()
                return False
            await asyncio.sleep(self._retry_delay(deadline))

    # -- release and extend -----------------------------------------------------

    def _released(
        self, hold: Hold, replies: dict[str, Any], errors: dict[str, BaseException]
    ) -> None:
        released = sum(1 for reply in replies.values() if reply)
        if len(errors) >= self.quorum:
            # Too few masters answered to tell; the leases end by themselves.
            self._release_failed_locally(hold)
            raise self._unavailable(errors, "release")
        # Masters that did not answer may still hold our key until it expires;
        # the hold was ours unless the answering ones show a majority lost it.
        self._finish(hold, 1 if released + len(errors) >= self.quorum else 0)

    def release(self) -> None:
        """Release the lock on every master; see :meth:`Mutex.release`."""
        hold = self._held_or_raise("release")
        if self._unnest(hold):
            return
        get_watchdog().unwatch(hold)
        replies, errors = self._each(scripts.RELEASE, self._script_keys, [hold.token])
        self._released(hold, replies, errors)

    async def arelease(self) -> None:
        """Async twin of :meth:`release`."""
        hold = self._held_or_raise("release")
        if self._unnest(hold):
            return
        get_watchdog().unwatch(hold)
        replies, errors = await self._aeach(scripts.RELEASE, self._script_keys, [hold.token])
        self._released(hold, replies, errors)

    def _after_extend(
        self, hold: Hold, ttl: float, replies: dict[str, Any], errors: dict[str, BaseException]
    ) -> None:
        extended = sum(1 for reply in replies.values() if reply)
        if extended < self.quorum and extended + len(errors) >= self.quorum:
            raise self._unavailable(errors, "extend")
        self._extended(hold, ttl, 1 if extended >= self.quorum else 0)

    def extend(self, ttl: float | None = None) -> None:
        """Extend the lease on a majority of masters; see :meth:`Mutex.extend`."""
        from .conf import validate_ttl

        ttl = self.lease if ttl is None else validate_ttl(ttl)
        hold = self._held_or_raise("extend")
        replies, errors = self._each(scripts.EXTEND, self._lock_key, [hold.token, _ms(ttl)])
        self._after_extend(hold, ttl, replies, errors)

    async def aextend(self, ttl: float | None = None) -> None:
        """Async twin of :meth:`extend`."""
        from .conf import validate_ttl

        ttl = self.lease if ttl is None else validate_ttl(ttl)
        hold = self._held_or_raise("extend")
        replies, errors = await self._aeach(scripts.EXTEND, self._lock_key, [hold.token, _ms(ttl)])
        self._after_extend(hold, ttl, replies, errors)

    # -- inspect ------------------------------------------------------------------

    def _states(self) -> list[tuple[str, int, str]]:
        """Return (token, pttl, owner JSON) per reachable master."""
        states = []
        errors: dict[str, BaseException] = {}
        for alias in self.aliases:
            key = self.member_keys[alias].lock
            try:
                pipe = get_client(alias).pipeline(transaction=False)
                pipe.hget(key, "token")
                pipe.pttl(key)
                pipe.hget(key, "owner")
                token, pttl, owner = pipe.execute()
            except (*UNAVAILABLE, ResponseError) as exc:
                errors[alias] = exc
                continue
            states.append((decode(token), int(pttl), decode(owner)))
        if len(errors) > len(self.aliases) - self.quorum:
            raise self._unavailable(errors, "inspect")
        return states

    def ttl(self) -> float:
        """Return the seconds until fewer than a majority of masters still hold our lease."""
        if self._hold is None:
            return 0.0
        mine = sorted(
            (pttl for token, pttl, _ in self._states() if token == self._hold.token and pttl > 0),
            reverse=True,
        )
        return mine[self.quorum - 1] / 1000 if len(mine) >= self.quorum else 0.0

    def owned(self) -> bool:
        """Return True if a majority of masters hold this handle's token."""
        if self._hold is None:
            return False
        token = self._hold.token
        return sum(1 for state in self._states() if state[0] == token) >= self.quorum

    def locked(self) -> bool:
        """Return True if one owner holds the lock on a majority of masters."""
        counts: dict[str, int] = {}
        for token, _pttl, _owner in self._states():
            if token:
                counts[token] = counts.get(token, 0) + 1
        return any(count >= self.quorum for count in counts.values())

    def owner(self) -> dict[str, Any] | None:
        """Return the metadata of the owner holding a majority, or None."""
        counts: dict[str, int] = {}
        owners: dict[str, str] = {}
        for token, _pttl, owner in self._states():
            if token:
                counts[token] = counts.get(token, 0) + 1
                owners[token] = owner
        for token, count in counts.items():
            if count >= self.quorum:
                return _owner_dict(owners[token])
        return None

    async def attl(self) -> float:
        """Async twin of :meth:`ttl` (asks the masters one after another)."""
        return await asyncio.to_thread(self.ttl)

    async def aowned(self) -> bool:
        """Async twin of :meth:`owned`."""
        return await asyncio.to_thread(self.owned)

    async def alocked(self) -> bool:
        """Async twin of :meth:`locked`."""
        return await asyncio.to_thread(self.locked)

    async def aowner(self) -> dict[str, Any] | None:
        """Async twin of :meth:`owner`."""
        return await asyncio.to_thread(self.owner)
