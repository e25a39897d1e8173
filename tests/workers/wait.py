"""Wait for one lock, report the moment it was granted, and release it.

Usage: wait.py NAME TIMEOUT

Reports ``waiting`` just before blocking, then ``acquired`` (with the fence;
its ``t`` is taken right after the grant) or ``timed_out``, then ``released``.
"""

import sys

import django

django.setup()

from support import emit  # noqa: E402

from django_redis_mutex import Mutex  # noqa: E402


def main(name: str, timeout: float) -> None:
    lock = Mutex(name, timeout=timeout)
    emit("waiting")
    if not lock.acquire():
        emit("timed_out")
        return
    emit("acquired", fence=lock.fence)
    lock.release()
    emit("released")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
