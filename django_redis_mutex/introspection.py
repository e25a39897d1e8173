"""Look at and force-release the locks and semaphores held in one cache alias, or in a quorum.

Shared by the ``locks`` management command and the admin inspector. Keys are
walked with SCAN on an escaped pattern within this app's namespace, in batches,
never with KEYS, and only this app's lock and semaphore keys are ever deleted.
A semaphore is the lock engine's shared kind under a limit, with its keys in a
space of their own (see :mod:`django_redis_mutex.keys`): it is read, merged
across a quorum and reset by the same functions as a lock, given its keys.

``using`` is a cache alias, as for :class:`~django_redis_mutex.Mutex`, or a
quorum: an alias whose ``MUTEX`` block names a ``QUORUM``, or a list of
aliases. One Redis is read and reset as a quorum of one master. A quorum lock
lives on every master under that master's own namespace, and its holder's
watchdog keeps renewing it as long as a majority still has its token, so it is
only ever reset on all of its masters at once (see :func:`ensure_resettable`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import ResponseError

from .client import UNAVAILABLE, backend_errors, get_client, namespace, probe_client, server_ms
from .conf import resolve_using
from .display import duration
from .driver import run_steps
from .eviction import EvictionPolicy, read_policy
from .exceptions import LockBackendUnavailable
from .handoff import read_state_steps, release_steps, reset_steps
from .holds import decode
from .keys import (
    LockKeys,
    SharedRecord,
    lock_pattern,
    place_is_live,
    semaphore_pattern,
    validate_name,
)
from .owners import Owner, parse_owner
from .quorum import quorum_members, quorum_of

__all__ = [
    "HeldLock",
    "HeldSemaphore",
    "ListedLock",
    "SemaphoreHolder",
    "SharedHolder",
    "ensure_resettable",
    "eviction_policies",
    "held_locks",
    "held_semaphores",
    "listed_locks",
    "quorum_members",
    "reset",
    "reset_all",
    "reset_listed",
    "reset_semaphore",
    "semaphore_lines",
]

SCAN_BATCH = 500

# What makes one master of a quorum fail without failing the others: it cannot
# be reached, or it answers with an error (ACLs, a foreign value at a lock key).
_MEMBER_FAILURES = (*UNAVAILABLE, ResponseError)

_T = TypeVar("_T")


def seconds_since(moment: datetime) -> float:
    """Return the seconds from ``moment`` until now by this server's clock, never negative."""
    return max(0.0, time.time() - moment.timestamp())


@dataclass(frozen=True)
class SharedHolder:
    """One holder of a lock held shared, as read from Redis.

    .. versionadded:: 0.2
    """

    owner: Owner
    acquired_at: datetime
    time_left: float  # seconds left on this holder's own lease
    fence: int


@dataclass(frozen=True)
class HeldLock:
    """One lock held right now, as read from Redis.

    For a quorum lock the fields come from the masters that hold the majority
    token: ``fence`` is the largest fence among them (the fence the holder
    got), ``time_left`` the time until fewer than a majority still hold the lease,
    and ``masters`` how many masters hold it (1 for a single Redis).

    A lock held shared (``shared`` True) lists each of its holders in
    ``holders``, earliest first; ``owner``, ``acquired_at`` and ``fence`` are
    then the earliest holder's, ``time_left`` the longest lease left. For an
    exclusive lock ``holders`` is empty.
    """

    name: str
    owner: Owner
    acquired_at: datetime
    time_left: float  # seconds left on the holder's lease
    fence: int
    waiters: int  # acquisitions waiting in line whose place still holds
    masters: int = 1
    shared: bool = False
    holders: tuple[SharedHolder, ...] = ()

    @property
    def held_for(self) -> float:
        """Seconds since the lock was acquired (by this server's clock)."""
        return seconds_since(self.acquired_at)

    @property
    def ttl(self) -> float:
        """Deprecated name of ``time_left`` (``ttl`` elsewhere means the lease)."""
        warnings.warn(
            "HeldLock.ttl is deprecated: use HeldLock.time_left (ttl= is the lease length).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.time_left

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as JSON-ready values (acquired_at in ISO 8601).

        ``ttl`` repeats ``time_left`` for readers of the previous release's
        output; it goes away in the next release.
        """
        data = asdict(self)
        data["acquired_at"] = self.acquired_at.isoformat()
        for holder in data["holders"]:
            holder["acquired_at"] = holder["acquired_at"].isoformat()
        data["ttl"] = self.time_left
        return data


@dataclass(frozen=True)
class ListedLock:
    """A held lock as it was listed, with the token of the acquisition that held it.

    :func:`reset_listed` releases the lock only while that acquisition still
    holds it, so a lock released and taken again since it was listed (perhaps
    by a holder the operator never saw) is left to its new holder. The token
    is a holder's secret: it is kept out of ``repr`` and never shown.

    .. versionadded:: 0.1
    """

    held: HeldLock
    # A shared lock's holders' tokens, space-separated.
    token: str = field(repr=False)


@dataclass(frozen=True)
class SemaphoreHolder:
    """One permit of a semaphore, as read from Redis."""

    token: str
    owner: Owner
    time_left: float
    fence: int = 0


@dataclass(frozen=True)
class HeldSemaphore:
    """One semaphore with at least one permit held, as read from Redis.

    On a quorum, ``holders`` are the permits held on as many masters as a
    quorum :class:`~django_redis_mutex.Semaphore` needs, and ``limit`` the
    smallest limit those masters keep.
    """

    name: str
    limit: int | None
    holders: list[SemaphoreHolder] = field(default_factory=list)
    waiters: int = 0
    read_at: datetime = field(default_factory=lambda: datetime.now(tz=timezone.utc))

    def as_dict(self) -> dict[str, Any]:
        """Return the semaphore as plain data (for JSON output)."""
        holders = [{**asdict(h), "owner": h.owner.as_dict()} for h in self.holders]
        return {"name": self.name, "limit": self.limit, "waiters": self.waiters, "holders": holders}


@dataclass(frozen=True)
class _Kind:
    """Where the keys of one kind live in a namespace: a lock's, or a semaphore's."""

    noun: str
    pattern: Callable[[str], str]  # namespace -> SCAN pattern of every main key of the kind
    keys: Callable[[str, str], LockKeys]  # (namespace, name) -> the keys of one


_LOCKS = _Kind("lock", lock_pattern, LockKeys.for_name)
_SEMAPHORES = _Kind("semaphore", semaphore_pattern, LockKeys.for_semaphore)


# -- which Redis a ``using`` means ------------------------------------------------


def eviction_policies(using: str | Sequence[str] = "default") -> list[EvictionPolicy]:
    """Return what the Redis of ``using`` (each master of a quorum) says about evicting keys.

    With the count of keys it evicted since it started (``INFO stats``), for the
    listings. Read afresh, within a short timeout; a server that cannot be
    reached is left out (the listing itself reports it).
    """
    label, members = resolve_using(using)
    found = []
    for alias in members or (label,):
        try:
            with probe_client(alias) as client:
                found.append(read_policy(client, alias, stats=True))
        except UNAVAILABLE:
            continue
    return found


def _quorums_with_member(alias: str) -> dict[str, list[str]]:
    """Return the aliases whose MUTEX QUORUM lists ``alias``, with their members.

    Reads settings.CACHES as written, so a broken MUTEX block of some unrelated
    alias cannot make a reset fail (the system checks report it).
    """
    from django.conf import settings

    found: dict[str, list[str]] = {}
    for other, entry in getattr(settings, "CACHES", {}).items():
        block = entry.get("MUTEX") if isinstance(entry, dict) else None
        members = block.get("QUORUM") if isinstance(block, dict) else None
        if other != alias and isinstance(members, (list, tuple)) and alias in members:
            found[other] = [str(member) for member in members]
    return found


def ensure_resettable(using: str | Sequence[str], noun: str = "lock") -> None:
    """Raise ValueError when a reset through ``using`` could release a quorum lock on one master.

    The rule: a plain alias (one without a QUORUM of its own) that is listed in
    the ``QUORUM`` of any alias in settings.CACHES is refused. A reset there
    would clear a quorum lock on that master only, while the holder's watchdog
    keeps it alive on the others. Resetting through the quorum alias (or a list
    of every master) instead runs the reset on every master, in each master's
    own namespace, so it also clears a plain lock of that name on the member.
    Quorums built only in code (``using=[...]`` lists) are not in settings and
    cannot be detected: reset those with the same list. ``noun`` ("lock",
    "semaphore") names what the refusal is about.
    """
    alias, members = resolve_using(using)
    if members is not None:
        return
    quorums = _quorums_with_member(alias)
    if not quorums:
        return
    names = ", ".join(map(repr, quorums))
    first, listed = next(iter(quorums.items()))
    raise ValueError(
        f"Cache alias {alias!r} is a member of quorum {names}; reset the {noun} through "
        f"{first!r} (or pass using={listed!r}) so it is released on every master, "
        "not on this one only."
    )


class _Masters:
    """The Redis a ``using`` names: one alias, or the masters of a quorum, and those that failed.

    One Redis failing fails the operation at once (LockBackendUnavailable when
    it cannot be reached). A master of a quorum that fails is recorded in
    ``errors`` and skipped from then on: the caller weighs the failures
    against the majority.
    """

    def __init__(self, using: str | Sequence[str], name: str | None = None) -> None:
        self.label, self.members = resolve_using(using)
        self.aliases = self.members or (self.label,)
        self.errors: dict[str, BaseException] = {}
        for alias in self.aliases:  # a misconfigured master fails before any command
            namespace(alias)
            try:
                # A Cluster client connects as it is built: no seed answering
                # is Redis unavailable, never redis-py's own error.
                with backend_errors(name, alias):
                    get_client(alias)
            except LockBackendUnavailable as exc:
                if self.members is None:
                    raise
                self.errors[alias] = exc

    def each(self, run: Callable[[str], _T], name: str | None = None) -> dict[str, _T]:
        """Return ``run(alias)`` of each Redis that answers."""
        if self.members is None:
            with backend_errors(name, self.label):
                return {self.label: run(self.label)}
        done: dict[str, _T] = {}
        for alias in self.members:
            if alias in self.errors:
                continue
            try:
                done[alias] = run(alias)
            except _MEMBER_FAILURES as exc:
                self.errors[alias] = exc
        return done

    def unreachable(self, what: str, why: str, name: str | None = None) -> LockBackendUnavailable:
        """Return the error of a quorum operation that too many masters did not answer."""
        detail = "; ".join(f"{alias}: {exc}" for alias, exc in self.errors.items())
        return LockBackendUnavailable(
            f"Cannot {what} on quorum {self.label!r}: {len(self.errors)} of "
            f"{len(self.aliases)} Redis masters could not be reached ({detail}); {why}",
            name=name,
        )

    def check_reset(self, noun: str, name: str | None = None) -> None:
        """Raise when the masters a reset missed are a majority: the hold may live on there."""
        if len(self.errors) >= quorum_of(len(self.aliases)):
            what = f"reset every {noun}" if name is None else f"reset {noun} {name!r}"
            why = (
                f"together they are a majority, so the {noun} may still be held there. "
                "Nothing was reported as released; reset again once they are back."
            )
            raise self.unreachable(what, why, name)


# -- reading ---------------------------------------------------------------------


def _keys_of_kind(client: Any, alias: str, kind: _Kind) -> Iterator[list[str]]:
    """Yield batches of the hash keys of ``kind`` in ``alias``'s namespace, each key once.

    A cluster client scans every node it believes to be a primary; just after a
    failover that can include the demoted one, whose replica copy of every key
    would otherwise be listed (and reset) a second time.
    """
    batch: list[str] = []
    seen: set[str] = set()
    pattern = kind.pattern(namespace(alias))
    for raw in client.scan_iter(match=pattern, count=SCAN_BATCH, _type="hash"):
        key = decode(raw)
        if key in seen:
            continue
        seen.add(key)
        batch.append(key)
        if len(batch) >= SCAN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _parse(
    name: str, record: dict[str, str], pttl: int, waiters: int, now_ms: int
) -> ListedLock | None:
    """Return the lock read from one lock hash with its token, or None if nobody holds it now."""
    if pttl == -2:
        return None  # released between SCAN and read
    token = record.get("token", "")
    if not token:
        return parse_shared(name, record, waiters, now_ms)
    stored_fence = record.get("fence", "")
    fence = int(stored_fence) if stored_fence.isdigit() else 0
    acquired = record.get("acquired", "")
    # The fence is the server clock in µs when the lock was taken, unless the
    # counter ran ahead of the clock: then ACQUIRE stored the time itself.
    ms = int(acquired) if acquired.isdigit() else fence // 1000
    held = HeldLock(
        name=name,
        owner=parse_owner(record.get("owner")) or Owner(),
        acquired_at=_at(ms),
        time_left=max(pttl, 0) / 1000,
        fence=fence,
        waiters=waiters,
    )
    return ListedLock(held, token)


def parse_shared(name: str, record: dict[str, str], waiters: int, now_ms: int) -> ListedLock | None:
    """Return a lock held shared with its holders' tokens: one ``r:<token>`` record per holder."""
    holders: list[tuple[str, SharedHolder]] = []
    for field_name, value in record.items():
        if not field_name.startswith("r:"):
            continue
        shared = SharedRecord.parse(value)
        if shared is None or shared.ends <= now_ms:
            continue  # not a record, or its lease ended (the next script to look drops it)
        holder = SharedHolder(
            owner=parse_owner(shared.owner) or Owner(),
            acquired_at=_at(shared.taken),
            time_left=(shared.ends - now_ms) / 1000,
            fence=shared.fence,
        )
        holders.append((field_name[2:], holder))
    return held_shared(name, holders, waiters) if holders else None


def held_shared(
    name: str, holders: list[tuple[str, SharedHolder]], waiters: int, masters: int = 1
) -> ListedLock:
    """Return the lock ``holders`` (token, holder; one at least) hold shared.

    Also what a filter narrows a shared lock to (see ``LockFilter.select``), so
    that the earliest holder's fields and the longest lease are taken one way.
    """
    holders.sort(key=lambda pair: (pair[1].acquired_at, pair[1].fence))
    first = holders[0][1]
    held = HeldLock(
        name=name,
        owner=first.owner,
        acquired_at=first.acquired_at,
        time_left=max(holder.time_left for _, holder in holders),
        fence=first.fence,
        waiters=waiters,
        masters=masters,
        shared=True,
        holders=tuple(holder for _, holder in holders),
    )
    return ListedLock(held, " ".join(token for token, _ in holders))


class _Found(NamedTuple):
    """One held lock or semaphore, as one Redis (or a quorum of them) holds it."""

    tag: str  # the key without its namespace: the same on every master
    listed: ListedLock
    limit: int | None  # a semaphore's, as its hash keeps it


def _read(client: Any, alias: str, kind: _Kind) -> Iterator[_Found]:
    """Yield every lock (or semaphore) of ``kind`` held in ``alias``'s namespace."""
    space = namespace(alias)
    for batch in _keys_of_kind(client, alias, kind):
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.hgetall(key)
            pipe.pttl(key)
            # HGETALL, not HVALS: the ACL the docs give has no other hash read.
            pipe.hgetall(LockKeys.for_lock_key(key).waiting)
        replies = pipe.execute()
        # Shared leases are kept as server times: read the server's clock after them.
        now_ms = server_ms(client.time())
        for index, key in enumerate(batch):
            i = 3 * index
            record = {decode(name): decode(value) for name, value in replies[i].items()}
            name = LockKeys.for_lock_key(key).name_of(space)
            waiters = sum(place_is_live(decode(place), now_ms) for place in replies[i + 2].values())
            listed = _parse(name, record, replies[i + 1], waiters, now_ms)
            if listed is not None:
                limit = record.get("limit", "")
                tag = key[len(space) + 1 :]
                yield _Found(tag, listed, int(limit) if limit.isdigit() else None)


def _on_quorum(copies: Sequence[HeldLock | SharedHolder], quorum: int) -> dict[str, Any]:
    """Return the holder's fields of one hold from its copies on ``quorum`` masters or more.

    ``fence`` is the largest among them (the fence the holder got),
    ``time_left`` the time until fewer than ``quorum`` still hold the lease.
    """
    left = sorted((copy.time_left for copy in copies), reverse=True)
    return {
        "owner": copies[0].owner,
        "acquired_at": min(copy.acquired_at for copy in copies),
        "time_left": left[quorum - 1],
        "fence": max(copy.fence for copy in copies),
    }


def _merge(copies: list[ListedLock], quorum: int) -> list[ListedLock]:
    """Return what ``quorum`` masters hold of one key, from its copies on each master.

    A lock held shared (a semaphore's permits) lists the holders whose own
    token is on ``quorum`` masters, each counted alone: the masters need not
    hold the same set of holders.
    """
    exclusive: dict[str, list[HeldLock]] = {}
    shared: dict[str, list[SharedHolder]] = {}
    for copy in copies:
        if not copy.held.shared:
            exclusive.setdefault(copy.token, []).append(copy.held)
            continue
        for token, holder in zip(copy.token.split(), copy.held.holders, strict=True):
            shared.setdefault(token, []).append(holder)
    found = [
        ListedLock(
            HeldLock(
                name=held[0].name,
                waiters=max(copy.waiters for copy in held),
                masters=len(held),
                **_on_quorum(held, quorum),
            ),
            token,
        )
        for token, held in exclusive.items()
        if len(held) >= quorum
    ]
    agreed = [
        (token, SharedHolder(**_on_quorum(same, quorum)))
        for token, same in shared.items()
        if len(same) >= quorum
    ]
    if agreed:
        tokens = {token for token, _ in agreed}
        holding = [copy.held for copy in copies if tokens.intersection(copy.token.split())]
        waiters = max(copy.waiters for copy in holding)
        found.append(held_shared(holding[0].name, agreed, waiters, masters=len(holding)))
    return found


def _found(using: str | Sequence[str], kind: _Kind) -> list[_Found]:
    """Return the locks (or semaphores) of ``kind`` held in ``using`` now, sorted by name.

    One Redis is read as a quorum of one: its holds are merged as a quorum's
    copies are, each counted on the one master it is on.
    """
    masters = _Masters(using)
    read = masters.each(lambda alias: list(_read(get_client(alias), alias, kind)))
    if len(read) < quorum_of(len(masters.aliases)):
        # Too few masters answered for anything to show a majority.
        raise masters.unreachable(
            f"list the {kind.noun}s",
            f"too few answered to tell which {kind.noun}s a majority holds.",
        )
    by_tag: dict[str, list[_Found]] = {}
    for rows in read.values():
        for row in rows:
            by_tag.setdefault(row.tag, []).append(row)
    found: list[_Found] = []
    for tag, copies in by_tag.items():
        # A permit counts on as many masters as a quorum semaphore needs; the
        # smallest limit kept asks the fewest, so no granted permit goes unlisted.
        limits = [copy.limit for copy in copies if copy.limit is not None]
        limit = min(limits) if limits else None
        quorum = quorum_of(len(masters.aliases), limit or 1)
        merged = _merge([copy.listed for copy in copies], quorum)
        found.extend(_Found(tag, listed, limit) for listed in merged)
    found.sort(key=lambda item: item.listed.held.name)
    return found


def held_locks(using: str | Sequence[str] = "default") -> list[HeldLock]:
    """Return the locks held right now in cache ``using``, sorted by name.

    For a quorum, a lock is listed once when one token is held on a majority
    of the masters (a lock whose majority includes an unreachable master is
    not listed); with too few masters reachable to see a majority, raise
    LockBackendUnavailable naming them. A lock held shared lists the holders
    each held on a majority.
    """
    return [listed.held for listed in listed_locks(using)]


def listed_locks(using: str | Sequence[str] = "default") -> list[ListedLock]:
    """Return the locks :func:`~django_redis_mutex.held_locks` returns, each with its token.

    The token is for a reset of a selection an operator saw (:func:`reset_listed`):
    what changed hands after this listing is then left alone.

    .. versionadded:: 0.1
    """
    return [found.listed for found in _found(using, _LOCKS)]


def held_semaphores(using: str | Sequence[str] = "default") -> list[HeldSemaphore]:
    """Return the semaphores of ``using`` with permits held now, each with its holders.

    For a quorum, as :func:`~django_redis_mutex.held_locks` does for locks,
    but a permit is listed when it is held on as many masters as a quorum
    :class:`~django_redis_mutex.Semaphore` needs for the limit the semaphore's
    hash keeps (a majority if none is kept).

    .. versionchanged:: 0.3.0
       ``using`` may be a quorum.
    """
    found = []
    for item in _found(using, _SEMAPHORES):
        held = item.listed.held
        tokens = item.listed.token.split()
        holders = [
            SemaphoreHolder(token, holder.owner, holder.time_left, holder.fence)
            for token, holder in zip(tokens, held.holders, strict=True)
        ]
        found.append(HeldSemaphore(held.name, item.limit, holders, held.waiters))
    return found


def semaphore_lines(
    using: str | Sequence[str] = "default", semaphores: list[HeldSemaphore] | None = None
) -> list[str]:
    """Return the held semaphores of ``using`` as text lines (none when nothing is held).

    What ``manage.py locks`` prints below its table of locks: each semaphore,
    then its permits, times left written as in that table ("25.8 s"). Pass
    ``semaphores`` when they were just read, to print those.
    """
    if semaphores is None:
        semaphores = held_semaphores(using)
    if not semaphores:
        return []
    lines = [f"Semaphores in cache {using!r}:"]
    for held in semaphores:
        limit = "?" if held.limit is None else str(held.limit)
        waiting = f", {held.waiters} waiting" if held.waiters else ""
        lines.append(f"  {held.name}  {len(held.holders)}/{limit} permits held{waiting}")
        lines.extend(f"    {h.owner}  {duration(h.time_left)} left" for h in held.holders)
    return lines


# -- resetting ---------------------------------------------------------------------


def _reset(name: str, using: str | Sequence[str], kind: _Kind, token: str | None = None) -> int:
    """Force-release ``name`` of ``kind`` on the Redis of ``using``; return the most one master had.

    With ``token`` (a listed acquisition's), only while that acquisition holds it.
    """
    validate_name(name)
    ensure_resettable(using, kind.noun)
    masters = _Masters(using, name)

    def keys_of(alias: str) -> LockKeys:
        return kind.keys(namespace(alias), name)

    done = _reset_each(masters, keys_of, name, token)
    masters.check_reset(kind.noun, name)
    return max(done.values(), default=0)


def _reset_each(
    masters: _Masters,
    keys_of: Callable[[str], LockKeys],
    name: str | None = None,
    token: str | None = None,
) -> dict[str, int]:
    """Force-release one lock on each master that answers; return what each one had.

    ``keys_of(alias)`` are the lock's keys on a master; ``token`` as for :func:`_reset`.
    On a quorum, the largest fence the lock's holders have on any master is read
    first: the reset raises every master's fence counter to it as it frees the
    lock, so the next majority's fence is larger (see quorum.py). One Redis's
    counter gave the fences itself.
    """

    def read_fence(alias: str) -> int:
        return int(run_steps(read_state_steps(alias, keys_of(alias)))[6])

    floor = max(masters.each(read_fence, name).values(), default=0) if masters.members else None

    def run(alias: str) -> int:
        keys = keys_of(alias)
        if token is None:
            return run_steps(reset_steps(alias, keys, floor))
        # The holder's own release script, so the compare on the token and the
        # hand-off to the first waiter follow its contract (see scripts.RELEASE).
        # Each holder of a shared lock is released as itself, every one of them.
        return any([run_steps(release_steps(alias, keys, one, floor)) for one in token.split()])

    return masters.each(run, name)


def reset(name: str, using: str | Sequence[str] = "default") -> bool:
    """Force-release lock ``name`` whoever holds it; return True if it was held.

    The first waiter, if any, is handed the lock and woken, as on a release.
    The holder learns of the loss when it next renews or leaves its block.

    For a quorum (an alias with a ``QUORUM``, or a list of aliases) the reset
    runs on every master, each in its own namespace, and returns True if any
    master had the lock: something was removed, even if it was only a
    minority's stale copy. Masters that cannot be reached are reported: when
    they are enough to make a majority (so the lock may still be held there)
    LockBackendUnavailable names them, after the reachable masters were reset;
    fewer than that cannot hold a majority, so the reset counts as done.

    A plain alias that is a member of a configured quorum raises ValueError
    instead of clearing one master only (see
    :func:`~django_redis_mutex.introspection.ensure_resettable`).
    """
    return _reset(name, using, _LOCKS) > 0


def reset_semaphore(name: str, using: str | Sequence[str] = "default") -> int:
    """Free every permit of semaphore ``name``; return how many were held.

    Waiters in line are handed the freed permits (up to the stored limit) and
    woken; a holder whose permit was freed learns it when it leaves its block
    (LockLost) or at its next renewal.

    A quorum is reset as by :func:`~django_redis_mutex.reset`; the count is
    the most permits one master held.

    .. versionchanged:: 0.3.0
       ``using`` may be a quorum.
    """
    return _reset(name, using, _SEMAPHORES)


def reset_all(using: str | Sequence[str] = "default") -> int:
    """Force-release every lock of this app in cache ``using``; return how many were held.

    For a quorum, every lock name found on any master is reset on every
    master as by :func:`reset`, and the count is of distinct names some
    master held.
    """
    ensure_resettable(using)
    masters = _Masters(using)
    tags: set[str] = set()

    def scan(alias: str) -> None:
        skip = len(namespace(alias)) + 1
        for batch in _keys_of_kind(get_client(alias), alias, _LOCKS):
            tags.update(key[skip:] for key in batch)

    masters.each(scan)
    count = 0
    for tag in sorted(tags):
        # The same lock on every master: that master's namespace, the same tag.
        count += any(_reset_each(masters, partial(_tag_keys, tag)).values())
    masters.check_reset("lock")
    return count


def _tag_keys(tag: str, alias: str) -> LockKeys:
    """The keys on ``alias`` of the lock whose key ends in ``tag`` (its ``{name}``)."""
    return LockKeys.for_lock_key(f"{namespace(alias)}:{tag}")


def reset_listed(listed: ListedLock, using: str | Sequence[str] = "default") -> bool:
    """Force-release ``listed``'s lock if the listed acquisition still holds it; return True if so.

    Compare-and-reset: the release script removes the lock only while it holds
    ``listed.token``, so a lock that was released, expired or changed hands
    since :func:`listed_locks` read it is left to its new holder (False). As
    with :func:`~django_redis_mutex.reset`, the first waiter is handed the
    lock and woken.

    For a quorum the release runs on every master as by
    :func:`~django_redis_mutex.reset`, and returns True if any of them still
    held that token.

    .. versionadded:: 0.1
    """
    return _reset(listed.held.name, using, _LOCKS, listed.token) > 0
