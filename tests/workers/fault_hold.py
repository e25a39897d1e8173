"""Take a lock with a bare lease (no watchdog), start a section, and never leave it.

Usage: fault_hold.py NAME TTL COUNTER_KEY BARRIER_KEY

After the barrier opens, acquires NAME with a TTL-second lease and the
watchdog off, so the lease ends TTL seconds after the grant whatever happens
to this process. Reports ``acquired`` with the fence, ``before`` and
``after`` (``time.time()`` just before calling acquire and just after it
returned: the grant happened between them), after incrementing the counter
COUNTER_KEY:NAME with a GET then a SET as every recorded section does. Then
it stays inside the section until the test SIGKILLs it (at most 60 s).
"""

import sys
import threading
import time

import django

django.setup()

from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import Mutex  # noqa: E402

LINGER = 60.0


def main(name: str, ttl: float, counter_key: str, barrier_key: str) -> int:
    client = data_client()
    lock = Mutex(name, ttl=ttl, watchdog=False, timeout=10)
    start_barrier(client, barrier_key)
    before = time.time()
    if not lock.acquire():
        emit("error", message=f"could not acquire {name!r} within 10s")
        return 2
    after = time.time()
    counter = f"{counter_key}:{name}"
    client.set(counter, int(client.get(counter) or 0) + 1)
    emit("acquired", fence=lock.fence, before=before, after=after)
    threading.Event().wait(LINGER)  # inside the section until killed
    emit("error", message=f"was not killed within {LINGER}s")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]))
