"""Exclusion and throughput under load: 16 processes x 4 threads on one lock, then on 1,000.

Every section is recorded (``tests/history.py``) and checked: no two sections
of a lock overlap, fences grow, no counter increment is lost. The figures
(throughput, wait percentiles) are printed, written to ``load-<case>.json``
in the test's temporary directory, and included in assertion messages. After
the run no lock may be left behind without a lease: every key in the test's
namespace is gone or expires by itself.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from .helpers import run_worker
from .history import History

pytestmark = pytest.mark.slow

PROCESSES, THREADS, DURATION = 16, 4, 8.0
WARM_UP = 1.0
START_TIMEOUT = 60.0


@pytest.fixture
def load_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a workload key of this test (outside the lock namespace)."""
    stem = f"load:{mutex_prefix}"
    yield lambda purpose: f"{stem}:{purpose}"
    for batch in _batches(list(raw.scan_iter(match=f"{stem}:*", count=1000)), 500):
        raw.delete(*batch)


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run_load(
    raw: redis.Redis, key: Callable[[str], str], names: int, out_dir: Path
) -> tuple[History, dict[str, Any]]:
    """Run PROCESSES processes of THREADS threads on ``names`` locks for DURATION seconds."""
    counter, barrier = key("counter"), key("barrier")
    out_dir.mkdir()
    worker = run_worker(
        "fault_sections.py",
        "--name",
        "load",
        "--names",
        str(names),
        "--counter",
        counter,
        "--barrier",
        barrier,
        "--threads",
        str(THREADS),
        "--duration",
        str(DURATION),
        "--timeout",
        "30",
        "--buffer",
        "--processes",
        str(PROCESSES),
        "--out-dir",
        str(out_dir),
    )
    try:
        assert worker.stdout is not None
        for _ in range(PROCESSES):
            line = worker.stdout.readline()
            if not line or json.loads(line)["event"] != "ready":
                worker.kill()
                raise AssertionError(f"a process did not start: {line!r} {worker.communicate()}")
        started = time.monotonic()
        raw.rpush(barrier, *["go"] * PROCESSES)
        out, err = worker.communicate(timeout=DURATION + START_TIMEOUT)
        elapsed = time.monotonic() - started
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, f"exit {worker.returncode}: {out} {err}"

    history, totals = History(), []
    for report in sorted(out_dir.glob("*.jsonl")):
        history.load_from_worker_output(report)
        totals += [
            json.loads(line)
            for line in report.read_text().splitlines()
            if '"event": "done"' in line
        ]
    assert len(totals) == PROCESSES, f"{len(totals)} processes finished: {out} {err}"
    waits = [s.wait for s in history.sections]
    # Past the first second: connections made, scripts loaded, every thread running.
    began = min(s.enter - s.wait for s in history.sections)
    steady = [s.wait for s in history.sections if s.enter - s.wait > began + WARM_UP]
    figures: dict[str, Any] = {
        "processes": PROCESSES,
        "threads": THREADS,
        "locks": names,
        "seconds": round(elapsed, 2),
        "sections": len(history),
        "throughput_per_s": round(len(history) / elapsed, 1),
        "wait_p50_ms": round(statistics.median(waits) * 1000, 2),
        "wait_p99_ms": round(percentile(waits, 0.99) * 1000, 2),
        "wait_max_ms": round(max(waits) * 1000, 2),
        "steady_wait_p99_ms": round(percentile(steady, 0.99) * 1000, 2),
        "steady_wait_max_ms": round(max(steady) * 1000, 2),
        "timeouts": sum(t["contended"] for t in totals),
        "failures": sum(t["failures"] for t in totals),
        "lost": sum(t["lost"] for t in totals),
    }
    values = raw.mget([f"{counter}:{name}" for name in history.names()])
    figures["counters"] = {n: int(v or 0) for n, v in zip(history.names(), values, strict=True)}
    return history, figures


def keys_left(raw: redis.Redis, mutex_prefix: str) -> dict[str, int]:
    """Return each key left in the test's lock namespace with its PTTL (-1: never expires)."""
    keys = list(raw.scan_iter(match=f"tests:{mutex_prefix}:*", count=1000))
    pipe = raw.pipeline(transaction=False)
    for name in keys:
        pipe.pttl(name)
    return {name.decode(): pttl for name, pttl in zip(keys, pipe.execute(), strict=True)}


def report(figures: dict[str, Any], case: str, tmp_path: Path) -> str:
    shown = {k: v for k, v in figures.items() if k != "counters"}
    (tmp_path / f"load-{case}.json").write_text(json.dumps(shown, indent=2))
    line = f"load {case}: " + ", ".join(f"{k}={v}" for k, v in shown.items())
    print("\n" + line)
    return line


@pytest.mark.parametrize("names", [1, 1000], ids=["one-lock", "1000-locks"])
def test_load_keeps_exclusion_and_leaves_no_key_without_a_lease(
    names: int,
    raw: redis.Redis,
    load_key: Callable[[str], str],
    mutex_prefix: str,
    tmp_path: Path,
) -> None:
    history, figures = run_load(raw, load_key, names, tmp_path / "reports")
    summary = report(figures, f"{names}-locks", tmp_path)

    assert figures["sections"] > 1000, summary
    assert figures["failures"] == figures["timeouts"] == figures["lost"] == 0, summary
    assert history.violations() == [], summary
    assert history.counter_violations(figures["counters"]) == [], summary
    left = keys_left(raw, mutex_prefix)
    # The fence counters stay on purpose (with a lease of their own); nothing may stay forever.
    assert sum(key.endswith(":fence") for key in left) == len(history.names()), summary
    assert [key for key, pttl in left.items() if pttl == -1] == [], summary
    assert not any(key.endswith("}") for key in left), f"a lock is still held: {summary}"
    # Every process got the lock(s) many times: nobody was starved.
    per_process: dict[int, int] = {}
    for section in history.sections:
        per_process[section.pid] = per_process.get(section.pid, 0) + 1
    assert len(per_process) == PROCESSES, summary
    assert min(per_process.values()) > figures["sections"] / PROCESSES / 4, (per_process, summary)
