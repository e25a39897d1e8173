"""``@mutex`` and ``@skip_if_locked`` on Celery tasks, run by real Celery workers.

Each test starts ``celery worker`` processes (prefork and solo pools) for the
tasks of ``tests/celery_app.py``, with a real redis-server as broker and
result backend, started by this module. The locks live on the suite's Redis,
in the test's namespace. The tasks append records of their runs (times,
process ids, renewer threads) to Redis lists the test then checks; results
come back through the result backend. Every worker runs in a process group of
its own and is SIGKILLed with its children at the end of the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Task

from django_redis_mutex import LockContended, Mutex, mutex, skip_if_locked
from django_redis_mutex.testing import RedisServer

from . import celery_app
from .celery_app import (
    CRASH_TTL,
    REPORT_TTL,
    build_report,
    hold_until_told,
    refresh,
    refresh_or_fail,
)
from .helpers import ROOT, wait_until

# Generous bounds: these tests run on a busy 2-core machine, and a worker
# imports Celery and Django before it takes its first task.
RESULT_TIMEOUT = 60.0


class CeleryWorker:
    """One ``celery worker`` process and its pool's children, in a process group of their own."""

    def __init__(self, url: str, queue: str, pool: str, concurrency: int, log: Path) -> None:
        self.queue = queue
        self.log = log
        env = dict(
            os.environ,
            DJANGO_SETTINGS_MODULE="tests.settings",
            PYTHONPATH=str(ROOT),
            DJANGO_REDIS_MUTEX_TEST_CELERY_URL=url,
        )
        command = [
            sys.executable,
            "-m",
            "celery",
            "--app",
            "tests.celery_app",
            "worker",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            f"--queues={queue}",
            f"--hostname={queue}@%h",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=INFO",
        ]
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                command,
                env=env,
                cwd=ROOT,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe(self) -> str:
        """Return the worker's exit status and the end of its log, for failure messages."""
        tail = self.log.read_text(errors="replace").strip().splitlines()[-30:]
        return f"worker {self.queue} (pid {self.pid}, exit {self.process.poll()}):\n" + "\n".join(
            tail
        )

    def kill(self) -> None:
        """SIGKILL the worker and every child of its pool at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture(scope="module")
def celery_url() -> Iterator[str]:
    """Start the module's broker Redis and point the Celery app of this process at it."""
    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        celery_app.configure(url)
        try:
            yield url
        finally:
            celery_app.app.close()
            celery_app.configure("redis://127.0.0.1:9")


@pytest.fixture
def records(celery_url: str) -> Iterator[redis.Redis]:
    """A client on the database the tasks record their runs in."""
    client = redis.Redis.from_url(f"{celery_url}/2")
    yield client
    client.close()


@pytest.fixture
def start_worker(celery_url: str, tmp_path: Path) -> Iterator[Callable[..., CeleryWorker]]:
    """Return a function starting a worker on a fresh queue; kill every worker after the test."""
    started: list[CeleryWorker] = []

    def start(pool: str, concurrency: int = 1) -> CeleryWorker:
        queue = f"q{uuid.uuid4().hex[:8]}"
        worker = CeleryWorker(celery_url, queue, pool, concurrency, tmp_path / f"{queue}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def runs(records: redis.Redis, log: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records.lrange(log, 0, -1)]


def get(result: Any, worker: CeleryWorker) -> Any:
    """Return a task's result; on a timeout, fail with the worker's log."""
    try:
        return result.get(timeout=RESULT_TIMEOUT)
    except TimeoutError as exc:  # celery.exceptions.TimeoutError subclasses it
        raise AssertionError(
            f"no result within {RESULT_TIMEOUT}s from {worker.describe()}"
        ) from exc


# -- one run at a time per key ----------------------------------------------


def test_prefork_runs_one_task_per_key_at_a_time_and_other_keys_alongside(
    start_worker: Callable[..., CeleryWorker], records: redis.Redis, mutex_prefix: str
) -> None:
    work = 1.5
    assert work > 2 * REPORT_TTL  # only renewals in the child keep the lock this long
    worker = start_worker("prefork", concurrency=2)
    log = f"runs:{mutex_prefix}"
    # Two children, four runs for customer 1: while one runs, the other child
    # waits for its lock. Customer 2 comes last and runs beside the last of them.
    sent = [build_report.apply_async((1, log, work), queue=worker.queue) for _ in range(4)]
    sent.append(build_report.apply_async((2, log, work), queue=worker.queue))
    results = [get(result, worker) for result in sent]

    done = runs(records, log)
    assert sorted(run["task_id"] for run in done) == sorted(result.id for result in sent)
    assert [result["task_id"] for result in results] == [result.id for result in sent]
    serial = sorted((run for run in done if run["customer_id"] == 1), key=lambda r: r["start"])
    overlaps = [(a, b) for a, b in pairwise(serial) if b["start"] < a["end"]]
    assert overlaps == [], f"runs of customer 1 overlapped: {overlaps}"
    assert max(run["waited"] for run in serial) > work / 2, "no run ever waited for the lock"
    other = next(run for run in done if run["customer_id"] == 2)
    assert any(run["start"] < other["end"] and other["start"] < run["end"] for run in serial), (
        "customer 2 did not run beside customer 1"
    )
    # The work ran in the pool's forked children, each renewing its own lease.
    assert len({run["pid"] for run in done}) == 2
    assert worker.pid not in {run["pid"] for run in done}
    assert all(run["renewers"] for run in done), "a child held its lock without a renewer"
    (parent,) = runs(records, f"worker-init:{mutex_prefix}")
    assert parent["pid"] == worker.pid and parent["renewers"], "no renewer before the fork"
    assert not Mutex("report:1").locked() and not Mutex("report:2").locked()


# -- a killed worker ----------------------------------------------------------


def test_killed_workers_lock_comes_back_after_its_lease_and_not_before(
    start_worker: Callable[..., CeleryWorker], records: redis.Redis, mutex_prefix: str
) -> None:
    holder = start_worker("prefork", concurrency=1)
    waiter = start_worker("solo")
    log, go = f"crash:{mutex_prefix}", f"go:{mutex_prefix}"
    hold_until_told.apply_async(("nightly", log, go), queue=holder.queue)
    first = wait_until(lambda: runs(records, log), RESULT_TIMEOUT, "the first run's lock")[0]
    assert first["pid"] != holder.pid  # a child of the prefork pool holds it
    second = hold_until_told.apply_async(("nightly", log, go), queue=waiter.queue)

    entered = f"entered:{mutex_prefix}"
    wait_until(
        lambda: second.id in {run["task_id"] for run in runs(records, entered)},
        RESULT_TIMEOUT,
        "the second run asking for the lock",
    )
    # Held past a whole lease: the child's watchdog renews it.
    wait_until(lambda: time.time() - first["t"] > CRASH_TTL + 0.5, 2 * CRASH_TTL, "a long hold")
    owner = Mutex("crash:nightly").owner()
    assert owner is not None and owner.pid == first["pid"]
    assert len(runs(records, log)) == 1, "the waiter got the lock while its holder lived"

    killed_at = time.time()
    holder.kill()
    taken = wait_until(
        lambda: runs(records, log)[1:], CRASH_TTL + RESULT_TIMEOUT, "the lock after the kill"
    )[0]

    latency = taken["t"] - killed_at
    # The lease left at the kill is between two thirds of the TTL (renewed a
    # third into it) and the whole TTL; the bounds leave room for a slow machine.
    assert CRASH_TTL / 4 < latency < CRASH_TTL + 3.0, f"taken {latency:.2f}s after the kill"
    assert taken["pid"] == waiter.pid  # the solo pool runs tasks in the worker itself
    records.rpush(go, "go")
    assert get(second, waiter) == waiter.pid
    assert not Mutex("crash:nightly").locked()


# -- skip if already running ----------------------------------------------------


def test_skip_if_locked_task_succeeds_without_running_while_the_lock_is_held(
    start_worker: Callable[..., CeleryWorker], records: redis.Redis, mutex_prefix: str
) -> None:
    worker = start_worker("solo")
    log = f"refresh:{mutex_prefix}"
    holder = Mutex("refresh:7", ttl=60)
    assert holder.acquire()
    try:
        skipped = refresh.apply_async((7, log), queue=worker.queue)
        assert get(skipped, worker) is None
        assert skipped.state == "SUCCESS"
        failed = refresh_or_fail.apply_async((7, log), queue=worker.queue)
        with pytest.raises(LockContended, match="refresh:7"):
            get(failed, worker)
        assert failed.state == "FAILURE"
        # Another customer's refresh is not held up by customer 7's lock.
        assert get(refresh.apply_async((8, log), queue=worker.queue), worker) == "refreshed"
    finally:
        holder.release()
    assert get(refresh.apply_async((7, log), queue=worker.queue), worker) == "refreshed"

    assert [run["customer_id"] for run in runs(records, log)] == [8, 7]
    assert not Mutex("refresh:7").locked()


# -- the decorators and Celery's task decorator, without a worker -------------


def test_locked_task_still_has_its_arguments_checked_when_sent() -> None:
    with pytest.raises(TypeError, match="argument"):
        build_report.delay(1)
    with pytest.raises(TypeError, match="argument"):
        refresh.delay(1, "log", "extra")


def test_bound_task_fills_the_name_from_task_arguments_when_called_directly() -> None:
    app = Celery("direct")

    @app.task(bind=True)
    @mutex("report:{customer_id}")
    def report(self: Any, customer_id: int) -> int | None:
        assert isinstance(self, Task)  # bind=True: the task itself comes first
        owner = Mutex("report:42").owner()
        return owner.pid if owner else None

    assert report(42) == os.getpid()
    assert not Mutex("report:42").locked()


@pytest.mark.parametrize("decorator", [mutex("report"), skip_if_locked("report")])
def test_lock_decorator_above_the_task_decorator_is_refused(decorator: Any) -> None:
    app = Celery("misordered")

    def report() -> None:
        pass

    with pytest.raises(TypeError, match="put it below the task decorator"):
        decorator(app.task(report))
