"""Compare the uncontended lock cycle of two revisions, measured in turns on this machine.

Run from the repository root, for example after a change to the engine:

    UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/revisions.py \
        --base c6b165b --head HEAD

Why: the recorded results (results/latest.json) come from one run at one
revision; a later run on a busier or slower machine moves every figure, so
"the cycle did not get slower" can only be told by measuring both revisions
in the same session. Each revision is checked out in a temporary git
worktree with its own environment, and ``bench.py --scenarios uncontended
--only drm,raw`` runs for each in turn, ``--rounds`` times (base, head, base,
head, ...), so drift in the machine's load hits both alike. The medians of
this app's cycle as a ratio to the raw SET NX PX + EVALSHA pair, with the
commands and round trips per cycle, go to results/revisions.json and are
printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def measure(tree: Path) -> dict[str, float]:
    """Run the uncontended scenario once in ``tree``; return this app's figures from it."""
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never")
    command = ["uv", "run", "--group", "bench", "python", "benchmarks/bench.py"]
    command += ["--scenarios", "uncontended", "--only", "drm,raw", "--runs", "1"]
    subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
    results = json.loads((tree / "benchmarks" / "results" / "latest.json").read_text())
    ours = results["uncontended"]["drm"]
    return {
        "ratio_to_raw": float(ours["ratio_to_raw"]),
        "cycle_p50_us": float(ours["cycle_us"]["p50"]),
        "commands_per_cycle": float(ours["commands"]["total_per_cycle"]),
        "round_trips_per_cycle": float(ours["commands"]["round_trips_per_cycle"]),
    }


def summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {
        key: {
            "median": statistics.median(s[key] for s in samples),
            "runs": [s[key] for s in samples],
        }
        for key in samples[0]
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--head", default="HEAD", help="the revision under test (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, in turns (default 3)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    revisions = {"base": git("rev-parse", args.base), "head": git("rev-parse", args.head)}
    samples: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="drm-revisions-") as scratch:
        trees = {side: Path(scratch) / side for side in revisions}
        try:
            for side, tree in trees.items():
                git("worktree", "add", "--detach", str(tree), revisions[side])
            for round_number in range(1, args.rounds + 1):
                for side, tree in trees.items():
                    samples[side].append(measure(tree))
                    ratio = samples[side][-1]["ratio_to_raw"]
                    print(f"round {round_number} {side}: {ratio:.3f}x raw", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(tree)],
                    cwd=ROOT,
                    capture_output=True,
                )
    record = {
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        # BENCH_MUTEX_STATS=1: the benchmark alias counts contention (STATS),
        # in every revision that knows the setting.
        "contention_stats": os.environ.get("BENCH_MUTEX_STATS") == "1",
        "revisions": {side: revisions[side][:12] for side in revisions},
        "uncontended": {side: summary(samples[side]) for side in samples},
    }
    (HERE / "results" / "revisions.json").write_text(json.dumps(record, indent=2) + "\n")
    print()
    print("| revision | cycle / raw pair (median) | cycle p50 µs | commands | round trips |")
    print("|---|---|---|---|---|")
    for side in ("base", "head"):
        figures = record["uncontended"][side]
        print(
            f"| {side} {record['revisions'][side]} | {figures['ratio_to_raw']['median']:.3f}x "
            f"| {figures['cycle_p50_us']['median']:.0f} "
            f"| {figures['commands_per_cycle']['median']:.0f} "
            f"| {figures['round_trips_per_cycle']['median']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
