"""Side-by-side benchmark of django-redis-mutex against other Python Redis locks.

Run from the repository root:

    UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/bench.py

Everything runs against private redis-servers started here (one, plus two
more for the three-master Redlock scenarios), or REDIS_URL for the first one,
where only keys named after this run are touched and then deleted. The whole
comparison runs ``--runs`` times (3 by default); results/latest.json keeps every
run's values and their medians, the targets are judged on the medians, and the
plots in results/ and the generated section of README.md are drawn from that
file. ``--quick`` is a one-run smoke test that writes to a temporary directory
and leaves the recorded results alone; ``--scenarios`` and ``--only`` pick
scenarios and libraries; ``--merge`` runs only the chosen ``--scenarios`` and
replaces just their entries in results/latest.json (the other scenarios and
their per-run values stay, the targets are judged again, and each scenario
records when, at which revision and under which load it was measured);
``--render`` redraws the plots and the README section from
results/latest.json without running anything.

Every server and process the run starts is stopped on the way out, whether the
run finished, failed or was interrupted (Ctrl-C, SIGTERM, SIGHUP). The run
exits 1 when a scenario failed or a safety target (:data:`SAFETY`) was missed;
a speed target missed is reported, never a failure: speed depends on the
machine, while a lost update or a key left without a TTL is a bug anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling modules, also in spawned workers

from adapters import CONTENDERS  # noqa: E402
from aggregate import median_tree  # noqa: E402
from contended import run_contended  # noqa: E402
from django_config import configure_django  # noqa: E402
from environment import benchmark_redis, describe  # noqa: E402
from report import (  # noqa: E402
    derive,
    judge_targets,
    markdown,
    plot,
    update_readme,
    write_json,
)
from topologies import TOPOLOGIES  # noqa: E402
from uncontended import run_uncontended  # noqa: E402

from django_redis_mutex.testing import RedisServer  # noqa: E402

COMMAND = "UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/bench.py"
# The targets that judge correctness, not speed (ids of report.evaluate_targets):
# no lost update in any scenario, no key of a lock left without a TTL.
SAFETY = frozenset({"lost-updates", "waiters-keys"})
SCENARIOS = (
    "uncontended",
    "contended",
    "redlock",
    "many-locks",
    "many-waiters",
    "requests",
    "watchdog",
    "profile",
    "topologies",
)
# The keys of the plan (results' "config") that each scenario's numbers depend on.
CONFIG_KEYS = {
    "uncontended": ("cycles", "warmup", "rounds", "counted"),
    "contended": ("seconds", "contended_rounds", "workers"),
    "redlock": ("redlock_workers", "redlock_seconds", "contended_rounds"),
    "many-locks": ("many_locks",),
    "many-waiters": ("waiters",),
    "requests": ("requests",),
    "watchdog": ("watchdog",),
    "profile": ("profile_quick",),
    "topologies": ("topologies",),
}
# Libraries of the many-locks comparison and kinds of waiters of the many-waiters scenario.
MANY_LOCKS_LIBRARIES = ("drm", "python-redis-lock", "redis-py")
WAITER_KINDS = ("drm-threads", "drm-asyncio", "python-redis-lock")


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="repeat everything (default 3)")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, from: {','.join(SCENARIOS)} (default all)",
    )
    parser.add_argument("--only", default="", help="comma-separated library keys (default all)")
    parser.add_argument("--workers", default="2,8,32", help="contended process counts")
    parser.add_argument("--seconds", type=float, default=2.0, help="per contended library and N")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved contended rounds")
    parser.add_argument("--cycles", type=int, default=2000, help="timed uncontended cycles")
    parser.add_argument("--quick", action="store_true", help="smoke run into a temp directory")
    parser.add_argument(
        "--render", action="store_true", help="redraw plots and README from results/latest.json"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the chosen scenarios in results/latest.json, keep the others",
    )
    args = parser.parse_args(argv)
    if args.merge and (args.quick or args.render):
        parser.error("--merge records into results/latest.json: not with --quick or --render")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if args.quick:
        args.workers, args.seconds, args.cycles, args.rounds = "2,8", 0.5, 200, 1
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    return args


def plan_of(args: argparse.Namespace) -> dict[str, Any]:
    """Return every scenario's parameters (recorded in the results file)."""
    quick = args.quick
    return {
        "runs": args.runs,
        "scenarios": args.scenarios.split(","),
        "cycles": args.cycles,
        "warmup": max(50, args.cycles // 10),
        "rounds": 10,
        "counted": max(50, args.cycles // 10),
        "seconds": args.seconds,
        "contended_rounds": args.rounds,
        "workers": _ints(args.workers),
        "redlock_workers": [8],
        "redlock_seconds": args.seconds,
        "many_locks": {
            "processes": 4 if quick else 16,
            "threads": 2 if quick else 4,
            "names": 1000,
            "curve": [10, 1000] if quick else [10, 100, 1000, 10000],
            "seconds": 0.5 if quick else 1.5,
            "memory_names": 20000,
        },
        "waiters": [1, 10, 100] if quick else [1, 10, 100, 1000],
        "requests": {
            "rounds": 3 if quick else 10,
            "requests": 10 if quick else 40,
            "servers": ["gunicorn", "uvicorn"],
        },
        "watchdog": {
            "locks": 200 if quick else 1000,
            "forced": 3 if quick else 5,
            "watch_s": 1.5 if quick else 3.0,
        },
        "profile_quick": quick,
        "topologies": {
            "topologies": list(TOPOLOGIES),
            "processes": 4,
            "threads": 2,
            "names": [1000, 1],
            "seconds": 0.5 if quick else 2.0,
        },
    }


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def delete_run_keys(urls: list[str], run_id: str) -> None:
    """Delete every key this run created (the run id is in each of them)."""
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            batch: list[bytes] = []
            for key in client.scan_iter(match=f"*{run_id}*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    client.unlink(*batch)
                    batch = []
            if batch:
                client.unlink(*batch)
        finally:
            client.close()


def log_uncontended(results: dict[str, Any]) -> None:
    for entry in results.values():
        cmds = entry["commands"]
        log(
            f"  {entry['label']:<40} median {entry['cycle_us']['p50']:6.0f} µs"
            f"  p99 {entry['cycle_us']['p99']:6.0f} µs"
            f"  round trips {cmds['round_trips_per_cycle']:.2f}"
            f"  commands {cmds['total_per_cycle']:5.2f}"
            f"  server {cmds['server_us_per_cycle']:5.1f} µs"
        )


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt, so every cleanup below runs.

    SIGINT too, explicitly: a process started in the background by a shell
    inherits SIGINT ignored, and its Ctrl-C (or kill -INT) would do nothing.
    """

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Context:
    """What every scenario of one invocation shares: servers, names, plan, libraries."""

    def __init__(self, url: str, quorum_urls: list[str], args: argparse.Namespace) -> None:
        self.url = url
        self.quorum_urls = quorum_urls
        self.run_id = uuid.uuid4().hex[:10]
        self.key_prefix = f"bench{self.run_id}"
        self.plan = plan_of(args)
        self.chosen = [c for c in CONTENDERS if not args.only or c.key in args.only.split(",")]
        self.keys = {c.key for c in self.chosen}


def _scenarios(ctx: Context, index: int) -> dict[str, Callable[[], Any]]:
    plan, url, run = ctx.plan, ctx.url, f"{ctx.run_id}r{index}"

    def uncontended() -> Any:
        log(f"Uncontended: {len(ctx.chosen)} libraries x {plan['cycles']} cycles")
        out = run_uncontended(
            ctx.chosen,
            url,
            lambda key: f"bench-{run}:uncontended:{key}",
            cycles=plan["cycles"],
            warmup=plan["warmup"],
            rounds=plan["rounds"],
            counted=plan["counted"],
        )
        log_uncontended(out)
        return out

    def contended() -> Any:
        log(f"Contended: N={plan['workers']}, {plan['seconds']} s per library")
        return run_contended(
            url,
            ctx.key_prefix,
            run,
            [c for c in ctx.chosen if c.contended],
            plan["workers"],
            seconds=plan["seconds"],
            rounds=plan["contended_rounds"],
            log=log,
            quorum_urls=ctx.quorum_urls,
        )

    def redlock() -> Any:
        chosen = [c for c in ctx.chosen if c.key in ("drm-quorum", "pottery-quorum")]
        log(f"Redlock on 3 masters, contended: N={plan['redlock_workers']}")
        return run_contended(
            url,
            ctx.key_prefix,
            run,
            chosen,
            plan["redlock_workers"],
            seconds=plan["redlock_seconds"],
            rounds=plan["contended_rounds"],
            log=log,
            quorum_urls=ctx.quorum_urls,
            tag="redlock",
        )

    def many_locks() -> Any:
        from manylocks import run_many_locks

        cfg = plan["many_locks"]
        log(
            f"Many locks: {cfg['processes']} processes x {cfg['threads']} threads,"
            f" {cfg['names']} names; curve {cfg['curve']};"
            f" memory of {cfg['memory_names']:,} fresh names"
        )
        return run_many_locks(
            url,
            ctx.key_prefix,
            run,
            [k for k in MANY_LOCKS_LIBRARIES if k in ctx.keys],
            processes=cfg["processes"],
            threads=cfg["threads"],
            names=cfg["names"],
            curve=cfg["curve"] if "drm" in ctx.keys else [],
            seconds=cfg["seconds"],
            memory_names=cfg["memory_names"] if "drm" in ctx.keys else 0,
            log=log,
        )

    def many_waiters() -> Any:
        from waiters import run_many_waiters

        kinds = [k for k in WAITER_KINDS if ("drm" if k.startswith("drm") else k) in ctx.keys]
        log(f"Many waiters: {plan['waiters']} waiters, {kinds}")
        return run_many_waiters(url, run, plan["waiters"], kinds, log=log)

    def requests() -> Any:
        from web import run_requests

        cfg = plan["requests"]
        log(f"Requests: test client and {cfg['servers']}")
        return run_requests(
            url,
            ctx.key_prefix,
            rounds=cfg["rounds"],
            requests=cfg["requests"],
            servers=cfg["servers"],
            log=log,
        )

    def watchdog() -> Any:
        from renewals import run_watchdog

        cfg = plan["watchdog"]
        log(f"Watchdog: {cfg['locks']} held locks")
        return run_watchdog(
            url, run, locks=cfg["locks"], forced=cfg["forced"], watch_s=cfg["watch_s"], log=log
        )

    def profile() -> Any:
        import profile_hotpath

        log("Profile of the uncontended cycle")
        found = profile_hotpath.profile(url, quick=plan["profile_quick"])
        parts = found["layers"]["breakdown_us"]
        log("  " + "; ".join(f"{us:.0f} µs {part.split(' (')[0]}" for part, us in parts.items()))
        return found

    def topologies() -> Any:
        from topologies import run_topologies

        cfg = plan["topologies"]
        log(
            f"Topologies: {cfg['processes']} processes x {cfg['threads']} threads,"
            f" names {cfg['names']}, {cfg['seconds']} s each"
        )
        return run_topologies(
            url,
            ctx.key_prefix,
            run,
            topologies=cfg["topologies"],
            processes=cfg["processes"],
            threads=cfg["threads"],
            names=cfg["names"],
            seconds=cfg["seconds"],
            log=log,
        )

    return {
        "uncontended": uncontended,
        "contended": contended,
        "redlock": redlock,
        "many-locks": many_locks,
        "many-waiters": many_waiters,
        "requests": requests,
        "watchdog": watchdog,
        "profile": profile,
        "topologies": topologies,
    }


def run_once(ctx: Context, index: int) -> dict[str, Any]:
    """Run every chosen scenario once; return their results and derived ratios."""
    began = time.monotonic()
    out: dict[str, Any] = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for name, scenario in _scenarios(ctx, index).items():
        if name not in ctx.plan["scenarios"]:
            continue
        started = time.monotonic()
        try:
            out[name.replace("-", "_")] = scenario()
        except Exception as exc:
            # One broken scenario (the engine changed under it) must not cost the
            # others of a long run: it is recorded as failed, and the run exits 1.
            log(f"  {name} FAILED: {exc!r}")
            traceback.print_exc()
            out.setdefault("failed", {})[name] = repr(exc)
        out.setdefault("scenario_s", {})[name] = time.monotonic() - started
    delete_run_keys([ctx.url, *ctx.quorum_urls], f"{ctx.run_id}r{index}")
    derive(out)
    out["elapsed_s"] = time.monotonic() - began
    return out


def render(results: dict[str, Any], out: Path, readme: Path | None) -> None:
    plots = plot(results, out)
    if readme is not None:
        update_readme(readme, markdown(results, plots))


def merge_results(old: dict[str, Any], new: dict[str, Any], scenarios: list[str]) -> dict[str, Any]:
    """Return ``old`` with the ``scenarios`` of ``new`` in place of its own (see --merge)."""
    out = dict(old)
    keys = [name.replace("-", "_") for name in scenarios]
    provenance = dict(out.get("provenance") or {})
    if not provenance:  # a file from before provenance: its scenarios date from its one run
        env = out["environment"]
        for name in (out.get("config") or {}).get("scenarios", []):
            provenance[name] = {
                "started_at": out["started_at"],
                "command": out["command"],
                "runs": len(out.get("runs") or []),
                "revision": env.get("revision", "unknown"),
                "loadavg_at_start": env["loadavg_at_start"],
                "loadavg_at_end": env["loadavg_at_end"],
            }
    for name in scenarios:
        provenance[name] = new["provenance"][name]
    out["provenance"] = provenance
    for key in keys:
        if key in new:
            out[key] = new[key]
        else:
            out.pop(key, None)
    old_runs = [dict(run) for run in out.get("runs") or []]
    new_runs = new["runs"]
    for index in range(max(len(old_runs), len(new_runs))):
        fresh = new_runs[index] if index < len(new_runs) else {}
        if index >= len(old_runs):
            old_runs.append({"started_at": fresh["started_at"], "elapsed_s": fresh["elapsed_s"]})
        run = old_runs[index]
        for key in keys:
            if key in fresh:
                run[key] = fresh[key]
            else:
                run.pop(key, None)
        for book in ("failed", "scenario_s"):
            entries = {k: v for k, v in (run.get(book) or {}).items() if k not in scenarios}
            entries.update(fresh.get(book) or {})
            if entries:
                run[book] = entries
            else:
                run.pop(book, None)
    out["runs"] = old_runs
    for book in ("failed", "scenario_s"):
        values = [run[book] for run in old_runs if book in run]
        if values:
            out[book] = median_tree(values)
        else:
            out.pop(book, None)
    config = dict(out.get("config") or {})
    for name in scenarios:
        for key in CONFIG_KEYS[name]:
            config[key] = new["config"][key]
    config["scenarios"] = [
        *config.get("scenarios", []),
        *(n for n in scenarios if n not in config.get("scenarios", [])),
    ]
    out["config"] = config
    out["labels"] = {**out.get("labels", {}), **new["labels"]}
    out["merges"] = [
        *(out.get("merges") or []),
        {"started_at": new["started_at"], "command": new["command"], "scenarios": scenarios},
    ]
    out["targets"] = judge_targets(out)
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.render:
        results = json.loads((HERE / "results" / "latest.json").read_text())
        render(results, HERE / "results", HERE / "README.md")
        log("Redrew the plots and the README section from results/latest.json")
        return 0
    began = time.monotonic()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with stop_on_signals(), ExitStack() as stack:
        url, where = stack.enter_context(benchmark_redis())
        # Three independent masters for the Redlock scenarios: the first server and two more.
        q2 = stack.enter_context(RedisServer())
        q3 = stack.enter_context(RedisServer())
        ctx = Context(url, [q2.url, q3.url], args)
        log(f"Redis: {url} ({where}); run id {ctx.run_id}; quorum peers {q2.url} {q3.url}")
        configure_django(url, ctx.key_prefix, quorum_urls=ctx.quorum_urls)
        environment = describe(url, where)
        try:
            for index in range(args.runs):
                log(f"=== Run {index + 1} of {args.runs} ===")
                runs.append(run_once(ctx, index))
                log(f"Run {index + 1} took {runs[-1]['elapsed_s']:.0f} s")
        finally:
            delete_run_keys([url, q2.url, q3.url], ctx.run_id)
    environment["loadavg_at_end"] = list(os.getloadavg())
    results: dict[str, Any] = {
        "started_at": started_at,
        "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
        "environment": environment,
        "config": ctx.plan,
        "labels": {c.key: c.label for c in CONTENDERS},
    }
    medians = median_tree([{k: v for k, v in r.items() if k != "started_at"} for r in runs])
    results.update(medians)
    results["runs"] = runs
    results["provenance"] = {
        name: {
            "started_at": started_at,
            "command": results["command"],
            "runs": args.runs,
            "revision": environment.get("revision", "unknown"),
            "loadavg_at_start": environment["loadavg_at_start"],
            "loadavg_at_end": environment["loadavg_at_end"],
        }
        for name in ctx.plan["scenarios"]
    }
    results["targets"] = judge_targets(results)
    results["elapsed_s"] = time.monotonic() - began
    latest = out / "latest.json"
    if args.merge and latest.exists():
        scenarios = ctx.plan["scenarios"]
        results = merge_results(json.loads(latest.read_text()), results, scenarios)
        log(f"Merged {', '.join(scenarios)} into {latest.name}; the other scenarios kept")
    write_json(results, out / "quick.json" if args.quick else latest)
    render(results, out, None if args.quick else HERE / "README.md")
    for target in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "info"}[target["met"]]
        log(f"[{verdict:>6}] {target['target']}: {target['value']} ({target['note']})")
    log(f"Done in {time.monotonic() - began:.0f} s; results in {out}")
    failed = {name for run in runs for name in run.get("failed", {})}
    if failed:
        log(f"Failed scenarios (recorded as such): {', '.join(sorted(failed))}")
    unsafe = [t["target"] for t in results["targets"] if t["id"] in SAFETY and t["met"] is False]
    if unsafe:
        log(f"Safety targets missed: {'; '.join(unsafe)}")
    return 1 if failed or unsafe else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        print("Interrupted: servers and workers stopped, nothing recorded.", file=sys.stderr)
        sys.exit(130)
