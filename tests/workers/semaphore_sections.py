"""Run critical sections under one semaphore, counting who is inside in Redis.

Usage: semaphore_sections.py NAME LIMIT INSIDE_KEY BARRIER_KEY ITERATIONS

Each section increments INSIDE_KEY just after the permit was granted and
decrements it just before the release, and reports [enter, exit, inside],
``inside`` being the count its own increment returned (how many sections were
inside at that moment, itself included); ``enter``/``exit`` are
``time.time()``, one clock for every process on the machine.
"""

import sys
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import semaphore  # noqa: E402


def main(name: str, limit: int, inside_key: str, barrier_key: str, iterations: int) -> None:
    client = data_client()
    permits = semaphore(name, limit, timeout=60)
    start_barrier(client, barrier_key)
    sections = []
    for _ in range(iterations):
        with permits:
            enter = time.time()
            inside = int(client.incr(inside_key))
            client.get(inside_key)  # a little work while inside
            client.decr(inside_key)
            sections.append([enter, time.time(), inside])
    emit("done", sections=sections)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
