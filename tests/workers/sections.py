"""Increment a shared counter non-atomically (GET, then SET value+1) under one lock.

Usage: sections.py NAME COUNTER_KEY BARRIER_KEY ITERATIONS

Only mutual exclusion keeps the count exact: two overlapping sections lose an
increment. Each section is reported as [fence, enter, exit, pid], with
``enter`` taken just after the lock was granted and ``exit`` just before it is
released (both ``time.time()``, one clock for every process on the machine),
so the test can check that no two sections overlap.
"""

import os
import sys
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import mutex  # noqa: E402


def main(name: str, counter_key: str, barrier_key: str, iterations: int) -> None:
    client = data_client()
    lock = mutex(name, timeout=60)
    pid = os.getpid()
    start_barrier(client, barrier_key)
    sections = []
    for _ in range(iterations):
        with lock as held:
            enter = time.time()
            value = int(client.get(counter_key) or 0)
            client.set(counter_key, value + 1)
            sections.append([held.fence, enter, time.time(), pid])
    emit("done", sections=sections)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
