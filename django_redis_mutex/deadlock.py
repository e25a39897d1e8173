"""Deadlock detection: find a cycle of waits through this wait, and end one wait of it.

Each thread or asyncio task is an *agent*, named in the owner record of every
lock it holds (see :func:`~django_redis_mutex.holds.owner_metadata`). A wait
that outlasts ``DEADLOCK_TIMEOUT`` writes a short-lived waits-for record under
its agent (``<namespace>:waits:{<agent>}``, see :mod:`~django_redis_mutex.keys`):
the lock it waits for and its token in that lock's queue, refreshed at each
check and deleted when the wait ends. Then, at each check, it walks from the
lock it waits for to its holders, from each holder's agent to that agent's
record, to the lock named there, and so on, in Redis only, so the walk sees
waits of every process on every host using that Redis.

A waiter is in a cycle when the walk comes back to it along edges that are
*certain*:

* a lock held exclusively: its waiter waits for that holder;
* a lock held shared: an exclusive waiter waits for every holder, so any
  holder in the cycle keeps it waiting; so does a shared waiter, kept out by
  an older exclusive waiter in line before it that waits for every holder;
* a semaphore: its waiter needs one permit back, so it is certainly stuck only
  when every permit is held (as many holders as the limit) and every holder is
  itself stuck in the cycle.

A record counts only while its agent's token is still in that lock's queue
(a waiter just handed the lock, or gone, is no longer waiting), and a holder
without an agent (written by an older version) is never followed.

A quorum lock's waiters never queue: they try every master again and again.
Their records live on one master of the quorum (the first by alias), with the
time their wait began (``<token>@<µs>|<lock key>``), and count while they
exist; the walk reads the locks' holders on that master, which knows every
quorum lock it granted. That master's failure only stops the detection (each
read is bounded as a quorum master's request is, and a failed one is skipped),
never the acquisition; a cycle through a lock that master did not grant goes
unseen until it does.

Every participant of a cycle may find it; exactly one must end its wait. The
victim is the youngest wait: the latest place in line by the Redis server
clock (the lock queue's score), ties broken by the token. A waiter looks for
a cycle through itself in which every other wait is older than its own, and
ends its own wait only when it finds one; the youngest of any cycle finds it,
and nobody else of a single cycle does. So the choice needs no message
between the participants, and it is the same whoever looks first.

The walk is bounded (:data:`MAX_DEPTH` levels, :data:`MAX_AGENTS` agents, two
pipelined round trips per level) and only runs on waits that outlasted the
timeout, off the hot path: an acquisition that gets its lock at once never
comes here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from .client import namespace
from .conf import MutexSettings
from .driver import Commands, Pop, Sleep, Steps
from .exceptions import LockDeadlock
from .holds import Attempt, decode
from .keys import LockKeys, SharedRecord, waits_key
from .owners import Owner, agent_of, parse_owner
from .scripts import WAIT_LEASE

__all__ = [
    "CHECK_INTERVAL",
    "MAX_AGENTS",
    "MAX_DEPTH",
    "RECORD_TTL",
    "Place",
    "WatchedHandle",
    "watched",
]

T = TypeVar("T")

#: How many locks deep a walk follows waits before it gives up.
MAX_DEPTH = 16
#: How many waiting agents one walk reads at most.
MAX_AGENTS = 64
#: How long a waits-for record outlives the check that wrote it (seconds):
#: longer than the time between two checks of a live waiter (a check-in is at
#: most half a wait lease apart), so only a dead waiter's record vanishes.
RECORD_TTL = WAIT_LEASE + 1.0
#: The least time between two checks of one wait (seconds).
CHECK_INTERVAL = 0.5


class WatchedHandle(Protocol):
    """What deadlock detection asks of the lock handle whose acquisition it watches."""

    name: str
    using: str
    settings: MutexSettings
    keys: LockKeys

    @property
    def _stats_class(self) -> tuple[str, str] | None: ...


class Place(NamedTuple):
    """Where a wait's record and the locks its walk reads live: a Redis and the lock's keys."""

    alias: str
    keys: LockKeys
    # True: the wait has a place in the lock's queue, whose score orders it and
    # which tells whether it still waits. False (a quorum's wait): its record
    # says when it began and counts while it exists.
    queued: bool = True
    # Each read bounded so (a quorum master's deadline); None: the alias's own
    # socket timeout.
    timeout: float | None = None


class _Lock:
    """What one lock hash says of its holders: their agents and owners, and a semaphore's limit."""

    __slots__ = ("exclusive", "holders", "limit", "name", "owners")

    def __init__(self, name: str, fields: dict[str, str]) -> None:
        self.name = name
        self.limit = int(fields["limit"]) if fields.get("limit", "").isdigit() else 0
        self.exclusive = "token" in fields
        owners: list[str] = []
        if self.exclusive:
            owners.append(fields.get("owner", ""))
        else:
            for key, value in fields.items():
                if key.startswith("r:"):
                    record = SharedRecord.parse(value)
                    owners.append(record.owner if record is not None else "")
        self.holders = [agent_of(owner) for owner in owners]
        self.owners = owners

    def waits_on(self) -> tuple[str, list[str | None]]:
        """Return ("any" or "all", agents) that a waiter of this lock certainly waits for.

        "any": one of the agents stuck in the cycle keeps the waiter waiting;
        "all": only every agent stuck does (a semaphore's permits). No agents:
        no certain edge.

        A lock held shared keeps an exclusive waiter out until every holder
        left. A shared waiter is kept out only while an exclusive waiter is
        in line before it, which is older and waits for every holder: it stays
        as long as one holder is stuck, so the shared waiter waits for every
        holder too.
        """
        if self.limit:
            return "all", self.holders if len(self.holders) >= self.limit else []
        return "any", self.holders


@dataclass
class _Wait:
    """One agent's wait as Redis shows it: the lock, its place in line (server µs) and token."""

    lock_key: str
    token: str
    since: float

    @property
    def age(self) -> tuple[float, str]:
        """Order of waits: the later place in line is the younger; ties by token."""
        return (self.since, self.token)


@dataclass
class _Graph:
    """What one walk read: each agent's wait, and each lock's holders."""

    me: str
    waits: dict[str, _Wait] = field(default_factory=dict)
    locks: dict[str, _Lock] = field(default_factory=dict)

    def cycle(self) -> list[tuple[str, str]] | None:
        """Return a cycle of certain waits through ``me``, as (lock name, holder's owner JSON).

        Only ``me`` and waits older than ``me``'s take part, so only the
        youngest wait of a cycle finds it. First the waits that are certainly
        stuck among them are kept (as long as one is not, it is dropped, and
        the waits that counted on it are looked at again): a semaphore's
        waiter is stuck only while every permit's holder is. Then a cycle is
        looked for among what is left, through ``me`` and at least one other
        agent: an owner waiting for a lock it holds itself (``reentrant=False``)
        waits for its own lease to end, which is no deadlock to break.
        """
        mine = self.waits[self.me]
        blocking: dict[str, tuple[str, list[tuple[str, _Lock, int]]]] = {}
        for agent, wait in self.waits.items():
            if agent != self.me and wait.age >= mine.age:
                continue
            lock = self.locks.get(wait.lock_key)
            if lock is None:
                continue
            how, holders = lock.waits_on()
            found = [
                (holder, lock, index)
                for index, holder in enumerate(holders)
                if holder is not None and (how == "all" or holder != agent)
            ]
            if found and (how == "any" or len(found) == len(holders)):
                blocking[agent] = (how, found)
        stuck = set(blocking)
        dropped = True
        while dropped:
            dropped = False
            for agent in list(stuck):
                how, found = blocking[agent]
                held = [holder in stuck for holder, _lock, _index in found]
                if not (any(held) if how == "any" else all(held)):
                    stuck.discard(agent)
                    dropped = True
        if self.me not in stuck:
            return None
        return self._path_back(blocking, stuck)

    def _path_back(
        self, blocking: dict[str, tuple[str, list[tuple[str, _Lock, int]]]], stuck: set[str]
    ) -> list[tuple[str, str]] | None:
        """Return the shortest path of waits among ``stuck`` from ``me`` back to ``me``."""
        came: dict[str, tuple[str, str, str]] = {}
        frontier = [self.me]
        while frontier:
            following = []
            for agent in frontier:
                for holder, lock, index in blocking[agent][1]:
                    if holder == agent or holder not in stuck:
                        continue
                    if holder == self.me:
                        path = [(lock.name, lock.owners[index])]
                        while agent != self.me:
                            before, name, owner = came[agent]
                            path.append((name, owner))
                            agent = before
                        return path[::-1]
                    if holder not in came:
                        came[holder] = (agent, lock.name, lock.owners[index])
                        following.append(holder)
            frontier = following
        return None


def watched(
    steps: Steps[T], lock: WatchedHandle, attempt: Attempt, place: Place | None = None
) -> Steps[T]:
    """Return the steps of a wait, looking for a deadlock when they block past the timeout.

    ``place``: where the wait's record and the locks live (the lock's own
    Redis and keys, queued, by default). Steps that cannot deadlock are
    returned as they are: a timeout no longer than DEADLOCK_TIMEOUT, or
    detection turned off.
    """
    timeout = lock.settings.deadlock_timeout
    if timeout is None or (
        attempt.deadline is not None and attempt.deadline - attempt.started <= timeout
    ):
        return steps
    place = place or Place(lock.using, lock.keys)
    return _watching(steps, lock, attempt, place, attempt.started + timeout)


def _watching(
    steps: Steps[T], lock: WatchedHandle, attempt: Attempt, place: Place, check_at: float
) -> Steps[T]:
    """Pass ``steps`` through; before each blocking step after ``check_at``, look for a cycle.

    The wait's record is deleted when the steps end (granted, or timed out);
    a wait ended by an error or a cancel leaves it to expire, and it no
    longer counts as soon as the token has left the queue.
    """
    watch: _Watch | None = None
    try:
        op = next(steps)
        while True:
            if isinstance(op, (Pop, Sleep)):
                now = time.monotonic()
                if now >= check_at:
                    if watch is None:
                        watch = _Watch(place, attempt)
                    found = yield from watch.check()
                    if found is not None:
                        yield from watch.forget()
                        raise _deadlock(lock, attempt, found)
                    check_at = time.monotonic() + CHECK_INTERVAL
                elif watch is None and isinstance(op, Pop) and now + op.wait > check_at:
                    # The first check comes at DEADLOCK_TIMEOUT, not at the end
                    # of a longer blocking wait; a pop that ends early is an
                    # early check-in, which the steps take as any other.
                    op = op._replace(wait=max(check_at - now, 0.001))
            op = steps.send((yield op))
    except StopIteration as done:
        if watch is not None:
            yield from watch.forget()
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()


def _deadlock(lock: WatchedHandle, attempt: Attempt, found: list[tuple[str, str]]) -> LockDeadlock:
    """Return the error ending this wait of the cycle ``found``."""
    contention = attempt.contention._replace(waited=time.monotonic() - attempt.started)
    error = contention.error(lock.name, lock.using, lock._stats_class)
    cycle = [f"{name!r} held by {parse_owner(owner) or Owner()}" for name, owner in found]
    cycle[-1] += " (this owner)"
    return LockDeadlock(
        lock.name,
        cycle=tuple(cycle),
        retry_after=error.retry_after,
        owner=error.owner,
        waited=error.waited,
    )


class _Watch:
    """One acquisition's deadlock checks: its record, and the walk from the lock it waits for."""

    def __init__(self, place: Place, attempt: Attempt) -> None:
        self.place = place
        self.namespace = namespace(place.alias)
        self.agent = agent_of(attempt.owner_json) or ""
        self.keys: LockKeys = place.keys
        self.token = attempt.token
        self.record = waits_key(self.namespace, self.agent)
        self.written = False
        # When a wait that has no place in line began, by this host's clock (µs).
        self.since = int((time.time() - (time.monotonic() - attempt.started)) * 1_000_000)

    def _ask(self, *commands: tuple[Any, ...]) -> Commands:
        """Return ``commands`` as this place sends them: bounded as it says, and skippable.

        A read that fails skips this check (logged), never the wait: the
        detector must not fail an acquisition the lock itself would grant, and
        a Redis that stays down fails the wait's own next check-in anyway.
        """
        place = self.place
        return Commands(place.alias, commands, timeout=place.timeout)

    def check(self) -> Steps[list[tuple[str, str]] | None]:
        """Write this wait's record, then walk; return the cycle if this wait is its victim."""
        if not self.agent:
            return None
        self.written = True
        ttl = int(RECORD_TTL * 1000)
        lock_key = self.keys.lock
        graph = _Graph(self.agent)
        if self.place.queued:
            replies = yield self._ask(
                ("SET", self.record, f"{self.token}|{lock_key}", "PX", ttl),
                ("ZSCORE", self.keys.queue, self.token),
                ("HGETALL", lock_key),
            )
            if replies is None or replies[1] is None:
                return None  # not in line: handed the lock, or the place lapsed
            since, fields = float(replies[1]), replies[2]
        else:
            replies = yield self._ask(
                ("SET", self.record, f"{self.token}@{self.since}|{lock_key}", "PX", ttl),
                ("HGETALL", lock_key),
            )
            if replies is None:
                return None
            since, fields = float(self.since), replies[1]
        graph.waits[self.agent] = _Wait(lock_key, self.token, since)
        graph.locks[lock_key] = self._lock(lock_key, fields)
        yield from self._walk(graph)
        return graph.cycle()

    def _walk(self, graph: _Graph) -> Steps[None]:
        """Read, level by level, the waits of the holders found so far and the locks they wait for.

        Only waits older than ours are followed: a younger one cannot be on a
        cycle this wait is the victim of.
        """
        mine = graph.waits[graph.me].age
        seen = {graph.me}
        frontier = self._holders(graph, graph.locks[self.keys.lock], seen)
        for _level in range(MAX_DEPTH):
            if not frontier or len(seen) > MAX_AGENTS:
                return
            records = yield self._ask(
                *(("GET", waits_key(self.namespace, agent)) for agent in frontier)
            )
            if records is None:
                return
            waiting: list[tuple[str, str, str, str]] = []
            for agent, record in zip(frontier, records, strict=True):
                token, _, lock_key = decode(record).partition("|")
                token, _, began = token.partition("@")  # a wait with no place in line
                if token and lock_key.startswith(self.namespace + ":"):
                    waiting.append((agent, token, began, lock_key))
            if not waiting:
                return
            commands: list[tuple[Any, ...]] = []
            for _agent, token, began, lock_key in waiting:
                if not began:
                    commands.append(("ZSCORE", LockKeys.for_lock_key(lock_key).queue, token))
                commands.append(("HGETALL", lock_key))
            replies = yield self._ask(*commands)
            if replies is None:
                return
            answers = iter(replies)
            frontier = []
            for agent, token, began, lock_key in waiting:
                since = began or next(answers)
                fields = next(answers)
                if since is None:
                    continue  # no longer in that line
                wait = _Wait(lock_key, token, float(since))
                graph.waits[agent] = wait
                if wait.age >= mine:
                    continue
                held = graph.locks.get(lock_key)
                if held is None:
                    held = graph.locks[lock_key] = self._lock(lock_key, fields)
                frontier += self._holders(graph, held, seen)

    @staticmethod
    def _holders(graph: _Graph, lock: _Lock, seen: set[str]) -> list[str]:
        """Return the agents holding ``lock`` not read yet, marking them read."""
        found = []
        for agent in lock.holders:
            if agent is not None and agent not in seen:
                seen.add(agent)
                found.append(agent)
        return found

    def _lock(self, lock_key: str, fields: Any) -> _Lock:
        if isinstance(fields, list):  # a client without HGETALL's reply callback
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        decoded = {decode(key): decode(value) for key, value in (fields or {}).items()}
        return _Lock(LockKeys.for_lock_key(lock_key).name_of(self.namespace), decoded)

    def forget(self) -> Steps[None]:
        """Delete this wait's record (best effort: it expires anyway)."""
        if self.written:
            self.written = False
            yield self._ask(("DEL", self.record))
