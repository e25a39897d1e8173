"""Side-by-side benchmark of django-redis-mutex against other Python Redis locks.

Run from the repository root:

    UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/bench.py

Everything runs against one Redis: a private redis-server started here (or
REDIS_URL, where only keys named after this run are touched and then deleted).
Writes results/latest.json, the PNG plots in results/ and the generated
section of README.md. ``--quick`` is a smoke run that writes to a temporary
directory and leaves the recorded results alone.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling modules, also in spawned workers

from adapters import CONTENDERS  # noqa: E402
from contended import run_contended  # noqa: E402
from django_config import configure_django  # noqa: E402
from environment import benchmark_redis, describe  # noqa: E402
from report import evaluate_targets, markdown, plot, update_readme, write_json  # noqa: E402
from uncontended import run_uncontended  # noqa: E402

from django_redis_mutex.testing import RedisServer  # noqa: E402

COMMAND = "UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/bench.py"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,8,32", help="contender counts (default 2,8,32)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contended run (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved contended rounds")
    parser.add_argument("--cycles", type=int, default=2000, help="timed uncontended cycles")
    parser.add_argument("--only", default="", help="comma-separated library keys (default all)")
    parser.add_argument("--quick", action="store_true", help="smoke run into a temp directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.seconds, args.cycles = "2,8", 0.5, 200
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def delete_run_keys(url: str, run_id: str) -> None:
    """Delete every key this run created (the run id is in each of them)."""
    client = redis.Redis.from_url(url)
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"*{run_id}*", count=500):
        batch.append(key)
        if len(batch) >= 500:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)
    client.close()


def log_uncontended(results: dict[str, Any]) -> None:
    for entry in results.values():
        cmds = entry["commands"]
        log(
            f"  {entry['label']:<34} median {entry['cycle_us']['p50']:6.0f} µs"
            f"  p99 {entry['cycle_us']['p99']:6.0f} µs"
            f"  round trips {cmds['round_trips_per_cycle']:.2f}"
            f"  commands {cmds['total_per_cycle']:5.2f}"
            f"  server {cmds['server_us_per_cycle']:5.1f} µs"
        )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run_id = uuid.uuid4().hex[:10]
    key_prefix = f"bench{run_id}"
    chosen = [c for c in CONTENDERS if not args.only or c.key in args.only.split(",")]
    sizes = [int(n) for n in args.workers.split(",") if n]
    config = {
        "cycles": args.cycles,
        "warmup": max(50, args.cycles // 10),
        "rounds": 10,
        "counted": max(50, args.cycles // 10),
        "seconds": args.seconds,
        "contended_rounds": args.rounds,
        "workers": sizes,
    }
    out = Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)

    with benchmark_redis() as (url, where), RedisServer() as q2, RedisServer() as q3:
        log(f"Redis: {url} ({where}); run id {run_id}; quorum peers {q2.url} {q3.url}")
        configure_django(url, key_prefix, quorum_urls=[q2.url, q3.url])
        environment = describe(url, where)
        log(f"Uncontended: {len(chosen)} libraries x {args.cycles} cycles")
        uncontended = run_uncontended(
            chosen,
            url,
            lambda key: f"bench-{run_id}:uncontended:{key}",
            cycles=config["cycles"],
            warmup=config["warmup"],
            rounds=config["rounds"],
            counted=config["counted"],
        )
        log_uncontended(uncontended)
        log(f"Contended: N={sizes}, {args.seconds} s per library")
        contended = run_contended(
            url,
            key_prefix,
            run_id,
            [c for c in chosen if c.contended],
            sizes,
            seconds=args.seconds,
            rounds=config["contended_rounds"],
            log=log,
        )
        delete_run_keys(url, run_id)

    environment["loadavg_at_end"] = list(os.getloadavg())
    results: dict[str, Any] = {
        "started_at": started_at,
        "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
        "environment": environment,
        "config": config,
        "labels": {c.key: c.label for c in chosen},
        "uncontended": uncontended,
        "contended": contended,
    }
    results["targets"] = evaluate_targets(results)
    results["elapsed_s"] = time.monotonic() - began
    write_json(results, out / ("quick.json" if args.quick else "latest.json"))
    plots = plot(results, out)
    if not args.quick:
        update_readme(HERE / "README.md", markdown(results, plots))
    for target in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "info"}[target["met"]]
        log(f"[{verdict:>6}] {target['target']}: {target['value']} ({target['note']})")
    log(f"Done in {results['elapsed_s']:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
