"""``@mutex`` and ``@skip_if_locked`` on tasks of Django's task framework (Django 6.0+).

The tasks are in ``tests/django_task_jobs.py``. On the ImmediateBackend (the
default) a task runs in the thread that enqueues it, so tasks enqueued from
several threads at once contend for their locks here. On django-tasks-db's
DatabaseBackend, two real ``db_worker`` processes run the tasks another process
queued in a SQLite file. The tasks append records of their runs (times,
process, how long they waited for their lock) to Redis lists the test checks.

The module needs ``django.tasks``: scripts/matrix.py runs it in its Django 6
leg; on older Django it is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis

pytest.importorskip("django.tasks", reason="django.tasks is new in Django 6.0")

from django.tasks import TaskResultStatus

from django_redis_mutex import LockContended, Mutex, mutex, skip_if_locked

from .django_task_jobs import (
    abuild_report,
    build_report,
    refresh,
    refresh_or_fail,
)
from .helpers import ROOT, held_elsewhere, wait_until
from .worker import Worker

# Generous bound: these tests run on a busy 2-core machine.
STEP_TIMEOUT = 60.0


@pytest.fixture
def log(raw: redis.Redis, mutex_prefix: str) -> Iterator[str]:
    """The Redis list this test's tasks record their runs in (outside the lock namespace)."""
    key = f"django-tasks:{mutex_prefix}:runs"
    yield key
    raw.delete(key)


def runs(raw: redis.Redis, log: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in raw.lrange(log, 0, -1)]


def check_one_at_a_time(done: list[dict[str, Any]], customer_id: int, work: float) -> None:
    """Fail unless the customer's runs never overlapped and at least one waited for the lock."""
    serial = sorted((r for r in done if r["customer_id"] == customer_id), key=lambda r: r["start"])
    overlaps = [(a, b) for a, b in pairwise(serial) if b["start"] < a["end"]]
    assert overlaps == [], f"runs of customer {customer_id} overlapped: {overlaps}"
    assert max(r["waited"] for r in serial) > work / 2, "no run ever waited for the lock"


# -- ImmediateBackend: tasks run in the threads that enqueue them ---------------


def test_immediate_tasks_run_one_per_key_at_a_time_across_threads(
    raw: redis.Redis, log: str
) -> None:
    work = 0.3
    # Customer 1 four times (sync and async tasks share the lock name),
    # customer 2 once: five threads enqueue at the same moment.
    calls = [(build_report, 1), (abuild_report, 1), (build_report, 1), (abuild_report, 1)]
    calls.append((build_report, 2))
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def enqueue(index: int) -> None:
        job, customer = calls[index]
        barrier.wait(timeout=STEP_TIMEOUT)
        results[index] = job.enqueue(customer, log, work)

    threads = [threading.Thread(target=enqueue, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STEP_TIMEOUT)

    assert [result.status for result in results] == [TaskResultStatus.SUCCESSFUL] * len(calls), [
        result.errors for result in results
    ]
    done = runs(raw, log)
    assert sorted(r["result_id"] for r in done) == sorted(str(r.id) for r in results)
    check_one_at_a_time(done, 1, work)
    other = next(r for r in done if r["customer_id"] == 2)
    assert any(
        r["start"] < other["end"] and other["start"] < r["end"]
        for r in done
        if r["customer_id"] == 1
    ), "customer 2 did not run beside customer 1"
    assert not Mutex("report:1").locked()


def test_immediate_skip_if_locked_task_succeeds_without_running_while_held(
    raw: redis.Redis, log: str
) -> None:
    with held_elsewhere("refresh:7", ttl=60):
        skipped = refresh.enqueue(7, log)
        assert skipped.status == TaskResultStatus.SUCCESSFUL
        assert skipped.return_value is None
        failed = refresh_or_fail.enqueue(7, log)
        assert failed.status == TaskResultStatus.FAILED
        assert failed.errors[0].exception_class is LockContended
        assert refresh.enqueue(8, log).return_value == "refreshed"
    assert refresh.enqueue(7, log).return_value == "refreshed"

    assert [r["customer_id"] for r in runs(raw, log)] == [8, 7]
    assert not Mutex("refresh:7").locked()


@pytest.mark.parametrize("decorator", [mutex("report"), skip_if_locked("report")])
def test_lock_decorator_above_task_is_refused(decorator: Any) -> None:
    with pytest.raises(TypeError, match="put it below the task decorator"):
        decorator(build_report)


# -- DatabaseBackend: db_worker processes ------------------------------------------


@pytest.fixture
def task_env(tmp_path: Path) -> dict[str, str]:
    """Return the environment of a process using the database task backend, migrated."""
    pytest.importorskip("django_tasks_db")
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings_tasks",
        DJANGO_REDIS_MUTEX_TEST_TASKS_DB=str(tmp_path / "tasks.sqlite3"),
        PYTHONPATH=str(ROOT),
    )
    migrate = [sys.executable, "-m", "django", "migrate", "django_tasks_database", "-v", "0"]
    done = subprocess.run(
        migrate, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return env


@pytest.fixture
def start_process(task_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Return a function starting a process with ``task_env``; kill what is left after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*command: str) -> subprocess.Popen[bytes]:
        output = open(tmp_path / f"process-{len(started)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            [sys.executable, *command],
            env=task_env,
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        output.close()  # the child has its own copy
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def queue(task_env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run tests/workers/task_queue.py with ``args`` and return the event it reported."""
    script = str(ROOT / "tests" / "workers" / "task_queue.py")
    process = subprocess.Popen(
        [sys.executable, script, *args],
        env=task_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = Worker("task_queue.py", process)
    try:
        event = worker.expect("enqueued" if args[0] == "enqueue" else "results")
        assert worker.finish() == 0
    finally:
        worker.close()
    return event


def test_db_workers_run_one_task_per_key_at_a_time_across_processes(
    task_env: dict[str, str],
    start_process: Callable[..., subprocess.Popen[bytes]],
    raw: redis.Redis,
    log: str,
    tmp_path: Path,
) -> None:
    work = 1.0
    workers = [
        start_process(
            "-m",
            "django",
            "db_worker",
            "--no-startup-delay",
            "--no-reload",
            "--interval",
            "0.05",
            "--worker-id",
            f"w{i}",
        )
        for i in range(2)
    ]
    # Both workers poll the queue before anything is queued, so the first two
    # tasks are claimed at once, one by each, and one waits for the lock.
    for i in range(2):
        log_file = tmp_path / f"process-{i}.log"
        wait_until(
            lambda log_file=log_file: "Starting worker" in log_file.read_text(errors="replace"),
            STEP_TIMEOUT,
            f"db_worker w{i} to start",
        )
    ids = queue(task_env, "enqueue", "1", "3", log, str(work))["ids"]
    wait_until(lambda: len(runs(raw, log)) == 3, STEP_TIMEOUT, "three runs")

    # The backend marks a task successful just after its function returned.
    def finished() -> dict[str, str] | None:
        statuses: dict[str, str] = queue(task_env, "results", *ids)["statuses"]
        return statuses if "RUNNING" not in statuses.values() else None

    assert wait_until(finished, STEP_TIMEOUT, "the results") == dict.fromkeys(ids, "SUCCESSFUL")
    done = runs(raw, log)
    assert sorted(r["result_id"] for r in done) == sorted(ids)
    check_one_at_a_time(done, 1, work)
    assert {r["pid"] for r in done} == {w.pid for w in workers}
    assert not Mutex("report:1").locked()
    for process in workers:
        process.send_signal(signal.SIGTERM)  # idle: a db_worker exits at once
        assert process.wait(STEP_TIMEOUT) == 0
