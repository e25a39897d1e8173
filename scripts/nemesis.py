#!/usr/bin/env python3
"""Run the randomized fault schedule ("nemesis") against real workers and check the history.

Usage (from the repository root)::

    uv run python scripts/nemesis.py                          # 60 s per topology, random seed
    uv run python scripts/nemesis.py --seconds 600 --seed 1234 --topology quorum
    uv run python scripts/nemesis.py --seed 1234 --keep       # keep journals and logs

Each topology gets its own redis-server(s) on free ports (``single``: one;
``quorum``: three masters plus one for unrelated single-alias locks), a
PostgreSQL server (from the machine's ``postgresql`` package, see
tests/databases.py) whose counter rows the workers' transactions update, worker
processes with threads and asyncio tasks taking locks exclusive and shared and
permits of a semaphore on every topology (some cancelled mid-acquisition,
mid-body or mid-release), and the faults the seed plans: worker SIGSTOP/SIGKILL,
event-loop stalls, Redis SIGSTOP, DEBUG SLEEP and restarts, proxy latency,
stalls and cuts, operator resets. Afterwards nothing may stay held by an
owner that is gone (see tests/nemesis.py for what is checked and why).
``--seconds`` is per topology. The seed is printed first; the same seed plans
the same faults, so a violation can be chased with it. The exit status is 1
when any violation was found, 0 otherwise; nothing outside the run's own
temporary directory and servers is touched.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.nemesis import TOPOLOGIES, Tuning, run_nemesis  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="run time per topology")
    parser.add_argument("--seed", type=int, help="plan seed (default: random, printed)")
    parser.add_argument("--topology", choices=(*TOPOLOGIES, "both"), default="both")
    parser.add_argument("--workers", type=int, default=Tuning.slots, help="worker processes")
    parser.add_argument("--threads", type=int, default=Tuning.threads, help="threads per worker")
    parser.add_argument("--tasks", type=int, default=Tuning.tasks, help="asyncio tasks per worker")
    parser.add_argument("--ttl", type=float, default=Tuning.ttl, help="lock lease in seconds")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run directory (journals, logs) and print it"
    )
    parser.add_argument("--max-violations", type=int, default=20, help="how many to describe")
    parser.add_argument(
        "--show-excused", type=int, default=0, metavar="N", help="describe N excused overlaps"
    )
    return parser.parse_args(argv)


def _terminate(signum: int, frame: FrameType | None) -> None:
    # SIGTERM ends the run like Ctrl-C: through the finally blocks that stop every process.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"nemesis seed: {seed}", flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    tuning = Tuning(slots=args.workers, threads=args.threads, tasks=args.tasks, ttl=args.ttl)
    topologies = TOPOLOGIES if args.topology == "both" else (args.topology,)
    failed = False
    try:
        for topology in topologies:
            report = run_nemesis(
                topology,
                args.seconds,
                seed,
                tuning,
                keep=args.keep,
                log=lambda line: print(line, flush=True),
            )
            print(report.summary(), flush=True)
            if args.show_excused:
                print(report.describe_excused(args.show_excused), flush=True)
            if not report.ok:
                failed = True
                print(report.describe_violations(args.max_violations), flush=True)
            if args.keep:
                print(f"  kept: {report.info.stats.get('workdir', '')}", flush=True)
    except KeyboardInterrupt:
        print(f"nemesis interrupted (seed {seed})", file=sys.stderr)
        return 130
    print(f"nemesis seed {seed}: {'VIOLATIONS FOUND' if failed else 'no violation'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
