"""What the worker scripts share: reports to the test, the start barrier, a data client.

A worker talks to the test that started it through stdout, one JSON object per
line with an ``event`` key (plus the worker's ``pid`` and ``time.time()`` as
``t``), flushed at once so the test sees each step when it happens. Workers
are started by ``tests.helpers.run_worker``, which sets DJANGO_SETTINGS_MODULE,
the test server's URL and the test's lock namespace in the environment; each
worker calls ``django.setup()`` itself before importing the app.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis

# Long enough for a slow CI machine, short enough that a lost test never hangs.
SIGNAL_TIMEOUT = 60


def emit(event: str, **data: Any) -> None:
    """Report one step to the test as a JSON line on stdout."""
    record = {"event": event, "pid": os.getpid(), "t": time.time(), **data}
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def data_client() -> redis.Redis:
    """Return a plain client on the test server for the workload's own keys.

    The workload (counters, barriers, signals) lives beside the locks, not in
    them: it is the "storage" a lock protects, reached without the app.
    """
    # redis-py reads with a 5 s socket timeout by default; signal waits are longer.
    return redis.Redis.from_url(
        os.environ["DJANGO_REDIS_MUTEX_TEST_URL"], socket_timeout=SIGNAL_TIMEOUT + 10
    )


def wait_for_signal(client: redis.Redis, key: str, what: str) -> None:
    """Block until the test pushes onto ``key``; exit with an error report if it never does."""
    if client.blpop([key], timeout=SIGNAL_TIMEOUT) is None:
        emit("error", message=f"no {what} signal on {key!r} within {SIGNAL_TIMEOUT}s")
        sys.exit(2)


def start_barrier(client: redis.Redis, key: str) -> None:
    """Say ready, then wait until the test opens the barrier for every worker at once."""
    emit("ready")
    wait_for_signal(client, key, "start")
