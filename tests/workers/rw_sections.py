"""Random shared and exclusive sections on one lock, checked with counters beside it.

Usage: rw_sections.py NAME WRITERS_KEY READERS_KEY BARRIER_KEY ITERATIONS SEED

Each section takes NAME shared or exclusively (at random, through a ``with``
block or ``acquire()``/``release()``). Inside, an exclusive section INCRs the
writers counter and then must read writers 1 and readers 0; a shared section
INCRs the readers counter and then must read writers 0; each DECRs its counter
as it leaves. A reading that breaks this is reported as a violation. Each
section is reported as [shared, fence, enter, exit, readers seen], ``enter``
taken just after the grant and ``exit`` just before the counter is DECRed
(both ``time.time()``, one clock for every process on the machine).
"""

import random
import sys
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import Mutex, mutex  # noqa: E402


def main(name: str, writers: str, readers: str, barrier: str, iterations: int, seed: int) -> None:
    client = data_client()
    rng = random.Random(seed)
    start_barrier(client, barrier)
    sections, violations = [], []

    def body(shared: bool, fence: int) -> None:
        enter = time.time()
        if shared:
            seen = client.incr(readers)
            if int(client.get(writers) or 0) != 0:
                violations.append(f"shared section (fence {fence}) saw a writer inside")
        else:
            if client.incr(writers) != 1 or int(client.get(readers) or 0) != 0:
                violations.append(f"exclusive section (fence {fence}) saw another holder")
            seen = 0
        # A little work, so sections of different processes meet.
        time.sleep(rng.random() * 0.004)
        if not shared and int(client.get(readers) or 0) != 0:
            violations.append(f"exclusive section (fence {fence}) saw a reader arrive")
        sections.append([shared, fence, enter, time.time(), seen])
        client.decr(readers if shared else writers)

    for _ in range(iterations):
        shared = rng.random() < 0.6
        if rng.random() < 0.5:
            with mutex(name, shared=shared, timeout=60) as held:
                body(shared, held.fence)
        else:
            lock = Mutex(name, shared=shared, timeout=60)
            if not lock.acquire():
                emit("error", message="timed out waiting for the lock")
                return
            try:
                body(shared, lock.fence)
            finally:
                lock.release()
    emit("done", sections=sections, violations=violations)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2], args[3], int(args[4]), int(args[5]))
