"""A stream of shared holders of one lock, or an exclusive one waiting behind it.

Usage: rw_stream.py reader NAME READERS_KEY STOP_KEY HOLD
       rw_stream.py writer NAME READERS_KEY TIMEOUT

A reader takes NAME shared over and over, holding it HOLD seconds each time
(the READERS_KEY counter counts the readers inside), until STOP_KEY exists;
it reports ``reading`` after its first section and ``done`` with how many it
ran. A writer reports ``waiting`` (with the readers inside at that moment)
just before it asks for NAME exclusively, then ``acquired`` (with the readers
inside then, which must be 0) or ``timed_out``, and releases.
"""

import sys
import time

import django

django.setup()

from support import data_client, emit  # noqa: E402

from django_redis_mutex import Mutex, mutex  # noqa: E402


def reader(name: str, readers: str, stop: str, hold: float) -> None:
    client = data_client()
    sections = 0
    while not client.exists(stop):
        with mutex(name, shared=True, timeout=60):
            client.incr(readers)
            time.sleep(hold)  # the reader's work
            client.decr(readers)
        sections += 1
        if sections == 1:
            emit("reading")
    emit("done", sections=sections)


def writer(name: str, readers: str, timeout: float) -> None:
    client = data_client()
    lock = Mutex(name, timeout=timeout)
    emit("waiting", readers=int(client.get(readers) or 0))
    if not lock.acquire():
        emit("timed_out")
        return
    emit("acquired", fence=lock.fence, readers=int(client.get(readers) or 0))
    lock.release()
    emit("released")


if __name__ == "__main__":
    if sys.argv[1] == "reader":
        reader(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    else:
        writer(sys.argv[2], sys.argv[3], float(sys.argv[4]))
