"""Deadlock detection: one wait of a cycle ends with LockDeadlock, the others go on.

The participants of a cycle are real OS processes (``tests/workers/deadlock.py``)
against the session's redis-server, each holding one lock and then waiting for
another when the test says so. The test starts their waits one after another,
each once the one before is in line, so the youngest wait (the victim the rule
picks) is known. Cases that need no process of their own (signals, settings,
the chain of in-process threads) run in threads of the test.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured

from django_redis_mutex import (
    LockContended,
    LockDeadlock,
    Mutex,
    Semaphore,
    mutex,
    semaphore,
    signals,
    stats,
)
from django_redis_mutex.client import namespace
from django_redis_mutex.conf import parse_settings
from django_redis_mutex.holds import owner_metadata
from django_redis_mutex.keys import LockKeys, waits_key
from django_redis_mutex.owners import agent_of
from django_redis_mutex.testing import RedisClusterServers, RedisServer

from .helpers import wait_until
from .topologies import cluster_entry, extra_caches, master_entries, redis_servers
from .worker import Worker

# Generous bounds: these tests run on a busy 2-core machine.
START_TIMEOUT = 30.0
# The detection's own bound is DEADLOCK_TIMEOUT (1 s here) plus a check-in.
DETECTED_WITHIN = 10.0
# How long the no-false-positive run lasts; DEADLOCK_SOAK_SECONDS runs it longer.
SOAK_SECONDS = float(os.environ.get("DEADLOCK_SOAK_SECONDS") or 12)


@pytest.fixture
def go_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a worker's go list (outside the lock namespace)."""
    made: list[str] = []

    def key(who: str) -> str:
        made.append(f"deadlocks:{mutex_prefix}:go:{who}")
        return made[-1]

    yield key
    if made:
        raw.delete(*made)


def keys_of(spec: str) -> LockKeys:
    """Return the keys of a worker's lock spec (``name``, ``name:shared``, ``name:semaphore:N``)."""
    name, _, kind = spec.partition(":")
    if kind.startswith("semaphore:"):
        return Semaphore(name, int(kind.split(":")[1])).keys
    return Mutex(name).keys


def in_line(raw: redis.Redis, spec: str) -> int:
    """Return how many waiters are in line for the lock of ``spec``."""
    return int(raw.zcard(keys_of(spec).queue))


def waits_records(raw: redis.Redis) -> list[bytes]:
    """Return the waits-for records of this test's namespace."""
    return list(raw.scan_iter(match=waits_key(namespace("default"), "*")))


def reported(worker: Worker, event: str) -> list[dict[str, Any]]:
    """Return every ``event`` the worker reported so far."""
    return [report for report in worker.events if report["event"] == event]


class Cycle:
    """Participants, each holding one lock, whose waits the test starts one after another."""

    def __init__(self, spawn: Callable[..., Worker], raw: redis.Redis, go_key: Any) -> None:
        self.spawn = spawn
        self.raw = raw
        self.go_key = go_key
        self.workers: dict[str, Worker] = {}
        self.wanted: dict[str, str] = {}

    def add(self, who: str, held: str, wanted: str, *options: object) -> Worker:
        worker = self.spawn("deadlock.py", held, wanted, self.go_key(who), *(options or ("1",)))
        self.workers[who] = worker
        self.wanted[who] = wanted
        return worker

    def hold(self) -> None:
        """Wait until every participant holds its first lock."""
        for worker in self.workers.values():
            worker.expect("holding", timeout=START_TIMEOUT)

    def wait(self, who: str) -> None:
        """Let ``who`` wait for its second lock, and return once it is in line."""
        before = in_line(self.raw, self.wanted[who])
        self.raw.rpush(self.go_key(who), "go")
        self.workers[who].expect("waiting")
        wait_until(lambda: in_line(self.raw, self.wanted[who]) > before, 10, f"{who} to be in line")

    def outcomes(self) -> dict[str, str]:
        """Return how each participant's wait ended, once every one of them is done."""
        ended = {}
        for who, worker in self.workers.items():
            worker.expect("done", timeout=60)
            assert worker.finish() == 0
            (event,) = [e for e in worker.events if e["event"] in {"acquired", "deadlock"}]
            ended[who] = event["event"]
            if event["event"] == "deadlock":
                assert event["waited"] < DETECTED_WITHIN, event
        return ended


@pytest.fixture
def cycle(spawn: Callable[..., Worker], raw: redis.Redis, go_key: Any) -> Cycle:
    return Cycle(spawn, raw, go_key)


def test_two_processes_waiting_for_each_other_end_the_younger_wait_only(
    cycle: Cycle, raw: redis.Redis
) -> None:
    cycle.add("older", "dl-a", "dl-b")
    cycle.add("younger", "dl-b", "dl-a")
    cycle.hold()
    cycle.wait("older")
    cycle.wait("younger")

    assert cycle.outcomes() == {"older": "acquired", "younger": "deadlock"}
    (deadlock,) = reported(cycle.workers["younger"], "deadlock")
    assert "'dl-a' held by" in deadlock["message"]
    assert len(deadlock["cycle"]) == 2
    assert waits_records(raw) == []  # each wait deleted its record as it ended


def test_three_processes_in_a_cycle_end_the_youngest_wait_only(cycle: Cycle) -> None:
    cycle.add("first", "dl-a", "dl-b")
    cycle.add("second", "dl-b", "dl-c")
    cycle.add("third", "dl-c", "dl-a")
    cycle.hold()
    for who in ("first", "second", "third"):
        cycle.wait(who)

    assert cycle.outcomes() == {"first": "acquired", "second": "acquired", "third": "deadlock"}
    (deadlock,) = reported(cycle.workers["third"], "deadlock")
    assert len(deadlock["cycle"]) == 3


def test_a_killed_participant_unblocks_the_others_without_a_false_deadlock(
    cycle: Cycle, raw: redis.Redis
) -> None:
    # The victim-to-be looks only after the killed one's record expired and
    # its place in line lapsed; the killed one's lease (8 s) outlasts that.
    killed = cycle.add("killed", "dl-a", "dl-b", "0.3", "8")
    cycle.add("survivor", "dl-b", "dl-a", "4.5", "8")
    cycle.hold()
    cycle.wait("killed")
    wait_until(lambda: waits_records(raw), 10, "the first waits record")
    cycle.wait("survivor")
    os.kill(killed.pid, signal.SIGKILL)

    survivor = cycle.workers["survivor"]
    survivor.expect("acquired", timeout=30)
    survivor.expect("done")
    assert survivor.finish() == 0
    assert reported(survivor, "deadlock") == []
    wait_until(lambda: not waits_records(raw), 10, "the killed one's record to expire")


def test_no_deadlock_is_found_among_processes_taking_locks_in_one_order(
    spawn: Callable[..., Worker],
) -> None:
    workers = [spawn("deadlock_soak.py", SOAK_SECONDS, seed) for seed in range(4)]
    reports = [worker.expect("done", timeout=SOAK_SECONDS + 60) for worker in workers]
    for worker in workers:
        assert worker.finish() == 0
    assert [report["deadlocks"] for report in reports] == [0, 0, 0, 0]
    assert sum(report["waits"] for report in reports) > 0  # detection did look
    assert sum(report["cycles"] for report in reports) > 10


# -- participants in threads of this process: each thread is an agent of its own --


@pytest.fixture
def quick_detection(settings: Any) -> None:
    """Look for cycles after 0.2 s of waiting (the threads' shared setting)."""
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"]["DEADLOCK_TIMEOUT"] = 0.2
    settings.CACHES = caches


def handle(spec: str, timeout: float = 30, using: str = "default") -> Any:
    """Return the context of a lock spec, as the worker builds it."""
    name, _, kind = spec.partition(":")
    if kind.startswith("semaphore:"):
        limit, _, strict = kind.removeprefix("semaphore:").partition(":")
        return semaphore(name, int(limit), timeout=timeout, reentrant=not strict, using=using)
    return mutex(name, timeout=timeout, shared=kind == "shared", using=using)


class Member(threading.Thread):
    """A participant in a thread (or in an event loop of its own): holds, waits when told."""

    def __init__(
        self,
        who: str,
        held: str,
        wanted: str,
        *,
        in_loop: bool = False,
        timeout: float = 30,
        using: str = "default",
    ) -> None:
        super().__init__(name=who)
        self.held, self.wanted, self.in_loop, self.timeout = held, wanted, in_loop, timeout
        self.using = using
        self.holding, self.go = threading.Event(), threading.Event()
        self.outcome = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.in_loop:
                asyncio.run(self._arun())
            else:
                self._run()
        except BaseException as error:  # reported by the test, which fails on it
            self.error = error

    def _run(self) -> None:
        with handle(self.held, using=self.using):
            self.holding.set()
            assert self.go.wait(30)
            try:
                with handle(self.wanted, self.timeout, self.using):
                    self.outcome = "acquired"
            except LockDeadlock as error:
                self.outcome, self.error = "deadlock", error
            except LockContended:
                self.outcome = "timed out"

    async def _arun(self) -> None:
        async with handle(self.held, using=self.using):
            self.holding.set()
            assert await asyncio.to_thread(self.go.wait, 30)
            try:
                async with handle(self.wanted, self.timeout, self.using):
                    self.outcome = "acquired"
            except LockDeadlock as error:
                self.outcome, self.error = "deadlock", error
            except LockContended:
                self.outcome = "timed out"


class Members:
    """Threads of one test, each holding one lock, whose waits start one after another."""

    def __init__(self, raw: redis.Redis) -> None:
        self.raw = raw
        self.members: dict[str, Member] = {}

    def add(self, who: str, held: str, wanted: str, **options: Any) -> Member:
        member = self.members[who] = Member(who, held, wanted, **options)
        member.start()
        assert member.holding.wait(10), f"{who} did not get {held!r}"
        return member

    def wait(self, who: str) -> None:
        """Let ``who`` wait for its second lock, and return once it is in line."""
        member = self.members[who]
        before = in_line(self.raw, member.wanted)
        member.go.set()
        wait_until(lambda: in_line(self.raw, member.wanted) > before, 10, f"{who} in line")

    def outcomes(self) -> dict[str, str]:
        """Return how each wait ended, once every thread is done."""
        for member in self.members.values():
            member.join(30)
            assert not member.is_alive(), f"{member.name} still waits"
            if member.outcome != "deadlock" and member.error is not None:
                raise member.error
        return {who: member.outcome for who, member in self.members.items()}

    def deadlock(self, who: str) -> LockDeadlock:
        error = self.members[who].error
        assert isinstance(error, LockDeadlock)
        return error

    def close(self) -> None:
        """Let every thread go on and end (after a failed test too)."""
        for member in self.members.values():
            member.go.set()
            member.join(30)


@pytest.fixture
def members(raw: redis.Redis, quick_detection: None) -> Iterator[Members]:
    threads = Members(raw)
    yield threads
    threads.close()


def checked_twice(
    raw: redis.Redis, waiters: int, find: Callable[[], list[bytes]] | None = None
) -> None:
    """Return once ``waiters`` waits each wrote their waits-for record and refreshed it.

    A refresh (a second check) shows as the record's expiry moving later.
    ``find`` lists the records on ``raw`` (this test's namespace by default).
    """
    find = find or (lambda: waits_records(raw))
    records = wait_until(lambda: len(found := find()) == waiters and found, 10, "the waits records")
    last = {key: raw.pttl(key) for key in records}
    refreshed: set[bytes] = set()

    def each_refreshed() -> bool:
        for key in records:
            ttl = raw.pttl(key)
            if ttl > last[key]:
                refreshed.add(key)
            last[key] = ttl
        return len(refreshed) == waiters

    wait_until(each_refreshed, 10, "every waiter to check again")


def test_an_async_with_participant_is_chosen_and_its_block_unwinds(
    members: Members, raw: redis.Redis
) -> None:
    members.add("sync", "mb-a", "mb-b")
    members.add("async", "mb-b", "mb-a", in_loop=True)
    members.wait("sync")
    members.wait("async")

    assert members.outcomes() == {"sync": "acquired", "async": "deadlock"}
    assert waits_records(raw) == []  # each wait deleted its record as it ended


def test_with_detection_off_a_cycle_waits_out_its_timeouts(members: Members, settings: Any) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"]["DEADLOCK_TIMEOUT"] = None
    settings.CACHES = caches
    members.add("first", "mb-a", "mb-b", timeout=1)
    members.add("second", "mb-b", "mb-a", timeout=1)
    members.wait("first")
    members.wait("second")

    # The first to time out lets go of its lock, which the other may still get.
    outcomes = members.outcomes()
    assert outcomes["first"] == "timed out" or outcomes["second"] == "timed out"
    assert set(outcomes.values()) <= {"timed out", "acquired"}


def test_an_exclusive_wait_on_a_shared_lock_deadlocks_when_any_reader_waits_for_it(
    members: Members,
) -> None:
    # A second reader of mb-a stays out of the cycle: the writer waits for
    # every reader, so the one in the cycle is enough.
    members.add("reader", "mb-a:shared", "mb-b")
    bystander = members.add("bystander", "mb-a:shared", "mb-free")
    members.add("writer", "mb-b", "mb-a")
    members.wait("reader")
    members.wait("writer")
    members.members["writer"].join(DETECTED_WITHIN)

    bystander.go.set()
    assert members.outcomes() == {
        "reader": "acquired",
        "bystander": "acquired",
        "writer": "deadlock",
    }


def test_a_shared_wait_behind_a_waiting_writer_deadlocks_when_a_reader_waits_for_it(
    members: Members,
) -> None:
    # The writer in line keeps new readers out until every reader left.
    members.add("writer", "mb-w", "mb-b")
    members.add("reader", "mb-b:shared", "mb-a")
    members.add("shared-waiter", "mb-a", "mb-b:shared")
    members.wait("writer")
    members.wait("reader")
    members.wait("shared-waiter")

    assert members.outcomes() == {
        "writer": "acquired",
        "reader": "acquired",
        "shared-waiter": "deadlock",
    }


def test_a_semaphore_whose_every_permit_is_in_the_cycle_deadlocks(members: Members) -> None:
    members.add("permit", "mb-s:semaphore:1", "mb-b")
    members.add("waiter", "mb-b", "mb-s:semaphore:1")
    members.wait("permit")
    members.wait("waiter")

    assert members.outcomes() == {"permit": "acquired", "waiter": "deadlock"}


def test_a_semaphore_with_a_permit_outside_the_cycle_is_no_deadlock(
    members: Members, raw: redis.Redis
) -> None:
    # The waiter needs one permit back, and the bystander's will come.
    members.add("permit", "mb-s:semaphore:2", "mb-b")
    bystander = members.add("bystander", "mb-s:semaphore:2", "mb-free")
    members.add("waiter", "mb-b", "mb-s:semaphore:2")
    members.wait("permit")
    members.wait("waiter")
    checked_twice(raw, 2)

    bystander.go.set()
    assert members.outcomes() == {
        "permit": "acquired",
        "bystander": "acquired",
        "waiter": "acquired",
    }


def test_a_chain_of_waits_that_is_no_cycle_raises_nothing(
    members: Members, raw: redis.Redis
) -> None:
    members.add("first", "mb-a", "mb-b")
    members.add("second", "mb-b", "mb-c")
    last = members.add("last", "mb-c", "mb-free")
    members.wait("first")
    members.wait("second")
    checked_twice(raw, 2)

    last.go.set()  # the end of the chain finishes, and the chain unwinds
    assert members.outcomes() == {"first": "acquired", "second": "acquired", "last": "acquired"}


def test_owners_each_holding_a_permit_and_waiting_for_another_deadlock(
    members: Members,
) -> None:
    # Non-reentrant permits: each owner waits for a second one, which only
    # the other's could free.
    members.add("first", "mb-s:semaphore:2", "mb-s:semaphore:2:strict")
    members.add("second", "mb-s:semaphore:2", "mb-s:semaphore:2:strict")
    members.wait("first")
    members.wait("second")

    assert members.outcomes() == {"first": "acquired", "second": "deadlock"}


@pytest.mark.usefixtures("quick_detection")
def test_an_owner_waiting_for_its_own_lock_waits_out_its_timeout() -> None:
    # Not reentrant: it waits for its own lease to end (none will, here),
    # which is no cycle between owners.
    with mutex("mb-a"):
        assert Mutex("mb-a", reentrant=False, timeout=1.5).acquire() is False


def test_the_victim_is_told_as_for_a_timeout_then_by_lock_deadlock(members: Members) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def contended(**kwargs: Any) -> None:
        sent.append(("contended", kwargs))

    def deadlock(**kwargs: Any) -> None:
        sent.append(("deadlock", kwargs))

    signals.lock_contended.connect(contended)
    signals.lock_deadlock.connect(deadlock)
    try:
        members.add("older", "mb-a", "mb-b")
        members.add("younger", "mb-b", "mb-a")
        members.wait("older")
        members.wait("younger")
        assert members.outcomes() == {"older": "acquired", "younger": "deadlock"}
    finally:
        signals.lock_contended.disconnect(contended)
        signals.lock_deadlock.disconnect(deadlock)

    error = members.deadlock("younger")
    assert isinstance(error, LockContended)
    assert [what for what, _ in sent] == ["contended", "deadlock"]
    contended_args, deadlock_args = sent[0][1], sent[1][1]
    assert contended_args["sender"] == deadlock_args["sender"] == "default"
    assert contended_args["name"] == deadlock_args["name"] == "mb-a"
    assert contended_args["owner"].thread == deadlock_args["owner"].thread == "older"
    assert deadlock_args["cycle"] == error.cycle
    assert deadlock_args["shared"] is False


def test_a_deadlock_is_counted_in_the_contention_figures(members: Members, settings: Any) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["MUTEX"]["STATS"] = True
    settings.CACHES = caches
    try:
        members.add("older", "mb-a", "mb-b")
        members.add("younger", "mb-b", "mb-a")
        members.wait("older")
        members.wait("younger")
        assert members.outcomes() == {"older": "acquired", "younger": "deadlock"}
        stats.flush()
        report = stats.read_stats("default", minutes=5)
        found = {c.lock_class: c for c in report.classes}
        # The victim waited for mb-a: one deadlock, counted among the give-ups.
        assert (found["mb-a"].deadlocks, found["mb-a"].contended) == (1, 1)
        assert found["mb-b"].deadlocks == 0
    finally:
        stats.flush()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "more than 0 seconds"),
        (-1, "more than 0 seconds"),
        ("1", "finite number of seconds, or None"),
        (True, "finite number of seconds, or None"),
        (float("nan"), "finite number of seconds, or None"),
        (float("inf"), "finite number of seconds, or None"),
    ],
)
def test_a_bad_deadlock_timeout_is_refused_naming_the_setting(value: object, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as refused:
        parse_settings("default", {"DEADLOCK_TIMEOUT": value})
    assert "CACHES['default']['MUTEX']['DEADLOCK_TIMEOUT']" in str(refused.value)


def test_deadlock_timeout_defaults_to_one_second_and_none_turns_detection_off() -> None:
    assert parse_settings("default", {}).deadlock_timeout == 1.0
    assert parse_settings("default", {"DEADLOCK_TIMEOUT": None}).deadlock_timeout is None
    assert parse_settings("default", {"DEADLOCK_TIMEOUT": 2}).deadlock_timeout == 2.0


def test_agents_are_never_reused_by_later_threads_or_tasks() -> None:
    # Thread idents and task ids are reused once their thread or task is
    # gone; an agent must not be, or a lock still held by a finished one
    # would read as held by whoever came next.
    seen: list[tuple[int, str | None]] = []

    def record() -> None:
        seen.append((threading.get_ident(), agent_of(owner_metadata(None))))

    for _ in range(5):
        thread = threading.Thread(target=record)
        thread.start()
        thread.join()

    async def task_agent() -> str | None:
        return agent_of(owner_metadata(None))

    async def tasks() -> list[str | None]:
        return [await asyncio.create_task(task_agent()) for _ in range(5)]

    agents = [agent for _, agent in seen] + asyncio.run(tasks())
    assert None not in agents
    assert len(set(agents)) == len(agents) == 10
    # Within one thread the agent stays the same from lock to lock.
    assert agent_of(owner_metadata(None)) == agent_of(owner_metadata("other label"))


# -- a quorum lock: its waiters never queue --------------------------------------------------

QUORUM = ["dq1", "dq2", "dq3"]


@pytest.fixture(scope="module")
def quorum_masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(QUORUM)) as servers:
        yield servers


@pytest.fixture
def on_quorum(quorum_masters: list[RedisServer], mutex_prefix: str, settings: Any) -> Iterator[Any]:
    """The quorum alias ``quorum`` (detection after 0.2 s); return a reader of its waits records.

    The records live on the quorum's first master by alias.
    """
    quick = {"DEADLOCK_TIMEOUT": 0.2, "QUORUM_TIMEOUT": 0.2}
    caches = {
        **copy.deepcopy(settings.CACHES),
        **master_entries(quorum_masters, QUORUM, mutex_prefix, **quick),
    }
    caches["quorum"] = {
        **caches[QUORUM[0]],
        "MUTEX": {"PREFIX": mutex_prefix, "QUORUM": QUORUM, **quick},
    }
    settings.CACHES = caches
    first = redis.Redis.from_url(quorum_masters[0].url)

    class Records:
        """The waits records on the first master (``first``: a client of it)."""

        def __init__(self) -> None:
            self.first = first

        def __call__(self) -> list[bytes]:
            return list(first.scan_iter(match=waits_key(namespace(QUORUM[0]), "*")))

    yield Records()
    first.close()
    for server in quorum_masters:
        if server.process is None:
            server.start()


class AliasMembers(Members):
    """Members on another alias: a wait shows as a new waits record (``records`` lists them)."""

    def __init__(self, raw: redis.Redis, using: str, records: Callable[[], list[bytes]]) -> None:
        super().__init__(raw)
        self.using, self.records = using, records

    def add(self, who: str, held: str, wanted: str, **options: Any) -> Member:
        return super().add(who, held, wanted, using=self.using, **options)

    def wait(self, who: str) -> None:
        """Let ``who`` wait; return once its record shows (or its wait already ended)."""
        member, before = self.members[who], len(self.records())
        member.go.set()
        wait_until(
            lambda: len(self.records()) > before or member.outcome,
            10,
            f"{who}'s waits record",
        )


@pytest.fixture
def quorum_members(
    raw: redis.Redis, on_quorum: Callable[[], list[bytes]]
) -> Iterator[AliasMembers]:
    threads = AliasMembers(raw, "quorum", on_quorum)
    yield threads
    threads.close()


def test_two_processes_in_a_cycle_of_quorum_locks_end_the_younger_wait_only(
    spawn: Callable[..., Worker], raw: redis.Redis, go_key: Any, on_quorum: Any, settings: Any
) -> None:
    caches = json.dumps({alias: settings.CACHES[alias] for alias in [*QUORUM, "quorum"]})
    options = ("0.2", "30", "sync", caches, "quorum")
    older = spawn("deadlock.py", "qp-a", "qp-b", go_key("older"), *options)
    younger = spawn("deadlock.py", "qp-b", "qp-a", go_key("younger"), *options)
    for worker in (older, younger):
        worker.expect("holding", timeout=START_TIMEOUT)
    raw.rpush(go_key("older"), "go")
    wait_until(lambda: len(on_quorum()) == 1, 10, "the older wait's record")
    raw.rpush(go_key("younger"), "go")

    for worker in (older, younger):
        worker.expect("done", timeout=60)
        assert worker.finish() == 0
    assert reported(older, "acquired") and not reported(older, "deadlock")
    (deadlock,) = reported(younger, "deadlock")
    assert deadlock["waited"] < DETECTED_WITHIN
    assert deadlock["cycle"][0].startswith("'qp-a' held by")
    assert wait_until(lambda: on_quorum() == [], 5, "the records deleted")


@pytest.mark.parametrize("in_loop", [False, True], ids=["thread", "asyncio"])
def test_a_cycle_of_quorum_locks_ends_the_younger_wait_only(
    quorum_members: AliasMembers, in_loop: bool
) -> None:
    quorum_members.add("first", "qd-a", "qd-b")
    quorum_members.add("second", "qd-b", "qd-a", in_loop=in_loop)
    quorum_members.wait("first")
    quorum_members.wait("second")

    assert quorum_members.outcomes() == {"first": "acquired", "second": "deadlock"}
    cycle = quorum_members.deadlock("second").cycle
    # From the lock the victim waits for, held by the other, back to its own.
    assert len(cycle) == 2
    assert cycle[0].startswith("'qd-a' held by") and "thread first" in cycle[0]
    assert cycle[1].startswith("'qd-b' held by") and cycle[1].endswith("(this owner)")


def test_a_chain_of_quorum_waits_that_is_no_cycle_raises_nothing(
    quorum_members: AliasMembers, on_quorum: Any
) -> None:
    quorum_members.add("first", "qd-a", "qd-b")
    quorum_members.add("second", "qd-b", "qd-c")
    last = quorum_members.add("last", "qd-c", "qd-free")
    quorum_members.wait("first")
    quorum_members.wait("second")
    checked_twice(on_quorum.first, 2, on_quorum)  # both waits looked, again

    last.go.set()
    assert quorum_members.outcomes() == {
        "first": "acquired",
        "second": "acquired",
        "last": "acquired",
    }


def test_a_quorum_wait_gets_its_lock_while_the_first_master_is_down(
    quorum_masters: list[RedisServer], on_quorum: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The detection's master is down: its checks fail, the wait goes on.
    holder = Mutex("qd-held", using="quorum", ttl=30)
    assert holder.acquire()
    quorum_masters[0].stop()
    got = threading.Event()

    def wait_for_it() -> None:
        with handle("qd-held", 30, "quorum"):
            got.set()

    waiter = threading.Thread(target=wait_for_it)
    try:
        waiter.start()
        wait_until(lambda: "Could not run commands on 'dq1'" in caplog.text, 10, "a failed check")
        assert not got.is_set()
        holder.release()
        waiter.join(30)
        assert got.is_set()
    finally:
        quorum_masters[0].start()


# -- a Redis Cluster: the records and the locks of a cycle lie in different slots -------------


@pytest.fixture(scope="module")
def deadlock_cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(primaries=3) as running:
        yield running


@pytest.fixture
def cluster_members(
    raw: redis.Redis, deadlock_cluster: RedisClusterServers, mutex_prefix: str
) -> Iterator[AliasMembers]:
    entry = cluster_entry(deadlock_cluster, mutex_prefix, DEADLOCK_TIMEOUT=0.2)
    client = redis.RedisCluster.from_url(deadlock_cluster.url)
    with extra_caches({"cluster": entry}):

        def records() -> list[bytes]:
            return list(client.scan_iter(match=waits_key(namespace("cluster"), "*")))

        threads = AliasMembers(raw, "cluster", records)
        threads.client = client
        yield threads
        threads.close()
    client.close()


def test_a_cycle_across_cluster_slots_ends_the_youngest_wait_only(
    cluster_members: AliasMembers,
) -> None:
    # Three locks, three agents' records: each in the slot of its own hash tag.
    primaries = {
        cluster_members.client.keyslot(Mutex(name, using="cluster").keys.lock)
        for name in ("cd-a", "cd-b", "cd-c")
    }
    assert (
        len({cluster_members.client.nodes_manager.get_node_from_slot(s).port for s in primaries})
        > 1
    )
    cluster_members.add("first", "cd-a", "cd-b")
    cluster_members.add("second", "cd-b", "cd-c")
    cluster_members.add("third", "cd-c", "cd-a")
    for who in ("first", "second", "third"):
        cluster_members.wait(who)

    assert cluster_members.outcomes() == {
        "first": "acquired",
        "second": "acquired",
        "third": "deadlock",
    }
    assert len(cluster_members.deadlock("third").cycle) == 3
