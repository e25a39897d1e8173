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

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

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
