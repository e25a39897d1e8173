"""Shared and exclusive holders of one lock, driven through the scripts in random orders.

A Hypothesis state machine plays a handful of owners, each taking the lock
shared or exclusively, straight through the scripts (ACQUIRE, ACQUIRE_SHARED,
RELEASE, CANCEL, EXTEND, RESET, WAKE) on the suite's Redis: try once, queue
and check in again, release, cancel, extend, operator resets, a holder whose
lease ends and a waiter that dies (both written into Redis as a dead process
would leave them, so nothing sleeps). After every step it reads the lock back
from Redis and asks what the shared lock promises:

* an exclusive holder (the ``token`` field) and a live shared holder (an
  ``r:<token>`` field whose lease has not ended) are never in the hash together;
* the holders in Redis are exactly the owners the model believes hold the
  lock: a waiter becomes a holder only when a script says so, to its caller
  (granted) or as a token the caller must wake, and WAKE then reaches it;
* no shared holder is admitted while an exclusive waiter that stays in line
  was first (live) in line before the step;
* every grant, shared or exclusive, takes a fence larger than every fence
  handed out before it for the name;
* the queue, its wait leases and the waiters' terms name the same tokens,
  the live waiters the model has; nobody both holds and waits; a held lock
  with a live waiter behind it is marked ``queued`` (so a release looks), and
  a script that found the lock free (any but EXTEND, a release of an ended
  lease, a reset of a lock already gone) leaves no live waiter on it;
* a holder that checks in again (or cancels), as a waiter handed the lock
  between two check-ins does, is told it holds it, with its own fence.

The same machine plays a semaphore: every owner shared, with a limit of one
to three given to ACQUIRE_SHARED and CANCEL. Then, besides the above, no more
than the limit hold at once, and a script that found room leaves no live
waiter in line while a permit is free.

The wait leases (WAIT_LEASE) and hand-off leases are real time: an example
that takes longer than :data:`TIMELY` (a stalled machine) checks only what
time cannot change (the first and fourth promises) from then on.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from django_redis_mutex import scripts
from django_redis_mutex.keys import LockKeys

# Every grant but a hand-off's (which is capped at HANDOFF_LEASE) lasts this long.
TTL_MS = 60_000
# Seconds an example may take before real-time leases could end on their own.
TIMELY = min(scripts.WAIT_LEASE, scripts.HANDOFF_LEASE) * 0.75
MAX_OWNERS = 5

pick = st.integers(0, 63)


@dataclass
class Owner:
    """One owner in the model: a kind, and its current token's state."""

    index: int
    shared: bool
    token: str | None = None
    # idle, waiting (in line), holding, dead-waiter (its wait lease ended), lapsed
    # (its hold's lease ended or was reset, so its token is stale)
    state: str = "idle"
    fence: int | None = None
    # The waiter its grant said was next in line, which its release may name.
    successor: str = ""

    def __str__(self) -> str:
        kind = "shared" if self.shared else "exclusive"
        return f"owner {self.index} ({kind}, {self.state}, {self.token and self.token[:9]})"


@dataclass
class Snapshot:
    """What Redis says about the lock at one moment."""

    now_ms: int
    fields: dict[str, str]
    queue: list[str]
    leases: dict[str, float]
    waiting: set[str]
    fence_counter: int | None

    @property
    def exclusive(self) -> str | None:
        return self.fields.get("token")

    def readers(self) -> dict[str, tuple[int, int]]:
        """Live shared holders: token -> (lease end ms, fence)."""
        live = {}
        for field, value in self.fields.items():
            if field.startswith("r:"):
                ends, fence, *_ = value.split("|", 3)
                if int(ends) > self.now_ms:
                    live[field[2:]] = (int(ends), int(fence))
        return live

    def holders(self) -> dict[str, int]:
        """Every holder: token -> fence."""
        found = {token: fence for token, (_, fence) in self.readers().items()}
        if self.exclusive is not None:
            found[self.exclusive] = int(self.fields["fence"])
        return found

    def live_line(self) -> list[str]:
        """The queue in order, without the waiters whose wait lease ended."""
        return [token for token in self.queue if self.leases.get(token, 0) > self.now_ms]


def _woken(value: Any) -> set[str]:
    """The tokens a script reply says the caller must wake."""
    if isinstance(value, str):
        return set(value.split())
    return set()


class SharedLockModel(RuleBasedStateMachine):
    """Owners taking one lock shared or exclusively, straight through the scripts."""

    # True to play a semaphore: shared owners only, at most ``limit`` at once.
    semaphore = False

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        super().__init__()
        self.client = client
        self.keys = LockKeys.for_name(namespace, "rw-" + uuid.uuid4().hex[:10])
        self.owners: list[Owner] = []
        self.last_fence = 0
        self.started = time.monotonic()
        self.tokens = itertools.count(1)
        self.limit = 0  # no bound: a shared lock

    @property
    def limit_args(self) -> list[int]:
        """The limit argument of ACQUIRE_SHARED and CANCEL (none for a shared lock)."""
        return [self.limit] if self.limit else []

    # -- reading Redis ---------------------------------------------------------

    def snapshot(self) -> Snapshot:
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(self.keys.lock)
        pipe.zrange(self.keys.queue, 0, -1)
        pipe.hgetall(self.keys.waiting)
        pipe.get(self.keys.fence)
        clock, fields, queue, waiting, counter = pipe.execute()
        return Snapshot(
            now_ms=int(clock[0]) * 1000 + int(clock[1]) // 1000,
            fields=fields,
            queue=queue,
            # A waiter's record: "<place lease end ms>|<ttl ms>|<owner JSON>".
            leases={token: int(record.split("|", 1)[0]) for token, record in waiting.items()},
            waiting=set(waiting),
            fence_counter=None if counter is None else int(counter),
        )

    def timely(self) -> bool:
        """True while no real-time lease of this example can have ended on its own."""
        return time.monotonic() - self.started < TIMELY

    # -- model helpers ---------------------------------------------------------

    def in_state(self, *states: str) -> list[Owner]:
        return [owner for owner in self.owners if owner.state in states]

    def choose(self, index: int, *states: str) -> Owner:
        candidates = self.in_state(*states)
        return candidates[index % len(candidates)]

    def new_token(self, owner: Owner) -> str:
        # Shared tokens start with "s", exclusive ones are hex (see scripts.py).
        serial = next(self.tokens)
        text = f"{owner.index:x}{serial:06x}" + uuid.uuid4().hex[:8]
        return "s" + text if owner.shared else text

    def owner_of(self, token: str) -> Owner | None:
        for owner in self.owners:
            if owner.token == token:
                return owner
        return None

    def owners_token(self, token: str) -> Owner:
        owner = self.owner_of(token)
        assert owner is not None, f"unknown token {token}"
        return owner

    def describe(self, token: str) -> str:
        owner = self.owner_of(token)
        return str(owner) if owner is not None else f"unknown token {token}"

    def run(self, script: scripts.LuaScript, keys: tuple[str, ...], args: list[Any]) -> Any:
        reply = scripts.run(self.client, script, keys, args)
        note(f"{script.name}{tuple(args)[:2]} -> {reply!r}")
        return reply

    def step(
        self,
        caller: Owner | None,
        run: Any,
        granted_to_caller: Any = None,
        hands_on: Any = None,
    ) -> tuple[Any, Snapshot]:
        """Run one script call and check the grants it made against the state before it.

        ``run()`` returns the reply and the tokens it says the caller must wake;
        ``granted_to_caller(reply)`` says whether the reply grants the lock to
        ``caller``; ``hands_on(reply)`` whether the script, having found the
        lock free, must have handed it to the first live waiter.
        """
        before = self.snapshot()
        reply, announced = run()
        after = self.snapshot()
        old = before.holders()
        new = {token: fence for token, fence in after.holders().items() if token not in old}
        got_it = caller is not None and granted_to_caller is not None and granted_to_caller(reply)
        if got_it:
            assert caller is not None and caller.token in new, (
                f"{caller} was told it holds the lock, Redis holders: {after.holders()}"
            )
        expected = set(announced) | ({caller.token} if got_it and caller else set())
        if self.timely():
            assert set(new) == expected, (
                f"new holders {[self.describe(t) for t in new]} but the reply granted "
                f"{[self.describe(t) for t in expected]}"
            )
        # Fences: every grant takes a new one, above all handed out before.
        for token, fence in sorted(new.items(), key=lambda item: item[1]):
            assert fence > self.last_fence, (
                f"{self.describe(token)} got fence {fence}, not above {self.last_fence}"
            )
            self.last_fence = fence
        assert after.fence_counter is None or after.fence_counter >= self.last_fence
        # Writers first: a shared holder never enters past an exclusive waiter
        # that was first in line and still waits.
        line = before.live_line()
        if line and not line[0].startswith("s") and line[0] in after.queue:
            readers = [token for token in new if token.startswith("s")]
            assert not readers, (
                f"{[self.describe(t) for t in readers]} admitted shared while "
                f"{self.describe(line[0])} was first in line and still waits"
            )
        for token, fence in new.items():
            owner = self.owner_of(token)
            assert owner is not None, f"the lock went to unknown token {token}"
            assert owner.state in ("idle", "waiting", "dead-waiter"), (
                f"{owner} granted again; reply {reply!r}"
            )
            if owner.state == "dead-waiter" and owner is not caller and self.timely():
                raise AssertionError(f"{owner} was handed the lock after its wait lease ended")
            owner.state, owner.fence = "holding", fence
        if hands_on is not None and hands_on(reply) and self.timely():
            assert after.holders() or not after.live_line(), (
                f"the lock is free after {reply!r} while "
                f"{[self.describe(t) for t in after.live_line()]} wait"
            )
            if self.limit:
                assert len(after.holders()) >= self.limit or not after.live_line(), (
                    f"{len(after.holders())} of {self.limit} permits held after {reply!r} "
                    f"while {[self.describe(t) for t in after.live_line()]} wait"
                )
        # A waiter handed the lock is woken by WAKE, which pushes its fence.
        for token in announced:
            wake_keys = (self.keys.lock, self.keys.queue, self.keys.wake(token))
            if token in after.holders():
                assert self.run(scripts.WAKE, wake_keys, [token]) == 1
                pushed = self.client.lpop(self.keys.wake(token))
                assert pushed is not None and pushed.split("|")[0] == str(after.holders()[token])
                self.owners_token(token).successor = pushed.split("|", 1)[1]
        return reply, after

    # -- rules ------------------------------------------------------------------

    @initialize(
        kinds=st.lists(st.booleans(), min_size=2, max_size=MAX_OWNERS), limit=st.integers(1, 3)
    )
    def owners_of_each_kind(self, kinds: list[bool], limit: int) -> None:
        if self.semaphore:
            kinds, self.limit = [True] * len(kinds), limit
            note(f"a semaphore of limit {limit}")
        self.owners = [Owner(index, shared) for index, shared in enumerate(kinds)]
        note(", ".join(str(owner) for owner in self.owners))

    def acquire(self, owner: Owner, join: bool) -> None:
        script = scripts.ACQUIRE_SHARED if owner.shared else scripts.ACQUIRE
        assert owner.token is not None
        token = owner.token
        owner_json = json.dumps({"o": owner.index})

        def call() -> tuple[Any, set[str]]:
            reply = self.run(
                script,
                self.keys.with_wake(token),
                [token, TTL_MS, owner_json, int(join), *self.limit_args],
            )
            if isinstance(reply, list) and reply[0] == 0:
                return reply, _woken(reply[3])
            if isinstance(reply, list) and len(reply) > 4:
                # Granted, with the shared waiters first in line admitted beside it.
                return reply, _woken(reply[4])
            return reply, set()

        def granted(reply: Any) -> bool:
            return not isinstance(reply, list) or reply[0] == 1

        reply, _ = self.step(owner, call, granted, lambda reply: True)
        if granted(reply):
            owner.successor = reply[3] if isinstance(reply, list) else ""
            fence = reply if not isinstance(reply, list) else reply[1]
            assert int(fence) == owner.fence
            if isinstance(reply, list) and reply[2] != -1:
                assert 0 < int(reply[2]) <= TTL_MS
        elif join:
            owner.state = "waiting"

    @precondition(lambda self: self.in_state("idle", "lapsed"))
    @rule(index=pick)
    def try_once(self, index: int) -> None:
        owner = self.choose(index, "idle", "lapsed")
        owner.token, owner.state = self.new_token(owner), "idle"
        self.acquire(owner, join=False)

    @precondition(lambda self: self.in_state("idle", "lapsed"))
    @rule(index=pick)
    def queue_up(self, index: int) -> None:
        owner = self.choose(index, "idle", "lapsed")
        owner.token, owner.state = self.new_token(owner), "idle"
        self.acquire(owner, join=True)

    @precondition(lambda self: self.in_state("waiting", "dead-waiter"))
    @rule(index=pick, join=st.booleans())
    def check_in(self, index: int, join: bool) -> None:
        self.acquire(self.choose(index, "waiting", "dead-waiter"), join=join)

    @precondition(lambda self: self.in_state("holding"))
    @rule(index=pick, cancel=st.booleans())
    def holder_checks_in(self, index: int, cancel: bool) -> None:
        """A holder checks in (or cancels) as a waiter handed the lock unawares would.

        It is told it holds the lock, with its own fence, and keeps it.
        """
        owner = self.choose(index, "holding")
        assert owner.token is not None
        token = owner.token
        keys = self.keys.with_wake(token)
        script = scripts.ACQUIRE_SHARED if owner.shared else scripts.ACQUIRE
        owner_json = json.dumps({"o": owner.index})

        def call() -> tuple[Any, set[str]]:
            if cancel:
                return self.run(scripts.CANCEL, keys, [token, *self.limit_args]), set()
            args = [token, TTL_MS, owner_json, 1, *self.limit_args]
            return self.run(script, keys, args), set()

        reply, after = self.step(None, call)
        assert isinstance(reply, list) and reply[0] == 1, f"{owner} was refused: {reply!r}"
        assert int(reply[1]) == owner.fence == after.holders().get(token)
        assert 0 < int(reply[2]) <= TTL_MS
        assert token not in after.queue

    @precondition(lambda self: self.in_state("holding", "lapsed"))
    @rule(index=pick, name_successor=st.booleans())
    def release(self, index: int, name_successor: bool) -> None:
        owner = self.choose(index, "holding", "lapsed")
        assert owner.token is not None
        token = owner.token
        # A holder may name the successor its grant reported, whose wake-up
        # list the release then pushes to itself (answering 2 when nobody
        # else needs waking).
        expected = owner.successor if name_successor else ""

        def call() -> tuple[Any, set[str]]:
            if not expected:
                reply = self.run(scripts.RELEASE, self.keys.script_keys, [token])
                return reply, _woken(reply)
            keys = self.keys.with_wake(expected)
            reply = self.run(scripts.RELEASE, keys, [token, expected])
            woken = _woken(reply)
            pushed = self.client.lpop(self.keys.wake(expected))
            if pushed is not None:
                assert self.client.hget(self.keys.lock, "token") == expected or (
                    self.client.hexists(self.keys.lock, "r:" + expected)
                ), f"{self.describe(expected)} woken without the lock"
                self.owners_token(expected).successor = pushed.split("|", 1)[1]
                woken.add(expected)
            else:
                assert reply != 2, "answered 2 without waking the expected waiter"
            return reply, woken

        # A release that finds the caller's lease ended hands nothing on (the
        # first waiter's next check-in finds the lock free); any other does.
        reply, after = self.step(None, call, hands_on=lambda reply: reply != 0)
        if owner.state == "holding":
            assert reply != 0, f"{owner} was refused its release"
        else:
            assert reply == 0, f"{owner}, whose lease ended, released: {reply!r}"
        assert token not in after.holders()
        owner.state = "idle"

    @precondition(lambda self: self.in_state("waiting", "dead-waiter"))
    @rule(index=pick)
    def cancel(self, index: int) -> None:
        owner = self.choose(index, "waiting", "dead-waiter")
        assert owner.token is not None
        token = owner.token

        def call() -> tuple[Any, set[str]]:
            reply = self.run(scripts.CANCEL, self.keys.with_wake(token), [token, *self.limit_args])
            return reply, (_woken(reply[1]) if reply[0] == 0 and len(reply) > 1 else set())

        reply, after = self.step(None, call, hands_on=lambda reply: True)
        # The model learns of every grant in the step that makes it: a waiter it
        # still has in line was not handed the lock, so its cancel finds none.
        assert reply[0] == 0, f"{owner} was handed the lock behind the model's back"
        assert token not in after.queue and token not in after.holders()
        owner.state = "idle"

    @precondition(lambda self: self.in_state("holding", "lapsed"))
    @rule(index=pick)
    def extend(self, index: int) -> None:
        owner = self.choose(index, "holding", "lapsed")
        assert owner.token is not None
        token = owner.token
        reply, after = self.step(
            None,
            lambda: (self.run(scripts.EXTEND, (self.keys.lock,), [token, TTL_MS]), set()),
        )
        if owner.state == "holding":
            assert reply == 1, f"{owner} could not extend its lease"
            if owner.shared:
                ends, _ = after.readers()[token]
                assert ends >= after.now_ms + TTL_MS - 1000
                assert self.client.pttl(self.keys.lock) >= TTL_MS - 1000
        else:
            assert reply == 0, f"{owner}'s ended lease was brought back"
            assert token not in after.holders()

    @rule()
    def operator_reset(self) -> None:
        def call() -> tuple[Any, set[str]]:
            reply = self.run(scripts.RESET, self.keys.script_keys, [])
            return reply, _woken(reply[1])

        holding = self.in_state("holding")
        for owner in holding:
            owner.state = "lapsed"
        # A reset of a lock that was already gone (its lease ended) touches nothing.
        reply, _ = self.step(None, call, hands_on=lambda reply: reply[0] != 0)
        if self.timely():
            assert reply[0] == len(holding), f"reset counted {reply[0]}, held by {holding}"

    @precondition(lambda self: self.in_state("holding"))
    @rule(index=pick)
    def lease_ends(self, index: int) -> None:
        """A holder stops renewing (it died): its lease is over, as Redis would see it."""
        owner = self.choose(index, "holding")
        assert owner.token is not None
        if owner.shared:
            field = "r:" + owner.token
            record = self.client.hget(self.keys.lock, field)
            assert record is not None, f"{owner} has no record"
            now = self.snapshot().now_ms
            self.client.hset(self.keys.lock, field, f"{now - 1}|" + record.split("|", 1)[1])
        else:
            # An exclusive lease ends with the hash itself.
            assert self.client.hget(self.keys.lock, "token") == owner.token
            self.client.delete(self.keys.lock)
        owner.state = "lapsed"

    @precondition(lambda self: self.in_state("waiting"))
    @rule(index=pick)
    def waiter_dies(self, index: int) -> None:
        """A waiter stops checking in: its wait lease ends, as Redis would see it."""
        owner = self.choose(index, "waiting")
        assert owner.token is not None
        now = self.snapshot().now_ms
        record = self.client.hget(self.keys.waiting, owner.token)
        assert record is not None
        _ends, terms = record.split("|", 1)
        self.client.hset(self.keys.waiting, owner.token, f"{now - 1}|{terms}")
        owner.state = "dead-waiter"

    # -- invariants -------------------------------------------------------------

    @invariant()
    def redis_agrees(self) -> None:
        if not self.owners:
            return
        now = self.snapshot()
        readers = now.readers()
        assert not (now.exclusive and readers), (
            f"exclusive holder {self.describe(now.exclusive or '')} beside shared "
            f"holders {[self.describe(t) for t in readers]}"
        )
        if self.limit:
            assert len(readers) <= self.limit, (
                f"{[self.describe(t) for t in readers]} hold a semaphore of limit {self.limit}"
            )
        if not self.timely():
            return
        believed = {owner.token: owner.fence for owner in self.in_state("holding")}
        assert now.holders() == believed, (
            f"Redis holders {[self.describe(t) for t in now.holders()]}, "
            f"the model's {[self.describe(t) for t in believed]}"
        )
        assert set(now.queue) == set(now.leases) == now.waiting, (
            f"queue {now.queue}, leases {now.leases}, waiting {now.waiting}"
        )
        assert not set(now.queue) & set(now.holders()), "a holder is still in line"
        live = {owner.token for owner in self.in_state("waiting")}
        assert set(now.live_line()) == live, (
            f"live line {[self.describe(t) for t in now.live_line()]}, "
            f"the model's waiters {[self.describe(t) for t in live]}"
        )
        assert set(now.queue) <= live | {o.token for o in self.in_state("dead-waiter")}
        if now.holders() and live:
            assert now.fields.get("queued") == "1", (
                f"held by {[self.describe(t) for t in now.holders()]} with "
                f"{[self.describe(t) for t in live]} waiting, but not marked queued: "
                "a release would not hand the lock on"
            )

    def teardown(self) -> None:
        wakes = [self.keys.wake(owner.token) for owner in self.owners if owner.token]
        self.client.delete(*self.keys.script_keys, *wakes)


# Bounded so a passing run takes well under a minute; no example database, so
# a run leaves nothing behind in the tree.
MODEL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("as_semaphore", [False, True], ids=["shared-lock", "semaphore"])
def test_owners_follow_the_model(redis_url: str, mutex_prefix: str, as_semaphore: bool) -> None:
    """Random interleavings of every script by the owners of one lock, or a semaphore's."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    class ModelOnTestRedis(SharedLockModel):
        """The machine bound to this test's Redis."""

        semaphore = as_semaphore

        def __init__(self) -> None:
            super().__init__(client, f"tests:{mutex_prefix}:sm")

    try:
        run_state_machine_as_test(ModelOnTestRedis, settings=MODEL_SETTINGS)
    finally:
        client.close()
