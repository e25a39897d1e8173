"""Re-acquire one lock in a tight loop until a shared total reaches a limit.

Usage: alternate.py NAME TOTAL_KEY PRESENT_KEY BARRIER_KEY WORKERS LIMIT

Nothing happens between a release and the next acquire, which is exactly when
a lock that lets the releaser barge back in starves everyone else. Counting
starts once every worker has held the lock once (each adds its pid to the set
PRESENT_KEY, which then has WORKERS members), so a worker that the OS started a
little late is not counted as starved. Each counted section takes the next
number of the shared total (INCR) and does a millisecond of work; the worker
reports the numbers it got, so the test can see how acquisitions were shared.
"""

import os
import sys
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import mutex  # noqa: E402


def main(
    name: str, total_key: str, present_key: str, barrier_key: str, workers: int, limit: int
) -> None:
    client = data_client()
    lock = mutex(name, timeout=60)
    start_barrier(client, barrier_key)
    mine, warmup = [], 0
    while True:
        with lock:
            pipe = client.pipeline()
            pipe.sadd(present_key, os.getpid()).scard(present_key)
            present = pipe.execute()[1]
            number = int(client.incr(total_key)) if present >= workers else None
            time.sleep(0.001)  # the work done under the lock
        if number is None:
            warmup += 1
            continue
        if number > limit:
            break
        mine.append(number)
    emit("done", numbers=mine, warmup=warmup)


if __name__ == "__main__":
    main(*sys.argv[1:5], int(sys.argv[5]), int(sys.argv[6]))
