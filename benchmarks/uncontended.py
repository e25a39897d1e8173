"""Scenario 1: one process, nobody else wants the lock.

What one acquire + release costs when it never waits: latency per cycle
(after a warm-up that opens connections and loads scripts) and the Redis
commands each cycle sends and runs. Each library gets its own lock name.

The timed cycles are run in interleaved rounds (every library runs a slice,
then the next round starts), so a slow patch of the machine is spread over
all libraries instead of landing on one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from adapters import Contender
from commandstats import count_commands
from contended import redis_cpu_seconds
from stats import percentile


def _cycle_of(contender: Contender, url: str, name: str) -> Callable[[], None]:
    adapter = contender.factory(url, name)
    adapter.prepare(adapter.client, name)

    def cycle() -> None:
        adapter.release(adapter.acquire())

    return cycle


def run_uncontended(
    contenders: list[Contender],
    url: str,
    name_of: Callable[[str], str],
    *,
    cycles: int,
    warmup: int,
    rounds: int,
    counted: int,
) -> dict[str, Any]:
    """Time ``cycles`` acquire+release cycles per library, then count commands of ``counted``."""
    cycle_of = {c.key: _cycle_of(c, url, name_of(c.key)) for c in contenders}
    for cycle in cycle_of.values():
        for _ in range(warmup):
            cycle()
    timings: dict[str, list[float]] = {key: [] for key in cycle_of}
    round_medians: dict[str, list[float]] = {key: [] for key in cycle_of}
    cpu_seconds = dict.fromkeys(cycle_of, 0.0)
    server_cpu_seconds = dict.fromkeys(cycle_of, 0.0)
    server = redis.Redis.from_url(url)
    clock = time.perf_counter_ns
    per_round = max(1, cycles // rounds)
    for _ in range(rounds):
        for key, cycle in cycle_of.items():
            samples: list[float] = []
            server_start = redis_cpu_seconds(server)
            cpu_start = time.process_time()
            for _ in range(per_round):
                start = clock()
                cycle()
                samples.append((clock() - start) / 1000)
            cpu_seconds[key] += time.process_time() - cpu_start
            server_cpu_seconds[key] += redis_cpu_seconds(server) - server_start
            timings[key] += samples
            round_medians[key].append(percentile(samples, 50))
    results: dict[str, Any] = {}
    for contender in contenders:
        samples = timings[contender.key]
        results[contender.key] = {
            "label": contender.label,
            "cycles": len(samples),
            "cycle_us": {
                "mean": sum(samples) / len(samples),
                "p50": percentile(samples, 50),
                "p99": percentile(samples, 99),
            },
            # Medians of each round, for ratios paired round by round (robust to drift).
            "round_p50_us": round_medians[contender.key],
            # This process's CPU per cycle (user + system): less sensitive to a busy machine.
            "client_cpu_us": cpu_seconds[contender.key] / len(samples) * 1e6,
            # The Redis server's CPU per cycle (INFO cpu, user + system), network
            # I/O included: what a cycle costs the shared server.
            "redis_cpu_us": server_cpu_seconds[contender.key] / len(samples) * 1e6,
            "commands": count_commands(url, cycle_of[contender.key], counted),
        }
    server.close()
    return results
