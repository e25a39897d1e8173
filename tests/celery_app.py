"""A Celery app whose tasks run under ``@mutex``, for tests/test_celery.py.

Real workers run it (``celery -A tests.celery_app worker``) with the Django
settings of the suite; Celery's Django fixup sets Django up, as in a project.
The broker, the result backend and the tasks' run records live on a Redis the
test started, named by DJANGO_REDIS_MUTEX_TEST_CELERY_URL (databases 0, 1 and
2); the locks live on the suite's Redis in the test's namespace, as usual.

Each task appends a JSON record of its run to a list named by the test, so the
test can compare the runs' times, processes and renewer threads afterwards.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_prerun, worker_init

from django_redis_mutex import mutex, skip_if_locked

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

# The serial task's lease, far shorter than its work: only renewals by a
# watchdog running in the worker's child process keep its lock.
REPORT_TTL = 0.6
# The lease left behind by a killed worker: long enough to tell "after the
# lease" from "at once", short enough for a quick test.
CRASH_TTL = 3.0
# Never 6379: without the test's URL, point at a port nothing serves.
_UNSET_URL = "redis://127.0.0.1:9"

app = Celery("tests")


def configure(url: str) -> None:
    """Use the Redis at ``url`` (no database number) as broker, result backend and records."""
    app.conf.update(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # One message at a time per child, so a waiting task never hides a
        # runnable one in a busy child's prefetch.
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=None,
    )
    global _records_url
    _records_url = f"{url}/2"


_records_url = ""
configure(os.environ.get("DJANGO_REDIS_MUTEX_TEST_CELERY_URL", _UNSET_URL))


_clients: dict[str, redis.Redis] = {}


def records() -> redis.Redis:
    """Return a client on the records database (its pool starts afresh in a forked child)."""
    if _records_url not in _clients:
        _clients[_records_url] = redis.Redis.from_url(_records_url, socket_timeout=90)
    return _clients[_records_url]


def renewer_threads() -> list[str]:
    """Return the names of this process's watchdog threads alive now."""
    return [t.name for t in threading.enumerate() if "django-redis-mutex-watchdog" in t.name]


# When each task of this process was handed to it, before any lock was asked for.
_entered: dict[str, float] = {}


@task_prerun.connect
def _note_entry(task_id: str, **kwargs: Any) -> None:
    _entered[task_id] = time.time()
    prefix = os.environ.get("DJANGO_REDIS_MUTEX_TEST_PREFIX", "")
    records().rpush(
        f"entered:{prefix}", json.dumps({"task_id": task_id, "pid": os.getpid(), "t": time.time()})
    )


@worker_init.connect
def _use_a_lock_before_the_pool_starts(**kwargs: Any) -> None:
    """Take and release a lock in the worker's main process before any child is forked.

    The children then inherit a renewer thread that does not run in them and
    a connection pool they must not share: the case the watchdog's fork
    handling exists for.
    """
    with mutex("celery-worker-init", timeout=30):
        pass
    prefix = os.environ.get("DJANGO_REDIS_MUTEX_TEST_PREFIX", "")
    records().rpush(
        f"worker-init:{prefix}", json.dumps({"pid": os.getpid(), "renewers": renewer_threads()})
    )


@app.task(bind=True)
@mutex("report:{customer_id}", ttl=REPORT_TTL, timeout=60)
def build_report(self: Any, customer_id: int, log: str, work: float) -> dict[str, Any]:
    """Hold the customer's lock for ``work`` seconds and record the run."""
    started = time.time()
    time.sleep(work)  # the work done under the lock
    run = {
        "customer_id": customer_id,
        "task_id": self.request.id,
        "pid": os.getpid(),
        "start": started,
        "end": time.time(),
        "waited": started - _entered.get(self.request.id, started),
        "renewers": renewer_threads(),
    }
    records().rpush(log, json.dumps(run))
    return run


@app.task
@skip_if_locked("refresh:{customer_id}")
def refresh(customer_id: int, log: str) -> str:
    """Record a run, unless another run of this customer's refresh holds the lock."""
    records().rpush(log, json.dumps({"customer_id": customer_id, "pid": os.getpid()}))
    return "refreshed"


@app.task
@mutex("refresh:{customer_id}", blocking=False)
def refresh_or_fail(customer_id: int, log: str) -> str:
    """Like ``refresh``, but fail with LockContended while the lock is held."""
    records().rpush(log, json.dumps({"customer_id": customer_id, "pid": os.getpid()}))
    return "refreshed"


@app.task
@mutex("crash:{job}", ttl=CRASH_TTL, timeout=60)
def hold_until_told(job: str, log: str, go: str) -> int:
    """Record that the lock was acquired, then hold it until the test pushes onto ``go``."""
    client = records()
    client.rpush(log, json.dumps({"event": "acquired", "pid": os.getpid(), "t": time.time()}))
    if client.blpop([go], timeout=60) is None:
        raise TimeoutError(f"no go signal on {go!r} within 60s")
    return os.getpid()
