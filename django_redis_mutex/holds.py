"""Holds: the local record of one acquisition, and the scopes that may nest into it.

A :class:`Hold` is created by one successful acquire and describes that
acquisition only: its token, its fence, where it lives (one Redis, or the
masters of a quorum) and, per place, until when Redis is known to keep it. That
bound is counted from the moment the command that granted or renewed it was
*sent*, never from when its reply was read, so the holder's idea of its lease
never outlasts the key in Redis.

Reentrancy never outlives the block or call that created it. A hold is nested
into either through the handle that acquired it, or, by another handle, only
inside the dynamic extent of a ``with`` block (or decorated call) of the same
owner: the block opens a :class:`Scope` in a context variable on enter and
closes it on exit. A lock taken with plain ``acquire()`` opens no scope, so a
thread that handed such a lock away can never nest into it later. An owner is
an asyncio task when code runs inside one, else a thread, and always within one
process: a child task or a forked child is a new owner.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import secrets
import socket
import threading
import time
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, NamedTuple

from . import scripts, stats
from .exceptions import LockContended
from .keys import LockKeys
from .owners import Owner, parse_owner
from .transactions import TransactionWait

__all__ = [
    "Attempt",
    "Contention",
    "Hold",
    "Scope",
    "await_transaction",
    "awaiting_hold",
    "close_scope",
    "current_owner",
    "decode",
    "open_scope",
    "owner_metadata",
    "scoped_hold",
    "transaction_ended",
]


def _running_task() -> asyncio.Task[Any] | None:
    # _get_running_loop() answers None outside a loop instead of raising, which
    # keeps this check cheap on the synchronous hot path.
    if asyncio._get_running_loop() is None:
        return None
    return asyncio.current_task()


# This process's id, read once (getpid is a system call on every lock cycle
# otherwise) and again in a forked child.
_pid = os.getpid()
# Starts the agent id of every thread and task of this process: random, so
# that agents of processes on different hosts (or a pid reused) never meet,
# and new in a forked child, whose threads reuse the parent's idents.
_agent_prefix = secrets.token_hex(6)


def _after_fork_in_child() -> None:
    global _pid, _agent_prefix
    _pid = os.getpid()
    _agent_prefix = secrets.token_hex(6)


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_owner() -> object:
    """Return the identity of the code running now: its asyncio task, or its thread."""
    task = _running_task()
    if task is not None:
        return task
    return (_pid, threading.get_ident())


@cache
def _hostname() -> str:
    return socket.gethostname()


@lru_cache(maxsize=256)
def _owner_start(pid: int, where: str, label: str | None) -> str:
    """Return the owner record up to the agent id, which the caller appends with ``"}``."""
    record = json.dumps(
        {"host": _hostname(), "pid": pid, "thread": where, "label": label, "agent": ""},
        separators=(",", ":"),
    )
    return record[:-2] + _agent_prefix + "."


@lru_cache(maxsize=1024)
def _owner_json(pid: int, where: str, label: str | None, serial: int) -> str:
    """Return the whole owner record of the thread numbered ``serial``: threads live long."""
    return _owner_start(pid, where, label) + f"{serial:x}" + '"}'


# Agents are numbered in the order this process first meets them, never by
# thread ident or id(task): both are reused once a thread or task is gone, and
# a lock still held by a finished one (kept for a transaction, leaked) would
# then be taken for a wait of its successor's.
_serials = itertools.count(1)
_thread_agent = threading.local()
_task_agents: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()


def owner_metadata(label: str | None) -> str:
    """Return the JSON owner record stored with a lock: host, pid, thread or task, label, agent.

    ``agent`` names the thread or asyncio task uniquely across hosts (a random
    prefix per process, then the number this process gave the thread or task
    when it first took a lock): deadlock detection follows it from a lock's
    holder to what that holder waits for. A task's record is not cached whole.
    """
    task = _running_task()
    if task is not None:
        serial = _task_agents.get(task)
        if serial is None:
            serial = _task_agents[task] = next(_serials)
        return _owner_start(_pid, task.get_name(), label) + f"t{serial:x}" + '"}'
    serial = getattr(_thread_agent, "serial", None)
    if serial is None:
        serial = _thread_agent.serial = next(_serials)
    return _owner_json(_pid, threading.current_thread().name, label, serial)


class Contention(NamedTuple):
    """What refused an acquisition last: the holder, its lease left, and how long we waited."""

    pttl: int = 0  # ms left on the holder's lease (0 or less: not known)
    # The holder's raw owner record (parsed only when an error needs it: a
    # waiter is refused on every check-in), an Owner, or None.
    holder: Any = None
    waited: float = 0.0  # seconds
    held: int = -1  # ms the holder had held the lock (negative: not known)

    def error(
        self, name: str, alias: str = "", lock_class: tuple[str, str] | None = None
    ) -> LockContended:
        """Return the LockContended telling the caller of lock ``name`` who is in the way.

        Its ``retry_after`` is estimated from the recent hold times of
        ``lock_class`` on ``alias`` when they are counted (see
        :func:`~django_redis_mutex.stats.retry_after`), else the lease left.
        """
        retry_after = stats.retry_after(alias, lock_class, self.pttl, self.held)
        holder = self.holder
        if not isinstance(holder, Owner):
            holder = parse_owner(holder) if holder else None
        return LockContended(name, retry_after=retry_after, owner=holder, waited=self.waited)


_NOT_REFUSED = Contention()


@dataclass(eq=False, slots=True)
class Attempt:
    """One acquisition in progress: what its steps send, and what refused it last.

    A handle may be shared by threads and tasks acquiring at once, so nothing
    an acquisition sends or reports is kept on the handle: the handle starts
    one Attempt per acquisition and passes it to its steps.
    """

    token: str
    blocking: bool
    started: float  # monotonic
    deadline: float | None
    # The owner record sent with every ACQUIRE of this attempt, taken in the
    # caller's thread or task (an async acquisition runs its steps in a child
    # task, which would name itself).
    owner_json: str
    contention: Contention = _NOT_REFUSED
    # True once an ACQUIRE that joins the line was sent for this token.
    joined: bool = False

    def refused(self, pttl: int, holder: Any, held: int = -1) -> None:
        """Record that ``holder`` had the lock for ``held`` ms, ``pttl`` ms of its lease left."""
        self.contention = Contention(pttl, holder, time.monotonic() - self.started, held)

    @property
    def was_refused(self) -> bool:
        """True once the lock was found held by someone else: the acquisition had to wait."""
        return self.contention is not _NOT_REFUSED


@dataclass(slots=True)
class Lease:
    """What one Redis (a quorum member, or the only one) confirmed about our key."""

    sent: float  # monotonic time the confirming command was sent
    ttl: float  # the lease it set, in seconds
    # Set when extend() changed the lease while a renewal to the old one was
    # in flight: renew to the new length at once.
    renew_now: bool = False

    @property
    def ends(self) -> float:
        """The monotonic time by which Redis lets the key expire, at the latest."""
        return self.sent + self.ttl


@dataclass(eq=False, slots=True)
class Hold:
    """One acquisition of a lock, shared by the levels and handles nested inside it."""

    alias: str
    name: str
    keys: LockKeys
    token: str
    fence: int
    ttl: float  # the lease renewals ask for
    owner: object
    # Where the lock lives: (alias, lock key) per Redis, and how many must agree.
    targets: tuple[tuple[str, str], ...] = ()
    quorum: int = 1
    # Subtracted from the confirmed leases: Redlock's allowance for clock drift.
    drift: float = 0.0
    acquired_at: float = field(default_factory=time.monotonic)
    depth: int = 1
    active: bool = True
    # A release was sent but its answer never came: never nest into it again.
    releasing: bool = False
    lost: bool = False
    lost_reason: str = ""
    leases: dict[str, Lease] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    # After a failed renewal: when to ask that place again.
    retry_at: dict[str, float] = field(default_factory=dict)
    max_hold: float | None = None
    raise_on_lost: bool = True
    # When the lease runs out by this process's clock unless renewed: the
    # quorum-th latest confirmed end, minus drift.
    expires_at: float = -math.inf
    # The waiter that was next in line when this hold was granted, if any: the
    # release declares its wake-up list, so it can wake it in the same script.
    successor: str | None = None
    # Set while the hold's block has ended inside a database transaction: the
    # lock is given back when that transaction ends (see transactions.py).
    transaction_wait: TransactionWait | None = None
    # "lock", or "semaphore" for a semaphore's permit: in log lines and signals.
    kind: str = "lock"
    # What the contention figures count this hold under (its kind and lock
    # class, see stats.py), or None when its alias does not count them.
    counted_as: tuple[str, str] | None = None
    # Guards leases, refused, retry_at and expires_at, which the owner's thread
    # (extend) and the watchdog's (renewals) change at once: a bound computed
    # from leases another thread changed meanwhile is wrong, or raises.
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = ((self.alias, self.keys.lock),)

    @property
    def shared(self) -> bool:
        """True for a shared (read) hold: its token starts with ``s`` (see scripts.py)."""
        return self.token.startswith("s")

    @property
    def strict(self) -> bool:
        """True when a lapsed local bound means the hold is lost (a quorum lock).

        For a single Redis a late renewal that still finds our token proves we
        kept the key all along; across a quorum, masters' clocks drift and a
        majority may have changed hands in between, so only the bound counts.
        """
        return self.quorum > 1

    def confirm(self, alias: str, sent: float, ttl: float, *, renew_now: bool = False) -> None:
        """Record that ``alias`` set our lease to ``ttl`` by a command sent at ``sent``.

        ``renew_now`` says the lease is already out of date (extend() changed
        it while this renewal was in flight): it is set under the guard, with
        the lease it marks, so a lease another thread stores meanwhile is
        neither marked by mistake nor looked up after it was dropped.
        """
        with self._guard:
            previous = self.leases.get(alias)
            if previous is None or sent >= previous.sent:
                # The command sent last set the expiry Redis keeps.
                self.leases[alias] = Lease(sent, ttl, renew_now)
            self.refused.discard(alias)
            self.retry_at.pop(alias, None)
            self._recompute()

    def refuse(self, alias: str) -> None:
        """Record that ``alias`` answered that the key is not ours."""
        with self._guard:
            self.leases.pop(alias, None)
            self.refused.add(alias)
            self._recompute()

    def failed(self, alias: str, retry_at: float) -> None:
        """Record that ``alias`` could not be asked; its last confirmation still bounds us."""
        with self._guard:
            self.retry_at[alias] = retry_at

    def _recompute(self) -> None:
        """Set ``expires_at`` from the leases; called with the guard held."""
        if self.quorum == 1 and len(self.leases) == 1:
            (lease,) = self.leases.values()  # one Redis: the common case
            self.expires_at = lease.ends - self.drift
            return
        ends = sorted((lease.ends for lease in self.leases.values()), reverse=True)
        if len(ends) < self.quorum:
            self.expires_at = -math.inf
        else:
            self.expires_at = ends[self.quorum - 1] - self.drift

    @property
    def doomed(self) -> bool:
        """True when too many places said the key is not ours for a majority to remain."""
        return len(self.refused) > len(self.targets) - self.quorum

    def valid(self, now: float | None = None) -> bool:
        """Return True while the local bound of the lease has not run out."""
        return (time.monotonic() if now is None else now) < self.expires_at

    def next_renewal(self, alias: str) -> float:
        """Return when the watchdog should renew the key on ``alias``: a third into its lease."""
        with self._guard:
            if alias in self.refused:
                return math.inf  # not ours there: nothing to renew
            lease = self.leases.get(alias)
            due = 0.0
            if lease is not None and not lease.renew_now:
                # A lease shorter than the one renewals ask for (a hand-over) is
                # lengthened a third into itself, like any other.
                due = lease.sent + min(lease.ttl, self.ttl) / 3
            return max(due, self.retry_at.get(alias, 0.0))

    def mark_lost(self, reason: str) -> bool:
        """Record that the lock is no longer ours; return True the first time."""
        if self.lost:
            return False
        self.lost = True
        self.lost_reason = reason
        return True

    # -- what the watchdog asks of a hold to renew it (see watchdog.py) --

    def renewal(self, key: str, ttl: float) -> tuple[scripts.LuaScript, tuple[str, ...], list[Any]]:
        """Return the script, keys and arguments that renew the lock ``key`` to ``ttl``.

        A quorum hold's renewal also carries its fence, the floor of each
        master's fence counter (see quorum.py).
        """
        if self.quorum > 1:
            keys = LockKeys.for_lock_key(key)
            return scripts.EXTEND, (key, keys.fence), [self.token, int(ttl * 1000), self.fence]
        return scripts.EXTEND, (key,), [self.token, int(ttl * 1000)]

    def describe(self) -> str:
        """Name the hold in log lines."""
        return f"{self.kind.title()} {self.name!r} (fence {self.fence})"

    def lost_signal(self, held: float) -> dict[str, Any]:
        """Return the ``lock_lost`` keyword arguments for this hold."""
        sent = {"name": self.name, "fence": self.fence, "held": held, "shared": self.shared}
        if self.kind != "lock":
            sent["kind"] = self.kind  # a lock's loss has never carried a kind
        return sent


@dataclass(eq=False, slots=True)
class Scope:
    """The dynamic extent of one ``with`` block (or decorated call) over a hold."""

    hold: Hold
    owner: object
    open: bool = True


_scopes: ContextVar[tuple[Scope, ...]] = ContextVar("django_redis_mutex_scopes", default=())


def open_scope(hold: Hold) -> Scope:
    """Let nested acquisitions of the current owner join ``hold`` until the scope closes."""
    scope = Scope(hold, current_owner())
    # Carry only open scopes: a block left in another context (a generator
    # closed by another task) could not drop its entry from this one.
    _scopes.set((*(s for s in _scopes.get() if s.open), scope))
    return scope


def close_scope(scope: Scope) -> None:
    """End ``scope``: from now on nothing nests into its hold through it."""
    scope.open = False
    current = _scopes.get()
    if scope in current:
        _scopes.set(tuple(s for s in current if s.open))


def scoped_hold(targets: tuple[tuple[str, str], ...]) -> Hold | None:
    """Return the live hold on ``targets`` of an open scope of the current owner, if any."""
    scopes = _scopes.get()
    if not scopes:
        return None
    owner = current_owner()
    for scope in reversed(scopes):
        hold = scope.hold
        if scope.open and hold.active and hold.targets == targets and scope.owner == owner:
            return hold
    return None


# Per thread: the holds whose blocks ended inside a transaction still open in
# this thread, by where they live. A later acquisition of the same lock in the
# same transaction joins the hold instead of waiting for itself.
_awaiting = threading.local()


def await_transaction(hold: Hold) -> None:
    """Let later acquisitions of this thread join ``hold`` until its transaction ends."""
    holds = getattr(_awaiting, "holds", None)
    if holds is None:
        holds = _awaiting.holds = {}
    holds[hold.targets] = hold


def transaction_ended(hold: Hold) -> None:
    """Stop offering ``hold`` to later acquisitions (its transaction ended)."""
    holds = getattr(_awaiting, "holds", None)
    if holds is not None and holds.get(hold.targets) is hold:
        del holds[hold.targets]


def awaiting_hold(targets: tuple[tuple[str, str], ...]) -> Hold | None:
    """Return this thread's hold on ``targets`` that waits for its transaction, if any."""
    holds = getattr(_awaiting, "holds", None)
    if not holds:
        return None
    hold: Hold | None = holds.get(targets)
    if hold is None or not hold.active or hold.lost or hold.transaction_wait is None:
        return None
    return hold


def decode(value: Any) -> str:
    """Return a Redis reply as text, whatever the client's decode_responses."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
