"""One handle shared by threads and tasks: each acquisition keeps its own state.

A :class:`Mutex` may be shared by several owners (threads, asyncio tasks), each
with a hold of its own. What an acquisition sends (its owner record) and what
its failure reports (the holder, ``retry_after`` and ``waited`` of
LockContended) belong to that acquisition, never to whichever owner of the
handle wrote last; a hold's lease record is written by its owner and by the
watchdog's thread at once. These tests force the interleavings where owners
meet, on a real Redis and with real threads.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from django_redis_mutex import LockContended, Mutex, held_locks
from django_redis_mutex.holds import Hold
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.signals import lock_contended


class Worker(threading.Thread):
    """A named thread running ``body``; :meth:`outcome` returns its result or re-raises."""

    def __init__(self, name: str, body: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self._body = body
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._body()
        except BaseException as exc:  # handed to the test thread by outcome()
            self._error = exc

    def outcome(self, timeout: float = 10) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"thread {self.name} did not finish"
        if self._error is not None:
            raise self._error
        return self._result


class PausedBeforeSending(Mutex):
    """A Mutex whose acquisitions in the threads named ``paused`` stop before sending ACQUIRE.

    The steps of an acquisition begin after it started (token and owner taken)
    and before its first command: pausing there lets another owner of the
    handle start its own acquisition in between.
    """

    def __init__(self, name: str, *, paused: tuple[str, ...], **options: Any) -> None:
        super().__init__(name, **options)
        self.arrived = {thread: threading.Event() for thread in paused}
        self.go = {thread: threading.Event() for thread in paused}
        acquire_steps = self._where.acquire_steps

        def paused_steps(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread().name
            if thread in self.go:
                self.arrived[thread].set()
                assert self.go[thread].wait(10), f"{thread} was never let go"
            return (yield from acquire_steps(*args, **kwargs))

        self._where.acquire_steps = paused_steps  # type: ignore[method-assign]


def held_by() -> str | None:
    """Return the thread or task name the one held lock's owner record names."""
    [held] = held_locks()
    return held.owner.thread


def test_each_thread_sharing_a_handle_is_recorded_as_the_owner_of_its_own_hold() -> None:
    lock = PausedBeforeSending("shared-handle", paused=("holder-a", "holder-b"), timeout=10)
    recorded: dict[str, str | None] = {}

    def hold() -> None:
        assert lock.acquire()
        try:
            recorded[threading.current_thread().name] = held_by()
        finally:
            lock.release()

    first = Worker("holder-a", hold)
    second = Worker("holder-b", hold)
    try:
        first.start()
        assert lock.arrived["holder-a"].wait(10)
        # A has started its acquisition and not sent it yet; B starts its own now.
        second.start()
        assert lock.arrived["holder-b"].wait(10)
        lock.go["holder-a"].set()
        first.outcome()
        lock.go["holder-b"].set()
        second.outcome()
    finally:
        for go in lock.go.values():
            go.set()

    assert recorded == {"holder-a": "holder-a", "holder-b": "holder-b"}


def test_each_task_sharing_a_handle_is_recorded_as_the_owner_of_its_own_hold() -> None:
    # An async acquisition sends from a child task: the owner is the task that
    # called aacquire(), whatever the other tasks of the handle started since.
    async def main() -> dict[str, str | None]:
        lock = Mutex("shared-handle", timeout=10)
        recorded: dict[str, str | None] = {}

        async def hold() -> None:
            assert await lock.aacquire()
            try:
                task = asyncio.current_task()
                assert task is not None
                recorded[task.get_name()] = held_by()
            finally:
                await lock.arelease()

        # Both tasks start before either's child task sends its ACQUIRE.
        await asyncio.gather(
            asyncio.create_task(hold(), name="task-a"), asyncio.create_task(hold(), name="task-b")
        )
        return recorded

    assert asyncio.run(main()) == {"task-a": "task-a", "task-b": "task-b"}


class ParkedWhenContended:
    """A ``lock_contended`` receiver that holds the thread named ``parked`` until let go.

    The signal is sent after an acquisition failed and before its caller
    builds the error: another owner of the handle fails in between.
    """

    def __init__(self, parked: str) -> None:
        self.parked = parked
        self.arrived = threading.Event()
        self.go = threading.Event()

    def __call__(self, sender: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == self.parked:
            self.arrived.set()
            assert self.go.wait(10), f"{self.parked} was never let go"


def contended_error(body: Callable[[], object]) -> Callable[[], LockContended]:
    def run() -> LockContended:
        try:
            body()
        except LockContended as busy:
            return busy
        raise AssertionError("entered a lock another owner holds")

    return run


def test_threads_failing_on_one_handle_each_get_their_own_contention() -> None:
    shared = Mutex("report", timeout=1.0)
    park = ParkedWhenContended("waiter-a")
    lock_contended.connect(park, weak=False)
    first = Mutex("report", label="first", ttl=60)
    second = Mutex("report", label="second", ttl=5)
    try:
        assert first.acquire()

        def enter() -> None:
            with shared:
                pass

        waiter_a = Worker("waiter-a", contended_error(enter))
        waiter_a.start()
        assert park.arrived.wait(10)
        # A waited its 1 s on the first holder; before its error is raised, the
        # lock changes hands and B fails at once on the second holder.
        first.release()
        assert second.acquire()

        def try_once() -> None:
            assert not shared.acquire(blocking=False)
            raise shared.contended()

        waiter_b = Worker("waiter-b", contended_error(try_once))
        waiter_b.start()
        busy_b = waiter_b.outcome()
        park.go.set()
        busy_a = waiter_a.outcome()
    finally:
        park.go.set()
        lock_contended.disconnect(park)
        for holder in (first, second):
            if holder.token is not None:
                holder.release()

    assert busy_a.owner is not None and busy_a.owner.label == "first"
    assert busy_a.waited >= 1.0 and busy_a.retry_after > 30
    assert busy_b.owner is not None and busy_b.owner.label == "second"
    assert busy_b.waited < 1.0 and busy_b.retry_after <= 5


def test_tasks_failing_on_one_handle_each_get_their_own_contention() -> None:
    async def main() -> dict[str, float]:
        shared = Mutex("report")
        failed = {"waiter": asyncio.Event(), "quick": asyncio.Event()}
        waited: dict[str, float] = {}

        async def fail(name: str, other: str, **wait: Any) -> None:
            assert not await shared.aacquire(**wait)
            failed[name].set()
            await failed[other].wait()  # both failed before either asks why
            waited[name] = shared.contended().waited

        holder = Mutex("report")
        assert await holder.aacquire()
        try:
            await asyncio.gather(
                fail("waiter", "quick", timeout=1.0), fail("quick", "waiter", blocking=False)
            )
        finally:
            await holder.arelease()
        return waited

    waited = asyncio.run(main())
    assert waited["waiter"] >= 1.0
    assert waited["quick"] < 1.0


def test_a_handle_keeps_few_failures_however_many_owners_failed_on_it() -> None:
    shared = Mutex("report", blocking=False)
    holder = Mutex("report", label="holder")
    callers = 40
    all_failed = threading.Barrier(callers + 1)

    def fail() -> bool:
        got = shared.acquire()
        all_failed.wait(10)  # alive at once: each thread is an owner of its own
        return got

    assert holder.acquire()
    try:
        workers = [Worker(f"caller-{number}", fail) for number in range(callers)]
        for worker in workers:
            worker.start()
        all_failed.wait(10)
        assert [worker.outcome() for worker in workers] == [False] * callers
        assert len(shared._levels._failures) <= 16
        assert not shared.acquire()
        busy = shared.contended()
    finally:
        holder.release()
    assert busy.owner is not None and busy.owner.label == "holder"
    kept = len(shared._levels._failures)
    assert shared.acquire()  # an owner that gets the lock keeps no failure
    shared.release()
    assert len(shared._levels._failures) == kept - 1


def test_a_quorum_hold_confirmed_and_refused_from_two_threads_stays_consistent() -> None:
    targets = (("r1", "lock"), ("r2", "lock"), ("r3", "lock"))
    hold = Hold(
        alias="r1",
        name="stress",
        keys=LockKeys.for_name("tests", "stress"),
        token="q" + "0" * 32,
        fence=1,
        ttl=30.0,
        owner=None,
        targets=targets,
        quorum=2,
        drift=0.302,
    )
    deadline = time.monotonic() + 1.5

    def renew_r1() -> int:  # the watchdog's lane of r1
        rounds = 0
        while time.monotonic() < deadline:
            hold.confirm("r1", time.monotonic(), 30.0)
            hold.next_renewal("r1")
            rounds += 1
        return rounds

    def extend_elsewhere() -> int:  # the owner's extend(), answered by r2 and r3
        rounds = 0
        while time.monotonic() < deadline:
            hold.confirm("r2", time.monotonic(), 30.0)
            hold.refuse("r3")
            hold.next_renewal("r3")
            hold.confirm("r3", time.monotonic(), 30.0)
            hold.refuse("r2")
            hold.failed("r2", time.monotonic() + 1)
            rounds += 1
        return rounds

    workers = [Worker("lane-r1", renew_r1), Worker("owner", extend_elsewhere)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for worker in workers:
            worker.start()
        rounds = [worker.outcome() for worker in workers]
    finally:
        sys.setswitchinterval(switch)

    assert min(rounds) > 0
    ends = sorted((lease.ends for lease in hold.leases.values()), reverse=True)
    assert set(hold.leases) == {"r1", "r3"}
    assert hold.expires_at == ends[hold.quorum - 1] - hold.drift
    assert not math.isinf(hold.expires_at)
