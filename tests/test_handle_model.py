"""A Hypothesis state machine: lock handles driven from real threads, checked against a model.

The example-based tests each pin one sentence of the lock contract. The
bugs that matter most in a reentrant distributed lock live in the
*combinations*: a plain ``acquire()`` followed by a ``with`` block in the same
thread, a handle handed to another thread half-way, a reset landing between two
nested levels, a lease running out under an open block. This module lets
Hypothesis compose those sequences and checks every single outcome against a
model of who holds what, so the contract is tested as a whole:

* Nesting (a second acquire succeeding while the lock is held) is granted only
  through the same handle by the owner holding it, or inside the dynamic
  extent of a ``with`` block / decorated call of the same owner. A lock taken
  with plain ``acquire()`` is nested into only through that handle; another
  owner always contends; once a hold is released nothing nests into it.
* ``release()`` succeeds from any thread while the handle holds the lock, and
  raises ``LockNotOwned`` when it holds nothing or its hold was lost.
* A hold lost to ``reset()`` or to a lapsed lease (watchdog off) is never
  hidden: its last level reports the loss -- ``release()`` raises
  ``LockNotOwned``, the outermost ``with`` block exits with ``LockLost`` --
  even when nested blocks re-entered or re-acquired the lock meanwhile. (An
  inner level may report it too, or not.)
* A handle shared by two threads: the thread that was handed the lock (after
  blocking on the same handle) can release it, and the lock is then free.
* A cancelled ``aacquire()`` leaves no lock held by a token nobody has.
* Fences strictly increase across successive holds of a name, and after every
  step Redis holds exactly the model's holder of each name.

Ownership is by thread, so every actor is a real OS thread that runs the
commands it is sent. A ``with`` block opened by an actor really is open: its
body runs a nested command loop until the block is told to end, so later steps
run inside its dynamic extent exactly as code in the block would. Waiting is
always a poll with a deadline, never a sleep, and every acquisition is
non-blocking except where blocking is the point (the shared-handle hand-over,
the cancelled async waiter), so each step has one predictable outcome.

Where the contract deliberately leaves a choice (re-entering a hold that was
already lost may fail, re-acquire, or nest; an inner level of a lost hold may
or may not report the loss) the model accepts every permitted outcome, tells
which one happened by the tokens Redis and the handle show, and goes on from
there.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pytest
import redis
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from django_redis_mutex import LockContended, LockLost, LockNotOwned, Mutex, mutex, reset
from django_redis_mutex.watchdog import get_watchdog

# Logical lock names; each example maps them to names of its own, so examples
# never see each other's keys (or a waiter slot an earlier example left).
NAMES = ("a", "b", "lease")
# The name the lease-lapse rule uses (any other rule may use it too).
LEASE = "lease"
ACTORS = 3
MAX_HANDLES = 6
MAX_OPEN_BLOCKS = 4
# A watchdog-less lease that lapses within one step; long enough that the
# step can still read the hold it was granted.
SHORT_LEASE = 0.2
# A watchdog-less lease that never lapses by itself within an example.
LONG_LEASE = 120.0
# Hand-overs of one shared handle in one step.
HANDOVERS = 6
# Cancel points (event-loop turns) one cancel sweep tries: they cover the first
# round trip of an acquisition (on localhost its reply is read after about six
# turns); a cancel during the blocking wait is tried by the ``queued`` mode.
CANCEL_POINTS = 12
# Before each cancel the event loop is stalled this long, as a busy loop would
# be: a command the task already sent has then run in Redis and its reply sits
# unread, so at the turn right after the send the cancel lands, every time, in
# the gap between Redis granting (or queueing) and the task reading that.
CANCEL_STALL = 0.002
# How long Redis is kept busy (by a Lua loop on another connection) in the
# ``slow redis`` cancel: the acquisition's command waits behind it, so a cancel
# sent meanwhile lands before Redis runs that command and answers it. Not done
# on an external server (REDIS_URL), which other clients may share.
BUSY_REDIS = 0.02
SLOW_REDIS_ALLOWED = not os.environ.get("REDIS_URL")
BUSY_SCRIPT = """
local t = redis.call('TIME')
local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
repeat t = redis.call('TIME') until tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop
return 1
"""
# How long a cancelled waiter may take to leave the queue. Far below the
# waiter lease (2 s), after which Redis would drop an abandoned slot by itself:
# until then the next release would hand the lock to the task that is gone.
CANCEL_SETTLE = 1.0
# How long a cancelled aacquire may take to end. Its wait re-checks for a
# cancel at least every second even if the cancel itself was swallowed.
CANCEL_PROMPT = 3.0
# The cancelled task's own timeout: a cancel it ignores shows as a return
# after this long instead of a CancelledError.
CANCEL_WAIT = 8.0
# Upper bound on any one operation, generous for a busy machine.
STEP_TIMEOUT = 15.0


class ContractViolation(AssertionError):
    """An operation's outcome disagreed with the contract."""


_VIOLATIONS: dict[str, type[ContractViolation]] = {}


def _rule(name: str, text: str) -> str:
    """Register a contract rule; its failures raise a ``ContractViolation`` subclass of its own.

    Hypothesis tells bugs apart by exception type and origin, so with a class
    per rule it reports (and shrinks) a minimal example for every rule that
    breaks instead of stopping at the first.
    """
    _VIOLATIONS[text] = type(name, (ContractViolation,), {"__doc__": text, "__module__": __name__})
    return text


# The contract rules, named in every failure so a report says which one broke.
NEST_SAME_HANDLE = _rule("NestSameHandle", "the owner nests through the handle that holds the lock")
NEST_IN_BLOCK = _rule("NestInBlock", "the owner nests inside its open with-block or decorated call")
PLAIN_NOT_SCOPED = _rule(
    "PlainNotScoped",
    (
        "reentrancy never outlives its block: a hold taken outside an open with-block "
        "is nested into only through its own handle"
    ),
)
SHARED_NO_NEST = _rule(
    "SharedNoNest", "a handle shared by threads nests only for the owner that holds it"
)
OTHER_OWNER = _rule("OtherOwner", "another owner's hold is never entered")
FREE_GRANTED = _rule("FreeGranted", "a free lock is granted to a non-blocking acquire")
RELEASE = _rule(
    "Release", "release() from any thread releases a held handle, else raises LockNotOwned"
)
LOSS = _rule(
    "Loss",
    (
        "a lost hold (reset or lapsed lease) is reported: "
        "release raises LockNotOwned, with-exit raises LockLost"
    ),
)
NESTED_LOSS = _rule(
    "NestedLoss", "a loss is never hidden by nesting: the outer with-exit still raises LockLost"
)
EXPIRY = _rule("Expiry", "without a watchdog a lease lapses after its ttl")
SHARED_HANDOFF = _rule(
    "SharedHandoff",
    "a thread handed the lock on a shared handle can release it, and it is then free",
)
CANCEL = _rule("Cancel", "a cancelled aacquire leaves no lock held by a token nobody has")
CANCEL_HONOURED = _rule(
    "CancelHonoured",
    "a cancelled aacquire ends promptly (CancelledError, or True if it got the lock)",
)
FENCE = _rule("Fence", "fences strictly increase across successive holds of a name")
STATE = _rule("State", "Redis holds exactly the model's holder of each name")
HANDLE_STATE = _rule("HandleState", "a handle reports the hold it has (owned, token, fence)")
WITH_EXIT = _rule("WithExit", "a with-block over a live hold exits cleanly")
RESET = _rule("Reset", "reset() force-releases whatever holds the lock")
NO_HANG = _rule("NoHang", "no non-blocking operation hangs")


def violated(which: str, detail: str) -> NoReturn:
    """Fail naming the contract rule that broke."""
    raise _VIOLATIONS[which](f"[{which}] {detail}")


# -- the model -----------------------------------------------------------------


@dataclass(eq=False)
class ModelHold:
    """One acquisition: from the grant until its last level is released."""

    ident: int
    key: str
    token: str
    fence: int
    owner: int  # the actor that acquired it
    state: str = "live"  # live, lost (reset or lapsed while levels remain), released
    levels: int = 0  # outstanding acquire levels and with-blocks over it
    nested: bool = False  # it had more than one level at some point

    def __str__(self) -> str:
        return f"hold#{self.ident}(fence {self.fence}, actor {self.owner}, {self.state})"


@dataclass(eq=False)
class Level:
    """One level a handle holds: an ``acquire()``, or the ``with h:`` block ``via_block``."""

    hold: ModelHold
    parent: int | None  # the acquiring actor's innermost open block on the name
    via_block: int | None = None


@dataclass(eq=False)
class Handle:
    """A ``Mutex`` created by the test and used by any actor (handles move between threads)."""

    ident: int
    key: str
    mutex: Mutex
    short_ttl: bool = False  # every new grant through it lapses within the step
    levels: list[Level] = field(default_factory=list)
    open_blocks: int = 0

    @property
    def top(self) -> ModelHold | None:
        return self.levels[-1].hold if self.levels else None

    def __str__(self) -> str:
        return f"h{self.ident}({self.key!r})"


@dataclass(eq=False)
class Block:
    """An open ``with`` block or decorated call, whose body is an actor's command loop."""

    ident: int
    actor: int
    kind: str  # "mutex", "Mutex", "decorated" or "handle"
    key: str
    hold: ModelHold
    exited: Future[Any]
    lock: Mutex | None = None  # what ``as`` gave (None for a decorated call)
    handle: Handle | None = None  # for ``with h:`` on a test handle
    open_at_loss: bool = False  # the hold was lost while this block was open
    nested_inside: bool = False  # the actor took this name again inside the block

    def __str__(self) -> str:
        return f"block#{self.ident}[{self.kind} {self.key!r}]"


@dataclass
class Expect:
    """The model's prediction for one non-blocking acquisition."""

    kind: str  # "nest", "grant", "refuse" or "ambiguous" (entering a lost hold)
    rule: str
    reason: str
    hold: ModelHold | None = None
    case: str = ""  # a short name of the situation, for the run's statistics


# -- actors: real threads --------------------------------------------------------

_LEAVE = object()  # ends the innermost open block's body
_STOP = object()  # ends the thread


@dataclass
class Result:
    """What a command run in an actor returned, or raised."""

    value: Any = None
    error: BaseException | None = None


class Actor:
    """A real OS thread running the commands it is sent, one at a time.

    Lock ownership is per thread, so the model's owners must be threads the
    test controls. A block opened here keeps its body running (it serves the
    following commands) until told to leave, so its dynamic extent spans the
    later steps.
    """

    def __init__(self, index: int, tag: str) -> None:
        self.index = index
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.blocks: list[Block] = []
        self.thread = threading.Thread(target=self._serve, name=f"actor{index}-{tag}", daemon=True)
        self.thread.start()

    def __str__(self) -> str:
        return f"actor {self.index}"

    def _serve(self) -> bool:
        """Run commands until told to leave this level (False) or to stop (True)."""
        while True:
            item = self.inbox.get()
            if item is _LEAVE:
                return False
            if item is _STOP:
                return True
            func, future = item
            try:
                value = func()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(value)

    def submit(self, func: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self.inbox.put((func, future))
        return future

    def run(self, func: Callable[[], Any], what: str) -> Result:
        """Run ``func`` in this thread and return its value or error."""
        return wait_for(self.submit(func), what)

    def open_block(
        self, enter: Callable[[Callable[..., bool]], bool]
    ) -> tuple[Future[Any], Future[Any]]:
        """Open a block in this thread; return (entered, exited) futures.

        ``enter(body)`` runs the block around ``body``; ``body`` reports the
        block entered and serves commands until the block is told to leave.
        """
        entered: Future[Any] = Future()

        def body(lock: Any = None) -> bool:
            entered.set_result(lock)
            return self._serve()

        def run() -> None:
            stopped = False
            try:
                stopped = enter(body)
            except BaseException as exc:
                if not entered.done():
                    entered.set_exception(exc)
                    return
                raise
            finally:
                if stopped:
                    self.inbox.put(_STOP)

        return entered, self.submit(run)

    def stop(self) -> None:
        for _ in self.blocks:
            self.inbox.put(_LEAVE)
        self.inbox.put(_STOP)
        self.thread.join(5)


def wait_for(future: Future[Any], what: str) -> Result:
    try:
        return Result(value=future.result(STEP_TIMEOUT))
    except FutureTimeout:
        violated(NO_HANG, f"{what} did not finish within {STEP_TIMEOUT}s")
    except BaseException as exc:
        return Result(error=exc)


def decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def poll(check: Callable[[], object], timeout: float) -> bool:
    """Poll ``check`` every 5 ms until it is true (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def with_block(factory: Callable[[], Any]) -> Callable[[Callable[..., bool]], bool]:
    """Return an ``enter`` for :meth:`Actor.open_block` running ``with factory() as lock``."""

    def enter(body: Callable[..., bool]) -> bool:
        with factory() as lock:
            return body(lock)

    return enter


def decorated_call(name: str) -> Callable[[Callable[..., bool]], bool]:
    """Return an ``enter`` running the body as a call decorated with ``@mutex(name)``."""

    def enter(body: Callable[..., bool]) -> bool:
        @mutex(name, blocking=False)
        def call() -> bool:
            return body()

        return call()

    return enter


# -- the state machine -----------------------------------------------------------

actors = st.integers(0, ACTORS - 1)
keys = st.sampled_from(NAMES)
picks = st.integers(0, 15)


class HandleModel(RuleBasedStateMachine):
    """Drive handles, blocks, resets, lapses, hand-overs and cancels; check each outcome."""

    def __init__(self, raw: redis.Redis) -> None:
        super().__init__()
        self.raw = raw
        tag = uuid.uuid4().hex[:8]
        self.names = {key: f"{key}-{tag}" for key in NAMES}
        self.lock_keys = {key: Mutex(self.names[key]).keys for key in NAMES}
        self.actors = [Actor(index, tag) for index in range(ACTORS)]
        self.handles: list[Handle] = []
        self.holder: dict[str, ModelHold | None] = dict.fromkeys(NAMES)
        self.holds: dict[str, ModelHold] = {}  # every hold seen, by token
        self.last_fence: dict[str, int] = dict.fromkeys(NAMES, 0)
        self.ids = itertools.count(1)

    # -- reading Redis ---------------------------------------------------------

    def redis_token(self, key: str) -> str | None:
        value = self.raw.hget(self.lock_keys[key].lock, "token")
        return None if value is None else decode(value)

    def redis_fence(self, key: str) -> int | None:
        value = self.raw.hget(self.lock_keys[key].lock, "fence")
        return None if value is None else int(value)

    def held_by(self, key: str, token: str | None) -> str:
        """Describe a token in model terms, for failure messages."""
        if token is None:
            return "nobody"
        if token in self.holds:
            return str(self.holds[token])
        return f"unknown token {token[:8]}"

    # -- model helpers ---------------------------------------------------------

    def scope(self, actor: Actor, key: str) -> Block | None:
        """The actor's innermost open block on ``key``: the extent nesting is granted in."""
        for block in reversed(actor.blocks):
            if block.key == key:
                return block
        return None

    def predict(self, actor: Actor, key: str, handle: Handle | None) -> Expect:
        """Predict a non-blocking acquisition of ``key`` by ``actor`` through ``handle``.

        ``handle`` is None for the fresh handle a ``with mutex()`` block, a
        ``with Mutex()`` block or a decorated call makes for itself.
        """
        top = handle.top if handle is not None else None
        if top is not None:
            if top.state == "live":
                if top.owner == actor.index:
                    return Expect(
                        "nest", NEST_SAME_HANDLE, f"{handle} holds {top}", top, case="same handle"
                    )
                return Expect(
                    "refuse",
                    SHARED_NO_NEST,
                    f"{handle} holds {top} for actor {top.owner}",
                    case="handle of another owner",
                )
            return Expect(
                "ambiguous", LOSS, f"{handle} holds the lost {top}", top, case="lost, same handle"
            )
        block = self.scope(actor, key)
        if block is not None:
            if block.hold.state == "live":
                return Expect(
                    "nest",
                    NEST_IN_BLOCK,
                    f"inside {block} over {block.hold}",
                    block.hold,
                    case="inside a block",
                )
            return Expect(
                "ambiguous",
                LOSS,
                f"inside {block} over the lost {block.hold}",
                block.hold,
                case="lost, inside a block",
            )
        holder = self.holder[key]
        if holder is None:
            return Expect("grant", FREE_GRANTED, "the lock is free", case="free")
        if holder.owner == actor.index:
            return Expect(
                "refuse",
                PLAIN_NOT_SCOPED,
                f"{holder} is this actor's, but no open block holds it",
                case="own hold outside any block",
            )
        return Expect(
            "refuse",
            OTHER_OWNER,
            f"{holder} belongs to actor {holder.owner}",
            case="another owner's hold",
        )

    def may_acquire(self, actor: Actor, handle: Handle) -> bool:
        """Whether the contract predicts a plain acquire on ``handle`` by ``actor``.

        A non-owner acquiring through a handle whose hold was lost is left
        undefined by the contract, and a handle with an open ``with h:`` block
        is only used by that block (acquiring or releasing it inside the block
        would leave the block unbalanced).
        """
        return handle.open_blocks == 0 and self.may_enter(actor, handle)

    def may_enter(self, actor: Actor, handle: Handle) -> bool:
        """Whether the contract predicts ``with handle:`` by ``actor``.

        Not when another owner's hold is on the handle and the actor is inside
        a block on the name (whose hold then can only be a lost one): the
        acquisition may nest into the block's hold, which leaves levels of two
        owners on one handle, and the contract does not say which of them a
        release from a third thread would end.
        """
        top = handle.top
        if top is None:
            return True
        if top.owner == actor.index:
            return True
        return top.state == "live" and self.scope(actor, handle.key) is None

    def exitable(self, actor: Actor) -> bool:
        """An actor may leave its innermost block once the levels taken inside it are released."""
        if not actor.blocks:
            return False
        inner = actor.blocks[-1].ident
        return not any(
            level.parent == inner and level.via_block is None
            for handle in self.handles
            for level in handle.levels
        )

    def new_handle(self, key: str, **options: Any) -> Handle:
        if len(self.handles) >= MAX_HANDLES:
            # Forget idle handles: they hold nothing the model must follow.
            idle = [h for h in self.handles if not h.levels and not h.open_blocks]
            for handle in idle[: len(self.handles) - MAX_HANDLES + 1]:
                self.handles.remove(handle)
        handle = Handle(
            next(self.ids),
            key,
            Mutex(self.names[key], blocking=False, **options),
            short_ttl=options.get("ttl") == SHORT_LEASE,
        )
        self.handles.append(handle)
        return handle

    def lose(self, hold: ModelHold, how: str) -> None:
        hold.state = "lost"
        self.holder[hold.key] = None
        for actor in self.actors:
            for block in actor.blocks:
                if block.hold is hold:
                    block.open_at_loss = True
        note(f"  {hold} lost: {how}")

    def drop_level(self, hold: ModelHold) -> None:
        hold.levels -= 1
        if hold.levels == 0 and hold.state == "live":
            hold.state = "released"
            self.holder[hold.key] = None

    def await_lapse(self, hold: ModelHold) -> None:
        """Wait (polling Redis) until a watchdog-less short lease has lapsed."""
        lock_key = self.lock_keys[hold.key].lock
        if not poll(lambda: not self.raw.exists(lock_key), 5.0):
            violated(EXPIRY, f"{hold} was still in Redis 5 s into a {SHORT_LEASE}s lease")
        self.lose(hold, "its lease lapsed")

    def grant(
        self, actor: Actor, key: str, lock: Mutex | None, short: bool, what: str
    ) -> ModelHold:
        """Record and check a new grant to ``lock`` (None: a decorated call's unseen handle)."""
        after = self.redis_token(key)
        redis_fence = self.redis_fence(key) if after is not None else None
        if lock is None:
            token, fence = after, redis_fence
        else:
            token, fence = lock.token, lock.fence
            if token is None:
                violated(HANDLE_STATE, f"{what} returned True, but the handle holds nothing")
        if token is None or fence is None:
            violated(STATE, f"{what} returned True, but neither the handle nor Redis holds it")
        if after != token and not (after is None and short):
            violated(
                STATE,
                f"{what} returned True with token {token[:8]}, but Redis has "
                f"{self.held_by(key, after)}",
            )
        if redis_fence is not None and after == token and redis_fence != fence:
            violated(HANDLE_STATE, f"{what}: the handle reports fence {fence}, Redis {redis_fence}")
        if fence <= self.last_fence[key]:
            violated(FENCE, f"{what} got fence {fence}, not above {self.last_fence[key]}")
        self.last_fence[key] = fence
        hold = ModelHold(next(self.ids), key, token, fence, actor.index, levels=1)
        self.holder[key] = hold
        self.holds[token] = hold
        return hold

    def judge(
        self,
        actor: Actor,
        key: str,
        expect: Expect,
        succeeded: bool,
        lock: Mutex | None,
        before: str | None,
        short: bool,
        what: str,
    ) -> tuple[ModelHold | None, bool]:
        """Check an acquisition's outcome; return (the hold it joined or got, whether new).

        ``lock`` is the handle that acquired (None for a decorated call, whose
        handle the test cannot see).
        """
        token = lock.token if lock is not None else None
        after = self.redis_token(key)
        if not succeeded:
            if expect.kind in ("nest", "grant"):
                violated(expect.rule, f"{what} was refused; the model says {expect.reason}")
            if after != before:
                violated(STATE, f"a refused {what} changed Redis to {self.held_by(key, after)}")
            return None, False
        if expect.kind == "refuse":
            violated(expect.rule, f"{what} succeeded, but {expect.reason}")
        if expect.kind == "grant":
            if token in self.holds:
                violated(
                    expect.rule,
                    f"{what} joined {self.holds[token]} instead of acquiring ({expect.reason})",
                )
            return self.grant(actor, key, lock, short, what), True
        hold = expect.hold
        assert hold is not None
        if expect.kind == "nest":
            if after != before or (lock is not None and token != hold.token):
                violated(
                    expect.rule,
                    f"{what} should have nested into {hold} but the handle has "
                    f"{self.held_by(key, token)} and Redis {self.held_by(key, after)}",
                )
            hold.levels += 1
            hold.nested = True
            return hold, False
        # Entering a lost hold: failing, nesting into it, or acquiring anew all
        # satisfy the contract; find out which happened.
        live = self.holder[key]
        nested = after == before if lock is None else token == hold.token
        if nested:
            if after != before:
                violated(STATE, f"{what} re-entered {hold} but Redis changed")
            note(f"  (permitted) {what} re-entered the lost {hold}")
            event("entering a lost hold: re-entered it")
            hold.levels += 1
            hold.nested = True
            return hold, False
        scope = self.scope(actor, key)
        if live is not None and token == live.token and scope is not None and scope.hold is live:
            note(f"  (permitted) {what} nested into the live {live} of {scope}")
            event("entering a lost hold: joined the block's live hold")
            live.levels += 1
            live.nested = True
            return live, False
        if before is not None:
            violated(
                OTHER_OWNER,
                f"{what} took a lock held by {self.held_by(key, before)} "
                f"(handle has {self.held_by(key, token)})",
            )
        note(f"  (permitted) {what} acquired anew instead of entering the lost {hold}")
        event("entering a lost hold: acquired anew")
        return self.grant(actor, key, lock, short, what), True

    def mark_nested(self, actor: Actor, key: str) -> None:
        for block in actor.blocks:
            if block.key == key:
                block.nested_inside = True

    # -- acquire and release ---------------------------------------------------

    def acquire_through(self, actor: Actor, handle: Handle) -> None:
        expect = self.predict(actor, handle.key, handle)
        before = self.redis_token(handle.key)
        what = f"{actor}: {handle}.acquire(blocking=False)"
        result = actor.run(lambda: handle.mutex.acquire(blocking=False), what)
        if result.error is not None or not isinstance(result.value, bool):
            violated(STATE, f"{what} gave {result.error or result.value!r}, not True/False")
        hold, new = self.judge(
            actor, handle.key, expect, result.value, handle.mutex, before, handle.short_ttl, what
        )
        note(f"{what} -> {result.value} ({expect.kind}: {expect.reason})")
        event(f"acquire, {expect.case} -> {result.value}")
        if hold is None:
            return
        self.mark_nested(actor, handle.key)
        scope = self.scope(actor, handle.key)
        handle.levels.append(Level(hold, scope.ident if scope else None))
        if new and handle.short_ttl:
            self.await_lapse(hold)

    @rule(actor=actors, key=keys)
    def acquire_fresh_handle(self, actor: int, key: str) -> None:
        """``Mutex(name).acquire(blocking=False)`` on a new handle."""
        self.acquire_through(self.actors[actor], self.new_handle(key))

    @precondition(lambda self: bool(self.handles))
    @rule(actor=actors, pick=picks)
    def acquire_existing_handle(self, actor: int, pick: int) -> None:
        """Acquire again through a handle another step made (possibly in another thread)."""
        who = self.actors[actor]
        candidates = [h for h in self.handles if self.may_acquire(who, h)]
        if not candidates:
            note(f"{who}: no handle to acquire through")
            return
        self.acquire_through(who, candidates[pick % len(candidates)])

    @precondition(lambda self: any(not h.open_blocks for h in self.handles))
    @rule(actor=actors, pick=picks)
    def release_handle(self, actor: int, pick: int) -> None:
        """``release()`` a handle, from whichever thread (the token lives on the handle)."""
        who = self.actors[actor]
        candidates = [h for h in self.handles if not h.open_blocks]
        handle = candidates[pick % len(candidates)]
        hold = handle.top
        what = f"{who}: {handle}.release()"
        result = who.run(handle.mutex.release, what)
        outcome = "ok" if result.error is None else type(result.error).__name__
        note(f"{what} -> {outcome} (model: {hold or 'holds nothing'})")
        state = "nothing" if hold is None else hold.state
        if hold is not None and hold.state == "lost":
            state += ", last level" if hold.levels == 1 else ", inner level"
        event(f"release of {state} -> {outcome}")
        if result.error is not None and not isinstance(result.error, LockNotOwned):
            violated(RELEASE, f"{what} raised {result.error!r}")
        if hold is None:
            if result.error is None:
                violated(RELEASE, f"{what} succeeded on a handle that holds nothing")
            return
        handle.levels.pop()
        if hold.state == "live":
            if result.error is not None:
                violated(RELEASE, f"{what} raised {result.error!r}, but it holds {hold}")
        elif hold.levels == 1 and result.error is None:
            # The last level of a lost hold: the loss must be reported. An
            # inner level may report it or not.
            violated(
                NESTED_LOSS if hold.nested else LOSS,
                f"{what} succeeded on the last level of the lost {hold}",
            )
        self.drop_level(hold)

    # -- with blocks and decorated calls ---------------------------------------

    def open(
        self,
        actor: Actor,
        key: str,
        kind: str,
        enter: Callable[[Callable[..., bool]], bool],
        handle: Handle | None,
        what: str,
        short: bool = False,
    ) -> Block | None:
        """Open a block in ``actor`` and check its entry against the model.

        ``short`` says the block's own fresh handle has a short watchdog-less
        lease (a grant through a short test handle is known from the handle).
        """
        expect = self.predict(actor, key, handle)
        before = self.redis_token(key)
        entered, exited = actor.open_block(enter)
        result = wait_for(entered, what)
        if result.error is not None and not isinstance(result.error, LockContended):
            violated(STATE, f"{what} raised {result.error!r} on entry")
        if result.error is not None:
            wait_for(exited, f"{what} (after its refused entry)")
        lock = result.value if kind != "decorated" else None
        if kind == "handle" and handle is not None:
            lock = handle.mutex
        short = short or (handle is not None and handle.short_ttl)
        hold, new = self.judge(actor, key, expect, result.error is None, lock, before, short, what)
        note(f"{what} -> {'entered' if hold else 'LockContended'} ({expect.kind}: {expect.reason})")
        event(f"enter {kind}, {expect.case} -> {'entered' if hold else 'LockContended'}")
        if hold is None:
            return None
        self.mark_nested(actor, key)
        block = Block(next(self.ids), actor.index, kind, key, hold, exited, lock, handle)
        actor.blocks.append(block)
        if handle is not None:
            handle.levels.append(Level(hold, None, via_block=block.ident))
            handle.open_blocks += 1
        if new and short:
            self.await_lapse(hold)
        return block

    @rule(actor=actors, key=keys, kind=st.sampled_from(["mutex", "Mutex", "decorated"]))
    def enter_block(self, actor: int, key: str, kind: str) -> None:
        """Open ``with mutex(name)``, ``with Mutex(name)`` or a ``@mutex(name)`` call."""
        who = self.actors[actor]
        if len(who.blocks) >= MAX_OPEN_BLOCKS:
            note(f"{who}: already {MAX_OPEN_BLOCKS} blocks deep")
            return
        name = self.names[key]
        enter: Callable[[Callable[..., bool]], bool]
        if kind == "mutex":
            enter = with_block(lambda: mutex(name, blocking=False))
            what = f"{who}: with mutex({key!r})"
        elif kind == "Mutex":
            enter = with_block(lambda: Mutex(name, blocking=False))
            what = f"{who}: with Mutex({key!r})"
        else:
            enter = decorated_call(name)
            what = f"{who}: @mutex({key!r}) call"
        self.open(who, key, kind, enter, None, what)

    @precondition(lambda self: bool(self.handles))
    @rule(actor=actors, pick=picks)
    def enter_handle_block(self, actor: int, pick: int) -> None:
        """Open ``with h:`` on an existing handle (the same-handle nesting path)."""
        who = self.actors[actor]
        if len(who.blocks) >= MAX_OPEN_BLOCKS:
            note(f"{who}: already {MAX_OPEN_BLOCKS} blocks deep")
            return
        candidates = [h for h in self.handles if self.may_enter(who, h)]
        if not candidates:
            note(f"{who}: no handle to enter")
            return
        handle = candidates[pick % len(candidates)]
        self.open(
            who,
            handle.key,
            "handle",
            with_block(lambda: handle.mutex),
            handle,
            f"{who}: with {handle}",
        )

    @precondition(lambda self: any(self.exitable(a) for a in self.actors))
    @rule(pick=st.integers(0, ACTORS - 1))
    def exit_block(self, pick: int) -> None:
        """Leave an actor's innermost block (its body succeeded)."""
        candidates = [a for a in self.actors if self.exitable(a)]
        who = candidates[pick % len(candidates)]
        block = who.blocks[-1]
        hold = block.hold
        final = hold.levels == 1
        what = f"{who}: leave {block}"
        who.inbox.put(_LEAVE)
        error = wait_for(block.exited, what).error
        who.blocks.pop()
        if block.handle is not None:
            level = block.handle.levels.pop()
            assert level.via_block == block.ident, "model: with-h levels out of order"
            block.handle.open_blocks -= 1
        note(f"{what} -> {'ok' if error is None else repr(error)} (model: {hold})")
        state = (
            hold.state if hold.state == "live" else f"lost, {'last' if final else 'inner'} level"
        )
        event(f"exit of {state} -> {'ok' if error is None else type(error).__name__}")
        if hold.state == "live":
            if error is not None:
                violated(WITH_EXIT, f"{what} raised {error!r}, but {hold} is live")
        elif error is not None and not isinstance(error, LockLost):
            violated(LOSS, f"{what} raised {error!r}, not LockLost, after {hold} was lost")
        elif error is None and final:
            # The last level of a lost hold must report the loss; inner levels may.
            nested = hold.nested or block.nested_inside
            violated(
                NESTED_LOSS if nested else LOSS,
                f"{what}, the last level of {hold}, exited cleanly although the hold was lost"
                + (" while it was open" if block.open_at_loss else "")
                + (" (the lock was nested or re-entered meanwhile)" if nested else ""),
            )
        self.drop_level(hold)

    # -- operator and time -----------------------------------------------------

    @rule(key=keys)
    def reset_lock(self, key: str) -> None:
        """``reset(name)``: the operator force-releases the lock; its holder has lost it."""
        hold = self.holder[key]
        done = reset(self.names[key])
        note(f"reset({key!r}) -> {done} (model: {hold or 'free'})")
        if done != (hold is not None):
            violated(RESET, f"reset({key!r}) returned {done}; the model's holder is {hold}")
        if hold is not None:
            self.lose(hold, "reset")

    @precondition(lambda self: self.holder[LEASE] is None)
    @rule(
        actor=actors,
        form=st.sampled_from(["acquire", "with_handle", "with_mutex"]),
        short_ttl=st.booleans(),
    )
    def lapse_lease(self, actor: int, form: str, short_ttl: bool) -> None:
        """Take the lease lock without a watchdog and let its lease run out.

        With ``short_ttl`` the handle's own ttl is short; otherwise its ttl is
        long and the holder shortens the remaining lease with ``extend()`` (so
        later re-acquisitions through that handle keep a long lease). Either
        way the step polls Redis until the key is gone, then the model marks
        the hold lost.
        """
        who = self.actors[actor]
        if self.scope(who, LEASE) is not None or len(who.blocks) >= MAX_OPEN_BLOCKS:
            note(f"{who}: already inside a block on {LEASE!r}, or too deep")
            return
        ttl = SHORT_LEASE if short_ttl else LONG_LEASE
        name = self.names[LEASE]
        lock: Mutex | None
        if form == "acquire":
            handle = self.new_handle(LEASE, ttl=ttl, watchdog=False)
            lock = handle.mutex
            what = f"{who}: {handle}(ttl={ttl}, watchdog=False).acquire()"
            result = who.run(lambda: handle.mutex.acquire(blocking=False), what)
            if result.error is not None or not isinstance(result.value, bool):
                violated(STATE, f"{what} gave {result.error or result.value!r}, not True/False")
            expect = Expect("grant", FREE_GRANTED, "the lock is free")
            taken, _ = self.judge(who, LEASE, expect, result.value, lock, None, short_ttl, what)
            assert taken is not None  # a refused grant already failed the step
            hold = taken
            self.mark_nested(who, LEASE)
            handle.levels.append(Level(hold, None))
            note(f"{what} -> True ({hold})")
        else:
            if form == "with_handle":
                handle = self.new_handle(LEASE, ttl=ttl, watchdog=False)
                what = f"{who}: with {handle}(ttl={ttl}, watchdog=False)"
                block = self.open(
                    who, LEASE, "handle", with_block(lambda: handle.mutex), handle, what
                )
            else:
                what = f"{who}: with mutex({LEASE!r}, ttl={ttl}, watchdog=False)"
                block = self.open(
                    who,
                    LEASE,
                    "mutex",
                    with_block(lambda: mutex(name, ttl=ttl, watchdog=False, blocking=False)),
                    None,
                    what,
                    short=short_ttl,
                )
            assert block is not None  # a refused entry already failed the step
            hold = block.hold
            lock = block.lock
        event(f"lease lapse: {form}, {'short ttl' if short_ttl else 'extend()'}")
        if short_ttl:
            # open() already waited for a grant through a short test handle.
            if hold.state == "live":
                self.await_lapse(hold)
            return
        assert lock is not None
        shorten = who.run(lambda: lock.extend(SHORT_LEASE), f"{who}: extend({SHORT_LEASE})")
        if shorten.error is not None:
            violated(HANDLE_STATE, f"extend() on the fresh {hold} raised {shorten.error!r}")
        self.await_lapse(hold)

    # -- a handle shared by two threads ----------------------------------------

    @rule(
        first=actors,
        second=actors,
        key=keys,
        release_now=st.booleans(),
    )
    def shared_handle_handoff(self, first: int, second: int, key: str, release_now: bool) -> None:
        """Two threads share one handle and hand the lock back and forth through it.

        The holder holds the handle, the other thread blocks in ``acquire()`` on
        the same handle, the holder releases: the lock is handed to the waiting
        acquire, so the waiter now holds it through the shared handle and must
        be able to release it in turn. Several hand-overs run in one step,
        because whether the releasing thread or the woken one finishes first
        is up to the scheduler. At the end the last receiver releases right
        away (and the lock must then be free), or keeps it for later steps.
        """
        if first == second:
            second = (first + 1) % ACTORS
        a, b = self.actors[first], self.actors[second]
        if self.holder[key] is not None or self.scope(a, key) or self.scope(b, key):
            note(f"shared hand-over on {key!r} skipped: held, or an actor is inside a block on it")
            return
        handle = self.new_handle(key)
        m = handle.mutex
        what = f"{a}: {handle}.acquire()"
        got = a.run(lambda: m.acquire(blocking=False), what)
        if got.error is not None or not isinstance(got.value, bool):
            violated(STATE, f"{what} gave {got.error or got.value!r}, not True/False")
        expect = Expect("grant", FREE_GRANTED, "the lock is free")
        taken_first, _ = self.judge(a, key, expect, got.value, m, None, False, what)
        assert taken_first is not None  # a refused grant already failed the step
        hold = taken_first
        handle.levels.append(Level(hold, None))
        note(f"{what} -> True ({hold})")
        holder, waiter = a, b
        queue_key = self.lock_keys[key].queue
        for _ in range(HANDOVERS):
            what = f"{waiter}: {handle}.acquire(blocking=True)"
            waiting = waiter.submit(lambda: m.acquire(blocking=True, timeout=STEP_TIMEOUT))

            def queued(waiting: Future[Any] = waiting) -> bool:
                return waiting.done() or bool(self.raw.zcard(queue_key))

            poll(queued, 5.0)
            if waiting.done():
                violated(
                    SHARED_NO_NEST,
                    f"{what} returned {wait_for(waiting, what)} while {holder} held it",
                )
            released = holder.run(m.release, f"{holder}: {handle}.release()")
            handle.levels.pop()
            self.drop_level(hold)
            if released.error is not None:
                violated(SHARED_HANDOFF, f"{holder}: {handle}.release() raised {released.error!r}")
            taken = wait_for(waiting, what)
            if taken.error is not None or taken.value is not True:
                violated(SHARED_HANDOFF, f"{what} gave {taken.error or taken.value!r}")
            if m.token is None:
                violated(
                    SHARED_HANDOFF,
                    f"{what} returned True but the handle holds nothing once {holder}'s "
                    f"release() returned (Redis: {self.held_by(key, self.redis_token(key))})",
                )
            hold = self.grant(waiter, key, m, False, what)
            handle.levels.append(Level(hold, None))
            note(f"{holder}: {handle}.release() -> ok; {what} -> True ({hold})")
            event("shared handle: hand-over")
            holder, waiter = waiter, holder
        if not release_now:
            return
        what = f"{holder}: {handle}.release()"

        def release_and_look() -> bool:
            m.release()
            return m.locked()

        done = holder.run(release_and_look, what)
        handle.levels.pop()
        self.drop_level(hold)
        note(f"{what} -> {done.error or 'ok'}; locked() -> {done.value}")
        if done.error is not None:
            violated(SHARED_HANDOFF, f"{what} raised {done.error!r}")
        if done.value is not False:
            violated(SHARED_HANDOFF, f"after {what} the lock is still held")

    # -- a cancelled async waiter ----------------------------------------------

    @rule(actor=actors, key=keys, mode=st.sampled_from(["sweep", "queued", "slow redis"]))
    def cancel_async_acquire(self, actor: int, key: str, mode: str) -> None:
        """Cancel a task in ``await m.aacquire()`` at every point of its acquisition.

        The task is its own owner, so it waits if the lock is held (even by
        this thread's open block) and takes it if free. In a ``sweep`` the
        cancel is sent after 0, 1, 2, ... event-loop turns and a short stall
        of the loop, so that within one step it lands before, during and just
        after the first round trip of the acquisition, the one that grants the
        lock or queues the waiter; the sweep ends once a cancel came after it
        (later points only repeat that). With ``queued`` the cancel is sent
        once the task waits in the queue; with ``slow redis`` while Redis,
        busy with another client, has not yet run the command the task sent.
        Whenever it lands, afterwards the lock must be as before (a lock the
        task did get is released here), or held by the task's handle, which
        then says so.
        """
        if mode == "slow redis" and not SLOW_REDIS_ALLOWED:
            mode = "sweep"
        who = self.actors[actor]
        name = self.names[key]
        queue_key = self.lock_keys[key].queue
        raw = self.raw
        holder = self.holder[key]
        before = self.redis_token(key)
        points: list[int | None] = list(range(CANCEL_POINTS)) if mode == "sweep" else [None]

        async def cancel_when_due(task: asyncio.Task[bool], turns: int | None) -> bool:
            """Send the cancel at the point ``mode`` and ``turns`` say; return True if late.

            Late means the first round trip had already been answered in Redis
            (the lock granted or the waiter queued): later points add nothing.
            """
            if mode == "queued":
                poll_deadline = time.monotonic() + 5.0
                while not task.done() and not raw.zcard(queue_key):
                    if time.monotonic() >= poll_deadline:
                        break
                    await asyncio.sleep(0.002)
                task.cancel()
                return True
            assert turns is not None
            for _ in range(turns):
                await asyncio.sleep(0)
            time.sleep(CANCEL_STALL)  # stalls the loop: see CANCEL_STALL
            late = task.done() or bool(raw.zcard(queue_key))
            task.cancel()
            return late

        async def slow_redis_attempt(m: Mutex) -> asyncio.Task[bool]:
            """Start acquiring while Redis is busy; cancel once the command was sent."""
            await m.alocked()  # this loop's connection, made before Redis is busy
            busy = threading.Thread(target=raw.eval, args=(BUSY_SCRIPT, 0, int(BUSY_REDIS * 1e6)))
            busy.start()
            time.sleep(BUSY_REDIS / 4)  # the busy loop is running in Redis by now
            task = asyncio.ensure_future(m.aacquire())
            for _ in range(CANCEL_POINTS):
                await asyncio.sleep(0)  # the task sends its command, which waits in Redis
            task.cancel()
            await asyncio.to_thread(busy.join)
            return task

        async def attempt(turns: int | None) -> tuple[str, Mutex, int | None, bool]:
            """Cancel one acquisition; return (outcome, handle, fence, whether it was late)."""
            m = Mutex(name, timeout=CANCEL_WAIT)
            if mode == "slow redis":
                task = await slow_redis_attempt(m)
                late = True
            else:
                task = asyncio.ensure_future(m.aacquire())
                late = await cancel_when_due(task, turns)
            ended, _ = await asyncio.wait({task}, timeout=CANCEL_PROMPT)
            ignored = not ended
            if ignored:
                await asyncio.wait({task})  # it ends by its own timeout
            try:
                got = task.result()
            except asyncio.CancelledError:
                return "cancelled", m, None, late
            fence = m.fence
            if got:
                await m.arelease()
            outcome = "acquired" if got else "refused"
            return (f"ignored ({outcome})" if ignored else outcome), m, fence, late

        def settled(m: Mutex) -> bool:
            if raw.exists(queue_key):
                return False
            token = self.redis_token(key)
            if token == before:
                return True
            if token is not None and token == m.token and m.owned():
                # Held by the handle, which says so: the caller can release it.
                m.release()
            return False

        def cancel_all() -> list[tuple[int | None, str, Mutex, int | None]]:
            async def run_all() -> list[tuple[int | None, str, Mutex, int | None]]:
                outcomes = []
                for turns in points:
                    outcome, m, fence, late = await attempt(turns)
                    outcomes.append((turns, outcome, m, fence))
                    if late or outcome.startswith("ignored"):
                        break
                    if not await asyncio.to_thread(
                        poll, functools.partial(settled, m), CANCEL_SETTLE
                    ):
                        break
                return outcomes

            return asyncio.run(run_all())

        what = f"{who}: cancel aacquire({key!r}) " + (
            f"after 0..{CANCEL_POINTS - 1} loop turns" if mode == "sweep" else mode
        )
        result = who.run(cancel_all, what)
        if result.error is not None:
            violated(CANCEL, f"{what} raised {result.error!r}")
        outcomes: list[tuple[int | None, str, Mutex, int | None]] = result.value
        summary = " ".join(f"{turns}:{outcome[0]}" for turns, outcome, _, _ in outcomes)
        legend = "c: cancelled, a: acquired, i: cancel ignored"
        note(f"{what} -> {summary} ({legend}; model: {holder or 'free'})")
        situation = f"cancel, {mode}, lock " + ("held" if holder else "free")
        for _, outcome, _, _ in outcomes:
            event(f"{situation} -> {outcome}")
        for turns, outcome, _, fence in outcomes:
            where = f"{what}: cancel after {turns} turns" if turns is not None else what
            if outcome == "acquired":
                if holder is not None:
                    violated(OTHER_OWNER, f"{where}: the task acquired a lock {holder} held")
                if fence is None or fence <= self.last_fence[key]:
                    violated(FENCE, f"{where}: the task got fence {fence}")
                self.last_fence[key] = fence
            elif outcome != "cancelled":
                violated(
                    CANCEL_HONOURED,
                    f"{where}: the task's acquire went on waiting and ended {outcome} "
                    f"instead of raising CancelledError",
                )
        turns, _, m, _ = outcomes[-1]
        if not poll(lambda: settled(m), CANCEL_SETTLE):
            token = self.redis_token(key)
            where = f"{what}: cancel after {turns} turns" if turns is not None else what
            violated(
                CANCEL,
                f"{where}: {CANCEL_SETTLE}s later Redis holds "
                f"{self.held_by(key, token)} (expected {self.held_by(key, before)}; the "
                f"task's handle has {m.token and m.token[:8]})"
                + (
                    "; its waiter slot is still queued, so the next release or acquire "
                    "would hand the lock to a task that is gone"
                    if raw.exists(queue_key)
                    else ""
                ),
            )
        counter = raw.get(self.lock_keys[key].fence)
        if counter is not None:
            self.last_fence[key] = max(self.last_fence[key], int(counter))

    # -- invariants ------------------------------------------------------------

    @invariant()
    def redis_matches_model(self) -> None:
        """After every step Redis holds exactly the model's holder of each name, with no waiter."""
        for key in NAMES:
            token = self.redis_token(key)
            hold = self.holder[key]
            if token != (hold.token if hold is not None else None):
                violated(
                    STATE,
                    f"{key!r}: Redis holds {self.held_by(key, token)}, "
                    f"the model {hold or 'nothing'}",
                )
            if self.raw.exists(self.lock_keys[key].queue):
                violated(STATE, f"{key!r}: a waiter is still queued after the step")

    @invariant()
    def handles_report_their_holds(self) -> None:
        """Every handle's ``owned()``, ``token`` and ``fence`` agree with the model."""
        for handle in self.handles:
            top = handle.top
            live = top is not None and top.state == "live"
            owned = handle.mutex.owned()
            if owned != live:
                violated(
                    HANDLE_STATE,
                    f"{handle}.owned() is {owned}; the model has it holding {top or 'nothing'}",
                )
            if (
                live
                and top is not None
                and (handle.mutex.token != top.token or handle.mutex.fence != top.fence)
            ):
                violated(
                    HANDLE_STATE,
                    f"{handle} reports fence {handle.mutex.fence}; the model {top}",
                )
        for actor in self.actors:
            for block in actor.blocks:
                if block.lock is None or block.handle is not None:
                    continue
                live = block.hold.state == "live"
                if block.lock.owned() != live:
                    violated(
                        HANDLE_STATE,
                        f"the handle of {actor}'s {block} has owned()={not live}; "
                        f"the model {block.hold}",
                    )

    def teardown(self) -> None:
        """Stop every actor and force-release every lock the example left held."""
        for key in NAMES:
            reset(self.names[key])  # also wakes a waiter a failed step left blocked
        for actor in self.actors:
            actor.stop()
        for key in NAMES:
            reset(self.names[key])
        # Holds the example's resets took away are found lost by the watchdog
        # only at their next renewal: stop renewing them now.
        watchdog = get_watchdog()
        ours = set(self.names.values())
        for hold in watchdog.watched():
            if hold.name in ours:
                watchdog.unwatch(hold)


# Bounded so the test runs well within a minute; no example database, so a
# run leaves nothing behind in the tree. A failure prints the step sequence
# (with each step's notes) that reproduces it, shrunk, once per broken rule.
MODEL_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    derandomize=False,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# A passing run takes well under a minute; shrinking a failure to its minimal
# step sequence (one per broken rule) can take a few minutes more.
@pytest.mark.timeout(900)
def test_handles_follow_the_model(raw: redis.Redis) -> None:
    """Random sequences of acquire, release, blocks, resets, lapses, hand-overs and cancels."""

    class HandleModelOnTestRedis(HandleModel):
        """The machine bound to this test's Redis client."""

        def __init__(self) -> None:
            super().__init__(raw)

    run_state_machine_as_test(HandleModelOnTestRedis, settings=MODEL_SETTINGS)
