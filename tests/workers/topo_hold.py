"""Take one lock on a topology (cluster, Sentinel, quorum), hold it until told, then let go.

Usage: topo_hold.py --caches JSON --using ALIAS[,ALIAS...] --name NAME [--go KEY]
       [--ttl S] [--timeout S] [--retry-pause S]

--caches and --using are as for topo_sections.py. The worker reports
``waiting``, then keeps trying to acquire NAME (blocking, with --timeout as
its overall deadline): an attempt that fails with LockBackendUnavailable (the
topology is changing under it) is reported as ``failure`` and retried after
--retry-pause, so a waiter is not lost when its Redis goes away. Once granted
it reports ``acquired`` (fence, token, attempts), and with --go waits until
the test pushes onto that key before leaving. Leaving reports the section
(tests/history.py) and ``released``; a lock found lost on the way out
(LockLost, LockNotOwned or ``lock.lost``) is reported as ``lost`` and the
section is marked as told. ``timed_out`` means the deadline passed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import django
from django.conf import settings


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--caches", required=True, help="JSON object of CACHES entries to add")
    parser.add_argument("--using", required=True, help="lock alias, or aliases joined by commas")
    parser.add_argument("--name", required=True, help="the lock to take")
    parser.add_argument("--go", help="key the test pushes onto to let the lock go")
    parser.add_argument("--ttl", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="overall deadline, seconds")
    parser.add_argument("--retry-pause", type=float, default=0.1)
    return parser.parse_args()


ARGS = parse_args()
settings.CACHES = {**settings.CACHES, **json.loads(ARGS.caches)}
django.setup()

from support import data_client, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import (  # noqa: E402
    LockBackendUnavailable,
    LockLost,
    LockNotOwned,
    Mutex,
)
from tests.history import Recorder  # noqa: E402


def acquire(lock: Mutex, deadline: float) -> int | None:
    """Acquire ``lock`` before ``deadline``, retrying through outages; return the attempts."""
    attempts = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        attempts += 1
        try:
            if lock.acquire(timeout=left):
                return attempts
        except LockBackendUnavailable as exc:
            emit("failure", op="acquire", error=type(exc).__name__, message=str(exc))
            time.sleep(ARGS.retry_pause)  # back off before asking a Redis that is going away


def release(lock: Mutex, deadline: float) -> bool:
    """Release ``lock``, retrying through outages; return False if it was found lost."""
    while True:
        try:
            lock.release()
            return not lock.lost
        except LockNotOwned:
            return False
        except LockBackendUnavailable as exc:
            emit("failure", op="release", error=type(exc).__name__, message=str(exc))
            if time.monotonic() > deadline:
                raise
            time.sleep(ARGS.retry_pause)


def main() -> int:
    aliases = ARGS.using.split(",")
    using = aliases[0] if len(aliases) == 1 else aliases
    client = data_client()
    lock = Mutex(ARGS.name, using=using, ttl=ARGS.ttl)
    deadline = time.monotonic() + ARGS.timeout
    emit("waiting")
    started = time.monotonic()
    attempts = acquire(lock, deadline)
    if attempts is None:
        emit("timed_out", waited=time.monotonic() - started)
        return 0
    enter = time.time()
    fence = lock.fence or 0
    emit("acquired", fence=fence, token=lock.token, attempts=attempts, enter=enter)
    if ARGS.go:
        wait_for_signal(client, ARGS.go, "go")
    leave = time.time()
    try:
        kept = release(lock, deadline + 60)
    except LockLost:
        kept = False
    Recorder().section(ARGS.name, fence, enter, leave, lost=not kept)
    emit("released" if kept else "lost", fence=fence)
    return 0


if __name__ == "__main__":
    sys.exit(main())
