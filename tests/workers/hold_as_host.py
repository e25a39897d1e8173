"""Hold one lock as a process on another machine would, until the test says to let go.

Usage: hold_as_host.py NAME HOST LABEL GO_KEY

A real process holding a real lock, standing in for one on machine HOST: the
host name it reports in its owner record is HOST, everything else (pid,
thread, the lock itself) is its own. Reports ``acquired`` with its fence,
blocks until the test pushes onto GO_KEY, then reports ``released`` if it
still held the lock when it let go, or ``lost`` if it had been force-released.
"""

import socket
import sys

HOST = sys.argv[2]
# Before the app is imported: it reads the host name once, for every owner record.
socket.gethostname = lambda: HOST

import django  # noqa: E402

django.setup()

from support import data_client, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import LockLost, mutex  # noqa: E402


def main(name: str, label: str, go_key: str) -> None:
    client = data_client()
    try:
        with mutex(name, label=label, ttl=60, timeout=10) as lock:
            emit("acquired", fence=lock.fence)
            wait_for_signal(client, go_key, "go")
    except LockLost as exc:
        emit("lost", name=exc.name)
        return
    emit("released")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3], sys.argv[4])
