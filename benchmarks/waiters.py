"""Scenario: many waiters queued on one lock, in one process.

The benchmark process takes the lock, starts W waiters (threads; for this app
also asyncio tasks on one event loop), waits until Redis shows all of them
blocked, then releases. Each waiter, once it has the lock, releases it at once,
so the lock travels down the whole line. Reported per W:

* *hand-off*: from one holder starting its release to the next holder
  returning from acquire (p50, p99), and the time to drain the whole line;
* *memory per waiter*: Redis ``used_memory`` with all W waiting minus before
  they started, divided by W. It includes each waiter's connection (one
  blocked client each); *keys per waiter* is the memory of the lock's own
  keys alone (``MEMORY USAGE`` of every key of the lock);
* *leftovers*: keys of the lock still present after the line drained, and
  how many of them have no expiry (those would stay forever).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import redis
from stats import summary_us

WAIT = 120.0  # seconds any one waiter may wait: the whole line must drain within it


def _used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _blocked(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])


def _key_memory(client: redis.Redis, pattern: str) -> tuple[int, int, int]:
    """Return (keys, keys without expiry, bytes) of the keys matching ``pattern``."""
    keys = list(client.scan_iter(match=pattern, count=1000))
    if not keys:
        return 0, 0, 0
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.ttl(key)
        pipe.memory_usage(key, samples=0)
    replies = pipe.execute()
    ttls, sizes = replies[0::2], replies[1::2]
    return len(keys), sum(1 for t in ttls if t == -1), sum(s or 0 for s in sizes)


def _wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def _must(acquired: bool, name: str) -> bool:
    if not acquired:
        raise TimeoutError(f"waited over {WAIT} s for {name!r}")
    return acquired


def _handoff_summary(stamps: list[tuple[float, float]], drain_s: float) -> dict[str, Any]:
    """Pair each holder's (acquired, releasing) with the next one's, in order of acquisition."""
    ordered = sorted(stamps)
    gaps = [b[0] - a[1] for a, b in pairwise(ordered)]
    return {
        "handoff_us": summary_us(gaps),
        "drain_s": drain_s,
        "drain_us_per_waiter": drain_s / max(1, len(ordered) - 1) * 1e6,
    }


class _Line:
    """What one run of W waiters measured."""

    def __init__(self, client: redis.Redis, pattern: str, waiters: int) -> None:
        self.client = client
        self.pattern = pattern
        self.waiters = waiters
        self.stamps: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.memory_before = 0
        self.memory_queued = 0
        self.key_bytes = 0
        self.queued_in_s = math.nan

    def measure_queued(self, baseline_blocked: int, timeout: float) -> bool:
        started = time.monotonic()
        ok = _wait_until(lambda: _blocked(self.client) >= baseline_blocked + self.waiters, timeout)
        self.queued_in_s = time.monotonic() - started
        self.memory_queued = _used_memory(self.client)
        self.key_bytes = _key_memory(self.client, self.pattern)[2]
        return ok

    def result(self, drain_s: float, queued: bool) -> dict[str, Any]:
        keys, no_ttl, left_bytes = _key_memory(self.client, self.pattern)
        out = {
            "waiters": self.waiters,
            "all_queued": queued,
            "queued_in_s": self.queued_in_s,
            "served": len(self.stamps) - 1,  # the first stamp is the initial holder's
            "memory_per_waiter_bytes": (self.memory_queued - self.memory_before) / self.waiters,
            "key_bytes_per_waiter": self.key_bytes / self.waiters,
            "keys_left": keys,
            "keys_left_without_ttl": no_ttl,
            "keys_left_bytes": left_bytes,
            "errors": self.errors[:3],
        }
        out.update(_handoff_summary(self.stamps, drain_s))
        return out


def _thread_line(
    client: redis.Redis,
    pattern: str,
    waiters: int,
    make: Callable[[], Any],
    acquire: Callable[[Any], Any],
    release: Callable[[Any, Any], None],
) -> dict[str, Any]:
    line = _Line(client, pattern, waiters)
    perf = time.perf_counter
    baseline_blocked = _blocked(client)
    holder = make()
    held = acquire(holder)
    holder_acquired = perf()
    line.memory_before = _used_memory(client)

    def waiter() -> None:
        try:
            lock = make()
            handle = acquire(lock)
            acquired = perf()
            releasing = perf()
            release(lock, handle)
            line.stamps.append((acquired, releasing))
        except Exception as exc:
            line.errors.append(repr(exc))

    old_stack = threading.stack_size(256 * 1024)
    try:
        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(waiters)]
        for thread in threads:
            thread.start()
    finally:
        threading.stack_size(old_stack)
    queued = line.measure_queued(baseline_blocked, timeout=60)
    releasing = perf()
    line.stamps.append((holder_acquired, releasing))
    release(holder, held)
    for thread in threads:
        thread.join(WAIT)
    drain = perf() - releasing
    return line.result(drain, queued)


def _async_line(client: redis.Redis, pattern: str, name: str, waiters: int) -> dict[str, Any]:
    from django_redis_mutex import Mutex

    line = _Line(client, pattern, waiters)
    perf = time.perf_counter

    async def main() -> float:
        baseline_blocked = _blocked(client)
        holder = Mutex(name, timeout=WAIT)
        await holder.aacquire()
        holder_acquired = perf()
        line.memory_before = _used_memory(client)

        async def waiter() -> None:
            try:
                lock = Mutex(name, timeout=WAIT)
                await lock.aacquire()
                acquired = perf()
                releasing = perf()
                await lock.arelease()
                line.stamps.append((acquired, releasing))
            except Exception as exc:
                line.errors.append(repr(exc))

        tasks = [asyncio.create_task(waiter()) for _ in range(waiters)]
        # The blocking INFO polls run in a thread so the waiters can queue meanwhile.
        queued = await asyncio.to_thread(line.measure_queued, baseline_blocked, 60)
        line.queued_ok = queued  # type: ignore[attr-defined]
        releasing = perf()
        line.stamps.append((holder_acquired, releasing))
        await holder.arelease()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        return perf() - releasing

    drain = asyncio.run(main())
    return line.result(drain, line.queued_ok)  # type: ignore[attr-defined]


def run_many_waiters(
    url: str,
    run_id: str,
    counts: list[int],
    kinds: list[str],
    *,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run each kind of waiter for each count; return {kind: {count: result}}."""
    from django_redis_mutex import Mutex
    from django_redis_mutex.keys import glob_escape

    client = redis.Redis.from_url(url)
    out: dict[str, Any] = {}
    try:
        for kind in kinds:
            out[kind] = {}
            for count in counts:
                name = f"bench-{run_id}:waiters:{kind}:{count}"
                # Every key of one lock starts with its lock key (see django_redis_mutex.keys).
                pattern = glob_escape(Mutex(name).keys.lock) + "*"
                if kind == "drm-threads":
                    entry = _thread_line(
                        client,
                        pattern,
                        count,
                        lambda name=name: Mutex(name, timeout=WAIT),
                        lambda lock, name=name: _must(lock.acquire(), name),
                        lambda lock, _handle: lock.release(),
                    )
                elif kind == "drm-asyncio":
                    entry = _async_line(client, pattern, name, count)
                elif kind == "python-redis-lock":
                    import redis_lock

                    # python-redis-lock keeps lock:<name> and lock-signal:<name>. Each
                    # blocked waiter holds a connection: redis-py's pool caps at 100.
                    waiters_client = redis.Redis.from_url(url, max_connections=4096)
                    entry = _thread_line(
                        client,
                        "lock*:" + glob_escape(name),
                        count,
                        lambda name=name, c=waiters_client: redis_lock.Lock(
                            c, name, expire=int(WAIT) + 30
                        ),
                        lambda lock, name=name: _must(lock.acquire(timeout=WAIT), name),
                        lambda lock, _handle: lock.release(),
                    )
                    waiters_client.close()
                else:
                    raise ValueError(f"unknown kind of waiter {kind!r}")
                out[kind][str(count)] = entry
                handoff = entry["handoff_us"]
                log(
                    f"  waiters {kind:<18} {count:>5}: hand-off p50 {handoff['p50']:7.0f} µs"
                    f" p99 {handoff['p99']:7.0f} µs  drain {entry['drain_s']:.2f} s"
                    f"  {entry['memory_per_waiter_bytes']:,.0f} B/waiter"
                    f" (keys {entry['key_bytes_per_waiter']:,.0f} B)  left {entry['keys_left']}"
                    f" keys, {entry['keys_left_without_ttl']} without TTL"
                    + (f"  errors {entry['errors'][:1]}" if entry["errors"] else "")
                )
    finally:
        client.close()
    return out
