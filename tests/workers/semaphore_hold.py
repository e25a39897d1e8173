"""Take one permit of a semaphore, hold it until the test says to let go, report how it ended.

Usage: semaphore_hold.py NAME LIMIT TTL GO_KEY

Reports ``acquired`` with the permit's token once it holds it (waiting as long
as it takes, up to 60 s), then blocks until the test pushes onto GO_KEY.
Leaving the block reports ``released``, or ``lost`` when it raised LockLost.
The test may SIGKILL it in between.
"""

import sys

import django

django.setup()

from support import data_client, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import LockLost, Semaphore  # noqa: E402


def main(name: str, limit: int, ttl: float, go_key: str) -> None:
    client = data_client()
    permit = Semaphore(name, limit, ttl=ttl, timeout=60)
    try:
        with permit:
            emit("acquired", token=permit.token)
            wait_for_signal(client, go_key, "go")
    except LockLost as exc:
        emit("lost", message=str(exc))
        return
    emit("released")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
