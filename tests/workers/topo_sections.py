"""Run critical sections on a Redis topology (cluster, Sentinel, quorum) and record each.

Usage: topo_sections.py --caches JSON --using ALIAS[,ALIAS...] --counter KEY --barrier KEY
       --stop KEY [options] (see --help)

--caches is a JSON object of CACHES entries merged into the test settings
before ``django.setup()``; --using is the lock alias, or a comma-separated
list of aliases for a quorum lock. Every thread (or, with --async, every task)
loops: pick a lock name from --names, enter the lock, take the time, increment that lock's
counter (COUNTER:<name>) on the test's own server with a GET then a SET, so
sections that overlap lose updates, hold for --hold seconds, take the time
again and leave. Sections are reported as ``section`` lines (tests/history.py);
a failed attempt as ``failure`` (op acquire or release, the error), a timed-out
one as ``contended``. The loop ends after --iterations per thread or when the
test pushes onto --stop. Reports are kept in memory until the end, so a long
run never fills the pipe; ``ready`` comes first, ``done`` with totals last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from typing import Any

import django
from django.conf import settings


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--caches", required=True, help="JSON object of CACHES entries to add")
    parser.add_argument("--using", required=True, help="lock alias, or aliases joined by commas")
    parser.add_argument("--names", required=True, help="JSON list of the lock names to spread over")
    parser.add_argument("--counter", required=True, help="stem of the per-lock counter keys")
    parser.add_argument("--barrier", required=True, help="start barrier list")
    parser.add_argument("--stop", required=True, help="list the test pushes onto to stop the run")
    parser.add_argument("--threads", type=int, default=1, help="threads (or tasks with --async)")
    parser.add_argument("--iterations", type=int, help="sections attempted per thread")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds of work per section")
    parser.add_argument("--ttl", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument(
        "--retry-pause",
        type=float,
        default=0.05,
        help="back-off after a failed attempt, so a dead Redis is not hammered",
    )
    parser.add_argument(
        "--async",
        dest="use_async",
        action="store_true",
        help="run the sections as asyncio tasks with async with",
    )
    return parser.parse_args()


ARGS = parse_args()
settings.CACHES = {**settings.CACHES, **json.loads(ARGS.caches)}
django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import (  # noqa: E402
    LockBackendUnavailable,
    LockContended,
    LockLost,
    Mutex,
)
from tests.history import Recorder  # noqa: E402


class Run:
    """The shared state of this worker's threads or tasks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        aliases = args.using.split(",")
        self.using: Any = aliases[0] if len(aliases) == 1 else aliases
        self.data = data_client()
        self.recorder = Recorder(buffered=True)
        self.names: list[str] = json.loads(args.names)
        self.stopped = threading.Event()
        self.totals = {"sections": 0, "lost": 0, "contended": 0, "failures": 0}
        self._lock = threading.Lock()

    def note(self, **changes: int) -> None:
        with self._lock:
            for key, value in changes.items():
                self.totals[key] += value

    def lock(self, name: str) -> Mutex:
        return Mutex(name, using=self.using, ttl=self.args.ttl, timeout=self.args.timeout)

    def work(self, name: str) -> None:
        counter = f"{self.args.counter}:{name}"
        value = int(self.data.get(counter) or 0)
        self.data.set(counter, value + 1)

    def report(self, name: str, fence: int, enter: float, leave: float, lost: bool) -> None:
        self.note(sections=1, lost=int(lost))
        self.recorder.section(name, fence, enter, leave, lost=lost)

    def failed(self, name: str, op: str, exc: BaseException) -> None:
        self.note(failures=1)
        self.recorder.event("failure", name=name, op=op, error=type(exc).__name__, message=str(exc))

    def section(self, name: str) -> bool:
        """Attempt one section; return False when the caller should pause before the next."""
        lock = self.lock(name)
        enter = leave = 0.0
        fence, lost = 0, False
        try:
            with lock:
                enter = time.time()
                fence = lock.fence or 0
                self.work(name)
                if self.args.hold:
                    time.sleep(self.args.hold)  # the work done under the lock
                lost = lock.lost
                leave = time.time()
        except LockLost:
            lost = True
        except LockContended as exc:
            self.note(contended=1)
            self.recorder.event("contended", name=name, message=str(exc))
            return True
        except LockBackendUnavailable as exc:
            self.failed(name, "release" if enter else "acquire", exc)
            if not enter:
                return False
        self.report(name, fence, enter, leave, lost)
        return True

    async def asection(self, name: str) -> bool:
        """Async twin of :meth:`section` (the counter is bumped in a thread)."""
        lock = self.lock(name)
        enter = leave = 0.0
        fence, lost = 0, False
        try:
            async with lock:
                enter = time.time()
                fence = lock.fence or 0
                await asyncio.to_thread(self.work, name)
                if self.args.hold:
                    await asyncio.sleep(self.args.hold)
                lost = lock.lost
                leave = time.time()
        except LockLost:
            lost = True
        except LockContended as exc:
            self.note(contended=1)
            self.recorder.event("contended", name=name, message=str(exc))
            return True
        except LockBackendUnavailable as exc:
            self.failed(name, "release" if enter else "acquire", exc)
            if not enter:
                return False
        self.report(name, fence, enter, leave, lost)
        return True

    def contend(self) -> None:
        rng = random.Random()
        left = self.args.iterations
        while not self.stopped.is_set() and (left is None or left > 0):
            if not self.section(self.names[rng.randrange(len(self.names))]):
                time.sleep(self.args.retry_pause)
            if left is not None:
                left -= 1

    async def acontend(self) -> None:
        rng = random.Random()
        left = self.args.iterations
        while not self.stopped.is_set() and (left is None or left > 0):
            if not await self.asection(self.names[rng.randrange(len(self.names))]):
                await asyncio.sleep(self.args.retry_pause)
            if left is not None:
                left -= 1

    def watch_stop(self) -> None:
        client = data_client()
        while not self.stopped.is_set():
            if client.blpop([self.args.stop], timeout=1):
                self.stopped.set()


def main() -> int:
    run = Run(ARGS)
    start_barrier(run.data, ARGS.barrier)
    threading.Thread(target=run.watch_stop, name="stop-watcher", daemon=True).start()
    errors: list[str] = []
    if ARGS.use_async:

        async def all_tasks() -> None:
            results = await asyncio.gather(
                *(run.acontend() for _ in range(ARGS.threads)), return_exceptions=True
            )
            errors.extend(
                f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)
            )

        asyncio.run(all_tasks())
    else:

        def guarded() -> None:
            try:
                run.contend()
            except BaseException as exc:  # reported below; the test fails on it
                # The message too: redis-py's repr of a server error leaves it out.
                name = threading.current_thread().name
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=guarded, name=f"contender-{i}") for i in range(ARGS.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    run.recorder.flush()
    if errors:
        emit("error", message="; ".join(errors))
        return 2
    emit("done", **run.totals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
