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

from django_redis_mutex import Mutex, held_locks
from django_redis_mutex.holds import Hold
from django_redis_mutex.keys import LockKeys


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
    """A Mutex whose acquisitions, in the threads named in ``go``, stop before sending ACQUIRE.

    The steps of an acquisition begin after it started (token and owner taken)
    and before its first command: pausing there lets another owner of the
    handle start its own acquisition in between.
    """

    def __init__(self, name: str, *, paused: tuple[str, ...], **options: Any) -> None:
        super().__init__(name, **options)
        self.arrived = {thread: threading.Event() for thread in paused}
        self.go = {thread: threading.Event() for thread in paused}

    def _acquire_steps(self, *args: Any, **kwargs: Any) -> Any:
        thread = threading.current_thread().name
        if thread in self.go:
            self.arrived[thread].set()
            assert self.go[thread].wait(10), f"{thread} was never let go"
        return (yield from super()._acquire_steps(*args, **kwargs))


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
    first.start()
    assert lock.arrived["holder-a"].wait(10)
    # A has started its acquisition and not sent it yet; B starts its own now.
    second = Worker("holder-b", hold)
    second.start()
    assert lock.arrived["holder-b"].wait(10)
    lock.go["holder-a"].set()
    first.outcome()
    lock.go["holder-b"].set()
    second.outcome()

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
