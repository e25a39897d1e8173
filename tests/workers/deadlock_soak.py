"""Take nested locks in one global order for a while and count LockDeadlock (there must be none).

Usage: deadlock_soak.py SECONDS SEED [ORDER]

Two threads take a random, ordered subset of a few names, each exclusive,
shared or (the last name) a semaphore permit, hold the innermost briefly and
let go, until SECONDS have passed. Taken in one order, nested locks can never
wait for each other in a cycle, so every LockDeadlock is a false one. A short
DEADLOCK_TIMEOUT makes nearly every contended wait look for cycles. Reports
``done`` with ``deadlocks``, ``timeouts`` (waits that ran out, 30 s),
``waits`` (waits longer than DEADLOCK_TIMEOUT) and ``cycles`` (nested
sections run).

ORDER ``any`` takes the names in a random order instead: deadlocks happen,
and every one must be broken (no wait runs out).
"""

import contextlib
import random
import sys
import threading
import time

import django
from django.conf import settings

django.setup()

from support import emit  # noqa: E402

from django_redis_mutex import LockContended, LockDeadlock, mutex, semaphore  # noqa: E402

NAMES = ["soak-0", "soak-1", "soak-2", "soak-3"]
DEADLOCK_TIMEOUT = 0.05


def section(rng: random.Random, counts: dict[str, int], ordered: bool) -> None:
    names = rng.sample(NAMES, rng.randint(2, len(NAMES)))
    if ordered:
        names.sort()
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == NAMES[-1]:
                handle = semaphore(name, 2, timeout=30)
            else:
                handle = mutex(name, timeout=30, shared=rng.random() < 0.3)
            started = time.monotonic()
            stack.enter_context(handle)  # type: ignore[arg-type]
            if time.monotonic() - started > DEADLOCK_TIMEOUT:
                counts["waits"] += 1
        time.sleep(rng.uniform(0, 0.03))  # the work under the locks
    counts["cycles"] += 1


def run(seconds: float, seed: int, counts: dict[str, int], ordered: bool) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            section(rng, counts, ordered)
        except LockDeadlock as error:
            counts["deadlocks"] += 1
            if ordered:
                emit("false_deadlock", message=str(error))
        except LockContended:
            counts["timeouts"] += 1


def main(seconds: float, seed: int, ordered: bool) -> None:
    settings.CACHES["default"]["MUTEX"]["DEADLOCK_TIMEOUT"] = DEADLOCK_TIMEOUT
    counts = [{"deadlocks": 0, "timeouts": 0, "waits": 0, "cycles": 0} for _ in range(2)]
    threads = [
        threading.Thread(target=run, args=(seconds, seed * 2 + index, counts[index], ordered))
        for index in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    emit("done", **{key: sum(count[key] for count in counts) for key in counts[0]})


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] != ["any"])
