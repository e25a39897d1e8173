"""Scenario: the watchdog renewing 1,000 locks held by one process.

The watchdog renews every hold a third into its lease, all due holds of one
Redis in one pipeline of EXTEND scripts (see django_redis_mutex/watchdog.py).
A round is one call of the module's ``_extend_all(client, entries)``; the
benchmark wraps that function (in this process only, the engine is untouched)
to count rounds and entries and time each call, and reads ``INFO
commandstats`` around the rounds for the commands Redis ran.

Two parts:

* *forced rounds*: with all locks held, every hold is marked due at once
  (``renew_now``, the flag ``extend()`` uses) and the lanes are poked, so one
  round must renew all of them: its wall time, its commands, and how many
  pipelines it took (one per Redis expected, not one call per lock);
* *steady state*: locks with a short lease (3 s: renewed every second),
  acquired one after another, watched for a few seconds: how the renewals
  group into rounds when they fall due at different moments.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from commandstats import commandstats
from stats import percentile, summary_us


class _RoundRecorder:
    """Wrap the watchdog's ``_extend_all``: one record per round (entries, seconds).

    Also counts the pipelines the watchdog's threads execute (``Pipeline.execute``
    called from a thread named ``django-redis-mutex-watchdog:<alias>``): a
    round that found its script missing on the server sends a second one.
    """

    def __init__(self) -> None:
        from django_redis_mutex import watchdog

        self.module = watchdog
        self.original = watchdog._extend_all
        self.original_execute = redis.client.Pipeline.execute
        self.rounds: list[tuple[int, float]] = []
        self.pipelines = 0

    def __enter__(self) -> _RoundRecorder:
        original, rounds = self.original, self.rounds
        original_execute = self.original_execute

        def execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name.startswith("django-redis-mutex-watchdog"):
                self.pipelines += 1
            return original_execute(pipe, *args, **kwargs)

        redis.client.Pipeline.execute = execute  # type: ignore[method-assign]

        def recorded(client: Any, entries: list[Any]) -> list[Any]:
            start = time.perf_counter()
            try:
                return original(client, entries)
            finally:
                rounds.append((len(entries), time.perf_counter() - start))

        self.module._extend_all = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._extend_all = self.original
        redis.client.Pipeline.execute = self.original_execute  # type: ignore[method-assign]


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> Any:
    calls = {
        name: after[name][0] - before.get(name, (0, 0))[0]
        for name in after
        if name not in ("info", "echo") and after[name][0] > before.get(name, (0, 0))[0]
    }
    usec = sum(after[name][1] - before.get(name, (0, 0))[1] for name in calls)
    return calls, usec


def _hold_all(count: int, prefix: str, ttl: float) -> list[Any]:
    from django_redis_mutex import Mutex

    locks = []
    for i in range(count):
        lock = Mutex(f"{prefix}:{i}", ttl=ttl, timeout=10)
        if not lock.acquire():
            raise RuntimeError(f"could not acquire {prefix}:{i}")
        locks.append(lock)
    return locks


def _release_all(locks: list[Any]) -> None:
    for lock in locks:
        lock.release()


def _forced_rounds(
    client: redis.Redis, locks: list[Any], rounds: int
) -> tuple[list[dict[str, Any]], list[str]]:
    from django_redis_mutex.watchdog import get_watchdog

    watchdog = get_watchdog()
    holds = [lock._current() for lock in locks]
    results = []
    errors = []
    for _ in range(rounds):
        with _RoundRecorder() as recorder:
            before = commandstats(client)
            started = time.perf_counter()
            for hold in holds:
                for lease in hold.leases.values():
                    lease.renew_now = True
            watchdog.poke(holds[0])  # one lane per Redis: all these holds share it
            deadline = time.monotonic() + 30
            while sum(n for n, _ in recorder.rounds) < len(holds):
                if time.monotonic() > deadline:
                    errors.append("forced round did not renew every lock within 30 s")
                    break
                time.sleep(0.002)
            elapsed = time.perf_counter() - started
            calls, usec = _delta(before, commandstats(client))
            results.append(
                {
                    "calls_of_extend_all": len(recorder.rounds),
                    "pipelines": recorder.pipelines,
                    "locks": sum(n for n, _ in recorder.rounds),
                    "renew_s": sum(s for _, s in recorder.rounds),
                    "poke_to_done_s": elapsed,
                    "commands": sum(calls.values()),
                    "evalsha": calls.get("evalsha", 0),
                    "server_us": usec,
                }
            )
        time.sleep(0.05)
    return results, errors


def run_watchdog(
    url: str, run_id: str, *, locks: int, forced: int, watch_s: float, log: Callable[..., None]
) -> dict[str, Any]:
    """Hold ``locks`` locks in this process and observe the watchdog's renewal rounds."""
    client = redis.Redis.from_url(url)
    out: dict[str, Any] = {"locks": locks}
    try:
        held = _hold_all(locks, f"bench-{run_id}:watchdog:forced", ttl=60)
        try:
            forced_rounds, errors = _forced_rounds(client, held, forced)
        finally:
            _release_all(held)
        renew_s = [r["renew_s"] for r in forced_rounds]
        out["forced"] = {
            "rounds": forced_rounds,
            "round_ms": summary_us(renew_s)["p50"] / 1000,
            "round_ms_max": max(renew_s) * 1000,
            # Medians over the rounds: the first round on a fresh server also
            # loads the EXTEND script (NOSCRIPT, SCRIPT LOAD, a second pipeline).
            "pipelines_per_round": percentile([r["pipelines"] for r in forced_rounds], 50),
            "first_round_pipelines": forced_rounds[0]["pipelines"],
            "commands_per_round": percentile([r["commands"] for r in forced_rounds], 50),
            "evalsha_per_round": percentile([r["evalsha"] for r in forced_rounds], 50),
            "server_us_per_round": percentile([r["server_us"] for r in forced_rounds], 50),
            "us_per_lock": summary_us(renew_s)["p50"] / locks,
            "errors": errors,
        }
        # Steady state: a 3 s lease is renewed every second.
        with _RoundRecorder() as recorder:
            held = _hold_all(locks, f"bench-{run_id}:watchdog:steady", ttl=3)
            try:
                time.sleep(1.0)  # the first renewals fall due about a second after each acquire
                before = commandstats(client)
                recorder.rounds.clear()
                recorder.pipelines = 0
                time.sleep(watch_s)
                calls, usec = _delta(before, commandstats(client))
                observed = list(recorder.rounds)
                pipelines = recorder.pipelines
            finally:
                _release_all(held)
        renewed = sum(n for n, _ in observed)
        out["steady"] = {
            "lease_s": 3,
            "watched_s": watch_s,
            "rounds": len(observed),
            "renewals": renewed,
            "renewals_per_s": renewed / watch_s,
            "pipelines_per_round": pipelines / len(observed) if observed else float("nan"),
            "locks_per_round": {
                "p50": percentile([n for n, _ in observed], 50),
                "max": max((n for n, _ in observed), default=0),
            },
            "round_ms": {
                "p50": percentile([s * 1000 for _, s in observed], 50),
                "max": max((s * 1000 for _, s in observed), default=0.0),
            },
            "commands_per_renewal": sum(calls.values()) / renewed if renewed else float("nan"),
            "server_us_per_renewal": usec / renewed if renewed else float("nan"),
        }
    finally:
        client.close()
    f, s = out["forced"], out["steady"]
    log(
        f"  watchdog {locks} locks: forced round {f['round_ms']:.1f} ms"
        f" ({f['pipelines_per_round']:.1f} pipelines, {f['commands_per_round']:.0f} commands,"
        f" {f['us_per_lock']:.1f} µs per lock); steady: {s['rounds']} rounds in {watch_s:.0f} s,"
        f" {s['locks_per_round']['p50']:.0f} locks per round (p50)"
    )
    return out
