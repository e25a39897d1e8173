"""Run critical sections from several threads, on one lock or many, and record each.

Usage: fault_sections.py --counter KEY --barrier KEY [options] (see --help)

Every thread loops: pick a lock name, enter ``with Mutex(name, ...)``, take
the time, increment that lock's counter (COUNTER:<name>) with a GET then a
SET, so sections that overlap lose updates, hold the lock for --hold seconds
(the work), take the time again and leave. Each section goes out as a JSON
``section`` line (see tests/history.py); an attempt that failed goes out as a
``failure`` line naming the operation (acquire or release), the error and how
long the call took, and one that timed out as ``contended``. The loop stops
after --iterations per thread, after --duration seconds, or when the test
pushes onto --stop (one item per worker). Last comes ``done`` with totals.

--lock-url points the lock alias at another Redis or at a proxy, with
--socket-timeout as its socket timeouts; the counters, the barrier and the
stop list always live on the test's own server (DJANGO_REDIS_MUTEX_TEST_URL),
the "storage" that the lock protects. --buffer keeps the report lines in
memory until the end, so that writing them does not slow a timed run.
--processes N forks N processes after Django is set up once (as a pre-forking
server does), each running --threads threads and writing its report to
<--out-dir>/<pid>.jsonl; only ``ready`` and ``error`` lines share stdout.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import django


def point_locks_at(url: str | None, socket_timeout: float | None) -> None:
    """Move the default cache alias to ``url`` before anything connected."""
    from django.conf import settings

    entry = settings.CACHES["default"]
    if url:
        entry["LOCATION"] = url
    if socket_timeout:
        builtin = entry["BACKEND"].startswith("django.core.")
        names = (
            ("socket_timeout", "socket_connect_timeout")
            if builtin
            else ("SOCKET_TIMEOUT", "SOCKET_CONNECT_TIMEOUT")
        )
        entry["OPTIONS"] = {**entry.get("OPTIONS", {}), **dict.fromkeys(names, socket_timeout)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="faults", help="lock name, or the stem of several")
    parser.add_argument("--names", type=int, default=1, help="spread over this many locks")
    parser.add_argument("--counter", required=True, help="stem of the per-lock counter keys")
    parser.add_argument("--barrier", required=True, help="start barrier list")
    parser.add_argument("--stop", help="list the test pushes onto to stop the run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iterations", type=int, help="sections attempted per thread")
    parser.add_argument("--duration", type=float, help="seconds to run after the barrier")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds of work per section")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--no-watchdog", dest="watchdog", action="store_false")
    parser.add_argument(
        "--no-reentrant",
        dest="reentrant",
        action="store_false",
        help="never join a hold this thread may still have on the lock",
    )
    parser.add_argument("--lock-url", help="where the lock alias connects (Redis or a proxy)")
    parser.add_argument("--socket-timeout", type=float, help="socket timeouts of the lock alias")
    parser.add_argument(
        "--retry-pause",
        type=float,
        default=0.05,
        help="back-off after a failed attempt, so a dead Redis is not hammered",
    )
    parser.add_argument("--buffer", action="store_true", help="report everything at the end")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="fork this many processes after setting up once (needs --out-dir)",
    )
    parser.add_argument("--out-dir", help="directory for each forked process's report file")
    return parser.parse_args()


ARGS = parse_args()
point_locks_at(ARGS.lock_url, ARGS.socket_timeout)
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
    """The shared state of this worker's threads."""

    def __init__(self, args: argparse.Namespace, report: IO[str]) -> None:
        self.args = args
        self.data = data_client()
        self.recorder = Recorder(report, buffered=args.buffer)
        self.names = (
            [args.name] if args.names == 1 else [f"{args.name}:{i}" for i in range(args.names)]
        )
        self.stopped = threading.Event()
        self.ends_at = float("inf")
        self.totals: dict[str, Any] = {
            "sections": 0,
            "lost": 0,
            "contended": 0,
            "failures": 0,
            "max_acquire": 0.0,
            "max_release": 0.0,
        }
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def note(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                if key.startswith("max_"):
                    self.totals[key] = max(self.totals[key], value)
                else:
                    self.totals[key] += value

    def running(self) -> bool:
        return not self.stopped.is_set() and time.monotonic() < self.ends_at

    def section(self, name: str) -> None:
        """Attempt one section on ``name`` and report how it went."""
        args = self.args
        lock = Mutex(
            name,
            ttl=args.ttl,
            timeout=args.timeout,
            watchdog=args.watchdog,
            reentrant=args.reentrant,
        )
        counter = f"{args.counter}:{name}"
        called, called_wall = time.monotonic(), time.time()
        enter = leave = 0.0
        fence, lost = 0, False
        try:
            with lock:
                enter = time.time()
                fence = lock.fence or 0
                value = int(self.data.get(counter) or 0)
                self.data.set(counter, value + 1)
                if args.hold:
                    time.sleep(args.hold)  # the work done under the lock
                lost = lock.lost
                leave = time.time()
        except LockLost:
            lost = True
        except LockContended:
            self.note(contended=1, max_acquire=time.monotonic() - called)
            self.recorder.event("contended", name=name, took=time.monotonic() - called)
            return
        except LockBackendUnavailable as exc:
            op = "release" if enter else "acquire"
            took = time.time() - leave if enter else time.monotonic() - called
            self.note(failures=1, **{f"max_{op}": took})
            self.recorder.event(
                "failure", name=name, op=op, took=took, error=type(exc).__name__, message=str(exc)
            )
            if not enter:
                time.sleep(args.retry_pause)
                return
        else:
            self.note(max_release=time.time() - leave)
        self.note(sections=1, lost=int(lost), max_acquire=enter - called_wall)
        self.recorder.section(name, fence, enter, leave, lost=lost, wait=enter - called_wall)

    def contend(self) -> None:
        rng = random.Random()
        iterations = self.args.iterations
        try:
            while self.running() and (iterations is None or iterations > 0):
                self.section(self.names[rng.randrange(len(self.names))])
                if iterations is not None:
                    iterations -= 1
        except BaseException as exc:  # reported by the main thread; the test fails on it
            with self._lock:
                self.errors.append(f"{threading.current_thread().name}: {exc!r}")

    def watch_stop(self) -> None:
        client = data_client()
        while not self.stopped.is_set():
            if client.blpop([self.args.stop], timeout=1):
                self.stopped.set()


def run_process(report: IO[str]) -> int:
    """Run this process's threads until the run ends; return the exit code."""
    run = Run(ARGS, report)
    start_barrier(run.data, ARGS.barrier)
    if ARGS.duration is not None:
        run.ends_at = time.monotonic() + ARGS.duration
    if ARGS.stop:
        threading.Thread(target=run.watch_stop, name="stop-watcher", daemon=True).start()
    threads = [
        threading.Thread(target=run.contend, name=f"contender-{i}") for i in range(ARGS.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if run.errors:
        run.recorder.flush()
        emit("error", message="; ".join(run.errors))
        return 2
    run.recorder.event("done", **run.totals)
    run.recorder.flush()
    return 0


def fork_processes(count: int, out_dir: Path) -> int:
    """Fork ``count`` processes from this one (set up once), each reporting to its own file.

    Like a pre-forking server (gunicorn --preload): every child has its own
    connections and its own watchdog. Only small lines (ready, error) share
    stdout; a child's sections go to ``<out_dir>/<pid>.jsonl``.
    """
    children = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                with open(out_dir / f"{os.getpid()}.jsonl", "w") as report:
                    code = run_process(report)
            except BaseException as exc:
                emit("error", message=f"child failed: {exc!r}")
            finally:
                sys.stdout.flush()
                os._exit(code)
        children.append(pid)
    exits = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    emit("children_done", exits=exits)
    return 0 if not any(exits) else 2


def main() -> int:
    if ARGS.processes > 1:
        return fork_processes(ARGS.processes, Path(ARGS.out_dir))
    return run_process(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
