"""Acquire one lock many times, by every path, and report the fence of each acquisition.

Usage: fences.py NAME SEQUENCE_KEY BARRIER_KEY ITERATIONS

Iterations alternate at random between a blocking acquire (often handed the
lock by a releasing process) and a single non-blocking try (granted only when
the lock is free and nobody waits), with short random pauses outside the lock
so that both paths happen. Inside each section the worker takes the next
number of a server-side sequence (INCR), which orders acquisitions across
processes without trusting any clock. Reports [sequence, fence, path] per
section, ``path`` being "try" or "wait".
"""

import random
import sys
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import Mutex  # noqa: E402


def main(name: str, sequence_key: str, barrier_key: str, iterations: int) -> None:
    client = data_client()
    rng = random.Random()
    start_barrier(client, barrier_key)
    sections = []
    for _ in range(iterations):
        lock = Mutex(name, timeout=60)
        path = "try" if rng.random() < 0.5 else "wait"
        if path == "try":
            if not lock.acquire(blocking=False):
                continue
        elif not lock.acquire():
            emit("error", message=f"could not acquire {name!r} within 60s")
            sys.exit(2)
        try:
            sections.append([int(client.incr(sequence_key)), lock.fence, path])
        finally:
            lock.release()
        # Work done outside the lock; it lets the lock fall free now and then.
        time.sleep(rng.random() * 0.002)
    emit("done", sections=sections)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
