"""Use the app, fork, and hold a lock in the child past several leases.

Usage: fork.py NAME TTL HOLD

The parent first acquires and releases a lock with the watchdog on, so its
renewer thread and its Redis connections exist before the fork, as in a
gunicorn master with preload or a Celery prefork pool. The child then holds
NAME with a TTL-second lease for HOLD seconds, which only works if the child
has a renewer of its own. Reports ``parent_ready``, ``child_acquired``,
``child_released`` (whether it still owned the lock at the end) or
``child_lost``, and finally ``parent_done`` with the child's exit code.
"""

import os
import sys
import threading
import time

import django

django.setup()

from support import emit  # noqa: E402

from django_redis_mutex import LockLost, mutex  # noqa: E402


def child(name: str, ttl: float, hold: float) -> int:
    try:
        with mutex(name, ttl=ttl, timeout=10) as lock:
            started = time.monotonic()
            emit("child_acquired", fence=lock.fence, owner=lock.owner().as_dict())
            time.sleep(hold)  # the work under the lock; the watchdog must keep it alive
            owned = lock.owned()
            held = time.monotonic() - started
    except LockLost as exc:
        emit("child_lost", message=str(exc))
        return 3
    emit("child_released", owned_at_end=owned, held=held)
    return 0


def main(name: str, ttl: float, hold: float) -> None:
    with mutex(f"{name}:before-fork", ttl=ttl) as lock:
        parent_fence = lock.fence
    renewers = [t.name for t in threading.enumerate() if "watchdog" in t.name]
    emit("parent_ready", fence=parent_fence, renewers=renewers)
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            code = child(name, ttl, hold)
        except BaseException as exc:  # report anything, then leave without the parent's cleanup
            emit("error", message=f"child failed: {exc!r}")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    emit("parent_done", child_pid=pid, child_exit=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
