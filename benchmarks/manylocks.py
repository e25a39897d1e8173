"""Scenario: many processes and threads on many lock names.

16 processes x 4 threads (by default) loop for a fixed time: pick a random
name out of ``names``, acquire its lock, run the same read-modify-write of a
counter (one counter per name, so a broken lock shows up as a lost update),
release. Reported per library: sections per second, the time one section
takes (acquire + critical section + release: p50, p99), client and Redis CPU
and Redis commands per section, lost updates.

The comparison runs every library on the same number of names; the cost curve
runs this app alone from a few names (where most sections wait for another
thread) to many (where almost none does). A lock whose cost grew with the
number of live names (a scan, a shared structure) would show a rising curve.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from contended import ServerMeter, WorkerPool
from stats import percentile, summary_us


@dataclass(frozen=True)
class ManyJob:
    """One timed run: every worker process runs ``threads`` threads on ``names`` lock names."""

    contender: str
    prefix: str  # lock names are f"{prefix}:{i}", counters f"{prefix}:n:{i}"
    names: int
    threads: int
    duration: float


def many_worker(
    index: int,
    url: str,
    key_prefix: str,
    quorum_urls: list[str],
    jobs: Any,
    results: Any,
    barrier: Any,
) -> None:
    """Run ManyJobs until a None arrives; report sections, CPU and section times."""
    from adapters import BY_KEY, plain_client
    from django_config import configure_django

    # Ctrl-C reaches the whole process group: the parent stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_django(url, key_prefix, quorum_urls=quorum_urls or None)
    client = plain_client(url)
    while (job := jobs.get()) is not None:
        factory = BY_KEY[job.contender].factory
        try:
            adapter = factory(url, f"{job.prefix}:{index}")
            adapter.release(adapter.acquire())  # connect, load scripts, import lazily
            barrier.wait(timeout=120)
        except Exception as exc:
            barrier.abort()
            results.put({"worker": index, "error": f"before start: {exc!r}"})
            continue
        end = time.monotonic() + job.duration
        sections: list[list[float]] = [[] for _ in range(job.threads)]
        errors: list[str] = []
        args = (job, factory, url, client, end, errors)
        started = time.time()
        cpu_started = time.process_time()
        threads = [
            threading.Thread(target=_loop, args=(sections[t], *args)) for t in range(job.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report: dict[str, Any] = {
            "worker": index,
            "sections": [s for per_thread in sections for s in per_thread],
            "started": started,
            "finished": time.time(),
            "cpu_s": time.process_time() - cpu_started,
        }
        if errors:
            report["error"] = errors[0]
        results.put(report)


def _loop(
    mine: list[float],
    job: ManyJob,
    factory: Any,
    url: str,
    client: Any,
    end: float,
    errors: list[str],
) -> None:
    """One thread of a worker: random name, acquire, counter GET + SET, release; until ``end``."""
    rng = random.Random()
    perf = time.perf_counter
    try:
        while time.monotonic() < end:
            i = rng.randrange(job.names)
            t0 = perf()
            adapter = factory(url, f"{job.prefix}:{i}")
            handle = adapter.acquire()
            counter = f"{job.prefix}:n:{i}"
            client.set(counter, int(client.get(counter) or 0) + 1)
            adapter.release(handle)
            mine.append(perf() - t0)
    except Exception as exc:
        errors.append(repr(exc))


def _counted(client: redis.Redis, prefix: str, names: int) -> int:
    total = 0
    for start in range(0, names, 1000):
        keys = [f"{prefix}:n:{i}" for i in range(start, min(start + 1000, names))]
        total += sum(int(v) for v in client.mget(keys) if v is not None)
    return total


def _summarise(reports: list[dict[str, Any]], cost: tuple[float, int, int], counted: int) -> Any:
    times = [s for r in reports for s in r.get("sections", [])]
    count = len(times)
    started = [r["started"] for r in reports if "started" in r]
    finished = [r["finished"] for r in reports if "finished" in r]
    window = max(finished) - min(started) if started and finished else 0.0
    cpu, calls, usec = cost
    return {
        "sections": count,
        "window_s": window,
        "sections_per_s": count / window if window > 0 else 0.0,
        "section_us": summary_us(times),
        "client_cpu_us_per_section": (
            sum(r.get("cpu_s", 0.0) for r in reports) / count * 1e6 if count else math.nan
        ),
        "redis_cpu_us_per_section": cpu / count * 1e6 if count else math.nan,
        "redis_commands_per_section": calls / count if count else math.nan,
        "redis_command_us_per_section": usec / count if count else math.nan,
        "lost_updates": count - counted,
        "errors": [r["error"] for r in reports if "error" in r],
    }


def run_many_locks(
    url: str,
    key_prefix: str,
    run_id: str,
    contenders: list[str],
    *,
    processes: int,
    threads: int,
    names: int,
    curve: list[int],
    seconds: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run every library on ``names`` names, then this app on each count of ``curve``."""
    client = redis.Redis.from_url(url)
    meter = ServerMeter([client])
    plan = [(key, names) for key in contenders]
    plan += [("drm", n) for n in curve if ("drm", n) not in plan]
    out: dict[str, Any] = {
        "processes": processes,
        "threads": threads,
        "names": names,
        "seconds": seconds,
        "libraries": {},
        "curve": {},
    }
    pool = WorkerPool(processes, url, key_prefix, target=many_worker).start()
    try:
        for key, count in plan:
            prefix = f"bench-{run_id}:many:{key}:{count}"
            job = ManyJob(key, prefix, count, threads, seconds)
            before = meter.read()
            try:
                reports = pool.run(job, timeout=seconds + 120)
            except TimeoutError as exc:
                log(f"  many locks {key} x {count}: {exc}; restarting the pool")
                pool.stop()
                pool = WorkerPool(processes, url, key_prefix, target=many_worker).start()
                reports = [{"worker": -1, "error": str(exc)}]
            cost = meter.delta(before, meter.read())
            entry = _summarise(reports, cost, _counted(client, prefix, count))
            log(
                f"  many locks {key:<18} {count:>6} names {entry['sections_per_s']:7.0f}/s"
                f"  p99 {entry['section_us']['p99'] / 1000:6.1f} ms"
                f"  CPU/section {entry['client_cpu_us_per_section']:5.0f}"
                f"+{entry['redis_cpu_us_per_section']:3.0f} µs  lost {entry['lost_updates']}"
                + (f"  errors {entry['errors'][:1]}" if entry["errors"] else "")
            )
            if count == names:
                out["libraries"][key] = entry
            if key == "drm":
                out["curve"][str(count)] = entry
    finally:
        pool.stop()
        client.close()
    return out


__all__ = ["ManyJob", "many_worker", "percentile", "run_many_locks"]
