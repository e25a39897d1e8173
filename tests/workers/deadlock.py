"""Hold one lock, then wait for another when told to: one participant of a deadlock test.

Usage: deadlock.py HELD WANTED GO_KEY DEADLOCK_TIMEOUT [TTL [MODE [CACHES USING]]]

HELD and WANTED name a lock each: ``name`` (exclusive), ``name:shared``, or
``name:semaphore:<limit>`` (a permit). MODE is ``sync`` (the default) or
``async`` (``async with`` on an event loop). DEADLOCK_TIMEOUT is this
process's setting (``none`` turns detection off); TTL the leases (default 30).
CACHES (JSON) adds cache aliases to the settings, and the locks use the alias
USING (``default`` otherwise), such as a quorum's.

Reports ``holding`` once it holds HELD, then blocks until the test pushes onto
GO_KEY, reports ``waiting`` and waits (up to 60 s) for WANTED. It reports
``acquired`` inside WANTED's block, or ``deadlock`` (with the cycle and how
long it waited) when chosen to end a deadlock, or ``timed_out``; then
``done`` once both blocks were left.
"""

import asyncio
import json
import sys
import time

import django
from django.conf import settings

django.setup()

from support import data_client, emit, wait_for_signal  # noqa: E402

from django_redis_mutex import LockContended, LockDeadlock, mutex, semaphore  # noqa: E402

USING = "default"


def handle(spec: str, ttl: float) -> object:
    name, _, kind = spec.partition(":")
    if kind.startswith("semaphore:"):
        return semaphore(name, int(kind.split(":")[1]), ttl=ttl, timeout=60, using=USING)
    return mutex(name, ttl=ttl, timeout=60, shared=kind == "shared", using=USING)


def outcome(started: float, error: BaseException | None) -> None:
    waited = time.monotonic() - started
    if isinstance(error, LockDeadlock):
        emit("deadlock", waited=waited, cycle=list(error.cycle), message=str(error))
    elif isinstance(error, LockContended):
        emit("timed_out", waited=waited)


def run_sync(held: str, wanted: str, go_key: str, ttl: float) -> None:
    client = data_client()
    with handle(held, ttl):  # type: ignore[attr-defined]
        emit("holding")
        wait_for_signal(client, go_key, "go")
        emit("waiting")
        started = time.monotonic()
        try:
            with handle(wanted, ttl):  # type: ignore[attr-defined]
                emit("acquired", waited=time.monotonic() - started)
        except LockContended as error:
            outcome(started, error)
    emit("done")


async def run_async(held: str, wanted: str, go_key: str, ttl: float) -> None:
    client = data_client()
    async with handle(held, ttl):  # type: ignore[attr-defined]
        emit("holding")
        await asyncio.to_thread(wait_for_signal, client, go_key, "go")
        emit("waiting")
        started = time.monotonic()
        try:
            async with handle(wanted, ttl):  # type: ignore[attr-defined]
                emit("acquired", waited=time.monotonic() - started)
        except LockContended as error:
            outcome(started, error)
    emit("done")


def main(held: str, wanted: str, go_key: str, deadlock_timeout: str, ttl: float, mode: str) -> None:
    block = settings.CACHES[USING]["MUTEX"]
    block["DEADLOCK_TIMEOUT"] = None if deadlock_timeout == "none" else float(deadlock_timeout)
    if mode == "async":
        asyncio.run(run_async(held, wanted, go_key, ttl))
    else:
        run_sync(held, wanted, go_key, ttl)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 7:
        settings.CACHES.update(json.loads(args[6]))
        USING = args[7]
    main(
        args[0],
        args[1],
        args[2],
        args[3],
        float(args[4]) if len(args) > 4 else 30.0,
        args[5] if len(args) > 5 else "sync",
    )
