"""Hold one lock until the test says to let go, then report how the block ended.

Usage: hold.py NAME TTL GO_KEY

Acquires with the given lease (watchdog on, the default), reports
``acquired`` with its fence and token, and blocks until the test pushes onto
GO_KEY. Leaving the block reports ``released`` (with the seconds held), or
``lost`` when it raised LockLost because the lock was no longer ours. The test
may SIGKILL or SIGSTOP it in between.
"""

import sys
import time

import django

django.setup()

from support import data_client, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import LockLost, mutex  # noqa: E402


def main(name: str, ttl: float, go_key: str) -> None:
    client = data_client()
    try:
        with mutex(name, ttl=ttl, timeout=10) as lock:
            started = time.monotonic()
            emit("acquired", fence=lock.fence, token=lock.token)
            wait_for_signal(client, go_key, "go")
            held = time.monotonic() - started
    except LockLost as exc:
        emit("lost", error=type(exc).__name__, message=str(exc), name=exc.name)
        return
    emit("released", held=held)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
