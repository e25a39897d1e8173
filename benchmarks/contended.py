"""Scenario 2: N worker processes fight over one lock.

Each worker loops acquire -> critical section -> release for a fixed time. The
critical section is a deliberately non-atomic read-modify-write of a shared
counter (GET, then SET to value + 1), so any break in mutual exclusion shows
up as a lost update: cycles counted by the workers minus the final counter.

One pool of N spawned processes serves every library in turn (spawning 32
interpreters per library would cost more than the runs themselves). Before a
run each worker builds its adapter and does one warm-up cycle, then all meet
at a barrier and start together.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from adapters import WAIT, Contender
from stats import Cycle, fairness, handoffs, summary_us

_SPAWN = mp.get_context("spawn")


@dataclass(frozen=True)
class Job:
    """One timed run of one library, sent to every worker of a pool."""

    contender: str
    lock_name: str
    counter_key: str
    duration: float


def worker_main(
    index: int,
    url: str,
    key_prefix: str,
    quorum_urls: list[str],
    jobs: Any,
    results: Any,
    barrier: Any,
) -> None:
    """Run jobs from ``jobs`` until a None arrives; report each run's cycles on ``results``."""
    from adapters import BY_KEY, plain_client
    from django_config import configure_django

    # Ctrl-C reaches the whole process group: the parent stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_django(url, key_prefix, quorum_urls=quorum_urls or None)
    client = plain_client(url)
    while (job := jobs.get()) is not None:
        try:
            adapter = BY_KEY[job.contender].factory(url, job.lock_name)
            adapter.release(adapter.acquire())  # connect, load scripts, import lazily
            barrier.wait(timeout=120)
        except Exception as exc:
            barrier.abort()
            results.put({"worker": index, "error": f"before start: {exc!r}"})
            continue
        cycles: list[tuple[int, float, float, float, float]] = []
        started = time.time()
        cpu_started = time.process_time()
        end = time.monotonic() + job.duration
        perf, thread_cpu = time.perf_counter, time.thread_time
        # This thread's CPU time in acquire, the critical section and release
        # (a blocked wait costs none); the rest of the process's CPU is other
        # threads' (the watchdog's) and the loop's own.
        cpu_acquire = cpu_hold = cpu_release = 0.0
        try:
            while time.monotonic() < end:
                c0 = thread_cpu()
                t0 = perf()
                handle = adapter.acquire()
                wait = perf() - t0
                c1 = thread_cpu()
                acquired_at = time.time()
                value = int(client.get(job.counter_key) or 0)
                client.set(job.counter_key, value + 1)
                releasing_at = time.time()
                c2 = thread_cpu()
                adapter.release(handle)
                c3 = thread_cpu()
                cycles.append((index, wait, acquired_at, releasing_at, time.time()))
                cpu_acquire += c1 - c0
                cpu_hold += c2 - c1
                cpu_release += c3 - c2
        except Exception as exc:
            results.put({"worker": index, "error": repr(exc), "cycles": cycles})
            continue
        results.put(
            {
                "worker": index,
                "cycles": cycles,
                "started": started,
                "finished": time.time(),
                "cpu_s": time.process_time() - cpu_started,
                "cpu_parts_s": {
                    "acquire": cpu_acquire,
                    "critical section": cpu_hold,
                    "release": cpu_release,
                },
            }
        )


class WorkerPool:
    """N spawned worker processes sharing one job queue, one result queue and one barrier."""

    def __init__(
        self,
        size: int,
        url: str,
        key_prefix: str,
        quorum_urls: list[str] | None = None,
        target: Callable[..., None] | None = None,
    ) -> None:
        self.target = target or worker_main
        self.size = size
        self.url = url
        self.key_prefix = key_prefix
        self.quorum_urls = list(quorum_urls or [])
        self.processes: list[Any] = []

    def start(self) -> WorkerPool:
        self.jobs = _SPAWN.Queue()
        self.results = _SPAWN.Queue()
        self.barrier = _SPAWN.Barrier(self.size)
        self.processes = [
            _SPAWN.Process(
                target=self.target,
                args=(
                    i,
                    self.url,
                    self.key_prefix,
                    self.quorum_urls,
                    self.jobs,
                    self.results,
                    self.barrier,
                ),
                name=f"bench-worker-{i}",
                daemon=True,
            )
            for i in range(self.size)
        ]
        for process in self.processes:
            process.start()
        return self

    def run(self, job: Job, timeout: float) -> list[dict[str, Any]]:
        """Send ``job`` to every worker and return their reports (raise TimeoutError if late)."""
        for _ in range(self.size):
            self.jobs.put(job)
        reports = []
        deadline = time.monotonic() + timeout
        for _ in range(self.size):
            try:
                reports.append(self.results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(
                    f"{job.contender}: only {len(reports)} of {self.size} workers reported "
                    f"within {timeout:.0f} s"
                ) from None
        if self.barrier.broken:
            self.barrier.reset()
        return reports

    def stop(self) -> None:
        """Ask workers to exit; terminate (by process handle) those that do not within 10 s."""
        for process in self.processes:
            if process.is_alive():
                self.jobs.put(None)
        deadline = time.monotonic() + 10
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.processes = []

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_cpu_seconds(client: Any) -> float:
    """Return the CPU time (user + system) the Redis server has used so far."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class ServerMeter:
    """Redis CPU time and commandstats of one or more servers, read before and after a run."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients

    def read(self) -> tuple[float, int, int]:
        """Return (CPU seconds, commands executed, µs executing them) summed over the servers."""
        cpu, calls, usec = 0.0, 0, 0
        for client in self.clients:
            cpu += redis_cpu_seconds(client)
            for name, value in client.info("commandstats").items():
                if name.removeprefix("cmdstat_").lower() not in ("info", "echo"):
                    calls += int(value["calls"])
                    usec += int(value["usec"])
        return cpu, calls, usec

    @staticmethod
    def delta(before: tuple[float, int, int], after: tuple[float, int, int]) -> Any:
        return tuple(b - a for a, b in zip(before, after, strict=True))


@dataclass
class Slice:
    """One library's run in one round: what every worker reported, and the servers' costs."""

    reports: list[dict[str, Any]]
    redis_cpu_s: float
    redis_calls: int = 0
    redis_usec: int = 0

    def cycles(self) -> list[Cycle]:
        return [Cycle(*c) for r in self.reports for c in r.get("cycles", [])]

    def window(self) -> float:
        """Seconds from the first worker starting to the last one finishing."""
        started = [r["started"] for r in self.reports if "started" in r]
        finished = [r["finished"] for r in self.reports if "finished" in r]
        return max(finished) - min(started) if started and finished else 0.0


def _cpu_parts(reports: list[dict[str, Any]], count: int) -> dict[str, float]:
    if not count:
        return {}
    parts: dict[str, float] = {}
    for report in reports:
        for name, seconds in report.get("cpu_parts_s", {}).items():
            parts[name] = parts.get(name, 0.0) + seconds
    total = sum(r.get("cpu_s", 0.0) for r in reports)
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {name: seconds / count * 1e6 for name, seconds in parts.items()}


def summarise(slices: list[Slice], workers: int, final_counter: int) -> dict[str, Any]:
    """Turn the workers' raw cycles into throughput, waits, handoffs, fairness, lost updates."""
    runs = [piece.cycles() for piece in slices]
    cycles = [c for run in runs for c in run]
    window = sum(piece.window() for piece in slices)
    reports = [r for piece in slices for r in piece.reports]
    count = len(cycles)
    result: dict[str, Any] = {
        "workers": workers,
        "window_s": window,
        "cycles": count,
        "throughput": count / window if window > 0 else 0.0,
        "wait_us": summary_us([c.wait for c in cycles]),
        # How long the critical section (GET + SET) took while held: CPU pressure shows here.
        "hold_us": summary_us([c.releasing_at - c.acquired_at for c in cycles]),
        "lost_updates": count - final_counter,
        "errors": [r["error"] for r in reports if "error" in r],
        # On a machine with few cores CPU per cycle bounds throughput: the workers (all their
        # threads) and the Redis server (measured around each run, warm-up included).
        "client_cpu_us_per_cycle": (
            sum(r.get("cpu_s", 0.0) for r in reports) / count * 1e6 if count else math.nan
        ),
        # The same split by where the looping thread spent it; "other" is the rest of
        # the processes' CPU (other threads, such as a watchdog, and the loop itself).
        "client_cpu_parts_us_per_cycle": _cpu_parts(reports, count),
        "redis_cpu_us_per_cycle": (
            sum(piece.redis_cpu_s for piece in slices) / count * 1e6 if count else math.nan
        ),
        # What Redis spent executing commands (commandstats), and how many, per cycle.
        "redis_commands_per_cycle": (
            sum(piece.redis_calls for piece in slices) / count if count else math.nan
        ),
        "redis_command_us_per_cycle": (
            sum(piece.redis_usec for piece in slices) / count if count else math.nan
        ),
    }
    if cycles:
        result.update(handoffs(runs))
        result.update(fairness(cycles, workers))
        # At saturation one cycle of the lock is a hold plus a hand-off to the next holder.
        result["period_us"] = 1e6 / result["throughput"] if result["throughput"] else math.nan
    return result


def run_contended(
    url: str,
    key_prefix: str,
    run_id: str,
    contenders: list[Contender],
    sizes: list[int],
    *,
    seconds: float,
    rounds: int,
    log: Callable[[str], None],
    quorum_urls: list[str] | None = None,
    tag: str = "contended",
) -> dict[str, Any]:
    """Run every library at every N; return summaries by N and library key.

    Each library's ``seconds`` are split into ``rounds`` interleaved runs (every
    library runs once per round), so a busy spell on the machine is shared out
    instead of landing on one library. One worker pool serves each N.
    """
    client = redis.Redis.from_url(url)
    servers = [client] + [redis.Redis.from_url(u) for u in quorum_urls or []]
    meter = ServerMeter(servers)
    results: dict[str, Any] = {}
    for size in sizes:
        slices: dict[str, list[Slice]] = {c.key: [] for c in contenders}
        counters = {c.key: f"bench-{run_id}:{tag}:counter:{c.key}:{size}" for c in contenders}
        for counter in counters.values():
            client.set(counter, 0)
        pool = WorkerPool(size, url, key_prefix, quorum_urls).start()
        try:
            for _ in range(rounds):
                for contender in contenders:
                    name = f"bench-{run_id}:{tag}:{contender.key}:{size}"
                    contender.factory.prepare(client, name)
                    job = Job(contender.key, name, counters[contender.key], seconds / rounds)
                    before = meter.read()
                    try:
                        reports = pool.run(job, timeout=job.duration + WAIT + 60)
                    except TimeoutError as exc:
                        log(f"  {contender.key} N={size}: {exc}; restarting the pool")
                        pool.stop()
                        pool = WorkerPool(size, url, key_prefix, quorum_urls).start()
                        reports = [{"worker": -1, "error": str(exc)}]
                    cpu, calls, usec = meter.delta(before, meter.read())
                    slices[contender.key].append(Slice(reports, cpu, calls, usec))
        finally:
            pool.stop()
        results[str(size)] = by_lib = {}
        for contender in contenders:
            final = int(client.get(counters[contender.key]) or 0)
            entry = by_lib[contender.key] = summarise(slices[contender.key], size, final)
            log(
                f"  N={size:<2} {contender.label:<34} {entry['throughput']:7.0f} cycles/s"
                f"  p99 wait {entry['wait_us']['p99'] / 1000:7.1f} ms"
                f"  CPU/cycle {entry['client_cpu_us_per_cycle']:5.0f}"
                f"+{entry['redis_cpu_us_per_cycle']:3.0f} µs"
                f"  lost {entry['lost_updates']}"
                + (f"  errors {entry['errors'][:1]}" if entry["errors"] else "")
            )
    for server in servers:
        server.close()
    return results
