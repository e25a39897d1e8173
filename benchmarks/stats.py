"""Summaries of raw timings: percentiles, handoffs, fairness.

Every contended cycle is recorded as one :class:`Cycle`. Wall-clock stamps
(``time.time()``) are comparable across processes on one machine and are used
only to order holds and pair a release with the next acquisition; durations
come from ``time.perf_counter()`` within one process.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise
from typing import Any, NamedTuple


class Cycle(NamedTuple):
    """One acquire -> critical section -> release by one worker."""

    worker: int
    wait: float  # seconds spent in acquire() (perf_counter)
    acquired_at: float  # time.time() right after acquire() returned
    releasing_at: float  # time.time() right before release() was called
    released_at: float  # time.time() right after release() returned


def percentile(values: list[float], q: float) -> float:
    """Return the q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_us(seconds: list[float]) -> dict[str, float]:
    """Return mean, p50, p99 and max of durations given in seconds, in microseconds."""
    micro = [s * 1e6 for s in seconds]
    return {
        "mean": sum(micro) / len(micro) if micro else math.nan,
        "p50": percentile(micro, 50),
        "p99": percentile(micro, 99),
        "max": max(micro) if micro else math.nan,
    }


def handoffs(runs: list[list[Cycle]]) -> dict[str, Any]:
    """Pair each hold with the one before it in the same run (holds never overlap).

    A *handoff* is a change of holder: the time from the previous holder
    starting its release to the next holder returning from acquire. When the
    same worker holds twice in a row it *re-acquired* (it barged back in, or
    nobody else was waiting). An *overlap* is a hold that began before the
    previous one's release started: mutual exclusion was broken.

    The handoff splits in two: the releaser's own release call (start to
    reply), and the *wake-up*, from the releaser getting its reply to the next
    holder returning from acquire (negative when the woken waiter returned
    first: the server answers both at once).
    """
    gaps: list[float] = []
    wakeups: list[float] = []
    release_calls: list[float] = []
    same = overlaps = pairs = 0
    for cycles in runs:
        ordered = sorted(cycles, key=lambda c: c.acquired_at)
        pairs += max(len(ordered) - 1, 0)
        for previous, current in pairwise(ordered):
            if current.acquired_at < previous.releasing_at:
                overlaps += 1
            if current.worker == previous.worker:
                same += 1
            else:
                gaps.append(current.acquired_at - previous.releasing_at)
                wakeups.append(current.acquired_at - previous.released_at)
        release_calls += [c.released_at - c.releasing_at for c in cycles]
    return {
        "handoffs": len(gaps),
        "handoff_us": summary_us(gaps),
        "wakeup_us": summary_us(wakeups),
        "release_call_us": summary_us(release_calls),
        "reacquire_rate": same / pairs if pairs else math.nan,
        "overlaps": overlaps,
    }


def fairness(cycles: list[Cycle], workers: int) -> dict[str, Any]:
    """Describe how evenly the lock was shared.

    ``fairness`` is the longest single wait divided by the median wait over
    all cycles of all workers: 1 means nobody ever waited longer than usual;
    a polling lock that lets the releaser barge back in scores in the hundreds.
    ``p99_over_p50`` is the same ratio without the one worst wait. ``share``
    is each worker's fraction of all cycles (1/workers each when even).
    """
    waits = [c.wait for c in cycles]
    median = percentile(waits, 50)
    per_worker = Counter(c.worker for c in cycles)
    total = len(cycles)
    share = [per_worker.get(w, 0) / total if total else 0.0 for w in range(workers)]
    return {
        "fairness": max(waits) / median if waits and median > 0 else math.nan,
        "p99_over_p50": percentile(waits, 99) / median if waits and median > 0 else math.nan,
        "share": share,
        "share_min": min(share),
        "share_max": max(share),
        "starved_workers": sum(1 for s in share if s == 0),
    }
