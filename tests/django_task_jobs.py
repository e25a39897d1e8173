"""Tasks of Django's task framework (Django 6.0+) under ``@mutex``, for tests/test_django_tasks.py.

``@task`` goes on top and ``@mutex`` below it, so the lock is held where the
task runs. They run on the ImmediateBackend in the test's own threads, and on
django-tasks-db's DatabaseBackend in ``db_worker`` processes (settings in
tests/settings_tasks.py). Each appends a JSON record of its run to a Redis list
named by the test, on the suite's Redis, beside (not inside) the lock namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import redis
from django.tasks import TaskContext, task

from django_redis_mutex import mutex, skip_if_locked

# The serial tasks' lease, shorter than their work in the cross-process test:
# renewals keep the lock.
REPORT_TTL = 0.6

_clients: dict[int, redis.Redis] = {}


def records() -> redis.Redis:
    """Return a client on the suite's Redis for the run records (one per process)."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(os.environ["DJANGO_REDIS_MUTEX_TEST_URL"])
    return _clients[pid]


def _record(context: TaskContext, customer_id: int, log: str, started: float) -> dict[str, Any]:
    result = context.task_result
    run = {
        "customer_id": customer_id,
        "result_id": str(result.id),
        "pid": os.getpid(),
        "thread": threading.get_ident(),
        "start": started,
        "end": time.time(),
        # From when the backend started the task until its lock was ours.
        "waited": started - result.started_at.timestamp() if result.started_at else 0.0,
    }
    records().rpush(log, json.dumps(run))
    return run


@task(takes_context=True)
@mutex("report:{customer_id}", ttl=REPORT_TTL, timeout=60)
def build_report(context: TaskContext, customer_id: int, log: str, work: float) -> dict[str, Any]:
    """Hold the customer's lock for ``work`` seconds and record the run."""
    started = time.time()
    time.sleep(work)  # the work done under the lock
    return _record(context, customer_id, log, started)


@task(takes_context=True)
@mutex("report:{customer_id}", ttl=REPORT_TTL, timeout=60)
async def abuild_report(
    context: TaskContext, customer_id: int, log: str, work: float
) -> dict[str, Any]:
    """The async twin of ``build_report``, under the same lock name."""
    started = time.time()
    await asyncio.sleep(work)  # the work done under the lock
    return await asyncio.to_thread(_record, context, customer_id, log, started)


@task
@skip_if_locked("refresh:{customer_id}")
def refresh(customer_id: int, log: str) -> str:
    """Record a run, unless another run of this customer's refresh holds the lock."""
    records().rpush(log, json.dumps({"customer_id": customer_id, "pid": os.getpid()}))
    return "refreshed"


@task
@mutex("refresh:{customer_id}", blocking=False)
def refresh_or_fail(customer_id: int, log: str) -> str:
    """Like ``refresh``, but fail with LockContended while the lock is held."""
    records().rpush(log, json.dumps({"customer_id": customer_id, "pid": os.getpid()}))
    return "refreshed"
