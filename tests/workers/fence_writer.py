"""Take a lock, then read-modify-write one fenced row when the test says, and leave when told.

Usage: fence_writer.py NAME TTL PK VALUE WRITE_KEY LEAVE_KEY DATABASE_JSON

DATABASE_JSON is the ``DATABASES["default"]`` entry to use (the test's shared
SQLite file or PostgreSQL database), set before ``django.setup()``. The worker
acquires NAME with lease TTL (watchdog on, the default), loads row PK of
``FencedRecord`` and reports ``acquired`` with its fence and token. When the
test pushes onto WRITE_KEY it sets the row's value to VALUE and saves it with
``save_fenced(lock)``, reporting ``written`` or, when the database refused it,
``stale`` with the StaleFence's fields. When the test pushes onto LEAVE_KEY it
leaves the block and reports ``released``, or ``lost`` when leaving raised
LockLost. The test may SIGSTOP it in between, to age its lease away.
"""

import json
import os
import sys

import django
import redis
from django.conf import settings

settings.DATABASES = {"default": json.loads(sys.argv[7])}
django.setup()

from support import SIGNAL_TIMEOUT, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import LockLost, StaleFence, mutex  # noqa: E402
from tests.testapp.models import FencedRecord  # noqa: E402


def signal_client() -> redis.Redis:
    """Return a client whose socket outwaits a signal wait (redis-py 8 cuts reads at 5 s)."""
    return redis.Redis.from_url(
        os.environ["DJANGO_REDIS_MUTEX_TEST_URL"], socket_timeout=SIGNAL_TIMEOUT + 10
    )


def main(name: str, ttl: float, pk: int, value: int, write_key: str, leave_key: str) -> None:
    client = signal_client()
    try:
        with mutex(name, ttl=ttl, timeout=30) as lock:
            record = FencedRecord.objects.get(pk=pk)
            emit("acquired", fence=lock.fence, token=lock.token)
            wait_for_signal(client, write_key, "write")
            record.value = value
            record.written_by = f"pid {os.getpid()}"
            try:
                record.save_fenced(lock)
            except StaleFence as exc:
                emit("stale", name=exc.name, fence=exc.fence, current=exc.current, message=str(exc))
            else:
                emit("written", fence=lock.fence)
            wait_for_signal(client, leave_key, "leave")
    except LockLost as exc:
        emit("lost", error=type(exc).__name__, name=exc.name, message=str(exc))
        return
    emit("released")


if __name__ == "__main__":
    main(
        sys.argv[1],
        float(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
        sys.argv[6],
    )
