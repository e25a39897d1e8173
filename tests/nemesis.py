"""Jepsen-style randomized faults against real worker processes, and a checker of their history.

Why this exists: the fault tests (test_faults.py, test_redlock_faults.py) each
inject one fault at a moment the test chose. Lease locks break in the
interleavings nobody chose: a holder paused just as a waiter is handed the
lock, a Redis restart during a release, an operator reset under a nested
block. Here a seed decides a schedule of faults for a bounded time, several
worker processes (each running threads *and* asyncio tasks) contend for a
handful of locks through every public way of taking one (some bodies of a
``with``, ``async with``, ``acquire()``, decorated call or nested block take
their lock shared, and nested levels join a shared or an exclusive hold
shared, on every lock, a quorum's too), some bodies take a permit of a
semaphore (limit SEMAPHORE_LIMIT, on the quorum as well) instead, some tasks
are cancelled at a random point of theirs, every critical section ("body")
is journalled with whether it was shared, and :func:`check` then asks of
the whole history what the lock promises.

A run (:class:`Nemesis`) starts its own redis-server(s) on free ports: one for
the ``single`` topology; for ``quorum`` three independent masters (``m1``..
``m3``, reached through the alias ``q`` whose MUTEX names them as its QUORUM, or
through the list of the three) plus one more Redis (``side``) carrying
unrelated single-alias locks. On the quorum the workers take every kind: its
locks exclusive and shared (a hold granted by a majority), and permits of its
semaphore, each granted by more than ``masters * limit / (limit + 1)``
masters, so with a limit of two by all three: a fault that stops any master
makes permits unavailable (``LockBackendUnavailable``, an acquisition refused
like any other) while it lasts. Workers reach every server through a loopback
proxy of their own (tests/proxy.py), so latency, stalls and cuts can hit one
worker or all. The plan (:func:`make_plan`, from ``random.Random`` seeded with
the seed and topology, so the same seed gives the same schedule) is applied on
time: SIGSTOP/SIGCONT and SIGKILL (then a restart in the same slot) of workers,
either a given slot or whichever process holds the hottest lock; event-loop
stalls inside a worker (a loop callback that calls ``time.sleep``); SIGSTOP/
SIGCONT and restart of a redis-server (it comes back empty); ``DEBUG SLEEP``
of a redis-server for longer than the workers' socket timeout (unlike a
SIGSTOP, Redis has read what was sent before and runs it when it wakes, so
an acquisition or a release whose caller timed out still happens, later);
proxy latency, stalls and cuts; operator resets of a lock
(``django_redis_mutex.reset``) or of the semaphore's permits
(``reset_semaphore``; a quorum's through its alias, on every master) from
this process. Some faults are scenarios, placed in every 30 s of a run with
their slot and their Redis to themselves:

* hand-over: a thread hands an acquired ``Mutex`` to another thread, which
  releases it later, and goes on to run an ``@mutex`` function of the same
  name: it must wait for that release, not join the handed-off hold (the
  workers do this by themselves, among their other bodies);
* hand-off stall: a waiter's event loop stalls right as the lock is handed
  to it, past the hand-off lease, while another thread takes the lock: the
  waiter must not run its body on the lapsed hand-off. Three variants: a 0.5 s
  lease and a 1.5 s stall (within the waiter's read timeout, so the hand-off
  reply is there when the loop runs again), a stall longer than
  HANDOFF_LEASE on an alias whose socket timeout is longer than the stall (a
  stall past the read timeout only makes the waiter's read fail), and a
  stall longer than HANDOFF_LEASE but shorter than the lock's lease, begun
  as the release hands the lock over (often just after), so it may fall
  between the waiter's wake-up and its entry;
* nested reset: the operator resets the hot lock while a worker is inside a
  nested ``with`` level of it: the outer block must raise ``LockLost``;
* side hold (quorum): a master is SIGSTOPped while one process holds both a
  quorum lock and the unrelated ``side`` lock: the side lock must not suffer.
  The masters' aliases have a long socket timeout (5 s), since a quorum lock
  bounds every request to a master by its QUORUM_TIMEOUT.

Clocks. Every timestamp, in workers and here, is ``time.monotonic_ns()``:
CLOCK_MONOTONIC is one clock for every process on the machine, so times of
different processes compare directly, and it never steps. A body is entered
at the timestamp taken right after the acquisition returned, and left at the
one taken right before the release is called; each is written (one
``os.write`` of a JSON line to the worker's own append-only file) before the
code goes on, so a process killed at any point leaves a journal that never
claims more than it did. A body's recorded span lies inside the time its
process believed it held the lock.

Told. A body was *told* it lost the lock when, before its outcome was
recorded, any of these happened: its block exit or ``release()`` raised
``LockLost`` or ``LockNotOwned``; ``lock.lost`` was True when it left; a
``lock_lost`` signal for its name and fence was received in its process.
A release that raised ``LockBackendUnavailable`` (or any other LockError)
leaves the body *unconfirmed*: the caller got an error, not a clean exit.
A transactional body whose lock was kept for its transaction records its
outcome after the COMMIT and the give-back that follows it, so a loss its
lock found only then counts as told, and a give-back that got no answer
leaves it unconfirmed.

Data. A third or so of the exclusive bodies, on every topology, are
*transactional*: inside ``transaction.atomic()`` on the run's PostgreSQL
database (started by the run next to its redis-servers, or given to it),
they read their lock's counter row, pause, write the value plus one and
record the increment, all in one transaction (tests/nemesis_data.py). Most
take their lock inside the transaction, so only the rule that keeps such a
lock until the COMMIT (django_redis_mutex/transactions.py) keeps the next
holder from reading the old value; threads do it with ``with``
(``tx-with``) and ``@mutex`` (``tx-decorated``), tasks through
``sync_to_async`` (``async-tx``), and the transaction goes on a little after
the lock's block. ``tx-inside`` opens the transaction inside the lock. Each
journals its *intent* (the value read) before the write and, after the
COMMIT returned, that it *committed* (the value written). The database is
the witness of what committed: the increments table holds a row for every
committed transaction, numbered in the row's commit order, and none for one
whose worker was killed before its COMMIT (it was rolled back). A worker
killed after its COMMIT but before its journal line is counted, not blamed.
Test-only: ``NEMESIS_RELEASE_AT_BLOCK_END=1`` makes these bodies give their
lock back at the end of its block, before the COMMIT
(``release_at_block_end=True``), which must show up as lost updates.

Cancellations. A task (``async-cancel``) runs a child task that takes a lock
or a permit (``async with``, or ``aacquire()``/``arelease()`` in a
``finally``) and cancels it while it waits in line, a loop step or two after
its call (an acquisition script in flight), inside its body, or as it leaves
(its release in flight); half the time a second cancel follows a few loop
steps later, as AnyIO cancel scopes deliver. A cancelled body's outcome is
"cancelled": its exit raised CancelledError, not a confirmation, so it
counts as unconfirmed. A cancel before the body journals an acquisition
refused as "cancelled". Some of these take the ``linger`` lock, or a
permit, with a lease of LINGER_TTL, so one left held for nobody is still
there when the orphan check looks.

Killed holders. A killed process cannot write; a body it had entered but not
left is taken to end when the kill was confirmed (the process reaped), or when
it was stopped, if it was SIGSTOPped at the kill and never resumed. A later
body may overlap it only if that is excused as below; its outcome is unknown.

What :func:`check` demands, per lock name:

* Two shared bodies (each with a fence of its own) may overlap: that is what
  a shared lock is for. Any other two bodies, an exclusive one and any body,
  overlap only if the *stale* one of them (the smaller fence: the
  one granted first, which is the one entered first unless a pause delayed
  its journal) was told, unconfirmed, or killed, and a fault in the run can
  explain how it lost its lease: between its acquire call and the newer
  body's entry, its process was paused (SIGSTOP, or a scheduling hiccup its
  heartbeat thread saw, here or in the nemesis process that runs the proxies),
  or its event loop stalled (async bodies), for a third of its lease or more (a
  holder renews a third into its lease, so it always has two thirds in hand:
  half of that is the bar); or a Redis it locks on was SIGSTOPped that long,
  restarted, or behind a proxy on its path stalled that long or slowed by a
  fifteenth of the lease per chunk; or an operator reset its lock. So with no
  fault that can cost a lease, no two bodies overlap at all. A single proxy
  cut, a smaller latency, or a pause shorter than the bar explains nothing.
* In the hand-off stall scenario the waiter must not enter on a hand-off
  that lapsed while its loop was stalled (a newer holder being inside), told
  or not: the lapse happened inside its acquire call, where the lock can
  still check its lease.
* A body of a ``with`` block (or decorated call) whose loss the lock knew
  (``lock.lost`` as it left, or a ``lock_lost`` signal before its exit
  returned) must see ``LockLost`` at exit; inside a transaction too, where
  the exit returns before the COMMIT.
* In the side-hold scenario the side lock must not be lost unless a fault of
  its own explains it.
* Fences are unique per name and strictly increase, in the order bodies
  entered, over the exclusive bodies that were neither told nor unconfirmed
  nor killed; such an exclusive body's fence is above every such shared
  body's that left before it entered, and below every one's that entered
  after it left (shared bodies among themselves journal in any order); this
  holds across a restart that wiped the counter, since a fence is never
  below the server clock in microseconds.
* No lost update. Each counter row ends equal to the number of committed
  increments of its lock, and every committed increment wrote one more
  than the commit before it (in commit order) left. One that wrote over
  commits it never read lost those updates: each such commit was made
  between its read and its COMMIT, so the two transactions overlapped on
  one lock, and each such pair must be excused as an overlap of two bodies
  is, by its stale one (the smaller fence) having been told, left
  unconfirmed or killed, and a fault that explains its lost lease before
  the newer one entered. A committed increment its journal does not match,
  or a journalled COMMIT the database does not have, is a violation too.
* At most ``limit`` permit bodies of a semaphore overlap. When one enters
  with ``limit`` others inside, enough of them to make room must be excused
  as a stale lock holder is (told, unconfirmed or killed, and a fault that
  explains a lost lease between its acquire call and that entry). A
  ``lock_lost`` signal of a permit names no grant, so it tells no body. On
  the quorum, as for its locks, a fault of any master (or of a proxy to one)
  can explain a lost permit.
* After the run no key on any server is without an expiry (``PTTL == -1``),
  checked every two seconds during the run and at the end.
* Nothing outlives its owner (the orphan rule). Once every worker has run
  its last body and waits, alive, to be let go (its watchdog and background
  give-backs still running), and again once every worker has exited, the
  nemesis polls the lock hashes and semaphore holder sets of the run's
  namespace until nothing is held. On a quorum a lock or permit is held
  where the quorum counts it: a lock's token on a majority of the masters,
  a permit's on as many as grant one (every master is read); a copy on
  fewer masters, which a quorum acquisition's undo or release leaves on a
  master that did not answer in time, is no grant, ends with its lease and
  is only counted. A lock or permit still held more than
  ORPHAN_GRACE (1 s) after the phase began is an orphan, named with its
  owner record, unless its owner was SIGKILLed and a wait lease plus the
  longest lease of its name, counted from the kill, explain it. During the
  run the same holds for each cancelled child task (its name, unique, is in
  the owner record of whatever it takes): the nemesis samples what is held
  every 0.3 s, and a grant still held in the name of a child that has ended
  is an orphan once CHILD_GRACE has passed since the child ended and since
  every fault that could keep a give-back from Redis (its server paused,
  asleep or restarting, its proxy stalled, cut or slowed, its process
  paused or its loop stalled) was over.

What it cannot tell: a caller paused inside its acquire call (a quorum
acquisition judged after its validity ran out, say) looks the same as one
paused just after the call returned, which no lock can prevent; both are
excused when the caller is told. Only the hand-off stall scenario knows its
pause began before the grant.

The runner: :func:`run_nemesis` (or ``scripts/nemesis.py``); the worker
entry point: ``python -m tests.nemesis worker CONFIG INCARNATION``.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import ctypes
import functools
import heapq
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .nemesis_data import DataState, Increment, read_state

if TYPE_CHECKING:
    from django_redis_mutex.introspection import HeldSemaphore, SemaphoreHolder

ROOT = Path(__file__).resolve().parent.parent
NS = 1_000_000_000

__all__ = [
    "TOPOLOGIES",
    "DataState",
    "Fault",
    "FaultRecord",
    "Increment",
    "Nemesis",
    "Report",
    "RunInfo",
    "Tuning",
    "Verdict",
    "check",
    "make_plan",
    "run_nemesis",
]

TOPOLOGIES = ("single", "quorum")
MASTERS = ("m1", "m2", "m3")
SERVERS: dict[str, tuple[str, ...]] = {"single": ("r0",), "quorum": (*MASTERS, "side")}
#: The lock spaces each server carries (a quorum lock lives on every master).
SPACES_ON: dict[str, tuple[str, ...]] = {
    "r0": ("single",),
    "m1": ("quorum",),
    "m2": ("quorum",),
    "m3": ("quorum",),
    "side": ("side",),
}
#: The alias an operator resets and inspects each space through.
OPERATOR_ALIAS = {"single": "default", "quorum": "q", "side": "side"}
#: "Whoever holds the hot lock", for faults aimed at the holder.
HOT = {"single": ("single", "hot"), "quorum": ("quorum", "q:hot")}
KEY_PREFIX = "nemesis"
# The socket timeout of the alias the long hand-off stall goes through: longer than
# the stall, so the waiter's pending read survives it (redis-py's default is 5 s).
HANDOFF_SOCKET_TIMEOUT = 60.0
# Heartbeat gaps (worker threads, this process) longer than this are journalled.
HICCUP = 0.15
# Slack on both ends of every time window the checker compares.
MARGIN = 50_000_000


def now_ns() -> int:
    return time.monotonic_ns()


def _handoff_lease() -> float:
    """The lease a waiter handed the lock starts with (scripts.py), 4 s if it moved."""
    try:
        from django_redis_mutex import scripts
    except ImportError:
        return 4.0
    return float(getattr(scripts, "HANDOFF_LEASE", 4.0))


@dataclass(frozen=True)
class Tuning:
    """The knobs of a run. Leases are short, so a long pause really costs one."""

    ttl: float = 1.5
    acquire_timeout: float = 3.0
    #: Redis calls fail (LockBackendUnavailable) instead of hanging on a stopped server.
    socket_timeout: float = 1.0
    #: Per-master deadline of a quorum lock; roomy, so CPU load alone does not cost leases.
    quorum_timeout: float = 0.25
    slots: int = 4
    threads: int = 2
    tasks: int = 2
    #: Mean seconds between random faults.
    fault_gap: float = 1.2


HANDOFF_VARIANTS = ("short", "long", "mid")


def handoff_variant(variant: str) -> tuple[float, float]:
    """Return (the lease of its lock, the loop stall) of a hand-off stall scenario variant.

    "short": a 0.5 s lease and a 1.5 s stall, inside the waiter's read
    timeout, so the hand-off reply is there when the loop runs again. "long": a
    stall longer than HANDOFF_LEASE, on an alias whose socket timeout outlasts
    it (a stall past the read timeout only makes the waiter's read fail, with
    nothing to learn). "mid": a stall longer than HANDOFF_LEASE but shorter
    than the lock's TTL, begun just after the holder's release handed the
    lock over: the waiter's hand-over lease lapses while its own lease (were
    it adopted and renewed) would not, so only the spent hand-over check keeps
    it out once a competitor took the lapsed lock.
    """
    if variant == "short":
        return 0.5, 1.5
    lease = _handoff_lease()
    if variant == "mid":
        return lease + 2.5, lease + 0.8
    return lease + 1.0, lease + 2.0


@dataclass(frozen=True)
class LockSpec:
    """A lock the workers use: its space, its name and the ways to name where it lives."""

    space: str
    name: str
    usings: tuple[Any, ...]
    weight: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "space": self.space,
            "name": self.name,
            "usings": [list(u) if isinstance(u, tuple) else u for u in self.usings],
            "weight": self.weight,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LockSpec:
        return cls(data["space"], data["name"], tuple(data["usings"]), data["weight"])


def lock_specs(topology: str) -> list[LockSpec]:
    """Return the locks the workers contend for in ``topology`` (the first is the hot one)."""
    if topology == "single":
        return [
            LockSpec("single", "hot", ("default",), 4.0),
            LockSpec("single", "a", ("default",), 1.5),
            LockSpec("single", "b", ("default",), 1.0),
            LockSpec("single", "c", ("default",), 1.0),
        ]
    # A quorum lock named by the alias with the QUORUM, or by the list of masters: one lock.
    quorum: tuple[Any, ...] = ("q", MASTERS)
    return [
        LockSpec("quorum", "q:hot", quorum, 3.0),
        LockSpec("quorum", "q:a", quorum, 1.5),
        LockSpec("quorum", "q:b", quorum, 1.0),
        LockSpec("side", "side:0", ("side",), 2.0),
        LockSpec("side", "side:1", ("side",), 1.0),
    ]


#: The lease of the "linger" lock and of some permits, taken by cancelled tasks: long,
#: so that one left held by an owner that is gone is still there when the run ends
#: and the orphan check looks.
LINGER_TTL = 6.0
#: The permits of the run's semaphore; at most this many permit bodies overlap.
SEMAPHORE_LIMIT = 2


def linger_spec(topology: str) -> LockSpec:
    """The lock some cancelled tasks take, with a lease of LINGER_TTL (see there)."""
    space = "single" if topology == "single" else "side"
    return LockSpec(
        space, "linger" if space == "single" else "side:linger", (OPERATOR_ALIAS[space],)
    )


def semaphore_spec(topology: str) -> LockSpec:
    """The semaphore of a run (limit SEMAPHORE_LIMIT): on its one Redis, or on the quorum.

    A quorum semaphore is named, as a quorum lock is, by the alias with the
    QUORUM or by the list of masters. Each of its permits is granted by more
    than ``masters * limit / (limit + 1)`` masters: with a limit of two, by
    all three, so a fault that stops any master makes permits unavailable
    while it lasts.
    """
    if topology == "single":
        return LockSpec("single", "sem", ("default",))
    return LockSpec("quorum", "q:sem", ("q", MASTERS))


def longest_lease(topology: str, tuning: Tuning, name: str) -> float:
    """The longest lease the workers take ``name`` with (a lock's or a semaphore's)."""
    if name in (linger_spec(topology).name, semaphore_spec(topology).name):
        return max(LINGER_TTL, tuning.ttl)
    if "handoff:" in name:
        return max(handoff_variant(variant)[0] for variant in HANDOFF_VARIANTS)
    return tuning.ttl


def handoff_spec(topology: str, slot: int) -> LockSpec:
    """The lock of a slot's hand-off scenario: a single-alias one (a quorum does not hand off).

    Its first way in is the plain alias (the short variant), the second the
    ``handoff`` alias with a long socket timeout (the long one): one lock.
    """
    if topology == "single":
        return LockSpec("single", f"handoff:{slot}", ("default", "handoff"), 0.0)
    return LockSpec("side", f"side:handoff:{slot}", ("side", "handoff"), 0.0)


def cache_entries(
    topology: str,
    urls: dict[str, str],
    prefix: str,
    tuning: Tuning,
    socket_timeout: float,
    member_timeout: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Return the CACHES of a worker (URLs of its proxies) or of the operator (the servers).

    ``member_timeout`` is the socket timeout of the quorum's master aliases
    (default: ``socket_timeout``).
    """

    def entry(url: str, timeout: float = socket_timeout, **mutex: Any) -> dict[str, Any]:
        options = {"SOCKET_CONNECT_TIMEOUT": min(socket_timeout, 0.5), "SOCKET_TIMEOUT": timeout}
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": url,
            "KEY_PREFIX": KEY_PREFIX,
            "OPTIONS": options,
            "MUTEX": {
                "PREFIX": prefix,
                "TTL": tuning.ttl,
                "TIMEOUT": tuning.acquire_timeout,
                "QUORUM_TIMEOUT": tuning.quorum_timeout,
                **mutex,
            },
        }

    def handoff(url: str) -> dict[str, Any]:
        # django-redis keeps one connection pool per URL: a URL of its own, or this
        # alias would share the plain alias's pool and its short timeout.
        return entry(f"{url}?socket_timeout={HANDOFF_SOCKET_TIMEOUT:g}", HANDOFF_SOCKET_TIMEOUT)

    if topology == "single":
        return {"default": entry(urls["r0"]), "handoff": handoff(urls["r0"])}
    member_timeout = member_timeout or socket_timeout
    caches = {master: entry(urls[master], member_timeout) for master in MASTERS}
    caches["q"] = entry(urls["m1"], member_timeout, QUORUM=list(MASTERS))
    caches["side"] = entry(urls["side"])
    caches["handoff"] = handoff(urls["side"])
    caches["default"] = entry(urls["side"])  # Django wants a default cache
    return caches


# == the plan ====================================================================================


@dataclass(frozen=True)
class Fault:
    """One planned fault, ``at`` seconds into the run."""

    at: float
    kind: str
    slot: int | None = None
    #: Aim at whichever slot holds the hot lock then, if it is one of ``allowed``.
    holder: bool = False
    allowed: tuple[int, ...] = ()
    server: str | None = None
    #: How long it lasts (pause, stall, latency), or the downtime (kill, restart).
    seconds: float = 0.0
    latency: float = 0.0
    space: str | None = None
    name: str | None = None
    variant: str = ""

    def describe(self) -> str:
        where = []
        if self.slot is not None:
            where.append(
                f"{'holder of the hot lock, else ' if self.holder else ''}slot {self.slot}"
            )
        elif self.kind in ("latency", "stall-proxy", "cut-proxy"):
            where.append("every slot")
        if self.server:
            where.append(f"server {self.server}")
        if self.name:
            where.append(f"lock {self.space}:{self.name}")
        extra = f" {self.variant}" if self.variant else ""
        extra += f" {self.seconds:.2f}s" if self.seconds else ""
        if self.latency:
            extra += f" latency {self.latency * 1000:.0f}ms"
        return f"+{self.at:.2f}s {self.kind}{extra} ({', '.join(where)})"


WORKER_FAULT_WEIGHTS = {"pause-worker": 3.0, "kill-worker": 1.2, "stall-loop": 2.0}
SERVER_FAULT_WEIGHTS = {
    "pause-redis": 1.0,
    # DEBUG SLEEP longer than the workers' socket timeout: calls time out while
    # Redis holds them, and runs them when it wakes.
    "sleep-redis": 0.8,
    "restart-redis": 0.6,
    "latency": 1.0,
    "stall-proxy": 1.2,
    "cut-proxy": 1.0,
    "reset": 1.5,
}


def make_plan(seed: int, topology: str, seconds: float, tuning: Tuning) -> list[Fault]:
    """Return the faults of a run, decided by ``seed`` alone (same seed, same plan).

    The first tenth of the run (at most 3 s) is calm and every fault is over a
    second before the end. Faults on one target never overlap, and the
    scenarios keep their slot to themselves, so each does what it says.
    """
    rng = random.Random(f"nemesis:{seed}:{topology}")
    ttl = tuning.ttl
    slots = list(range(tuning.slots))
    servers = SERVERS[topology]
    specs = lock_specs(topology)
    # What an operator resets now and then: the locks, and the semaphore's permits.
    resettable = [*specs, semaphore_spec(topology)]
    calm = min(3.0, seconds * 0.1)
    last = seconds - 1.0
    # Per key, the (start, end) spans already given out. "slot<n>", "server:<s>",
    # "proxy:<s>" and "reset" are taken by the fault acting on them; "hush:<s>"
    # marks a scenario's need for server <s> to be left alone, which scenarios
    # may share and faults on <s> avoid.
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    faults: list[Fault] = []

    def claim(
        start: float,
        end: float,
        *take: str,
        mark: tuple[str, ...] = (),
        avoid: tuple[str, ...] = (),
    ) -> bool:
        if start < calm or end > last:
            return False
        for key in (*take, *avoid):
            if any(a < end + 0.3 and start < b + 0.3 for a, b in busy[key]):
                return False
        for key in (*take, *mark):
            busy[key].append((start, end))
        return True

    def span() -> float:
        # Short faults stay under the threat bar, long ones beat the lease.
        return rng.uniform(1.3, 2.5) * ttl if rng.random() < 0.5 else rng.uniform(0.03, 0.2) * ttl

    # Slots kept for a scenario: no fault aimed at "the holder" may land there meanwhile.
    reserved: list[tuple[int, float, float]] = []

    def hosts(space: str) -> list[str]:
        return [server for server in servers if space in SPACES_ON[server]]

    def place(
        at: float, length: float, quiet: str, *take: str, avoid: tuple[str, ...] = ()
    ) -> int | None:
        """Give a scenario a slot, and keep Redis and proxy faults off ``quiet``'s servers."""
        hushed = hosts(quiet)
        mark = tuple(f"hush:{server}" for server in hushed)
        avoid += tuple(f"{kind}:{server}" for server in hushed for kind in ("server", "proxy"))
        for slot in rng.sample(slots, len(slots)):
            if claim(at, at + length, f"slot{slot}", *take, mark=mark, avoid=avoid):
                reserved.append((slot, at, at + length))
                return slot
        return None

    # The run is cut in windows of about 30 s; each window has every scenario.
    windows = max(1, round(seconds / 30))
    width = seconds / windows

    def first_fit(window: int, shares: tuple[float, ...], plan: Callable[[float], bool]) -> None:
        """Plan a scenario at the first of ``shares`` of a window where it fits."""
        for share in shares:
            if plan((window + share) * width):
                return

    # The scenarios, near fixed shares of the run so that every run has them, each
    # with its slot and its Redis to itself, so that they do what they say.
    def handoff(variant: str) -> Callable[[float], bool]:
        def plan(at: float) -> bool:
            stall = handoff_variant(variant)[1]
            slot = place(at, stall + 3.0, handoff_spec(topology, 0).space)
            if slot is not None:
                faults.append(Fault(at, "handoff-stall", slot=slot, seconds=stall, variant=variant))
            return slot is not None

        return plan

    def nested_reset(at: float) -> bool:
        space, name = HOT[topology]
        slot = place(at, 2.0, space)
        if slot is not None:
            faults.append(Fault(at, "nested-reset", slot=slot, space=space, name=name))
        return slot is not None

    def side_hold(at: float) -> bool:
        master, pause = rng.choice(MASTERS), rng.uniform(2.0, 3.0) * ttl
        slot = place(at, pause + 1.5, "side", f"server:{master}", avoid=(f"hush:{master}",))
        if slot is not None:
            faults.append(Fault(at, "side-hold", slot=slot, seconds=pause + 1.2))
            faults.append(Fault(at + 0.3, "pause-redis", server=master, seconds=pause))
        return slot is not None

    def restart(at: float) -> bool:
        server, down = rng.choice(servers), rng.uniform(0.05, 0.5)
        if claim(at, at + down + 1.0, f"server:{server}", avoid=(f"hush:{server}",)):
            faults.append(Fault(at, "restart-redis", server=server, seconds=down))
            return True
        return False

    def sleep(at: float) -> bool:
        # On a Redis of the linger lock or of the semaphore (one server carries
        # both, or on the quorum one of the side server and a master), long
        # enough that a give-back sent a socket timeout into it times out too;
        # a worker of ``slot`` takes and cancels what lives there as it falls asleep.
        linger_host = hosts(linger_spec(topology).space)[0]
        semaphore_hosts = hosts(semaphore_spec(topology).space)
        server = linger_host
        if semaphore_hosts != [linger_host]:
            server = rng.choice([linger_host, rng.choice(semaphore_hosts)])
        length = rng.uniform(2.3, 3.0) * tuning.socket_timeout
        if claim(at, at + length + 1.0, f"server:{server}", avoid=(f"hush:{server}",)):
            slot = rng.choice(slots)
            faults.append(Fault(at, "sleep-redis", slot=slot, server=server, seconds=length))
            return True
        return False

    def sleep_length() -> float:
        # Always past the socket timeout, so calls in flight time out.
        return rng.uniform(1.3, 2.8) * tuning.socket_timeout

    # With one server, the scenarios' quiet spans leave little room for the
    # server faults every window must have: the two long hand-off stalls run
    # side by side (other slots) at its start, the rest after them.
    for window in range(windows):
        first_fit(window, (0.1, 0.12, 0.45, 0.4, 0.55), handoff("long"))
        first_fit(window, (0.11, 0.13, 0.6, 0.55, 0.3, 0.05), handoff("mid"))
        first_fit(window, (0.48, 0.5, 0.15, 0.2, 0.1), handoff("short"))
        first_fit(window, (0.5, 0.35, 0.3, 0.4, 0.25, 0.8), nested_reset)
        if topology == "quorum":
            first_fit(window, (0.3, 0.25, 0.35, 0.2, 0.6, 0.7), side_hold)
        first_fit(window, (0.68, 0.7, 0.85, 0.55, 0.35, 0.2), restart)
        first_fit(window, (0.76, 0.8, 0.9, 0.6, 0.4, 0.15), sleep)

    kinds = {**WORKER_FAULT_WEIGHTS, **SERVER_FAULT_WEIGHTS}
    t = calm
    while True:
        t += rng.expovariate(1.0 / tuning.fault_gap)
        if t >= last:
            break
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        if kind in WORKER_FAULT_WEIGHTS:
            slot = rng.choice(slots)
            holder = kind != "stall-loop" and rng.random() < 0.5
            length = rng.uniform(0.1, 1.0) if kind == "kill-worker" else span()
            ends = t + length + (2.0 if kind == "kill-worker" else 0.0)
            if claim(t, ends, f"slot{slot}"):
                allowed = tuple(
                    s
                    for s in slots
                    if not any(r == s and a < ends + 0.3 and t < b for r, a, b in reserved)
                )
                faults.append(
                    Fault(t, kind, slot=slot, holder=holder, allowed=allowed, seconds=length)
                )
        elif kind == "reset":
            spec = rng.choices(resettable, weights=[s.weight for s in resettable])[0]
            if claim(t, t + 0.5, "reset"):
                faults.append(Fault(t, kind, space=spec.space, name=spec.name))
        else:
            server = rng.choice(servers)
            if kind in ("pause-redis", "restart-redis", "sleep-redis"):
                length = {
                    "pause-redis": span,
                    "restart-redis": lambda: rng.uniform(0.05, 0.5),
                    "sleep-redis": sleep_length,
                }[kind]()
                if claim(t, t + length + 1.0, f"server:{server}", avoid=(f"hush:{server}",)):
                    faults.append(Fault(t, kind, server=server, seconds=length))
                continue
            slot_or_all = rng.choice(slots) if rng.random() < 0.7 else None
            length = {"latency": rng.uniform(0.5, 3.0), "stall-proxy": span(), "cut-proxy": 0.0}[
                kind
            ]
            latency = rng.uniform(0.005, 0.06) if kind == "latency" else 0.0
            # Cuts on one server are spaced: one cut costs a renewal at most.
            hush = (f"hush:{server}",)
            if claim(t, t + max(length, 1.0), f"proxy:{server}", avoid=hush):
                faults.append(
                    Fault(t, kind, slot=slot_or_all, server=server, seconds=length, latency=latency)
                )
    faults.sort(key=lambda f: f.at)
    return faults


# == the record of what was done =================================================================


@dataclass
class FaultRecord:
    """A fault as it was applied: what, to whom (pid, server), from ``t0`` to ``t1`` (ns)."""

    id: int
    kind: str
    t0: int
    t1: int | None = None
    slot: int | None = None
    pid: int | None = None
    server: str | None = None
    seconds: float = 0.0
    latency: float = 0.0
    space: str | None = None
    name: str | None = None
    #: A kill of a process that was SIGSTOPped then: when it stopped.
    stopped_since: int | None = None
    #: A reset: True/False as reset() answered, None if it raised (it may have run).
    held: bool | None = None
    note: str = ""

    @property
    def end(self) -> int:
        return self.t1 if self.t1 is not None else self.t0

    def describe(self, t0: int) -> str:
        parts = [f"+{(self.t0 - t0) / NS:.3f}s"]
        if self.t1 is not None and self.t1 != self.t0:
            parts.append(f"..+{(self.t1 - t0) / NS:.3f}s")
        text = "".join(parts) + f" {self.kind}"
        if self.slot is not None:
            text += f" slot {self.slot}"
        if self.pid is not None:
            text += f" pid {self.pid}"
        if self.server:
            text += f" server {self.server}"
        if self.name:
            text += f" lock {self.space}:{self.name}"
        if self.latency:
            text += f" latency {self.latency * 1000:.0f}ms"
        if self.kind == "reset":
            text += f" (held={self.held})"
        if self.note:
            text += f" ({self.note})"
        return text


@dataclass(frozen=True)
class HeldSample:
    """A lock or permit the orphan check saw held after the run, at ``t`` (ns).

    ``phase`` is "idle" (every worker had run its last body and still lived,
    watchdog and all) or "exited" (every worker had exited or been killed).
    ``grant`` names the grant (a lock's fence, a permit's token); ``lease`` is
    the longest lease the workers take ``name`` with.
    """

    phase: str
    t: int
    what: str
    space: str
    name: str
    grant: str
    pid: int | None
    owner: str
    time_left: float
    lease: float
    #: The owner record's thread or task name.
    thread: str | None = None


#: A cancelled child task's name ends so (see _Worker.async_cancel).
CHILD_SUFFIX = re.compile(r"-c[0-9]+$")
#: How long after an owner is gone (and every fault that could keep its
#: give-back from Redis is over) what it held may still be held: the grace,
#: plus the longest wait between two tries of a background give-back.
CHILD_GRACE = 2 * NS


#: After every worker is idle or gone, nothing may stay held longer than this (ns),
#: unless a killed owner's lease explains it.
ORPHAN_GRACE = NS


#: Faults that hold back what a client sent until they end: of its server ...
HOLDING_SERVER = ("pause-redis", "sleep-redis", "restart-redis")
#: ... or of the proxy between one worker slot (or every slot: None) and it.
HOLDING_PATH = ("stall-proxy", "cut-proxy", "latency")


def holding_spans(
    space: str, slot: int | None, faults: list[FaultRecord], hiccups: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The spans (ns) in which a command a worker in ``slot`` sent to ``space`` may wait.

    A paused, asleep or restarting server runs it once the fault ends, as a
    stalled, cut or slowed proxy delivers it; a hiccup of the nemesis process
    means the whole machine was slow, Redis too.
    """
    servers = [server for server, spaces in SPACES_ON.items() if space in spaces]
    spans = [
        (record.t0, record.end)
        for record in faults
        if record.server in servers
        and (
            record.kind in HOLDING_SERVER
            or (record.kind in HOLDING_PATH and record.slot in (None, slot))
        )
    ]
    return sorted(spans + list(hiccups))


def orphan_deadline(
    sample: HeldSample,
    start: int,
    kills: dict[int, FaultRecord],
    faults: list[FaultRecord],
    hiccups: list[tuple[int, int]],
    stalls: Sequence[tuple[int, int]] = (),
) -> int:
    """Until when (ns) ``sample``'s lock or permit may still be held; ``start``: its phase's.

    A grace of ORPHAN_GRACE from the phase's start; for an owner the nemesis
    SIGKILLed, until its lease could have run out: renewed last when its last
    command ran, or handed to it as a waiter up to a wait lease after its
    last check-in, with a lease of up to ``sample.lease``. Its last command
    was sent by the kill, and ran then, or when the spans that hold a command
    back (see :func:`holding_spans`; ``stalls``: its own process's, too) in
    progress at the kill ended: Redis reads what a killed process wrote, and
    sets the lease when it runs it.
    """
    allowed = start + ORPHAN_GRACE
    kill = kills.get(sample.pid) if sample.pid is not None else None
    if kill is not None:
        ran = kill.t0
        for t0, t1 in sorted([*holding_spans(sample.space, kill.slot, faults, hiccups), *stalls]):
            if t0 <= ran and t1 >= kill.t0:
                ran = max(ran, t1)
        allowed = max(allowed, ran + int((_wait_lease() + sample.lease) * NS) + MARGIN)
    return allowed


def _wait_lease() -> float:
    """A waiter's place in line (scripts.py), 2 s if it moved."""
    try:
        from django_redis_mutex import scripts
    except ImportError:
        return 2.0
    return float(getattr(scripts, "WAIT_LEASE", 2.0))


@dataclass
class RunInfo:
    """What the checker needs to know about a run besides the workers' journals."""

    topology: str
    seed: int
    tuning: Tuning
    t0: int
    end: int
    faults: list[FaultRecord] = field(default_factory=list)
    #: Gaps (t0, t1) of this process's heartbeat: the whole machine was slow.
    hiccups: list[tuple[int, int]] = field(default_factory=list)
    #: Problems the runner found itself: keys without expiry, locks that never drained, ...
    problems: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    #: The database at the end (None: no data to check, as in hand-made histories).
    data: DataState | None = None
    #: The transactional bodies gave their lock back at its block's end (test-only).
    release_at_block_end: bool = False
    #: What the orphan check saw held after the run, and when each of its
    #: phases ("idle", "exited") began (empty: not checked, as in hand-made histories).
    held_after: list[HeldSample] = field(default_factory=list)
    orphan_phases: dict[str, int] = field(default_factory=dict)
    #: What was seen held during the run in the name of a cancelled child task.
    held_during: list[HeldSample] = field(default_factory=list)


# == the checker =================================================================================


@dataclass
class Violation:
    """One broken guarantee: its kind, a description, and the times it concerns (ns)."""

    kind: str
    text: str
    lo: int = 0
    hi: int = 0
    pids: tuple[int, ...] = ()


@dataclass
class Body:
    """One critical section as journalled by a worker."""

    id: str
    pid: int
    slot: int
    space: str
    name: str
    fence: int
    kind: str
    owner: str
    is_async: bool
    called: int
    enter: int
    leave: int | None = None
    end: int = 0
    ended_by: str = "leave"
    result: str | None = None
    result_at: int | None = None
    told_at: int | None = None
    told_how: str = ""
    joined: bool = False
    scenario: str | None = None
    #: The lease the body's lock was taken with (seconds).
    ttl: float = 0.0
    #: A nested level that got a fence of its own (a second grant), not the body's.
    parent: str | None = None
    #: Taken shared (a read lock): it may overlap other shared bodies of its lock.
    shared: bool = False
    #: A transactional body: the value it read of its lock's counter row ("intent").
    read: int | None = None
    #: When it journalled its COMMIT, and what it wrote then.
    committed_at: int | None = None
    value: int | None = None
    #: After that COMMIT, its lock was given back (None: the transaction ended
    #: inside the lock's block; False: the give-back failed or found the lock lost).
    given_back: bool | None = None
    #: When the block of a lock kept for its transaction had exited (before the COMMIT).
    exited_at: int | None = None
    #: A permit of a semaphore of ``limit`` permits (``name`` is the semaphore's).
    limit: int | None = None

    @property
    def permit(self) -> bool:
        return self.limit is not None

    @property
    def status(self) -> str:
        """clean, told, unconfirmed (the exit raised another error), or unknown (killed)."""
        if self.result == "told":
            return "told"
        deadline = self.result_at if self.result_at is not None else self.end
        if self.told_at is not None and self.told_at <= deadline:
            return "told"
        if self.result is None:
            return "unknown"
        if self.result == "clean":
            # A lock kept for a transaction is given back after the COMMIT: a
            # give-back that got no answer leaves the body unconfirmed.
            return "unconfirmed" if self.given_back is False else "clean"
        return "unconfirmed"

    def describe(self, t0: int) -> str:
        status = self.status
        if status == "told":
            status += f" ({self.told_how or 'at exit'})"
        elif status == "unconfirmed":
            status += f" ({self.result})"
        elif status == "unknown":
            status += f" (ended by {self.ended_by})"
        joined = ", entered without a grant of its own" if self.joined else ""
        kind = f"shared {self.kind}" if self.shared else self.kind
        return (
            f"[{kind} {self.owner} slot {self.slot} pid {self.pid} fence {self.fence} "
            f"entered +{(self.enter - t0) / NS:.3f}s left +{(self.end - t0) / NS:.3f}s, "
            f"acquire called +{(self.called - t0) / NS:.3f}s, {status}{joined}]"
        )


#: Kinds that are with blocks or decorated calls: a loss they learned must raise LockLost.
BLOCK_KINDS = frozenset(
    {
        "with",
        "handle",
        "decorated",
        "nested",
        "multi",
        "multi-inner",
        "after-handover",
        "async-with",
        "async-decorated",
        "async-nested",
        "handoff-waiter",
        "handoff-competitor",
        "side-hold",
        "quorum-partner",
        "nested-reset",
        "tx-with",
        "tx-decorated",
        "tx-inside",
        "async-tx",
        "sem-with",
        "async-sem",
        "async-cancel-with",
        "async-sem-cancel-with",
    }
)
#: Kinds that read-modify-write their lock's counter row in a database transaction.
TX_KINDS = frozenset({"tx-with", "tx-decorated", "tx-inside", "async-tx"})


@dataclass(frozen=True)
class Threat:
    """A fault that may cost leases: when, whose (None: everyone's), and how badly.

    ``measure`` says what makes it a threat to a body with lease ``ttl``:
    ``always`` (a restart, a reset), ``length`` (a stall or pause of at least
    a third of the lease) or ``latency`` (at least a fifteenth of the lease
    per chunk, each way).
    """

    t0: int
    t1: int
    label: str
    spaces: frozenset[str] | None = None
    slots: frozenset[int] | None = None
    names: frozenset[str] | None = None
    measure: str = "always"
    latency: float = 0.0

    def hits(self, body: Body, lo: int, hi: int) -> bool:
        if self.measure == "length" and self.t1 - self.t0 < _bar(body.ttl):
            return False
        if self.measure == "latency" and self.latency < body.ttl / 15:
            return False
        return (
            (self.spaces is None or body.space in self.spaces)
            and (self.slots is None or body.slot in self.slots)
            and (self.names is None or body.name in self.names)
            and self.t0 <= hi + MARGIN
            and self.t1 >= lo - MARGIN
        )


def _bar(ttl: float) -> int:
    """The shortest pause (ns) that may cost a lease of ``ttl`` seconds: a third of it."""
    return int(ttl / 3 * NS)


@dataclass
class Verdict:
    """What the checker found, and what it counted on the way."""

    violations: list[Violation]
    stats: dict[str, Any]
    bodies: list[Body]
    #: The overlaps that were excused, each with the fault that explains it.
    excused: list[str] = field(default_factory=list)


def _merge(intervals: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Merge intervals closer than 100 ms: two pauses in a row cost a lease together."""
    merged: list[tuple[int, int, str]] = []
    for start, stop, label in sorted(intervals):
        if merged and start <= merged[-1][1] + 100_000_000:
            a, b, first = merged[-1]
            merged[-1] = (a, max(b, stop), first if label in first else f"{first} + {label}")
        else:
            merged.append((start, stop, label))
    return merged


class _Checker:
    def __init__(self, events: list[dict[str, Any]], info: RunInfo) -> None:
        self.info = info
        self.t0 = info.t0
        self.ttl = info.tuning.ttl
        self.violations: list[Violation] = []
        self.stats: Counter[str] = Counter()
        self.detail: dict[str, Counter[str]] = defaultdict(Counter)
        self.events = events
        self.bodies: dict[str, Body] = {}
        self.levels: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.kills: dict[int, FaultRecord] = {}
        self.done: set[int] = set()
        self.last_seen: dict[int, int] = {}
        self.slot_of: dict[int, int] = {}
        self.gaps: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
        self.stalls: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
        self.scenarios: dict[str, dict[str, Any]] = defaultdict(dict)
        self.threats: list[Threat] = []
        self.excused: list[str] = []
        self.cancels: list[dict[str, Any]] = []
        self.children: dict[tuple[int, str], dict[str, Any]] = {}

    # -- reading --------------------------------------------------------------------------

    def read(self) -> None:
        for record in self.info.faults:
            if record.kind in ("kill-worker", "teardown-kill") and record.pid is not None:
                self.kills[record.pid] = record
            if record.kind == "pause-worker" and record.pid is not None:
                self.gaps[record.pid].append(
                    (record.t0, record.end, f"SIGSTOP of pid {record.pid}")
                )
        for event in self.events:
            pid = event["pid"]
            self.last_seen[pid] = max(self.last_seen.get(pid, 0), event.get("t", 0))
            kind = event["e"]
            if kind == "start":
                self.slot_of[pid] = event["slot"]
            elif kind == "enter":
                self.bodies[event["b"]] = Body(
                    id=event["b"],
                    pid=pid,
                    slot=event["slot"],
                    space=event["space"],
                    name=event["name"],
                    fence=int(event["fence"]),
                    kind=event["kind"],
                    owner=event["owner"],
                    is_async=bool(event["async"]),
                    called=event["called"],
                    enter=event["t"],
                    joined=bool(event.get("joined")),
                    scenario=event.get("scenario"),
                    ttl=float(event.get("ttl") or self.ttl),
                    shared=bool(event.get("shared")),
                    limit=event.get("limit"),
                )
                self.stats["bodies"] += 1
                if event.get("limit") is not None:
                    self.stats["permit bodies"] += 1
                if event.get("shared"):
                    self.stats["shared bodies"] += 1
                if event["kind"] in TX_KINDS:
                    self.stats["transactional bodies"] += 1
                self.detail["kinds"][event["kind"]] += 1
            elif kind == "refused":
                self.detail["refused"][event["why"]] += 1
            elif kind == "cancel":
                self.cancels.append(event)
            elif kind == "child-end":
                self.children[(pid, event["child"])] = event
            elif kind == "hiccup":
                self.gaps[pid].append((event["t0"], event["t1"], f"hiccup of pid {pid}"))
            elif kind == "stall":
                label = f"loop stall of pid {pid}"
                self.stalls[pid].append((event["t0"], event["t1"], label))
                if event.get("scenario"):
                    self.scenarios[event["scenario"]]["stall"] = (event["t0"], event["t1"])
            elif kind == "scenario":
                self.scenarios[event["sc"]][event["role"]] = event
            elif kind == "done":
                self.done.add(pid)
            elif kind == "unexpected":
                self.violations.append(
                    Violation(
                        "unexpected exception",
                        f"pid {pid} {event.get('owner', '')}: {event['error']}\n"
                        + _indent(event.get("trace", ""), 6),
                        event["t"],
                        event["t"],
                        (pid,),
                    )
                )
        for event in self.events:
            body = self.bodies.get(event.get("b", ""))
            if body is None:
                continue
            kind = event["e"]
            if kind == "leave":
                body.leave = event["t"]
            elif kind == "outcome":
                body.result, body.result_at = event["result"], event["t"]
                if event["result"] == "told":
                    self.note_told(body, event["t"], "at exit")
            elif kind == "told":
                self.note_told(body, event["t"], event["how"])
            elif kind in ("level", "unlevel"):
                self.levels[body.id].append(event)
            elif kind == "intent":
                body.read = int(event["read"])
            elif kind == "committed":
                body.committed_at, body.value = event["t"], int(event["value"])
                body.given_back = event.get("given_back")
            elif kind == "exited":
                body.exited_at = event["t"]
        by_hold: dict[tuple[int, str, int], list[Body]] = defaultdict(list)
        for body in self.bodies.values():
            by_hold[(body.pid, body.name, body.fence)].append(body)
        for event in self.events:
            # A permit's signal names no grant (see _Worker._on_lost): it tells no body.
            if event["e"] == "told" and event.get("how") == "signal" and not event.get("permit"):
                for body in by_hold.get((event["pid"], event["name"], int(event["fence"])), []):
                    self.note_told(body, event["t"], "lock_lost signal")

    def note_told(self, body: Body, at: int, how: str) -> None:
        if body.told_at is None or at < body.told_at:
            body.told_at, body.told_how = at, how

    def settle_ends(self) -> None:
        for body in list(self.bodies.values()):
            if body.leave is not None:
                body.end, body.ended_by = body.leave, "leave"
            elif body.pid in self.kills:
                kill = self.kills[body.pid]
                stopped = kill.stopped_since
                body.end = max(body.enter, stopped if stopped is not None else kill.t0)
                body.ended_by = "SIGKILL while stopped" if stopped is not None else kill.kind
            else:
                body.end = max(body.enter, self.last_seen.get(body.pid, body.enter))
                body.ended_by = "the end of its journal"
                self.violations.append(
                    Violation(
                        "harness",
                        f"body {body.describe(self.t0)} never left, and its process was not "
                        "killed by the nemesis",
                        body.enter,
                        body.end,
                        (body.pid,),
                    )
                )
            self.detail["status"][body.status] += 1
        # A nested level with a fence of its own is a second grant: a body of its own.
        for parent_id, events in self.levels.items():
            parent = self.bodies[parent_id]
            opened: list[dict[str, Any]] = []
            for event in events:
                if event["e"] == "level":
                    opened.append(event)
                    self.stats["levels"] += 1
                    if event.get("shared"):
                        self.stats["shared levels"] += 1
                    continue
                if not opened:
                    continue
                level = opened.pop()
                fence = level.get("fence")
                if fence is None or int(fence) == parent.fence:
                    continue
                pseudo = Body(
                    id=f"{parent_id}/level",
                    pid=parent.pid,
                    slot=parent.slot,
                    space=parent.space,
                    name=parent.name,
                    fence=int(fence),
                    kind=f"{parent.kind} inner level",
                    owner=parent.owner,
                    is_async=parent.is_async,
                    called=level["t"],
                    enter=level["t"],
                    leave=event["t"],
                    end=event["t"],
                    result=parent.result,
                    result_at=parent.result_at,
                    told_at=parent.told_at,
                    told_how=parent.told_how,
                    ttl=parent.ttl,
                    parent=parent_id,
                    shared=bool(level.get("shared", parent.shared)),
                )
                self.bodies[pseudo.id] = pseudo

    # -- what may cost a lease --------------------------------------------------------------

    def collect_threats(self) -> None:
        info = self.info
        for record in info.faults:
            spaces = None
            if record.server is not None:
                spaces = frozenset(SPACES_ON.get(record.server, ()))
            slots = None if record.slot is None else frozenset({record.slot})
            label = record.describe(self.t0)
            if record.kind == "restart-redis":
                self.threats.append(Threat(record.t0, record.end, label, spaces=spaces))
            elif record.kind in ("pause-redis", "sleep-redis"):
                self.threats.append(
                    Threat(record.t0, record.end, label, spaces=spaces, measure="length")
                )
            elif record.kind == "stall-proxy":
                self.threats.append(
                    Threat(record.t0, record.end, label, spaces, slots, measure="length")
                )
            elif record.kind == "latency":
                self.threats.append(
                    Threat(
                        record.t0,
                        record.end,
                        label,
                        spaces,
                        slots,
                        measure="latency",
                        latency=record.latency,
                    )
                )
            elif record.kind == "reset" and record.held is not False:
                self.threats.append(
                    Threat(
                        record.t0,
                        record.end,
                        label,
                        spaces=frozenset({record.space or ""}),
                        names=frozenset({record.name or ""}),
                    )
                )
        for start, stop in info.hiccups:
            label = f"+{(start - self.t0) / NS:.3f}s hiccup of the nemesis process"
            self.threats.append(Threat(start, stop, label, measure="length"))
        self.merged_sync = {pid: _merge(gaps) for pid, gaps in self.gaps.items()}
        self.merged_async = {
            pid: _merge(self.gaps.get(pid, []) + self.stalls.get(pid, []))
            for pid in set(self.gaps) | set(self.stalls)
        }
        bar = _bar(self.ttl)
        self.stats["threats"] = sum(
            1
            for threat in self.threats
            if threat.measure == "always"
            or (threat.measure == "length" and threat.t1 - threat.t0 >= bar)
            or (threat.measure == "latency" and threat.latency >= self.ttl / 15)
        ) + sum(1 for gaps in self.merged_async.values() for a, b, _ in gaps if b - a >= bar)

    def explain(self, body: Body, lo: int, hi: int) -> str | None:
        """Return the faults that may have cost ``body`` its lease between ``lo`` and ``hi``."""
        gaps = (self.merged_async if body.is_async else self.merged_sync).get(body.pid, [])
        bar = _bar(body.ttl)
        causes = [
            f"{label} for {(stop - start) / NS:.3f}s from +{(start - self.t0) / NS:.3f}s"
            for start, stop, label in gaps
            if stop - start >= bar and start <= hi + MARGIN and stop >= lo - MARGIN
        ]
        causes += [threat.label for threat in self.threats if threat.hits(body, lo, hi)]
        return "; ".join(causes) if causes else None

    def paused(self, pid: int, lo: int, hi: int) -> bool:
        """True if ``pid`` was stopped or starved at some point between ``lo`` and ``hi``."""
        return any(
            start <= hi + MARGIN and stop >= lo - MARGIN
            for start, stop, _ in self.gaps.get(pid, [])
        )

    # -- the checks ---------------------------------------------------------------------------

    def by_lock(self, permits: bool = False) -> dict[tuple[str, str], list[Body]]:
        """Group the bodies by lock (or, with ``permits``, the permit bodies by semaphore)."""
        groups: dict[tuple[str, str], list[Body]] = defaultdict(list)
        for body in self.bodies.values():
            if body.permit == permits:
                groups[(body.space, body.name)].append(body)
        for bodies in groups.values():
            bodies.sort(key=lambda b: (b.enter, b.id))
        return groups

    def check_overlaps(self, groups: dict[tuple[str, str], list[Body]]) -> None:
        stale_handoffs = self.stale_handoff_pairs()
        for (space, name), bodies in sorted(groups.items()):
            active: list[Body] = []
            for body in bodies:
                active = [other for other in active if other.end > body.enter]
                for other in active:
                    self.pair(space, name, other, body, stale_handoffs)
                active.append(body)

    def pair(
        self,
        space: str,
        name: str,
        first: Body,
        second: Body,
        stale_handoffs: set[tuple[str, str]],
    ) -> None:
        if first.shared and second.shared and first.fence != second.fence:
            # Two shared holders of one lock, each with a grant of its own: what
            # a shared lock is for. Anything else overlapping is judged below.
            self.stats["shared overlaps"] += 1
            return
        self.stats["overlaps"] += 1
        overlap = (min(first.end, second.end) - second.enter) / 1e6
        lock = f"lock {space}:{name}"
        if first.fence == second.fence:
            self.violations.append(
                Violation(
                    "overlap: one fence, two bodies",
                    f"{lock}: bodies {first.describe(self.t0)} and {second.describe(self.t0)} "
                    f"overlap by {overlap:.1f} ms holding the same fence",
                    second.enter,
                    min(first.end, second.end),
                    (first.pid, second.pid),
                )
            )
            return
        stale, newer = (first, second) if first.fence < second.fence else (second, first)
        if (stale.id, newer.id) in stale_handoffs:
            self.violations.append(
                Violation(
                    "overlap: entered on a lapsed hand-off",
                    f"{lock}: the waiter {stale.describe(self.t0)} was handed the lock while its "
                    f"event loop stalled, and entered its body after the hand-off lease had "
                    f"lapsed, while {newer.describe(self.t0)} held the lock "
                    f"(overlap {overlap:.1f} ms)",
                    second.enter,
                    min(first.end, second.end),
                    (first.pid, second.pid),
                )
            )
            return
        status = stale.status
        if status == "clean":
            self.violations.append(
                Violation(
                    "overlap: stale holder never told",
                    f"{lock}: bodies {first.describe(self.t0)} and {second.describe(self.t0)} "
                    f"overlap by {overlap:.1f} ms and the stale one (fence {stale.fence}) "
                    "was never told it lost the lock",
                    second.enter,
                    min(first.end, second.end),
                    (first.pid, second.pid),
                )
            )
            return
        cause = self.explain(stale, stale.called, newer.enter)
        if cause is None:
            self.violations.append(
                Violation(
                    "overlap: lease lost without a fault to explain it",
                    f"{lock}: bodies {first.describe(self.t0)} and {second.describe(self.t0)} "
                    f"overlap by {overlap:.1f} ms; the stale one (fence {stale.fence}) was "
                    f"{status}, but nothing in the run could have cost its lease",
                    second.enter,
                    min(first.end, second.end),
                    (first.pid, second.pid),
                )
            )
            return
        self.detail["excused"][status] += 1
        self.excused.append(
            f"{lock}: {stale.describe(self.t0)} overlapped {newer.describe(self.t0)} by "
            f"{overlap:.1f} ms; excused: {cause}"
        )

    def stale_handoff_pairs(self) -> set[tuple[str, str]]:
        """Return (waiter, newer holder) pairs where the hand-off scenario's waiter entered stale.

        Only scenarios that ran as designed count: the holder kept the lock
        until it released into the stall, the waiter had called before the
        stall began and entered after it ended, and nothing paused the
        waiter's process after the stall (a pause there could come after the
        acquire returned, where no lock can help).
        """
        pairs: set[tuple[str, str]] = set()
        waiters = {b.scenario: b for b in self.bodies.values() if b.kind == "handoff-waiter"}
        holders = {b.scenario: b for b in self.bodies.values() if b.kind == "handoff-holder"}
        for sc, parts in self.scenarios.items():
            waiter, holder = waiters.get(sc), holders.get(sc)
            stall, release = parts.get("stall"), parts.get("release")
            if waiter is None or holder is None or stall is None or release is None:
                continue
            self.stats["handoff scenarios"] += 1
            s0, s1 = stall
            # The stall begins before the release; in the "mid" variant also just after it.
            late = NS if parts.get("start", {}).get("variant") == "mid" else 0
            if holder.status != "clean" or not (waiter.called < s0 <= release["t"] + late):
                continue
            if waiter.enter < s1 or self.paused(waiter.pid, s1, waiter.enter):
                continue
            self.stats["handoff scenarios judged"] += 1
            for other in self.bodies.values():
                if (
                    other.space == waiter.space
                    and other.name == waiter.name
                    and other.fence > waiter.fence
                    and other.enter < waiter.enter < other.end
                ):
                    pairs.add((waiter.id, other.id))
        return pairs

    def check_told_at_exit(self) -> None:
        """A with block (or decorated call) whose loss the lock knew must raise LockLost.

        The lock knew when ``lock.lost`` was True as the body left, or when it
        sent ``lock_lost`` for the hold before the exit returned (while the
        body ran, or from the release itself).
        """
        for body in self.bodies.values():
            if body.parent is not None or body.kind not in BLOCK_KINDS:
                continue
            if body.result != "clean" or body.told_at is None or body.leave is None:
                continue
            # A lock kept for its transaction: its block exited before the COMMIT.
            exited = body.exited_at if body.exited_at is not None else body.result_at
            if exited is not None and body.told_at <= exited:
                when = "before it left" if body.told_at <= body.leave else "while it exited"
                if body.exited_at is not None:
                    when += " (its lock kept for its transaction, which then committed)"
                self.violations.append(
                    Violation(
                        "loss hidden at exit",
                        f"lock {body.space}:{body.name}: body {body.describe(self.t0)} was told "
                        f"of its loss ({body.told_how}) at +{(body.told_at - self.t0) / NS:.3f}s, "
                        f"{when}, yet its block exited without LockLost",
                        body.told_at,
                        exited,
                        (body.pid,),
                    )
                )

    def check_losses(self) -> None:
        """Count losses nothing explains; in the side-hold scenario one is a violation.

        The side lock lives on a Redis no fault touched, so a master of the
        quorum hanging must not cost it its lease.
        """
        for body in self.bodies.values():
            if body.parent is not None or body.status != "told":
                continue
            until = body.told_at if body.told_at is not None else body.end
            cause = self.explain(body, body.called, until)
            if cause is not None:
                continue
            self.stats["unexplained losses"] += 1
            if body.kind == "side-hold":
                self.violations.append(
                    Violation(
                        "unrelated lock lost while a quorum master hung",
                        f"lock {body.space}:{body.name}: {body.describe(self.t0)} was held "
                        "across a quorum master's SIGSTOP in a process that also held a quorum "
                        "lock, and lost its lease with nothing on its own Redis to explain it",
                        body.enter,
                        body.end,
                        (body.pid,),
                    )
                )

    def check_fences(self, groups: dict[tuple[str, str], list[Body]]) -> None:
        for (space, name), bodies in sorted(groups.items()):
            lock = f"lock {space}:{name}"
            seen: dict[int, list[Body]] = defaultdict(list)
            for body in bodies:
                if body.fence >= 0:
                    seen[body.fence].append(body)
                    self.stats["fences unique"] += 1
            for fence, holders in seen.items():
                if len(holders) > 1:
                    self.violations.append(
                        Violation(
                            "fence handed out twice",
                            f"{lock}: fence {fence} went to {len(holders)} bodies: "
                            + " and ".join(b.describe(self.t0) for b in holders),
                            min(b.enter for b in holders),
                            max(b.end for b in holders),
                            tuple(b.pid for b in holders),
                        )
                    )
            trusted = [
                b for b in bodies if b.status == "clean" and b.parent is None and b.fence >= 0
            ]
            exclusive = [b for b in trusted if not b.shared]
            self.check_shared_fences(lock, exclusive, [b for b in trusted if b.shared])
            for before, after in itertools.pairwise(exclusive):
                self.stats["fences in order"] += 1
                if after.fence < before.fence:  # an equal one is reported as handed out twice
                    self.violations.append(
                        Violation(
                            "fence went backwards",
                            f"{lock}: {after.describe(self.t0)} entered after "
                            f"{before.describe(self.t0)} with a smaller fence, and "
                            "neither was told it lost the lock",
                            before.enter,
                            after.enter,
                            (before.pid, after.pid),
                        )
                    )

    def check_shared_fences(self, lock: str, exclusive: list[Body], shared: list[Body]) -> None:
        """An exclusive body's fence is above every shared body's that left before it entered.

        And below every shared body's that entered after it left. Shared
        bodies among themselves enter in any order (several are granted at
        once, and each journals when its thread gets to it), so only their
        order against exclusive ones is checked, over bodies neither told nor
        unconfirmed nor killed.
        """
        if not shared or not exclusive:
            return
        by_end = sorted(shared, key=lambda b: b.end)
        ends = [b.end for b in by_end]
        # The shared body with the largest fence among those that left by each end.
        highest = list(itertools.accumulate(by_end, lambda a, b: a if a.fence >= b.fence else b))
        by_enter = sorted(shared, key=lambda b: b.enter)
        enters = [b.enter for b in by_enter]
        # The shared body with the smallest fence among those entering from each on.
        lowest = list(
            itertools.accumulate(reversed(by_enter), lambda a, b: a if a.fence <= b.fence else b)
        )[::-1]
        for body in exclusive:
            self.stats["fences against shared"] += 1
            index = bisect.bisect_right(ends, body.enter)
            if index and highest[index - 1].fence > body.fence:
                other = highest[index - 1]
                self.violations.append(
                    Violation(
                        "fence went backwards",
                        f"{lock}: {body.describe(self.t0)} entered after the shared "
                        f"{other.describe(self.t0)} left, with a smaller fence, and neither "
                        "was told it lost the lock",
                        other.enter,
                        body.enter,
                        (other.pid, body.pid),
                    )
                )
            index = bisect.bisect_left(enters, body.end)
            if index < len(lowest) and lowest[index].fence < body.fence:
                other = lowest[index]
                self.violations.append(
                    Violation(
                        "fence went backwards",
                        f"{lock}: the shared {other.describe(self.t0)} entered after "
                        f"{body.describe(self.t0)} left, with a smaller fence, and neither "
                        "was told it lost the lock",
                        body.enter,
                        other.enter,
                        (body.pid, other.pid),
                    )
                )

    # -- the data ---------------------------------------------------------------------------

    def check_data(self) -> None:
        """Check the counter rows against the increments that committed, and explain each loss.

        The database says which increments committed and in what order (see
        tests/nemesis_data.py); the journals say when each body ran and what
        it was told. Every commit must write one more than the commit before
        it left; one that wrote over commits it never read lost those updates,
        and each such pair is an overlap of two transactions on one lock,
        which must be excused as a code overlap is.
        """
        data = self.info.data
        if data is None:
            return
        self.stats["data checked"] = 1
        by_lock: dict[str, list[Increment]] = defaultdict(list)
        committed = set()
        for increment in data.increments:
            by_lock[increment.lock].append(increment)
            committed.add(increment.body)
            self.stats["increments committed"] += 1
            self.check_increment_journalled(increment)
        for body in self.bodies.values():
            if body.kind not in TX_KINDS or body.read is None:
                continue
            if body.id not in committed:
                self.stats["increments rolled back"] += 1
                if body.committed_at is not None:
                    self.violations.append(
                        Violation(
                            "data: a journalled COMMIT the database does not have",
                            f"{body.describe(self.t0)} journalled that it committed "
                            f"{body.value}, but no increment of it is in the database",
                            body.enter,
                            body.committed_at,
                            (body.pid,),
                        )
                    )
        for lock, counter in sorted(data.counters.items()):
            self.check_counter(lock, counter, sorted(by_lock.get(lock, []), key=lambda i: i.seq))

    def check_increment_journalled(self, increment: Increment) -> None:
        """A committed increment comes from a body that journalled its intent, or it is a lie."""
        body = self.bodies.get(increment.body)
        if body is None or body.read is None or body.read + 1 != increment.value:
            self.violations.append(
                Violation(
                    "harness",
                    f"the database holds an increment of body {increment.body} "
                    f"({increment.lock} = {increment.value}) that its journal does not match",
                )
            )
        elif body.committed_at is None:
            # Killed between its COMMIT and the journal line: the table is the witness.
            self.stats["commits a kill kept out of the journal"] += 1

    def check_counter(self, lock: str, counter: int, increments: list[Increment]) -> None:
        """The row must hold one per committed increment, each written over the one before."""
        self.stats["counters checked"] += 1
        seqs = [increment.seq for increment in increments]
        if seqs != list(range(1, len(increments) + 1)) or data_writes(self.info, lock) != len(seqs):
            self.violations.append(
                Violation(
                    "harness",
                    f"counter {lock}: the committed increments are numbered {seqs[:20]}..., "
                    f"not 1..{len(seqs)} as the row's {data_writes(self.info, lock)} writes say",
                )
            )
            return
        after = [0]  # the row's value after each commit
        for k, increment in enumerate(increments, 1):
            read = increment.value - 1
            if read != after[k - 1]:
                # It read the row as commit j left it, and wrote over commits j+1..k-1:
                # each of them committed after its read and before its COMMIT.
                j = max((i for i in range(k - 1) if after[i] == read), default=None)
                missed = increments[(j if j is not None else k - 1) : k - 1]
                if j is None:
                    self.violations.append(
                        Violation(
                            "lost update",
                            f"counter {lock}: increment {increment.seq} "
                            f"({increment.body}) wrote {increment.value}, one more than a "
                            "value the row never held",
                        )
                    )
                for other in missed:
                    self.lost_update(lock, increment, other)
            after.append(increment.value)
        lost = len(increments) - counter
        self.stats["lost updates"] += lost
        if counter != after[-1]:
            self.violations.append(
                Violation(
                    "harness",
                    f"counter {lock} holds {counter}, but its last committed increment wrote "
                    f"{after[-1]}",
                )
            )

    def lost_update(self, lock: str, late: Increment, missed: Increment) -> None:
        """``late`` committed without having read ``missed``, which committed while it ran.

        The two transactions overlapped on one lock: excused only as an overlap
        of two bodies is, by the stale one (the smaller fence) having been told,
        left unconfirmed or killed by the end of its transaction, and a fault
        that can explain how it lost its lease before the newer one entered.
        """
        first, second = self.bodies.get(late.body), self.bodies.get(missed.body)
        if first is None or second is None:
            return  # a harness violation already
        self.stats["lost update pairs"] += 1
        stale, newer = (first, second) if first.fence < second.fence else (second, first)
        what = (
            f"counter {lock}: {first.describe(self.t0)} wrote {late.value} without having read "
            f"the commit of {second.describe(self.t0)} ({missed.value}), made while it ran"
        )
        lo, hi = min(first.enter, second.enter), max(first.end, second.end)
        pids = (first.pid, second.pid)
        if first.fence == second.fence:
            kind = "lost update: one fence, two bodies"
            self.violations.append(Violation(kind, what, lo, hi, pids))
            return
        status = stale.status
        if status == "clean":
            self.violations.append(
                Violation(
                    "lost update: stale holder never told",
                    f"{what}; the stale one (fence {stale.fence}) was never told it lost the lock",
                    lo,
                    hi,
                    pids,
                )
            )
            return
        cause = self.explain(stale, stale.called, newer.enter)
        if cause is None:
            self.violations.append(
                Violation(
                    "lost update without a fault to explain it",
                    f"{what}; the stale one (fence {stale.fence}) was {status}, but nothing in "
                    "the run could have cost its lease",
                    lo,
                    hi,
                    pids,
                )
            )
            return
        self.detail["lost updates excused"][status] += 1
        self.excused.append(f"{what}; excused: {cause}")

    # -- permits, cancellations, orphans ------------------------------------------------------

    def check_permits(self) -> None:
        """At most ``limit`` permit bodies of one semaphore overlap, save for excused holders.

        When a body enters with ``limit`` others inside, enough of those must
        be excused as a stale lock holder is: told, unconfirmed or killed, and
        a fault that explains how it lost its lease between its acquire call
        and this entry. A permit has no fence, so any of them may be the stale one.
        """
        for (space, name), bodies in sorted(self.by_lock(permits=True).items()):
            active: list[Body] = []
            for body in bodies:
                active = [other for other in active if other.end > body.enter]
                limit = body.limit or SEMAPHORE_LIMIT
                if active:
                    self.stats["permit overlaps"] += 1
                over = len(active) + 1 - limit
                if over > 0:
                    self.judge_permits(space, name, limit, body, active, over)
                active.append(body)

    def judge_permits(
        self, space: str, name: str, limit: int, newest: Body, active: list[Body], over: int
    ) -> None:
        self.stats["permits over the limit"] += 1
        excusable = []
        for other in active:
            if other.status == "clean":
                continue
            cause = self.explain(other, other.called, newest.enter)
            if cause is not None:
                excusable.append((other, cause))
        inside = [newest, *active]
        text = (
            f"semaphore {space}:{name} (limit {limit}): {len(inside)} permit bodies at once "
            f"at +{(newest.enter - self.t0) / NS:.3f}s: "
            + " and ".join(body.describe(self.t0) for body in inside)
        )
        if len(excusable) >= over:
            self.detail["excused"]["permit " + excusable[0][0].status] += 1
            self.excused.append(
                text + "; excused: " + "; ".join(f"{b.id}: {cause}" for b, cause in excusable)
            )
            return
        unexcused = [body for body in active if all(body is not b for b, _ in excusable)]
        why = (
            "none of the others was told or unconfirmed"
            if all(body.status == "clean" for body in unexcused)
            else "nothing in the run could have cost the others' leases"
        )
        self.violations.append(
            Violation(
                "permits: more holders than the limit",
                f"{text}; {why}",
                newest.enter,
                min(body.end for body in inside),
                tuple(body.pid for body in inside),
            )
        )

    def count_cancels(self) -> None:
        """Count the cancels by where they found the child: acquiring, inside, or releasing."""
        for event in self.cancels:
            if event.get("n", 1) > 1:
                self.stats["repeated cancels"] += 1
                continue
            body = self.bodies.get(event.get("b") or "")
            if body is None:
                where = "acquiring"
            elif body.leave is not None and body.leave <= event["t"]:
                where = "releasing"
            else:
                where = "inside"
            self.detail["cancelled"][where] += 1
            self.detail["cancel phases"][event.get("phase", "?")] += 1

    def check_orphans(self) -> None:
        """No lock or permit may stay held after the run by an owner that is gone.

        Once every worker had run its last body (the "idle" phase: processes,
        watchdogs and background give-backs alive) and again once every one
        had exited, what the nemesis still saw held must be gone within
        ORPHAN_GRACE, unless its owner was SIGKILLed and its lease explains it
        (see :func:`orphan_deadline`).
        """
        phases = self.info.orphan_phases
        if not phases:
            return
        self.stats["orphan check"] = 1
        last: dict[tuple[str, str, str, str, str], HeldSample] = {}
        for sample in self.info.held_after:
            self.stats["orphan samples"] += 1
            key = (sample.phase, sample.what, sample.space, sample.name, sample.grant)
            if key not in last or sample.t > last[key].t:
                last[key] = sample
        for key in sorted(last):
            sample = last[key]
            start = phases[sample.phase]
            deadline = orphan_deadline(
                sample, start, self.kills, self.info.faults, self.info.hiccups
            )
            if sample.t <= deadline:
                self.stats["held after the run, explained"] += 1
                continue
            self.violations.append(self.orphan(sample, start))

    def check_children(self) -> None:
        """Nothing may stay held in the name of a cancelled child task that has ended.

        A child's grant is given back when it ends, or from the background
        once Redis answers: what the nemesis still sees held in its name
        CHILD_GRACE after it ended, and after every fault that could keep a
        give-back from Redis (its server paused, asleep or restarting, its
        proxy stalled, cut or slowed, its process paused or its loop stalled)
        is over, outlived its owner. A SIGKILLed child's process explains its
        grants up to a wait lease and a lease after the kill.
        """
        if not self.children:
            return
        latest: dict[tuple[int, str, str, str], HeldSample] = {}
        for sample in self.info.held_during:
            if sample.pid is None or sample.thread is None:
                continue
            key = (sample.pid, sample.thread, sample.space, sample.name)
            if key not in latest or sample.t > latest[key].t:
                latest[key] = sample
        self.stats["children ended"] = len(self.children)
        self.stats["child grants sampled"] = len(self.info.held_during)
        for key in sorted(latest):
            sample = latest[key]
            child = self.children.get((key[0], key[1]))
            if child is None or child["t"] >= sample.t:
                continue  # still running when seen
            self.stats["held by an ended child, seen"] += 1
            deadline = self.child_deadline(sample, child)
            if sample.t <= deadline:
                continue
            self.violations.append(self.orphan(sample, child["t"], child=child))

    def child_deadline(self, sample: HeldSample, child: dict[str, Any]) -> int:
        """Until when (ns) ``sample`` may be held after its child task ended."""
        lease = int(sample.lease * NS)
        slot = self.slot_of.get(sample.pid or -1)
        stalls = [(a, b) for a, b, _ in self.merged_async.get(sample.pid or -1, [])]
        blocking = holding_spans(sample.space, slot, self.info.faults, self.info.hiccups) + stalls
        deadline = child["t"] + CHILD_GRACE
        for start, stop in sorted(blocking):
            # A fault that began within a lease before the child ended may have
            # kept its give-back (or the script it gives back) from Redis.
            if start <= deadline and stop >= child["t"] - lease:
                deadline = max(deadline, stop + CHILD_GRACE)
        # A SIGKILLed child's process: as for any killed owner.
        killed = orphan_deadline(sample, 0, self.kills, self.info.faults, self.info.hiccups, stalls)
        return max(deadline, killed)

    def orphan(
        self, sample: HeldSample, start: int, child: dict[str, Any] | None = None
    ) -> Violation:
        """Describe a lock or permit held past its deadline, with its owner's last body."""
        if child is not None:
            after = (
                f"its owner, a child task cancelled {child.get('cancels')} time(s) "
                f"({child.get('phase')}), ended at +{(child['t'] - self.t0) / NS:.3f}s"
            )
            what = f"{sample.what} {sample.space}:{sample.name} ({sample.grant})"
            body = self.bodies.get(child.get("b") or "")
            text = (
                f"{what} still held at +{(sample.t - self.t0) / NS:.3f}s, "
                f"{(sample.t - start) / NS:.3f}s after {after}, with nothing to keep a "
                f"give-back from Redis since; {sample.time_left:.3f}s left on its lease; "
                f"owner record: {sample.owner}; "
                + (f"its body: {body.describe(self.t0)}" if body else "it never entered a body")
            )
            return Violation(
                f"orphan: {sample.what} outlived its owner",
                text,
                start,
                sample.t,
                (sample.pid,) if sample.pid is not None else (),
            )
        after = "had run its last body" if sample.phase == "idle" else "had exited"
        kill = self.kills.get(sample.pid) if sample.pid is not None else None
        fate = (
            f"its process was killed at +{(kill.t0 - self.t0) / NS:.3f}s"
            if kill is not None
            else "its process was not killed"
        )
        # The owner's own bodies (a thread's or task's name is in the owner record).
        mine = [
            body
            for body in self.bodies.values()
            if body.pid == sample.pid
            and body.name == sample.name
            and body.parent is None
            and body.owner == sample.thread
        ]
        last = max(mine, key=lambda body: body.enter, default=None)
        text = (
            f"{sample.what} {sample.space}:{sample.name} ({sample.grant}) still held "
            f"{(sample.t - start) / NS:.3f}s after every worker {after}, "
            f"{sample.time_left:.3f}s left on its lease; owner record: {sample.owner}; {fate}"
        )
        if last is not None:
            text += f"; its owner's last body of it: {last.describe(self.t0)}"
        else:
            text += "; its owner never entered a body of it"
        return Violation(
            f"orphan: {sample.what} outlived its owner",
            text,
            start,
            sample.t,
            (sample.pid,) if sample.pid is not None else (),
        )

    def check_processes(self) -> None:
        pids = {event["pid"] for event in self.events}
        for pid in sorted(pids):
            if pid not in self.done and pid not in self.kills:
                self.violations.append(
                    Violation(
                        "harness",
                        f"worker pid {pid} (slot {self.slot_of.get(pid)}) stopped journalling "
                        "without finishing and without being killed by the nemesis",
                        self.last_seen.get(pid, 0),
                        self.last_seen.get(pid, 0),
                        (pid,),
                    )
                )

    def run(self) -> Verdict:
        self.read()
        self.settle_ends()
        self.collect_threats()
        groups = self.by_lock()
        self.check_overlaps(groups)
        self.check_told_at_exit()
        self.check_losses()
        self.check_fences(groups)
        self.check_permits()
        self.count_cancels()
        self.check_data()
        self.check_orphans()
        self.check_children()
        self.check_processes()
        stats: dict[str, Any] = dict(self.stats)
        for key, counter in self.detail.items():
            stats[key] = dict(counter)
        return Verdict(
            self.violations + list(self.info.problems),
            stats,
            list(self.bodies.values()),
            self.excused,
        )


def data_writes(info: RunInfo, lock: str) -> int:
    """The number of committed writes ``lock``'s counter row counted."""
    assert info.data is not None
    return info.data.writes.get(lock, 0)


def check(events: list[dict[str, Any]], info: RunInfo) -> Verdict:
    """Check the workers' journalled events of a run against what the lock promises."""
    return _Checker(events, info).run()


def load_journals(directory: Path) -> list[dict[str, Any]]:
    """Read every worker journal in ``directory`` (a torn last line of a killed one is skipped)."""
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):
        with path.open(encoding="utf-8") as journal:
            for line in journal:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    return events


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line for line in text.strip().splitlines())


# == the report ==================================================================================


@dataclass(repr=False)
class Report:
    """The outcome of one run: its seed, what happened, and every violation found."""

    topology: str
    seed: int
    seconds: float
    tuning: Tuning
    plan: list[Fault]
    info: RunInfo
    verdict: Verdict

    def __repr__(self) -> str:
        return (
            f"<Report seed={self.seed} topology={self.topology} violations={len(self.violations)}>"
        )

    @property
    def ok(self) -> bool:
        return not self.verdict.violations

    @property
    def violations(self) -> list[Violation]:
        return self.verdict.violations

    def faults_by_kind(self) -> Counter[str]:
        return Counter(
            record.kind for record in self.info.faults if not record.note.startswith("skipped")
        )

    def summary(self) -> str:
        stats = self.verdict.stats
        tuning = self.tuning
        kinds = stats.get("kinds", {})
        statuses = stats.get("status", {})
        refused = stats.get("refused", {})
        excused = stats.get("excused", {})
        faults = self.faults_by_kind()
        skipped = sum(1 for r in self.info.faults if r.note.startswith("skipped"))
        runner = self.info.stats
        lines = [
            f"nemesis seed {self.seed}, topology {self.topology}: {self.seconds:g}s, "
            f"{tuning.slots} workers x ({tuning.threads} threads + {tuning.tasks} tasks), "
            f"ttl {tuning.ttl:g}s",
            f"  bodies: {stats.get('bodies', 0)} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
            + f"; nested levels {stats.get('levels', 0)})",
            "  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
            "  acquisitions refused: "
            + (", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "none"),
            f"  faults: {sum(faults.values())} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(faults.items()))
            + f"); skipped {skipped}; lease-threatening {stats.get('threats', 0)}",
            f"  shared: {stats.get('shared bodies', 0)} bodies, "
            f"{stats.get('shared levels', 0)} nested levels, "
            f"{stats.get('shared overlaps', 0)} pairs of shared bodies overlapping",
            f"  overlaps: {stats.get('overlaps', 0)} pairs; excused "
            + (", ".join(f"stale holder {k} {v}" for k, v in sorted(excused.items())) or "none")
            + f"; hand-off stall scenarios {stats.get('handoff scenarios', 0)} "
            f"(judged {stats.get('handoff scenarios judged', 0)})",
            f"  losses nothing explains (not violations by themselves): "
            f"{stats.get('unexplained losses', 0)}",
            self._data_line(),
            f"  fences: {stats.get('fences unique', 0)} checked unique, "
            f"{stats.get('fences in order', 0)} consecutive pairs checked in order, "
            f"{stats.get('fences against shared', 0)} exclusive ones against shared bodies",
            f"  permits: {stats.get('permit bodies', 0)} bodies, "
            f"{stats.get('permit overlaps', 0)} entered beside another, "
            f"{stats.get('permits over the limit', 0)} over the limit (each excused or a "
            "violation)",
            "  cancels: "
            + (
                ", ".join(f"{k} {v}" for k, v in sorted(stats.get("cancelled", {}).items()))
                or "none"
            )
            + f"; repeated {stats.get('repeated cancels', 0)}; "
            f"{stats.get('children ended', 0)} cancelled children ended, "
            f"{stats.get('child grants sampled', 0)} samples of their grants, "
            f"{stats.get('held by an ended child, seen', 0)} of their grants seen held after",
            f"  keys: {runner.get('keys scanned', 0)} scanned for an expiry in "
            f"{runner.get('scans', 0)} scans",
            f"  orphans: {'checked' if stats.get('orphan check') else 'not checked'}, "
            f"{stats.get('orphan samples', 0)} held samples; everything given back "
            f"{runner.get('drained while idle', 'not checked')} of the workers going idle, "
            f"{runner.get('drained', 'not checked')} of their exit"
            + (
                f"; {runner['permit copies on too few masters']} quorum permit copies on "
                "too few masters to be a permit, left to their lease"
                if runner.get("permit copies on too few masters")
                else ""
            ),
            f"  result: {'OK' if self.ok else f'{len(self.violations)} violation(s)'}"
            + (
                " ("
                + ", ".join(
                    f"{k} {v}" for k, v in sorted(Counter(v.kind for v in self.violations).items())
                )
                + ")"
                if self.violations
                else ""
            ),
        ]
        return "\n".join(lines)

    def _data_line(self) -> str:
        stats = self.verdict.stats
        if not stats.get("data checked"):
            return "  data: not checked"
        excused = stats.get("lost updates excused", {})
        rule = (
            " (locks given back at their block's end: the transaction rule was off)"
            if self.info.release_at_block_end
            else ""
        )
        return (
            f"  data{rule}: {stats.get('transactional bodies', 0)} transactional bodies, "
            f"{stats.get('increments committed', 0)} increments committed "
            f"({stats.get('commits a kill kept out of the journal', 0)} not journalled, "
            f"killed right after the COMMIT), {stats.get('increments rolled back', 0)} "
            f"rolled back; {stats.get('counters checked', 0)} counters checked, lost updates "
            f"{stats.get('lost updates', 0)} ({stats.get('lost update pairs', 0)} pairs; excused "
            + (", ".join(f"stale holder {k} {v}" for k, v in sorted(excused.items())) or "none")
            + ")"
        )

    def describe_violations(self, limit: int = 10) -> str:
        """Return the violations with the faults and pauses around each."""
        t0 = self.info.t0
        out = [f"seed {self.seed}, topology {self.topology}: {len(self.violations)} violation(s)"]
        for violation in self.violations[:limit]:
            out.append(f"- {violation.kind}: {violation.text}")
            lo, hi = violation.lo - 3 * NS, violation.hi + NS // 2
            near = [
                record.describe(t0)
                for record in self.info.faults
                if record.t0 <= hi and record.end >= lo
            ]
            for pid in sorted(set(violation.pids)):
                near += [
                    f"+{(a - t0) / NS:.3f}s..+{(b - t0) / NS:.3f}s {what} of pid {pid}"
                    for a, b, what in self._worker_gaps(pid)
                    if a <= hi and b >= lo
                ]
            if near:
                out.append("    faults around it:")
                out += [f"      {line}" for line in sorted(set(near))]
            else:
                out.append("    no fault around it")
        if len(self.violations) > limit:
            out.append(f"... and {len(self.violations) - limit} more")
        return "\n".join(out)

    def describe_excused(self, limit: int = 10) -> str:
        """Return the overlaps that were excused, with the fault that explains each."""
        lines = [f"excused overlaps: {len(self.verdict.excused)}"]
        lines += [f"- {text}" for text in self.verdict.excused[:limit]]
        if len(self.verdict.excused) > limit:
            lines.append(f"... and {len(self.verdict.excused) - limit} more")
        return "\n".join(lines)

    def _worker_gaps(self, pid: int) -> list[tuple[int, int, str]]:
        """Return the hiccups and loop stalls ``pid`` journalled."""
        return list(self.info.stats.get("gaps", {}).get(pid, []))


# == the runner ==================================================================================


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the nemesis that started it dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stop(pid: int, timeout: float = 2.0) -> int:
    """SIGSTOP ``pid`` and return when it was seen stopped (or the deadline passed)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while _state(pid) not in ("T", "t", "Z", "") and time.monotonic() < deadline:
        time.sleep(0.001)
    return now_ns()


@contextlib.contextmanager
def operator_settings(caches: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Give this process the operator's CACHES (direct to the servers) for the block."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            CACHES=caches,
            INSTALLED_APPS=["django_redis_mutex"],
            USE_TZ=True,
            SECRET_KEY="nemesis-operator",
            LOGGING_CONFIG=None,
        )
        django.setup()
        yield
        return
    from django.test import override_settings

    with override_settings(CACHES=caches):
        yield


class _Slot:
    """One worker slot: its current process, incarnation and proxies."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.stopped: FaultRecord | None = None
        self.killing = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Nemesis:
    """Start the servers, proxies and workers of one run, apply the plan, and check it."""

    def __init__(
        self,
        topology: str,
        seconds: float,
        seed: int,
        tuning: Tuning | None = None,
        *,
        keep: bool = False,
        log: Callable[[str], None] | None = None,
        postgres: Any = None,
    ) -> None:
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, not {topology!r}")
        self.topology = topology
        self.seconds = seconds
        self.seed = seed
        self.tuning = tuning or Tuning()
        self.keep = keep
        self.log = log or (lambda _line: None)
        self.prefix = f"r{random.Random(f'{seed}:{topology}').getrandbits(40):x}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"nemesis-{topology}-"))
        self.history = self.workdir / "history"
        self.history.mkdir()
        self.servers: dict[str, Any] = {}
        #: The PostgreSQL server of the data (a PostgresServer); started here when not given.
        self.postgres = postgres
        self._own_postgres = postgres is None
        self.database: dict[str, Any] = {}
        self.release_at_block_end = os.environ.get(RELEASE_AT_BLOCK_END_ENV) == "1"
        self.proxies: dict[tuple[int, str], Any] = {}
        self.slots = [_Slot(i) for i in range(self.tuning.slots)]
        self.pid_slot: dict[int, int] = {}
        self.records: list[FaultRecord] = []
        self._ids = itertools.count(1)
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nemesis-operator")
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._hiccups: list[tuple[int, int]] = []
        self._sleepers: list[threading.Thread] = []
        self._held_after: list[HeldSample] = []
        self._held_during: list[HeldSample] = []
        #: The quorum permit copies on too few masters seen after the run, by (semaphore, token).
        self._minority_permits: dict[tuple[str, str], dict[str, Any]] = {}
        self._orphan_phases: dict[str, int] = {}
        self._problems: list[Violation] = []
        self._ttl_lock = threading.Lock()
        self._keys_scanned = 0
        self._scans = 0
        self._closed = False
        self.t0 = 0
        self.end = 0
        atexit.register(self.close)

    # -- set-up -------------------------------------------------------------------------------

    def _start_servers(self) -> None:
        from django_redis_mutex.testing import RedisServer

        from .proxy import Proxy

        for name in SERVERS[self.topology]:
            # DEBUG SLEEP stalls the server with its clients connected (sleep-redis).
            self.servers[name] = RedisServer(extra_args=["--enable-debug-command", "yes"]).start()
        self._start_database()
        for slot in self.slots:
            for name, server in self.servers.items():
                self.proxies[(slot.index, name)] = Proxy(server.port).start()

    def _start_database(self) -> None:
        """Create the run's database (on a PostgreSQL server of its own unless given one)."""
        from .databases import PostgresServer
        from .nemesis_data import create_database

        if self.postgres is None:
            self.postgres = PostgresServer().start()
        locks = [f"{spec.space}:{spec.name}" for spec in lock_specs(self.topology)]
        self.database = create_database(self.postgres, locks)

    def _config_path(self, slot: int) -> Path:
        return self.workdir / f"slot{slot}.json"

    def _write_configs(self) -> None:
        for slot in self.slots:
            urls = {name: self.proxies[(slot.index, name)].url for name in self.servers}
            config = {
                "topology": self.topology,
                "seed": self.seed,
                "slot": slot.index,
                # A quorum lock bounds each request to a master by QUORUM_TIMEOUT;
                # the members' own socket timeout is long, so a lock that asked a
                # hung master without that bound would hang visibly, not for 1 s.
                "caches": cache_entries(
                    self.topology,
                    urls,
                    self.prefix,
                    self.tuning,
                    self.tuning.socket_timeout,
                    member_timeout=max(self.tuning.socket_timeout, 5.0),
                ),
                "locks": [spec.to_json() for spec in lock_specs(self.topology)],
                "database": self.database,
                "release_at_block_end": self.release_at_block_end,
                "handoff": handoff_spec(self.topology, slot.index).to_json(),
                "linger": linger_spec(self.topology).to_json(),
                "semaphore": semaphore_spec(self.topology).to_json(),
                "ttl": self.tuning.ttl,
                "timeout": self.tuning.acquire_timeout,
                "threads": self.tuning.threads,
                "tasks": self.tuning.tasks,
                "history": str(self.history),
                "workdir": str(self.workdir),
            }
            self._config_path(slot.index).write_text(json.dumps(config))

    def _operator_caches(self) -> dict[str, dict[str, Any]]:
        urls = {name: server.url for name, server in self.servers.items()}
        return cache_entries(self.topology, urls, self.prefix, self.tuning, 0.5)

    def _spawn(self, slot: _Slot) -> None:
        slot.incarnation += 1
        env = dict(os.environ)
        env.pop("DJANGO_SETTINGS_MODULE", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with open(self.workdir / f"slot{slot.index}-{slot.incarnation}.log", "wb") as output:
            slot.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.nemesis",
                    "worker",
                    str(self._config_path(slot.index)),
                    str(slot.incarnation),
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        slot.killing = False
        self.pid_slot[slot.process.pid] = slot.index

    def _ready(self, slot: _Slot) -> bool:
        return (self.workdir / f"ready-{slot.index}-{slot.incarnation}").exists()

    def _log_tail(self, slot: _Slot, lines: int = 30) -> str:
        path = self.workdir / f"slot{slot.index}-{slot.incarnation}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            while not self._ready(slot):
                assert slot.process is not None
                if slot.process.poll() is not None:
                    raise RuntimeError(
                        f"worker of slot {slot.index} exited with {slot.process.returncode} "
                        f"before it was ready:\n{self._log_tail(slot)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker of slot {slot.index} not ready within {timeout}s")
                time.sleep(0.02)

    # -- background watchers ------------------------------------------------------------------

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _heartbeat(self) -> None:
        previous = now_ns()
        while not self._stopping.wait(0.02):
            current = now_ns()
            if current - previous > HICCUP * NS:
                self._hiccups.append((previous, current))
            previous = current

    def _scan_expiries(self, final: bool = False) -> None:
        """Look at every key of every reachable server; a key without expiry is a violation."""
        import redis

        for name, server in list(self.servers.items()):
            if server.process is None:
                continue
            client = redis.Redis(port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                keys = list(client.scan_iter(count=1000))
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.pttl(key)
                ttls = pipe.execute() if keys else []
            except redis.RedisError:
                if final:
                    self._problems.append(
                        Violation("harness", f"server {name} could not be scanned at the end")
                    )
                continue
            finally:
                client.close()
            with self._ttl_lock:
                self._scans += 1
                self._keys_scanned += len(keys)
                for key, pttl in zip(keys, ttls, strict=True):
                    if pttl == -1:
                        t = now_ns()
                        self._problems.append(
                            Violation(
                                "key without expiry",
                                f"server {name}: key {key.decode(errors='replace')!r} has no "
                                f"expiry (PTTL -1) at +{(t - self.t0) / NS:.3f}s",
                                t,
                                t,
                            )
                        )

    def _scanner(self) -> None:
        while not self._stopping.wait(2.0):
            self._scan_expiries()

    def _sample_children(self) -> None:
        """Note, during the run, what is held in the name of a cancelled child task.

        Such a child has a name of its own (CHILD_SUFFIX) that ends up in the
        owner record of whatever it took; the checker compares these samples
        with when each child ended (see _Checker.check_children).
        """
        while not self._stopping.wait(0.3):
            if now_ns() > self.end:
                return
            self._held_during += [
                sample
                for sample in self._held_now("run", quiet=True)
                if sample.thread and CHILD_SUFFIX.search(sample.thread)
            ]

    # -- the schedule -------------------------------------------------------------------------

    def _at(self, when: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), action))

    def _record(self, kind: str, **fields: Any) -> FaultRecord:
        record = FaultRecord(id=next(self._ids), kind=kind, t0=fields.pop("t0", now_ns()), **fields)
        self.records.append(record)
        return record

    def _skip(self, fault: Fault, why: str) -> None:
        self._record(fault.kind, slot=fault.slot, server=fault.server, note=f"skipped: {why}")

    def _holder_slot(self) -> int | None:
        """Return the slot whose worker holds the hot lock now, if an operator can tell."""
        from django_redis_mutex import held_locks

        space, name = HOT[self.topology]
        if any(server.process is None for server in self.servers.values()):
            return None  # a down server would cost a socket timeout to find out
        if any(r.kind in ("pause-redis", "sleep-redis") and r.t1 is None for r in self.records):
            return None
        try:
            locks = held_locks(OPERATOR_ALIAS[space])
        except Exception:
            return None
        for held in locks:
            if held.name == name:
                return self.pid_slot.get(held.owner.pid or -1)
        return None

    def _target(self, fault: Fault) -> _Slot | None:
        """Return the live, ready, running slot the fault aims at, or None (skipped)."""
        index = fault.slot
        if fault.holder:
            holder = self._holder_slot()
            if holder is not None and holder in fault.allowed:
                index = holder
        assert index is not None
        slot = self.slots[index]
        for candidate in (slot, self.slots[fault.slot]) if fault.slot is not None else (slot,):
            alive = candidate.process is not None and candidate.process.poll() is None
            if alive and candidate.stopped is None and self._ready(candidate):
                return candidate
        return None

    def _apply(self, fault: Fault) -> None:
        kind = fault.kind
        if kind in (
            "pause-worker",
            "kill-worker",
            "stall-loop",
            "handoff-stall",
            "side-hold",
            "nested-reset",
        ):
            slot = self._target(fault)
            if slot is None:
                self._skip(fault, "no live worker in the slot")
                return
            getattr(self, "_" + kind.replace("-", "_"))(fault, slot)
        else:
            getattr(self, "_" + kind.replace("-", "_"))(fault)

    def _pause_worker(self, fault: Fault, slot: _Slot) -> None:
        pid = slot.pid
        assert pid is not None
        record = self._record("pause-worker", t0=_stop(pid), slot=slot.index, pid=pid)
        record.seconds = fault.seconds
        slot.stopped = record

        def resume() -> None:
            if slot.stopped is record and slot.pid == pid:
                os.kill(pid, signal.SIGCONT)
                record.t1 = now_ns()
                slot.stopped = None

        self._at(record.t0 + int(fault.seconds * NS), resume)

    def _kill_worker(self, fault: Fault, slot: _Slot) -> None:
        process = slot.process
        assert process is not None
        slot.killing = True
        stopped = slot.stopped
        process.kill()
        process.wait(10)
        record = self._record("kill-worker", slot=slot.index, pid=process.pid)
        record.seconds = fault.seconds
        if stopped is not None:
            record.stopped_since = stopped.t0
            stopped.t1 = record.t0
            slot.stopped = None
        slot.process = None
        self._at(record.t0 + int(fault.seconds * NS), lambda: self._restart(slot))

    def _restart(self, slot: _Slot) -> None:
        if self._stopping.is_set() or now_ns() > self.end - NS:
            return
        self._spawn(slot)
        self._record("restart-worker", slot=slot.index, pid=slot.pid)

    def _command(self, slot: _Slot, command: dict[str, Any]) -> None:
        path = self.workdir / f"control-{slot.index}-{slot.incarnation}"
        with open(path, "a", encoding="utf-8") as control:
            control.write(json.dumps(command) + "\n")
        assert slot.pid is not None
        os.kill(slot.pid, signal.SIGUSR1)

    def _stall_loop(self, fault: Fault, slot: _Slot) -> None:
        record = self._record("stall-loop", slot=slot.index, pid=slot.pid, seconds=fault.seconds)
        self._command(slot, {"cmd": "stall", "seconds": fault.seconds, "fault": record.id})

    def _handoff_stall(self, fault: Fault, slot: _Slot) -> None:
        record = self._record("handoff-stall", slot=slot.index, pid=slot.pid, seconds=fault.seconds)
        record.note = fault.variant
        self._command(
            slot,
            {
                "cmd": "handoff-stall",
                "seconds": fault.seconds,
                "variant": fault.variant,
                "fault": record.id,
            },
        )

    def _side_hold(self, fault: Fault, slot: _Slot) -> None:
        record = self._record("side-hold", slot=slot.index, pid=slot.pid, seconds=fault.seconds)
        self._command(slot, {"cmd": "side-hold", "seconds": fault.seconds, "fault": record.id})

    def _nested_reset(self, fault: Fault, slot: _Slot) -> None:
        """Reset the hot lock while a worker is inside a nested level of it."""
        record = self._record("nested-reset", slot=slot.index, pid=slot.pid)
        inner = self.workdir / f"nested-{record.id}-inner"
        done = self.workdir / f"nested-{record.id}-done"
        self._command(slot, {"cmd": "nested-reset", "fault": record.id})

        def operator() -> None:
            deadline = time.monotonic() + 15.0
            while not inner.exists():
                if time.monotonic() > deadline or self._stopping.is_set():
                    record.note = "the nested level was never entered"
                    return
                time.sleep(0.005)
            self._run_reset(self._record("reset", space=fault.space, name=fault.name))
            done.touch()

        self._executor.submit(operator)

    def _pause_redis(self, fault: Fault) -> None:
        assert fault.server is not None
        server = self.servers[fault.server]
        if server.process is None:
            self._skip(fault, "server down")
            return
        pid = server.process.pid
        record = self._record("pause-redis", t0=_stop(pid), server=fault.server, pid=pid)
        record.seconds = fault.seconds

        def resume() -> None:
            if server.process is not None and server.process.pid == pid:
                os.kill(pid, signal.SIGCONT)
            record.t1 = now_ns()

        self._at(record.t0 + int(fault.seconds * NS), resume)

    def _sleep_redis(self, fault: Fault) -> None:
        """Keep a server busy with DEBUG SLEEP, past the workers' socket timeout.

        Unlike a SIGSTOP, the server has read what its clients sent before the
        sleep and runs it after: an acquisition or release whose caller timed
        out still happens, later.
        """
        import redis

        assert fault.server is not None
        server = self.servers[fault.server]
        if server.process is None:
            self._skip(fault, "server down")
            return
        record = self._record("sleep-redis", server=fault.server, seconds=fault.seconds)
        target = self._target(fault) if fault.slot is not None else None
        # What lives on the sleeping server: the linger lock, the semaphore, or both.
        takes = [
            what
            for what, spec in (("lock", linger_spec), ("permit", semaphore_spec))
            if spec(self.topology).space in SPACES_ON[fault.server]
        ]
        if target is not None and takes and fault.seconds > 2 * self.tuning.socket_timeout:
            # Its acquisitions land in the sleep, and are cancelled there.
            self._command(
                target,
                {"cmd": "cancel-in-sleep", "delay": 0.1, "takes": takes, "fault": record.id},
            )
            record.slot, record.pid = target.index, target.pid
            record.note = f"with cancelled acquisitions ({', '.join(takes)})"

        def sleep() -> None:
            client = redis.Redis(port=server.port, socket_timeout=fault.seconds + 10)
            try:
                record.t0 = now_ns()
                client.execute_command("DEBUG", "SLEEP", f"{fault.seconds:.3f}")
            except redis.RedisError as exc:
                record.note = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                record.t1 = now_ns()
                client.close()

        thread = threading.Thread(target=sleep, name="nemesis-sleep-redis", daemon=True)
        # The command runs on the worker's loop first; then Redis falls asleep.
        self._at(now_ns() + 50_000_000, thread.start)
        self._sleepers.append(thread)

    def _restart_redis(self, fault: Fault) -> None:
        assert fault.server is not None
        server = self.servers[fault.server]
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.kill()
        record = self._record("restart-redis", server=fault.server, seconds=fault.seconds)

        def start() -> None:
            server.start()
            record.t1 = now_ns()

        self._at(record.t0 + int(fault.seconds * NS), start)

    def _proxies_of(self, fault: Fault) -> list[Any]:
        assert fault.server is not None
        if fault.slot is None:
            return [self.proxies[(slot.index, fault.server)] for slot in self.slots]
        return [self.proxies[(fault.slot, fault.server)]]

    def _latency(self, fault: Fault) -> None:
        proxies = self._proxies_of(fault)
        for proxy in proxies:
            proxy.latency = fault.latency
        record = self._record(
            "latency", slot=fault.slot, server=fault.server, latency=fault.latency
        )

        def heal() -> None:
            for proxy in proxies:
                proxy.latency = 0.0
            record.t1 = now_ns()

        self._at(record.t0 + int(fault.seconds * NS), heal)

    def _stall_proxy(self, fault: Fault) -> None:
        proxies = self._proxies_of(fault)
        for proxy in proxies:
            proxy.stall()
        record = self._record("stall-proxy", slot=fault.slot, server=fault.server)

        def heal() -> None:
            for proxy in proxies:
                proxy.resume()
            record.t1 = now_ns()

        self._at(record.t0 + int(fault.seconds * NS), heal)

    def _cut_proxy(self, fault: Fault) -> None:
        cut = sum(proxy.cut() for proxy in self._proxies_of(fault))
        self._record("cut-proxy", slot=fault.slot, server=fault.server, note=f"{cut} connections")

    def _reset(self, fault: Fault) -> None:
        record = self._record("reset", space=fault.space, name=fault.name)
        self._executor.submit(self._run_reset, record)

    def _run_reset(self, record: FaultRecord) -> None:
        """Force-release a lock or a semaphore's permits as an operator would (in a thread).

        Through the quorum alias on the quorum: both resets then run on every
        master (a member alias of a quorum is refused).
        """
        from django_redis_mutex import reset, reset_semaphore

        assert record.space is not None and record.name is not None
        record.t0 = now_ns()
        using = OPERATOR_ALIAS[record.space]
        try:
            if record.name == semaphore_spec(self.topology).name:
                record.held = reset_semaphore(record.name, using=using) > 0
            else:
                record.held = reset(record.name, using=using)
        except Exception as exc:
            record.held = None
            record.note = f"{type(exc).__name__}: {exc}"[:200]
        record.t1 = now_ns()

    # -- the run ------------------------------------------------------------------------------

    def _sleep_until(self, when: int) -> None:
        while True:
            left = when - now_ns()
            self._watch_workers()
            if left <= 0:
                return
            time.sleep(min(left / NS, 0.05))

    def _watch_workers(self) -> None:
        for slot in self.slots:
            process = slot.process
            if process is None or slot.killing or process.poll() is None:
                continue
            if now_ns() >= self.end:
                continue  # finishing on its own
            self._problems.append(
                Violation(
                    "harness",
                    f"worker of slot {slot.index} (pid {process.pid}) exited with "
                    f"{process.returncode} mid-run:\n{_indent(self._log_tail(slot), 6)}",
                    now_ns(),
                    now_ns(),
                    (process.pid,),
                )
            )
            record = self._record("teardown-kill", slot=slot.index, pid=process.pid)
            record.note = "exited by itself"
            slot.process = None
            self._at(now_ns() + NS // 2, functools.partial(self._restart, slot))

    def _heal(self) -> None:
        """Undo every fault still in force: resume, restart, unstall, no latency."""
        while self._queue:
            _, _, action = heapq.heappop(self._queue)
            action()
        for thread in self._sleepers:
            thread.join(15)
        for slot in self.slots:
            if slot.stopped is not None and slot.pid is not None:
                os.kill(slot.pid, signal.SIGCONT)
                slot.stopped.t1 = now_ns()
                slot.stopped = None
        for server in self.servers.values():
            if server.process is None:
                server.start()
            else:
                os.kill(server.process.pid, signal.SIGCONT)
        for proxy in self.proxies.values():
            proxy.latency = 0.0
            proxy.resume()

    def _finish_workers(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            process = slot.process
            if process is None:
                continue
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait(10)
                record = self._record("teardown-kill", slot=slot.index, pid=process.pid)
                self._problems.append(
                    Violation(
                        "stuck worker",
                        f"worker of slot {slot.index} (pid {process.pid}) had not finished "
                        f"{timeout:g}s after the run ended, with every fault healed:\n"
                        + _indent(self._log_tail(slot), 6),
                        record.t0,
                        record.t0,
                        (process.pid,),
                    )
                )
                continue
            if process.returncode != 0:
                self._problems.append(
                    Violation(
                        "harness",
                        f"worker of slot {slot.index} (pid {process.pid}) exited with "
                        f"{process.returncode}:\n{_indent(self._log_tail(slot), 6)}",
                        now_ns(),
                        now_ns(),
                        (process.pid,),
                    )
                )
            slot.process = None

    def _wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every live worker has run its last body (it stays alive meanwhile)."""
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            while slot.process is not None and slot.process.poll() is None:
                if (self.workdir / f"idle-{slot.index}-{slot.incarnation}").exists():
                    break
                if time.monotonic() > deadline:
                    return  # _finish_workers reports it stuck
                time.sleep(0.02)

    def _held_now(self, phase: str, quiet: bool = False) -> list[HeldSample]:
        """Return every lock and permit held now in the run's namespace, on every server."""
        from django_redis_mutex import held_locks, held_semaphores

        samples: list[HeldSample] = []
        spaces = sorted({s for server in SERVERS[self.topology] for s in SPACES_ON[server]})
        for space in spaces:
            alias = OPERATOR_ALIAS[space]
            t = now_ns()
            try:
                locks = held_locks(alias)
                sems = held_semaphores(alias)
                if space == "quorum" and phase != "run":
                    self._note_partial_permits(sems, phase)
            except Exception as exc:
                if not quiet:  # during the run, faults make a server unreadable at times
                    self._problems.append(
                        Violation("harness", f"the orphan check could not read {alias}: {exc!r}")
                    )
                continue
            for lock in locks:
                holders = lock.holders or (lock,)
                for holder in holders:
                    samples.append(
                        HeldSample(
                            phase,
                            t,
                            "lock",
                            space,
                            lock.name,
                            f"fence {holder.fence}",
                            holder.owner.pid,
                            str(holder.owner),
                            holder.time_left,
                            longest_lease(self.topology, self.tuning, lock.name),
                            holder.owner.thread,
                        )
                    )
            for sem in sems:
                for permit in sem.holders:
                    samples.append(
                        HeldSample(
                            phase,
                            t,
                            "permit",
                            space,
                            sem.name,
                            f"token {permit.token}",
                            permit.owner.pid,
                            str(permit.owner),
                            permit.time_left,
                            longest_lease(self.topology, self.tuning, sem.name),
                            permit.owner.thread,
                        )
                    )
        return samples

    def _note_partial_permits(self, listed: list[HeldSemaphore], phase: str) -> None:
        """Note the quorum permit copies on too few masters to be a permit.

        held_semaphores() of the quorum alias lists a permit held on as many
        masters as grant one (all three for a limit of two), as held_locks()
        lists a quorum lock held on a majority. A copy on fewer masters is no
        permit: no holder holds it or can be told it is lost, and it ends with
        its lease. A quorum operation leaves one on a master it did not reach,
        so each master is read through its own alias and such copies seen
        after the run are counted ("permit copies on too few masters"), not
        judged.
        """
        from django_redis_mutex import held_semaphores

        granted = {holder.token for sem in listed for holder in sem.holders}
        copies: dict[tuple[str, str], list[SemaphoreHolder]] = defaultdict(list)
        for master in MASTERS:
            for sem in held_semaphores(master):
                for holder in sem.holders:
                    if holder.token not in granted:
                        copies[(sem.name, holder.token)].append(holder)
        for (name, token), held in copies.items():
            self._minority_permits[(name, token)] = {
                "what": "permit copy on too few masters",
                "phase": phase,
                "t": now_ns(),
                "name": name,
                "owner": str(held[0].owner),
                "masters": len(held),
                "time_left": max(holder.time_left for holder in held),
            }

    def _look_for_orphans(self, phase: str) -> str:
        """Poll what is held until nothing is, or until each thing's deadline has passed.

        The checker judges the samples (see _Checker.check_orphans); here they
        are only gathered, every 50 ms.
        """
        started = now_ns()
        self._orphan_phases[phase] = started
        kills = {r.pid: r for r in self.records if r.kind in ("kill-worker", "teardown-kill")}
        kills = {pid: record for pid, record in kills.items() if pid is not None}
        cap = started + 20 * NS
        while True:
            samples = self._held_now(phase)
            self._held_after += samples
            if not samples:
                return f"within {(now_ns() - started) / NS:.2f}s"
            latest = max(
                orphan_deadline(sample, started, kills, self.records, self._hiccups)
                for sample in samples
            )
            if now_ns() > min(latest + NS // 4, cap):
                return "never"
            time.sleep(0.05)

    def _release_workers(self) -> None:
        """Let the idle workers exit."""
        (self.workdir / "quit").touch()

    def run(self) -> Report:
        """Run the whole thing and return the report; everything started is stopped after."""
        plan = make_plan(self.seed, self.topology, self.seconds, self.tuning)
        try:
            self._start_servers()
            self._write_configs()
            with operator_settings(self._operator_caches()):
                for slot in self.slots:
                    self._spawn(slot)
                self._wait_ready()
                self._thread(self._heartbeat, "nemesis-heartbeat")
                self.t0 = now_ns()
                self.end = self.t0 + int(self.seconds * NS)
                (self.workdir / "go.tmp").write_text(json.dumps({"t0": self.t0, "end": self.end}))
                (self.workdir / "go.tmp").rename(self.workdir / "go")
                self.log(f"nemesis: seed {self.seed}, topology {self.topology}, {self.seconds:g}s")
                self._thread(self._scanner, "nemesis-expiry-scan")
                self._thread(self._sample_children, "nemesis-child-samples")
                for fault in plan:
                    self._at(self.t0 + int(fault.at * NS), functools.partial(self._apply, fault))
                while self._queue and self._queue[0][0] <= self.end:
                    when, _, action = heapq.heappop(self._queue)
                    self._sleep_until(when)
                    action()
                self._sleep_until(self.end)
                self._heal()
                self._wait_idle()
                orphans_idle = self._look_for_orphans("idle")
                self._release_workers()
                self._finish_workers()
                self._executor.shutdown(wait=True)
                self._stopping.set()
                for thread in self._threads:
                    thread.join(10)
                self._scan_expiries(final=True)
                drained = self._look_for_orphans("exited")
            info = RunInfo(
                topology=self.topology,
                seed=self.seed,
                tuning=self.tuning,
                t0=self.t0,
                end=self.end,
                faults=self.records,
                hiccups=self._hiccups,
                problems=self._problems,
                data=read_state(self.database),
                release_at_block_end=self.release_at_block_end,
                held_after=self._held_after,
                held_during=self._held_during,
                orphan_phases=self._orphan_phases,
            )
            events = load_journals(self.history)
            verdict = check(events, info)
            with open(self.workdir / "faults.jsonl", "w", encoding="utf-8") as log:
                for record in self.records:
                    log.write(json.dumps(record.__dict__) + "\n")
            with open(self.workdir / "held.jsonl", "w", encoding="utf-8") as log:
                for sample in self._held_during + self._held_after:
                    log.write(json.dumps(sample.__dict__) + "\n")
                for copy in self._minority_permits.values():
                    log.write(json.dumps(copy) + "\n")
            (self.workdir / "plan.txt").write_text(
                "".join(fault.describe() + "\n" for fault in plan), encoding="utf-8"
            )
            gaps: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
            for event in events:
                if event["e"] in ("hiccup", "stall"):
                    gaps[event["pid"]].append((event["t0"], event["t1"], event["e"]))
            info.stats.update(
                {
                    "keys scanned": self._keys_scanned,
                    "scans": self._scans,
                    "drained": drained,
                    "drained while idle": orphans_idle,
                    "permit copies on too few masters": len(self._minority_permits),
                    "gaps": dict(gaps),
                    "workdir": str(self.workdir) if self.keep else "",
                }
            )
            return Report(self.topology, self.seed, self.seconds, self.tuning, plan, info, verdict)
        finally:
            self.close()

    def close(self) -> None:
        """Stop everything this run started; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        for slot in self.slots:
            process = slot.process
            if process is not None and process.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGCONT)
                    os.killpg(process.pid, signal.SIGKILL)
            if process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
        self._executor.shutdown(wait=True, cancel_futures=True)
        for thread in self._threads:
            thread.join(10)
        for proxy in self.proxies.values():
            proxy.close()
        for server in self.servers.values():
            if server.process is not None:
                with contextlib.suppress(OSError):
                    os.kill(server.process.pid, signal.SIGCONT)
            server.close()
        if self._own_postgres and self.postgres is not None:
            self.postgres.close()
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)


def run_nemesis(
    topology: str,
    seconds: float,
    seed: int,
    tuning: Tuning | None = None,
    *,
    keep: bool = False,
    log: Callable[[str], None] | None = None,
    postgres: Any = None,
) -> Report:
    """Run one topology for ``seconds`` under the faults ``seed`` plans; return the report.

    ``postgres`` is a started PostgresServer (tests/databases.py) to create the
    run's database on; without one the run starts its own.
    """
    return Nemesis(topology, seconds, seed, tuning, keep=keep, log=log, postgres=postgres).run()


# == the worker ==================================================================================
#
# Everything below runs in the worker processes (python -m tests.nemesis worker ...).


class _Journal:
    """This process's append-only journal: one JSON line per event, one write(2) each."""

    def __init__(self, path: Path, slot: int, incarnation: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.getpid()
        self.slot = slot
        self.incarnation = incarnation
        self._lock = threading.Lock()

    def write(self, event: str, **data: Any) -> None:
        record = {"e": event, "pid": self.pid, "t": data.pop("t", None) or now_ns(), **data}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self.fd, line)


@dataclass
class _Rec:
    """The body an attempt entered, if it got that far."""

    body: str | None = None


def _owner() -> str:
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task.get_name() if task is not None else threading.current_thread().name


# The share of with, async with, acquire() and decorated bodies that take their
# lock shared, on every topology.
SHARED_SHARE = 0.35

SYNC_KINDS = {
    "with": 4.0,
    "handle": 2.0,
    "acquire": 3.0,
    "decorated": 3.0,
    "nested": 2.0,
    "multi": 1.0,
    "handover": 1.0,
    # Read-modify-writes of the lock's counter row in a database transaction.
    "tx-with": 4.0,
    "tx-decorated": 3.0,
    "tx-inside": 2.0,
    # A permit of the run's semaphore.
    "sem-with": 2.0,
}
ASYNC_KINDS = {
    "async-with": 4.0,
    "async-acquire": 3.0,
    "async-decorated": 3.0,
    "async-nested": 2.0,
    "async-tx": 5.0,
    "async-sem": 2.0,
    # A child task taking a lock or a permit, cancelled at a random point.
    "async-cancel": 5.0,
}
#: Where a cancelled child task is when its first cancel lands.
CANCEL_PHASES = ("waiting", "entering", "inside", "leaving")
#: Test-only: set to 1, the transactional bodies give their lock back at the end of
#: its block (``release_at_block_end=True``), before their COMMIT; the checker must
#: then find lost updates.
RELEASE_AT_BLOCK_END_ENV = "NEMESIS_RELEASE_AT_BLOCK_END"


class _Worker:
    """One worker process: threads and asyncio tasks running bodies until the run ends."""

    def __init__(self, config: dict[str, Any], incarnation: int) -> None:
        from django_redis_mutex import signals

        self.config = config
        self.slot = int(config["slot"])
        self.incarnation = incarnation
        self.workdir = Path(config["workdir"])
        self.journal = _Journal(
            Path(config["history"]) / f"slot{self.slot}-{incarnation}-{os.getpid()}.jsonl",
            self.slot,
            incarnation,
        )
        self.specs = [LockSpec.from_json(s) for s in config["locks"]]
        self.handoff = LockSpec.from_json(config["handoff"])
        self.linger = LockSpec.from_json(config["linger"])
        self.semaphore = LockSpec.from_json(config["semaphore"])
        self.ttl = float(config["ttl"])
        self.timeout = float(config["timeout"])
        self.seed = f"{config['seed']}:{config['topology']}:{self.slot}:{incarnation}"
        self.end = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cooldown_until = 0
        self._ids = itertools.count(1)
        self._announced: dict[tuple[int, str], int] = {}
        self._released: dict[tuple[int, str], int] = {}
        self.release_at_block_end = bool(config.get("release_at_block_end"))
        self._guards: dict[tuple[str, bool, bool, bool], Callable[..., Any]] = {}
        self._control_offset = 0
        self._control_lock = threading.Lock()
        self._scenario_threads: list[threading.Thread] = []
        # Tasks started by commands, kept so that they are not collected while running.
        self._background: set[asyncio.Future[None]] = set()
        signals.lock_acquired.connect(self._on_acquired, weak=False)
        signals.lock_lost.connect(self._on_lost, weak=False)
        signals.lock_released.connect(self._on_released, weak=False)

    # -- journal ----------------------------------------------------------------------------

    def _on_acquired(self, sender: Any, name: str, fence: Any, **kwargs: Any) -> None:
        # Receivers run in the acquiring thread: remember the fence for decorated bodies.
        self._announced[(threading.get_ident(), name)] = int(fence)

    def _on_lost(self, sender: Any, name: str, fence: Any, **kwargs: Any) -> None:
        # A permit has no fence: which of this process's permits of ``name`` was
        # lost the signal does not say, so it tells no permit body (their
        # ``lost`` flag and their exit do).
        self.journal.write(
            "told",
            how="signal",
            name=name,
            fence=-1 if fence is None else int(fence),
            alias=str(sender),
            permit=kwargs.get("kind") == "semaphore",
        )

    def _announced_fence(self, name: str) -> int | None:
        return self._announced.pop((threading.get_ident(), name), None)

    def _on_released(self, sender: Any, name: str, fence: Any, **kwargs: Any) -> None:
        # Sent in the releasing thread; after a COMMIT, in the committing one.
        self._released[(threading.get_ident(), name)] = int(fence)

    def _given_back(self, name: str, fence: int | None) -> bool:
        """True if this thread's last give-back of ``name`` was of ``fence`` (and confirmed)."""
        released = self._released.pop((threading.get_ident(), name), None)
        return fence is not None and released == fence

    def enter(
        self,
        spec: LockSpec,
        kind: str,
        called: int,
        fence: int | None,
        *,
        is_async: bool = False,
        joined: bool = False,
        scenario: str | None = None,
        ttl: float | None = None,
        shared: bool = False,
        permit: bool = False,
    ) -> str:
        t = now_ns()
        body = f"{os.getpid()}-{next(self._ids)}"
        self.journal.write(
            "enter",
            t=t,
            b=body,
            slot=self.slot,
            space=spec.space,
            name=spec.name,
            fence=-1 if fence is None else int(fence),
            kind=kind,
            owner=_owner(),
            called=called,
            joined=joined,
            scenario=scenario,
            ttl=ttl or self.ttl,
            shared=shared,
            # A permit body: at most ``limit`` of its semaphore's overlap.
            limit=SEMAPHORE_LIMIT if permit else None,
            **{"async": is_async},
        )
        return body

    def leave(self, body: str, lost: bool) -> None:
        t = now_ns()
        if lost:
            self.journal.write("told", t=t, b=body, how="lock.lost")
        self.journal.write("leave", t=t, b=body)

    def level(self, body: str, fence: int | None, how: str, shared: bool = False) -> None:
        self.journal.write("level", b=body, fence=fence, how=how, shared=shared)

    def unlevel(self, body: str) -> None:
        self.journal.write("unlevel", b=body)

    @contextlib.contextmanager
    def attempt(self, spec: LockSpec, rec: _Rec | None = None) -> Iterator[_Rec]:
        """Run one attempt; record the body's outcome, or why no body was entered."""
        rec = rec or _Rec()
        try:
            yield rec
        except Exception as exc:
            self.settle(rec, spec, exc)
        else:
            self.settle(rec, spec, None)

    def settle(self, rec: _Rec, spec: LockSpec, exc: BaseException | None) -> None:
        from django_redis_mutex import (
            LockBackendUnavailable,
            LockContended,
            LockError,
            LockLost,
            LockNotOwned,
        )

        if exc is not None and not isinstance(exc, LockError):
            self.journal.write(
                "unexpected",
                owner=_owner(),
                b=rec.body,
                error=f"{type(exc).__name__}: {exc}"[:500],
                trace="".join(traceback.format_exception(exc))[-3000:],
            )
        if rec.body is None:
            if isinstance(exc, LockContended):
                why = "contended"
            elif isinstance(exc, LockBackendUnavailable):
                why = "unavailable"
                self.cooldown_until = now_ns() + 100_000_000
            else:
                why = f"error:{type(exc).__name__}"
            detail = f"{type(exc).__name__}: {exc}"[:300] if exc is not None else ""
            self.journal.write("refused", space=spec.space, name=spec.name, why=why, detail=detail)
            return
        if exc is None:
            result = "clean"
        elif isinstance(exc, (LockLost, LockNotOwned)):
            result = "told"
        elif isinstance(exc, LockBackendUnavailable):
            result = "unavailable"
        else:
            result = f"error:{type(exc).__name__}"
        detail = f"{type(exc).__name__}: {exc}"[:300] if exc is not None else ""
        self.journal.write("outcome", b=rec.body, result=result, detail=detail)

    # -- choices ------------------------------------------------------------------------------

    def pick(self, rng: random.Random, specs: list[LockSpec] | None = None) -> tuple[LockSpec, Any]:
        specs = specs or self.specs
        spec = rng.choices(specs, weights=[s.weight for s in specs])[0]
        return spec, _using(rng.choice(spec.usings))

    def share(self, rng: random.Random) -> bool:
        """Whether to take this body's lock shared."""
        return rng.random() < SHARED_SHARE

    def share_inner(self, rng: random.Random, outer: bool) -> bool:
        """Whether a nested level takes its lock shared: always inside a shared hold
        (an exclusive level there is refused), now and then inside an exclusive one
        (it joins that hold)."""
        return outer or self.share(rng)

    def hold(self, rng: random.Random) -> float:
        """A few ms to ~100 ms of work; now and then longer than a renewal period."""
        if rng.random() < 0.03:
            return rng.uniform(0.5, 1.5) * self.ttl
        return rng.uniform(0.002, 0.1)

    def guard(
        self, using: Any, is_async: bool, shared: bool = False, release_at_block_end: bool = False
    ) -> Callable[..., Any]:
        """Return ``@mutex("{name}", using=using, shared=shared)`` over a _Call-running function."""
        from django_redis_mutex import mutex

        key = (json.dumps(using), is_async, shared, release_at_block_end)
        guarded = self._guards.get(key)
        if guarded is None:
            if is_async:

                async def body(name: str, call: _Call) -> None:
                    await call.arun()

                guarded = mutex(
                    "{name}",
                    using=using,
                    shared=shared,
                    release_at_block_end=release_at_block_end,
                )(body)
            else:

                def sync_body(name: str, call: _Call) -> None:
                    call.run()

                guarded = mutex(
                    "{name}",
                    using=using,
                    shared=shared,
                    release_at_block_end=release_at_block_end,
                )(sync_body)
            self._guards[key] = guarded
        return guarded

    def running(self) -> bool:
        return now_ns() < self.end

    # -- sync bodies --------------------------------------------------------------------------

    def contend(self, index: int) -> None:
        rng = random.Random(f"{self.seed}:s{index}")
        kinds = list(SYNC_KINDS)
        weights = list(SYNC_KINDS.values())
        while self.running():
            kind = rng.choices(kinds, weights=weights)[0]
            try:
                getattr(self, "sync_" + kind.replace("-", "_"))(rng)
            except Exception as exc:  # a bug here, not in a lock: journalled, fails the run
                self.journal.write(
                    "unexpected",
                    owner=_owner(),
                    error=f"worker {kind}: {exc!r}",
                    trace=traceback.format_exc()[-3000:],
                )
            wait = max(self.cooldown_until - now_ns(), 0) / NS + rng.uniform(0, 0.01)
            time.sleep(wait)

    def sync_with(self, rng: random.Random) -> None:
        from django_redis_mutex import mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        shared = self.share(rng)
        with self.attempt(spec) as rec:
            called = now_ns()
            with mutex(spec.name, using=using, shared=shared) as held:
                rec.body = self.enter(spec, "with", called, held.fence, shared=shared)
                try:
                    time.sleep(hold)
                finally:
                    self.leave(rec.body, held.lost)

    def sync_handle(self, rng: random.Random) -> None:
        from django_redis_mutex import Mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        lock = Mutex(spec.name, using=using)
        with self.attempt(spec) as rec:
            called = now_ns()
            with lock:
                rec.body = self.enter(spec, "handle", called, lock.fence)
                try:
                    time.sleep(hold)
                finally:
                    self.leave(rec.body, lock.lost)

    def sync_acquire(self, rng: random.Random) -> None:
        from django_redis_mutex import Mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        shared = self.share(rng)
        lock = Mutex(spec.name, using=using, shared=shared)
        with self.attempt(spec) as rec:
            called = now_ns()
            if not lock.acquire():
                raise lock.contended()
            rec.body = self.enter(spec, "acquire", called, lock.fence, shared=shared)
            try:
                time.sleep(hold)
            finally:
                self.leave(rec.body, lock.lost)
            lock.release()

    def sync_decorated(self, rng: random.Random) -> None:
        spec, using = self.pick(rng)
        shared = self.share(rng)
        call = _Call(self, spec, "decorated", self.hold(rng), shared=shared)
        with self.attempt(spec, call.rec):
            self._announced_fence(spec.name)
            call.called = now_ns()
            self.guard(using, False, shared)(spec.name, call)

    def sync_nested(self, rng: random.Random) -> None:
        from django_redis_mutex import mutex

        spec, using = self.pick(rng)
        inner_using = _using(rng.choice(spec.usings))
        how = rng.choice(("with", "handle", "decorated"))
        first, second, third = self.hold(rng) / 2, rng.uniform(0.002, 0.05), rng.uniform(0, 0.02)
        shared = self.share(rng)
        inner_shared = self.share_inner(rng, shared)
        with self.attempt(spec) as rec:
            called = now_ns()
            with mutex(spec.name, using=using, shared=shared) as outer:
                rec.body = body = self.enter(spec, "nested", called, outer.fence, shared=shared)
                try:
                    time.sleep(first)
                    if how == "with":
                        with mutex(spec.name, using=inner_using, shared=inner_shared) as inner:
                            self.level(body, inner.fence, how, inner_shared)
                            try:
                                time.sleep(second)
                            finally:
                                self.unlevel(body)
                    elif how == "handle":
                        with outer:
                            self.level(body, outer.fence, how, shared)
                            try:
                                time.sleep(second)
                            finally:
                                self.unlevel(body)
                    else:
                        self._announced_fence(spec.name)
                        call = _Call(self, spec, "nested", second, parent=body, shared=inner_shared)
                        self.guard(inner_using, False, inner_shared)(spec.name, call)
                    time.sleep(third)
                finally:
                    self.leave(body, outer.lost)

    def sync_multi(self, rng: random.Random) -> None:
        from django_redis_mutex import mutex

        first, using_first = self.pick(rng)
        others = [s for s in self.specs if s.name != first.name]
        second, using_second = self.pick(rng, others)
        # Always in one order, so two workers never wait for each other in a cycle.
        (first, using_first), (second, using_second) = sorted(
            ((first, using_first), (second, using_second)), key=lambda p: (p[0].space, p[0].name)
        )
        hold = self.hold(rng)
        with self.attempt(first) as outer_rec:
            called = now_ns()
            with mutex(first.name, using=using_first) as outer:
                outer_rec.body = self.enter(first, "multi", called, outer.fence)
                try:
                    time.sleep(hold / 2)
                    with self.attempt(second) as inner_rec:
                        inner_called = now_ns()
                        with mutex(second.name, using=using_second) as inner:
                            inner_rec.body = self.enter(
                                second, "multi-inner", inner_called, inner.fence
                            )
                            try:
                                time.sleep(hold / 2)
                            finally:
                                self.leave(inner_rec.body, inner.lost)
                finally:
                    self.leave(outer_rec.body, outer.lost)

    def sync_handover(self, rng: random.Random) -> None:
        """Hand an acquired handle to another thread, then run @mutex of the same name here.

        The other thread releases later; the decorated call must wait for that
        release, never join the hold it handed away.
        """
        from django_redis_mutex import Mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        lock = Mutex(spec.name, using=using)
        handed = _Rec()
        called = now_ns()
        try:
            got = lock.acquire()
        except Exception as exc:
            self.settle(handed, spec, exc)
            return
        if not got:
            self.settle(handed, spec, lock.contended())
            return
        handed.body = self.enter(spec, "handover", called, lock.fence)
        fence = lock.fence

        def finish() -> None:
            with self.attempt(spec, handed):
                try:
                    time.sleep(hold)
                finally:
                    self.leave(handed.body or "", lock.lost)
                lock.release()

        other = threading.Thread(target=finish, name=f"{threading.current_thread().name}-handed")
        other.start()
        call = _Call(self, spec, "after-handover", rng.uniform(0.002, 0.05), fallback=fence)
        with self.attempt(spec, call.rec):
            self._announced_fence(spec.name)
            call.called = now_ns()
            self.guard(using, False)(spec.name, call)
        other.join(self.timeout + 3 * self.ttl + 10)

    # -- transactional bodies -----------------------------------------------------------------
    #
    # Each reads its lock's counter row, pauses, writes the value plus one and
    # records the increment, in one transaction on the run's PostgreSQL
    # database; "intent" is journalled before the write, "committed" after the
    # COMMIT returned. A lock taken inside the transaction is kept until the
    # COMMIT (the transaction goes on a little after the lock's block, as real
    # code does): only that keeps the next holder from reading the old value.

    def tx_pick(self, rng: random.Random) -> tuple[LockSpec, Any, float, float]:
        """Return a lock, a way to it, the pause between read and write, and the work after."""
        spec, using = self.pick(rng)
        return spec, using, self.hold(rng), rng.uniform(0.002, 0.03)

    def sync_tx_with(self, rng: random.Random) -> None:
        self.tx_with(*self.tx_pick(rng), kind="tx-with")

    def tx_with(self, spec: LockSpec, using: Any, pause: float, after: float, *, kind: str) -> None:
        """``with mutex(...)`` inside ``transaction.atomic()``: the lock outlives its block."""
        from django.db import transaction

        from django_redis_mutex import mutex

        tx = _Tx(self, spec)
        with self.attempt(spec) as rec:
            with transaction.atomic():
                called = now_ns()
                lock = mutex(spec.name, using=using, release_at_block_end=self.release_at_block_end)
                with lock as held:
                    fence = held.fence
                    rec.body = self.enter(spec, kind, called, fence)
                    try:
                        tx.increment(rec.body, pause)
                    finally:
                        self.leave(rec.body, held.lost)
                self.journal.write("exited", b=rec.body)
                time.sleep(after)
            tx.committed(self._given_back(spec.name, fence))

    def sync_tx_decorated(self, rng: random.Random) -> None:
        """An ``@mutex`` function called inside ``transaction.atomic()``."""
        from django.db import transaction

        spec, using, pause, after = self.tx_pick(rng)
        tx = _Tx(self, spec)
        call = _Call(self, spec, "tx-decorated", pause, work=tx.increment)
        with self.attempt(spec, call.rec):
            self._announced_fence(spec.name)
            with transaction.atomic():
                call.called = now_ns()
                self.guard(using, False, release_at_block_end=self.release_at_block_end)(
                    spec.name, call
                )
                self.journal.write("exited", b=call.rec.body)
                time.sleep(after)
            tx.committed(self._given_back(spec.name, call.fence))

    def sync_tx_inside(self, rng: random.Random) -> None:
        """``transaction.atomic()`` inside ``with mutex(...)``: committed before the release."""
        from django.db import transaction

        from django_redis_mutex import mutex

        spec, using, pause, _ = self.tx_pick(rng)
        tx = _Tx(self, spec)
        with self.attempt(spec) as rec:
            called = now_ns()
            with mutex(spec.name, using=using) as held:
                rec.body = self.enter(spec, "tx-inside", called, held.fence)
                try:
                    with transaction.atomic():
                        tx.increment(rec.body, pause)
                    tx.committed(None)
                finally:
                    self.leave(rec.body, held.lost)

    # -- async bodies -------------------------------------------------------------------------

    async def acontend(self, index: int) -> None:
        rng = random.Random(f"{self.seed}:a{index}")
        kinds = list(ASYNC_KINDS)
        weights = list(ASYNC_KINDS.values())
        while self.running():
            kind = rng.choices(kinds, weights=weights)[0]
            try:
                await getattr(self, "async_" + kind.removeprefix("async-"))(rng)
            except Exception as exc:
                self.journal.write(
                    "unexpected",
                    owner=_owner(),
                    error=f"worker {kind}: {exc!r}",
                    trace=traceback.format_exc()[-3000:],
                )
            wait = max(self.cooldown_until - now_ns(), 0) / NS + rng.uniform(0, 0.01)
            await asyncio.sleep(wait)

    async def async_with(self, rng: random.Random) -> None:
        from django_redis_mutex import mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        shared = self.share(rng)
        with self.attempt(spec) as rec:
            called = now_ns()
            async with mutex(spec.name, using=using, shared=shared) as held:
                rec.body = self.enter(
                    spec, "async-with", called, held.fence, is_async=True, shared=shared
                )
                try:
                    await asyncio.sleep(hold)
                finally:
                    self.leave(rec.body, held.lost)

    async def async_acquire(self, rng: random.Random) -> None:
        from django_redis_mutex import Mutex

        spec, using = self.pick(rng)
        hold = self.hold(rng)
        shared = self.share(rng)
        lock = Mutex(spec.name, using=using, shared=shared)
        with self.attempt(spec) as rec:
            called = now_ns()
            if not await lock.aacquire():
                raise lock.contended()
            rec.body = self.enter(
                spec, "async-acquire", called, lock.fence, is_async=True, shared=shared
            )
            try:
                await asyncio.sleep(hold)
            finally:
                self.leave(rec.body, lock.lost)
            await lock.arelease()

    async def async_decorated(self, rng: random.Random) -> None:
        spec, using = self.pick(rng)
        shared = self.share(rng)
        call = _Call(self, spec, "async-decorated", self.hold(rng), is_async=True, shared=shared)
        with self.attempt(spec, call.rec):
            self._announced_fence(spec.name)
            call.called = now_ns()
            await self.guard(using, True, shared)(spec.name, call)

    async def async_nested(self, rng: random.Random) -> None:
        from django_redis_mutex import mutex

        spec, using = self.pick(rng)
        inner_using = _using(rng.choice(spec.usings))
        decorated = rng.random() < 0.5
        first, second = self.hold(rng) / 2, rng.uniform(0.002, 0.05)
        shared = self.share(rng)
        inner_shared = self.share_inner(rng, shared)
        with self.attempt(spec) as rec:
            called = now_ns()
            async with mutex(spec.name, using=using, shared=shared) as outer:
                rec.body = body = self.enter(
                    spec, "async-nested", called, outer.fence, is_async=True, shared=shared
                )
                try:
                    await asyncio.sleep(first)
                    if decorated:
                        self._announced_fence(spec.name)
                        call = _Call(
                            self,
                            spec,
                            "async-nested",
                            second,
                            parent=body,
                            is_async=True,
                            shared=inner_shared,
                        )
                        await self.guard(inner_using, True, inner_shared)(spec.name, call)
                    else:
                        async with mutex(
                            spec.name, using=inner_using, shared=inner_shared
                        ) as inner:
                            self.level(body, inner.fence, "async with", inner_shared)
                            try:
                                await asyncio.sleep(second)
                            finally:
                                self.unlevel(body)
                finally:
                    self.leave(body, outer.lost)

    async def async_tx(self, rng: random.Random) -> None:
        """A transaction with its lock inside, run from a task as Django runs sync code."""
        from asgiref.sync import sync_to_async

        await sync_to_async(self.tx_with)(*self.tx_pick(rng), kind="async-tx")

    # -- permits ------------------------------------------------------------------------------

    def permit_ttl(self, rng: random.Random) -> float:
        """The lease of a permit: mostly the run's, now and then LINGER_TTL."""
        return LINGER_TTL if rng.random() < 0.2 else self.ttl

    def sem_using(self, rng: random.Random) -> Any:
        """One of the ways to name where the run's semaphore lives (a quorum has two)."""
        return _using(rng.choice(self.semaphore.usings))

    def sync_sem_with(self, rng: random.Random) -> None:
        """A permit of the run's semaphore, through ``with Semaphore(...)`` or acquire()."""
        from django_redis_mutex import Semaphore

        spec, hold, ttl = self.semaphore, self.hold(rng), self.permit_ttl(rng)
        sem = Semaphore(spec.name, SEMAPHORE_LIMIT, using=self.sem_using(rng), ttl=ttl)
        with self.attempt(spec) as rec:
            called = now_ns()
            if rng.random() < 0.5:
                with sem:
                    rec.body = self.enter(spec, "sem-with", called, None, ttl=ttl, permit=True)
                    try:
                        time.sleep(hold)
                    finally:
                        self.leave(rec.body, sem.lost)
                return
            if not sem.acquire():
                raise sem.contended()
            rec.body = self.enter(spec, "sem-acquire", called, None, ttl=ttl, permit=True)
            try:
                time.sleep(hold)
            finally:
                self.leave(rec.body, sem.lost)
            sem.release()

    async def async_sem(self, rng: random.Random) -> None:
        """A permit through ``async with semaphore(...)``."""
        from django_redis_mutex import semaphore

        spec, hold, ttl = self.semaphore, self.hold(rng), self.permit_ttl(rng)
        context = semaphore(spec.name, SEMAPHORE_LIMIT, using=self.sem_using(rng), ttl=ttl)
        with self.attempt(spec) as rec:
            called = now_ns()
            async with context as sem:
                rec.body = self.enter(
                    spec, "async-sem", called, None, is_async=True, ttl=ttl, permit=True
                )
                try:
                    await asyncio.sleep(hold)
                finally:
                    self.leave(rec.body, sem.lost)

    # -- cancellations ------------------------------------------------------------------------

    async def async_cancel(self, rng: random.Random) -> None:
        """Take a lock or a permit in a child task, and cancel the child at a random point.

        The point is one of CANCEL_PHASES: waiting in line (a while after the
        call), entering (a loop step or two after it: the first script in
        flight), inside the body, or leaving it (the release in flight). Half
        the time a second cancel follows a few loop steps later, as an AnyIO
        cancel scope delivers one at every await. The child journals what
        happened: a body it entered and left, with the outcome "cancelled" if
        the cancel reached it there, or an acquisition refused as "cancelled".
        Whatever it took must be given back: the orphan check looks.
        """
        from django_redis_mutex import Mutex, Semaphore, mutex

        phase = rng.choice(CANCEL_PHASES)
        again = rng.random() < 0.5
        steps = rng.randint(1, 6)
        hold = self.hold(rng) + 0.05
        way = rng.choice(("with", "acquire"))
        target = rng.random()
        shared = False
        handle: Any
        if target < 0.3:
            # Half with a long lease: a permit left to nobody stays long enough to be seen.
            ttl = LINGER_TTL if rng.random() < 0.5 else self.ttl
            spec, permit = self.semaphore, True
            handle = Semaphore(spec.name, SEMAPHORE_LIMIT, using=self.sem_using(rng), ttl=ttl)
        else:
            spec, using = (self.linger, self.linger.usings[0]) if target < 0.55 else self.pick(rng)
            ttl, permit = (LINGER_TTL if spec is self.linger else self.ttl), False
            shared = self.share(rng)
            if way == "with":
                handle = mutex(spec.name, using=using, shared=shared, ttl=ttl)
            else:
                handle = Mutex(spec.name, using=using, shared=shared, ttl=ttl)
        await self.cancel_one(
            spec,
            handle,
            way,
            hold,
            ttl,
            shared,
            permit,
            phase,
            again,
            steps,
            rng.uniform(0.02, 1.2),
        )

    async def cancel_one(
        self,
        spec: LockSpec,
        handle: Any,
        way: str,
        hold: float,
        ttl: float,
        shared: bool,
        permit: bool,
        phase: str,
        again: bool,
        steps: int,
        wait: float,
    ) -> None:
        """Run one child task taking ``handle`` and cancel it at ``phase`` (see async_cancel).

        ``wait`` is how long a "waiting" child is let wait before the cancel.
        """
        rng = random.Random(f"{self.seed}:{spec.name}:{now_ns()}")
        inside, leaving = asyncio.Event(), asyncio.Event()
        rec = _Rec()
        child = asyncio.create_task(
            self.cancel_child(spec, handle, way, hold, ttl, shared, permit, rec, inside, leaving),
            # A name of its own, stored in the owner record of whatever it takes, so
            # the nemesis can tell a grant of a child that has ended (CHILD_SUFFIX).
            name=f"{_owner()}-c{next(self._ids)}",
        )
        if phase == "waiting":
            await asyncio.wait({child}, timeout=wait)
        elif phase == "entering":
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
        else:
            event = inside if phase == "inside" else leaving
            waiter = asyncio.ensure_future(event.wait())
            await asyncio.wait({child, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if phase == "inside" and not child.done():
                await asyncio.wait({child}, timeout=rng.uniform(0, hold))
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(0)
        cancels = 0
        if not child.done():
            child.cancel()
            cancels = 1
            self.journal.write("cancel", b=rec.body, phase=phase, n=1, child=child.get_name())
            if again:
                for _ in range(steps):
                    await asyncio.sleep(0)
                if not child.done():
                    child.cancel()
                    cancels = 2
                    self.journal.write(
                        "cancel", b=rec.body, phase=phase, n=2, child=child.get_name()
                    )
        done, _ = await asyncio.wait({child}, timeout=self.timeout + 3 * ttl + 15)
        if not done:
            self.journal.write(
                "unexpected",
                owner=_owner(),
                error=f"a cancelled child task ({phase}, {cancels} cancel(s)) never ended",
            )
            return
        # From now on nothing may stay held in the child's name (the orphan rule).
        self.journal.write(
            "child-end",
            child=child.get_name(),
            b=rec.body,
            phase=phase,
            cancels=cancels,
            space=spec.space,
            name=spec.name,
            ttl=ttl,
        )
        if not child.cancelled():
            child.result()  # its own errors were journalled by attempt(); a bug would be here

    async def cancel_child(
        self,
        spec: LockSpec,
        handle: Any,
        way: str,
        hold: float,
        ttl: float,
        shared: bool,
        permit: bool,
        rec: _Rec,
        inside: asyncio.Event,
        leaving: asyncio.Event,
    ) -> None:
        """The child of :meth:`async_cancel`: one body, journalled whatever cancels it."""
        kind = ("async-sem" if permit else "async") + f"-cancel-{way}"

        async def body(held: Any, called: int) -> None:
            fence = None if permit else held.fence
            rec.body = self.enter(
                spec, kind, called, fence, is_async=True, ttl=ttl, shared=shared, permit=permit
            )
            inside.set()
            try:
                await asyncio.sleep(hold)
            finally:
                leaving.set()
                self.leave(rec.body, held.lost)

        try:
            with self.attempt(spec, rec):
                called = now_ns()
                if way == "with":
                    async with handle as held:
                        await body(held, called)
                    return
                if not await handle.aacquire():
                    raise handle.contended()
                try:
                    await body(handle, called)
                finally:
                    # As callers write it: a cancel inside the body still releases.
                    await handle.arelease()
        except asyncio.CancelledError:
            if rec.body is None:
                self.journal.write(
                    "refused", space=spec.space, name=spec.name, why="cancelled", detail=""
                )
            else:
                self.journal.write("outcome", b=rec.body, result="cancelled", detail="")
            raise

    async def cancel_in_sleep(self, delay: float, takes: list[str]) -> None:
        """Take the linger lock, a long permit or both just as Redis falls asleep, and cancel them.

        ``takes`` says which live on the Redis falling asleep ("lock",
        "permit"). The nemesis starts a DEBUG SLEEP longer than twice the
        socket timeout ``delay`` seconds from now: each acquisition's script is
        then in flight when the cancel lands (on the quorum, its request to the
        sleeping master), its reply times out, and so does the give-back that
        follows (Redis is still asleep), while Redis, once awake, runs the
        acquisition it had read. What it granted must still be given back; the
        orphan rule checks it (see _Checker.check_children). A sleeping quorum
        master grants a copy of the permit on its own, which is no permit (see
        Nemesis._note_partial_permits).
        """
        from django_redis_mutex import Semaphore, mutex

        await asyncio.sleep(delay)
        lock, sem = self.linger, self.semaphore
        children = []
        if "lock" in takes:
            children.append(
                self.cancel_one(
                    lock, mutex(lock.name, using=lock.usings[0], ttl=LINGER_TTL), "with",
                    0.05, LINGER_TTL, False, False, "waiting", True, 2, 0.1,
                )
            )  # fmt: skip
        if "permit" in takes:
            using = _using(sem.usings[0])
            permit = Semaphore(sem.name, SEMAPHORE_LIMIT, using=using, ttl=LINGER_TTL)
            children.append(
                self.cancel_one(
                    sem, permit, "acquire",
                    0.05, LINGER_TTL, False, True, "waiting", False, 1, 0.15,
                )
            )  # fmt: skip
        try:
            await asyncio.gather(*children)
        except Exception as exc:
            self.journal.write(
                "unexpected",
                owner=_owner(),
                error=f"cancel-in-sleep: {exc!r}",
                trace=traceback.format_exc()[-3000:],
            )

    # -- commands from the nemesis ------------------------------------------------------------

    def on_control(self) -> None:
        """Read the commands the nemesis appended since last time (runs on the event loop)."""
        path = self.workdir / f"control-{self.slot}-{self.incarnation}"
        with self._control_lock:
            try:
                with open(path, encoding="utf-8") as control:
                    control.seek(self._control_offset)
                    data = control.read()
            except FileNotFoundError:
                return
            complete = data[: data.rfind("\n") + 1]
            self._control_offset += len(complete.encode())
        for line in complete.splitlines():
            command = json.loads(line)
            kind = command["cmd"]
            self.journal.write("command", cmd=kind, fault=command.get("fault"))
            if kind == "stall":
                self.stall(float(command["seconds"]), command.get("fault"))
            elif kind == "handoff-stall":
                self.start_scenario(self.handoff_scenario, command)
            elif kind == "side-hold":
                self.start_scenario(self.side_hold, command)
            elif kind == "nested-reset":
                self.start_scenario(self.nested_reset, command)
            elif kind == "cancel-in-sleep":
                takes = list(command.get("takes") or ("lock", "permit"))
                self._background.add(
                    asyncio.ensure_future(self.cancel_in_sleep(float(command["delay"]), takes))
                )

    def stall(
        self,
        seconds: float,
        fault: Any = None,
        scenario: str | None = None,
        started: threading.Event | None = None,
    ) -> None:
        """Block the event loop: a task that calls time.sleep() where it should await."""
        t0 = now_ns()
        self.journal.write("stall-begin", t=t0, fault=fault, scenario=scenario)
        if started is not None:
            started.set()
        time.sleep(seconds)
        self.journal.write("stall", t0=t0, t1=now_ns(), fault=fault, scenario=scenario)

    def start_scenario(
        self, target: Callable[[dict[str, Any]], None], command: dict[str, Any]
    ) -> None:
        def guarded() -> None:
            try:
                target(command)
            except Exception as exc:
                self.journal.write(
                    "unexpected",
                    owner=_owner(),
                    error=f"scenario {command['cmd']}: {exc!r}",
                    trace=traceback.format_exc()[-3000:],
                )

        thread = threading.Thread(target=guarded, name=f"scenario-{command['cmd']}", daemon=True)
        self._scenario_threads.append(thread)
        thread.start()

    def handoff_scenario(self, command: dict[str, Any]) -> None:
        """Hand the lock to an async waiter while its event loop is stalled past the lease.

        H (this thread) holds the slot's hand-off lock; W, a task on the loop,
        queues for it; the loop is stalled (longer than W's hand-off lease) and
        H releases into the stall, so Redis hands the lock to W, whose loop
        cannot run. C, another thread, queues behind W and takes the lock when
        W's hand-off lease lapses, holding it past the end of the stall. When
        the loop runs again W must find out that its hand-off lapsed and wait
        for C, not enter beside it.
        """
        from django_redis_mutex import Mutex

        variant = str(command.get("variant") or "short")
        ttl, seconds = handoff_variant(variant)
        seconds = float(command.get("seconds") or seconds)
        spec = self.handoff
        using = _using(spec.usings[0 if variant == "short" else -1])
        sc = f"{os.getpid()}-hs{command.get('fault')}"
        loop = self.loop
        if loop is None or now_ns() + int((seconds + 3) * NS) > self.end:
            self.journal.write("scenario", sc=sc, role="skipped", why="too late in the run")
            return
        self.journal.write("scenario", sc=sc, role="start", variant=variant)
        holder = Mutex(spec.name, using=using, ttl=ttl)
        held = _Rec()
        with self.attempt(spec, held):
            called = now_ns()
            if not holder.acquire():
                raise holder.contended()
            held.body = self.enter(
                spec, "handoff-holder", called, holder.fence, scenario=sc, ttl=ttl
            )
            self.journal.write("scenario", sc=sc, role="holder", b=held.body)
            queued = threading.Event()
            waiter = asyncio.run_coroutine_threadsafe(
                self.handoff_waiter(spec, using, ttl, sc, seconds, queued), loop
            )
            queued.wait(5)
            # Schedule timing, not synchronisation: W's first check-in reaches Redis
            # and queues it behind H well within this.
            time.sleep(0.3)
            stalled = threading.Event()

            def stall() -> None:
                loop.call_soon_threadsafe(self.stall, seconds, command.get("fault"), sc, stalled)
                stalled.wait(10)

            # "mid": the stall begins as the release hands the lock over (just
            # before or after it), so it may fall between W's wake-up and its entry.
            after = variant == "mid" and random.random() < 0.7
            if not after:
                stall()
            competitor = threading.Thread(
                target=self.handoff_competitor,
                args=(spec, using, ttl, sc, now_ns() + int((seconds + 1.2) * NS)),
                name="handoff-competitor",
            )
            competitor.start()
            time.sleep(0.1)  # C's check-in queues it behind W
            self.leave(held.body, holder.lost)
            self.journal.write("scenario", sc=sc, role="release")
            try:
                holder.release()
                if after:
                    stall()
            finally:
                competitor.join(seconds + 3 * ttl + 20)
                with contextlib.suppress(Exception):
                    waiter.result(seconds + 3 * ttl + 20)

    async def handoff_waiter(
        self,
        spec: LockSpec,
        using: Any,
        ttl: float,
        sc: str,
        seconds: float,
        queued: threading.Event,
    ) -> None:
        from django_redis_mutex import Mutex

        lock = Mutex(spec.name, using=using, ttl=ttl, timeout=seconds + 3 * ttl + 10)
        with self.attempt(spec) as rec:
            called = now_ns()
            queued.set()
            async with lock:
                rec.body = self.enter(
                    spec, "handoff-waiter", called, lock.fence, is_async=True, scenario=sc, ttl=ttl
                )
                try:
                    await asyncio.sleep(0.05)
                finally:
                    self.leave(rec.body, lock.lost)

    def handoff_competitor(
        self, spec: LockSpec, using: Any, ttl: float, sc: str, until: int
    ) -> None:
        from django_redis_mutex import Mutex

        wait = (until - now_ns()) / NS + 3 * ttl
        lock = Mutex(spec.name, using=using, ttl=ttl, timeout=wait)
        with self.attempt(spec) as rec:
            called = now_ns()
            with lock:
                rec.body = self.enter(
                    spec, "handoff-competitor", called, lock.fence, scenario=sc, ttl=ttl
                )
                try:
                    time.sleep(max(until - now_ns(), 0) / NS + 0.05)
                finally:
                    self.leave(rec.body, lock.lost)

    def nested_reset(self, command: dict[str, Any]) -> None:
        """Hold the hot lock in a nested with block while the operator resets it.

        The reset hands the lock to the next waiter, who enters while this
        body goes on after its inner level: the outer block must raise
        LockLost at its exit (the inner one may not hide the loss).
        """
        from django_redis_mutex import mutex

        spec = self.specs[0]
        using, inner_using = _using(spec.usings[0]), _using(spec.usings[-1])
        inner_marker = self.workdir / f"nested-{command['fault']}-inner"
        done = self.workdir / f"nested-{command['fault']}-done"
        with self.attempt(spec) as rec:
            called = now_ns()
            # The hot lock is contended: wait longer than the ordinary bodies do.
            with mutex(spec.name, using=using, timeout=10.0) as outer:
                rec.body = body = self.enter(spec, "nested-reset", called, outer.fence)
                try:
                    time.sleep(0.02)
                    with mutex(spec.name, using=inner_using) as inner:
                        self.level(body, inner.fence, "with")
                        try:
                            inner_marker.touch()
                            deadline = time.monotonic() + 8.0
                            while not done.exists() and time.monotonic() < deadline:
                                time.sleep(0.005)
                            time.sleep(0.1)
                        finally:
                            self.unlevel(body)
                    time.sleep(0.3)  # the waiter the reset handed the lock to runs meanwhile
                finally:
                    self.leave(body, outer.lost)

    def side_hold(self, command: dict[str, Any]) -> None:
        """Hold the side lock and a quorum lock at once, across a master's SIGSTOP."""
        from django_redis_mutex import mutex

        seconds = float(command["seconds"])
        side = next(s for s in self.specs if s.space == "side")
        quorum = next(s for s in self.specs if s.space == "quorum")

        def hold(spec: LockSpec, using: Any, kind: str) -> None:
            with self.attempt(spec) as rec:
                called = now_ns()
                with mutex(spec.name, using=using) as held:
                    rec.body = self.enter(spec, kind, called, held.fence)
                    try:
                        time.sleep(seconds)
                    finally:
                        self.leave(rec.body, held.lost)

        partner = threading.Thread(
            target=hold, args=(quorum, _using(quorum.usings[0]), "quorum-partner"), daemon=True
        )
        partner.start()
        hold(side, _using(side.usings[0]), "side-hold")
        partner.join(seconds + self.timeout + 10)

    # -- life cycle ----------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Journal every gap in this process's scheduling: a pause its locks lived through."""
        previous = now_ns()
        while True:
            time.sleep(0.02)
            current = now_ns()
            if current - previous > HICCUP * NS:
                self.journal.write("hiccup", t0=previous, t1=current)
            previous = current

    async def amain(self, threads: list[threading.Thread]) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.add_signal_handler(signal.SIGUSR1, self.on_control)
        self.on_control()  # commands sent before the handler was in place
        tasks = [
            asyncio.create_task(self.acontend(i), name=f"task{i}")
            for i in range(int(self.config["tasks"]))
        ]
        await asyncio.gather(*tasks)

        def join() -> None:
            for thread in threads:
                thread.join(self.timeout + 4 * self.ttl + 30)
            for thread in list(self._scenario_threads):
                thread.join(60)

        # The loop keeps serving stalls and the hand-off waiter until every thread is done.
        await asyncio.to_thread(join)

    def run(self) -> int:
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()
        (self.workdir / f"ready-{self.slot}-{self.incarnation}").touch()
        go = self.workdir / "go"
        deadline = time.monotonic() + 600
        while not go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.01)
        self.end = int(json.loads(go.read_text())["end"])
        self.journal.write("start", slot=self.slot, incarnation=self.incarnation)
        threads = [
            threading.Thread(target=self.contend, args=(i,), name=f"thread{i}", daemon=True)
            for i in range(int(self.config["threads"]))
        ]
        for thread in threads:
            thread.start()
        asyncio.run(self.amain(threads))
        # Every body is over, but the process (its watchdog, its background
        # give-backs) lives on until the nemesis has looked for locks and
        # permits held with no body inside: the orphan check's first look.
        self.journal.write("idle")
        (self.workdir / f"idle-{self.slot}-{self.incarnation}").touch()
        quit_file = self.workdir / "quit"
        deadline = time.monotonic() + 120
        while not quit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.journal.write("done")
        return 0


class _Call:
    """A body run inside a decorated function, where the handle is out of reach.

    Its fence is the one ``lock_acquired`` announced in this thread; a body
    that finds none was let in without an acquisition of its own (it joined a
    hold): it takes ``fallback``, the fence of the hold it could have joined.
    With ``parent`` it is a nested level of that body instead.
    """

    def __init__(
        self,
        worker: _Worker,
        spec: LockSpec,
        kind: str,
        hold: float,
        *,
        parent: str | None = None,
        fallback: int | None = None,
        is_async: bool = False,
        shared: bool = False,
        work: Callable[[str, float], None] | None = None,
    ) -> None:
        self.worker = worker
        self.spec = spec
        self.kind = kind
        self.hold = hold
        self.parent = parent
        self.fallback = fallback
        self.is_async = is_async
        self.shared = shared
        self.work = work
        self.called = now_ns()
        self.rec = _Rec()
        #: The fence of its own grant, once entered (None: joined, or not entered).
        self.fence: int | None = None

    def _enter(self) -> str:
        fence = self.worker._announced_fence(self.spec.name)
        if self.parent is not None:
            self.worker.level(self.parent, fence, "decorated", self.shared)
            return self.parent
        joined = fence is None
        self.fence = fence
        self.rec.body = self.worker.enter(
            self.spec,
            self.kind,
            self.called,
            self.fallback if joined else fence,
            is_async=self.is_async,
            joined=joined,
            shared=self.shared,
        )
        return self.rec.body

    def _exit(self, body: str) -> None:
        if self.parent is not None:
            self.worker.unlevel(body)
        else:
            self.worker.leave(body, False)

    def run(self) -> None:
        body = self._enter()
        try:
            if self.work is not None:
                self.work(body, self.hold)
            else:
                time.sleep(self.hold)
        finally:
            self._exit(body)

    async def arun(self) -> None:
        body = self._enter()
        try:
            await asyncio.sleep(self.hold)
        finally:
            self._exit(body)


class _Tx:
    """One transactional body's read-modify-write, journalled before each step goes on.

    "intent" (the value read, so the value about to be written) goes out
    before the write; "committed" (the value written, its place in the row's
    commit order, and whether the lock was then given back) after the COMMIT
    returned. A process killed in between leaves an intent: its row is in
    the increments table if the COMMIT had been sent, never otherwise.
    """

    def __init__(self, worker: _Worker, spec: LockSpec) -> None:
        self.worker = worker
        self.lock = f"{spec.space}:{spec.name}"
        self.body: str | None = None
        self.value = 0
        self.seq = 0

    def increment(self, body: str, pause: float) -> None:
        from django.db import connection

        from .nemesis_data import increment

        def intent(read: int) -> None:
            self.worker.journal.write("intent", b=body, lock=self.lock, read=read)

        with connection.cursor() as cursor:
            self.value, self.seq = increment(cursor, self.lock, body, pause, intent)
        self.body = body

    def committed(self, given_back: bool | None) -> None:
        """Journal the COMMIT; ``given_back`` is None when the lock's block outlived it."""
        if self.body is not None:
            self.worker.journal.write(
                "committed", b=self.body, value=self.value, seq=self.seq, given_back=given_back
            )


def _using(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def worker_main(config_path: str, incarnation: int) -> int:
    """Run one worker process: set Django up with the slot's CACHES and contend until the end."""
    # Until the event loop handles it, a command signal must not kill us.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _die_with_parent()
    config = json.loads(Path(config_path).read_text())
    import django
    from django.conf import settings

    settings.configure(
        CACHES=config["caches"],
        DATABASES={"default": config["database"]},
        INSTALLED_APPS=["django_redis_mutex"],
        USE_TZ=True,
        SECRET_KEY="nemesis-worker",
        LOGGING_CONFIG=None,
    )
    django.setup()
    logging.basicConfig(
        level=logging.WARNING,
        format="%(created).3f %(process)d %(threadName)s %(levelname)s %(name)s: %(message)s",
    )
    code = _Worker(config, incarnation).run()
    sys.stdout.flush()
    sys.stderr.flush()
    # Daemon threads (the watchdog, blocked waiters) must not hold the exit up.
    os._exit(code)


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "worker":
        return worker_main(argv[1], int(argv[2]))
    print("usage: python -m tests.nemesis worker CONFIG INCARNATION", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
