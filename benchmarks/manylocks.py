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

Then, in the benchmark process alone, the memory distinct names leave behind:
``Mutex`` is acquired and released once on each of 20,000 fresh names, one after
another, and Redis is asked what stayed: the ``used_memory`` delta (INFO
memory), the keys of those names still present and their expiry (PTTL), and
``MEMORY USAGE`` of a sample of them. A name's fence counter outlives its last
use by ``scripts.FENCE_RETENTION``, so a project that locks a million new names
a day keeps about a million of them. The keys are deleted afterwards.
"""

from __future__ import annotations

import math
import random
import signal
import statistics
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


MEMORY_SAMPLE = 1000  # leftover keys whose MEMORY USAGE is read


def _used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _settled_memory(client: redis.Redis, timeout: float = 2.0) -> int:
    """Return ``used_memory`` once two readings 100 ms apart agree (a table rehash done)."""
    deadline = time.monotonic() + timeout
    last = _used_memory(client)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _used_memory(client)
        if now == last:
            break
        last = now
    return last


def _scan(client: redis.Redis, pattern: str) -> list[bytes]:
    return list(client.scan_iter(match=pattern, count=1000))


def measure_name_memory(
    url: str, base: str, names: int, *, log: Callable[[str], None]
) -> dict[str, Any]:
    """Acquire and release ``Mutex`` once on ``names`` fresh names; report what stays in Redis.

    The names are f"{base}:n:{i}"; every key any of them leaves starts with the
    lock key's prefix up to the number (see django_redis_mutex.keys), and every
    key of the step contains ``base``: those are deleted at the end.
    """
    from django_redis_mutex import Mutex, scripts
    from django_redis_mutex.keys import glob_escape

    client = redis.Redis.from_url(url)
    try:
        # Connect, load the scripts and start the watchdog before the first reading.
        warm = Mutex(f"{base}:warm-up")
        if not warm.acquire():
            raise RuntimeError(f"could not acquire {warm.name!r}")
        warm.release()
        first = Mutex(f"{base}:n:0").keys
        pattern = glob_escape(first.lock[: -len("0}")]) + "*"
        before_keys = int(client.dbsize())
        before = _settled_memory(client)
        started = time.perf_counter()
        for i in range(names):
            lock = Mutex(f"{base}:n:{i}")
            if not lock.acquire():
                raise RuntimeError(f"could not acquire {lock.name!r}")
            lock.release()
        elapsed = time.perf_counter() - started
        after = _settled_memory(client)
        added_keys = int(client.dbsize()) - before_keys
        left = _scan(client, pattern)
        pipe = client.pipeline(transaction=False)
        for key in left:
            pipe.pttl(key)
        pttls = [int(t) for t in pipe.execute()] if left else []
        kinds: dict[str, int] = {}
        for key in left:
            kind = key.decode().rsplit("}", 1)[1].lstrip(":") or "lock"
            kinds[kind] = kinds.get(kind, 0) + 1
        sample = left[:: max(1, len(left) // MEMORY_SAMPLE)][:MEMORY_SAMPLE]
        pipe = client.pipeline(transaction=False)
        for key in sample:
            pipe.memory_usage(key, samples=0)
        usage = [int(u) for u in pipe.execute() if u is not None] if sample else []
        with_ttl = [t for t in pttls if t > 0]
        delta = after - before
        key_bytes = statistics.median(usage) if usage else math.nan
        out = {
            "names": names,
            "name_example": f"{base}:n:0",
            "fence_key_example": first.fence,
            "cycle_us": elapsed / names * 1e6,
            "used_memory_delta_bytes": delta,
            "bytes_per_name": delta / names,
            # MB = 10^6 bytes: per million names it is the same number as bytes per name.
            "mb_per_million_names": delta / names,
            "keys_added": added_keys,
            "keys_left": len(left),
            "keys_left_per_name": len(left) / names,
            "keys_left_by_kind": kinds,
            "key_chars_mean": sum(map(len, left)) / len(left) if left else math.nan,
            "keys_left_without_ttl": len(left) - len(with_ttl),
            "memory_usage_sampled": len(usage),
            "memory_usage_p50_bytes": key_bytes,
            "memory_usage_mb_per_million_names": key_bytes * len(left) / names,
            "fence_retention_s": scripts.FENCE_RETENTION,
            "pttl_max_ms": max(with_ttl, default=math.nan),
            "pttl_min_ms": min(with_ttl, default=math.nan),
        }
    finally:
        created = _scan(client, "*" + glob_escape(base) + "*")
        for start in range(0, len(created), 1000):
            client.unlink(*created[start : start + 1000])
        client.close()
    log(
        f"  many locks: {names:,} fresh names left {out['keys_left']:,} keys"
        f" ({out['keys_left_without_ttl']} without TTL), {out['bytes_per_name']:.0f} B per name"
        f" (used_memory), MEMORY USAGE p50 {key_bytes:.0f} B per key;"
        f" {out['mb_per_million_names']:.0f} MB per million names"
    )
    return out


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
    memory_names: int = 0,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run every library on ``names`` names, then this app on each count of ``curve``.

    With ``memory_names``, then measure the memory that many fresh names leave
    behind (:func:`measure_name_memory`), once the worker processes have stopped.
    """
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
    if memory_names:
        base = f"bench-{run_id}:many:names"
        try:
            out["memory_per_name"] = measure_name_memory(url, base, memory_names, log=log)
        except Exception as exc:
            # The sections above stay recorded; the memory row then says what failed.
            log(f"  many locks: memory of {memory_names:,} fresh names FAILED: {exc!r}")
            out["memory_per_name"] = {"names": memory_names, "error": repr(exc)}
    return out


__all__ = ["ManyJob", "many_worker", "measure_name_memory", "percentile", "run_many_locks"]
