"""Exclusion under faults, checked on a history: killed holders, Redis restarts, bad networks.

Workers (``tests/workers/fault_*.py``) are real processes with several threads
that run critical sections on real locks and report every section (lock,
fence, enter and exit time, process, whether it was told it lost the lock) to
``tests/history.py``, whose checker finds any two sections that overlapped
without one of them being told, and any fence out of order. Each section also
bumps a counter with a non-atomic GET then SET, so broken exclusion would also
show up as lost updates. The faults are real: SIGKILL of a holder, SIGKILL and
restart of a dedicated redis-server, and a loopback proxy (``tests/proxy.py``)
that adds latency, stalls, or cuts every connection between the app and Redis.

The first tests check the checker itself on hand-made histories, so that a
clean result from the fault tests means something.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from django_redis_mutex import LockBackendUnavailable, Mutex
from django_redis_mutex.client import BLOCKING_GRACE
from django_redis_mutex.scripts import WAIT_LEASE
from django_redis_mutex.testing import RedisServer

from .helpers import run_worker, wait_until
from .history import History, Section
from .proxy import Proxy

# Generous bounds: these tests run on a busy 2-core machine.
START_TIMEOUT = 30.0
STEP_TIMEOUT = 30.0
# Slack on every "within N seconds" bound for scheduling delays under load.
SLACK = 0.5


class BrokenExclusion(AssertionError):
    """Two owners held one lock (what the failed-release regression tests guard against)."""


# -- the checker on hand-made histories ---------------------------------------------------


def section(
    fence: int, enter: float, exit: float, *, lost: bool = False, pid: int = 1, name: str = "x"
) -> Section:
    return Section(name=name, fence=fence, enter=enter, exit=exit, pid=pid, lost=lost)


def test_checker_accepts_back_to_back_sections_with_growing_fences() -> None:
    history = History([section(1, 0.0, 1.0), section(2, 1.0, 2.0, pid=2), section(5, 2.5, 3.0)])

    assert history.violations() == []
    assert history.counter_violations({"x": 3}) == []


def test_checker_flags_two_sections_that_overlap() -> None:
    history = History([section(1, 0.0, 1.0), section(2, 0.9, 2.0, pid=2)])

    found = history.violations()

    assert len(found) == 1
    assert "overlap by 100.000 ms" in found[0]
    assert "neither was told it lost the lock" in found[0]


def test_checker_flags_a_short_section_inside_a_long_one_after_others() -> None:
    history = History([section(1, 0.0, 10.0), section(2, 1.0, 2.0), section(3, 3.0, 4.0)])

    assert len(history.violations()) == 2


def test_checker_excuses_an_overlap_with_a_section_told_it_lost_the_lock() -> None:
    history = History([section(1, 0.0, 5.0, lost=True), section(2, 2.0, 3.0, pid=2)])

    assert history.violations() == []


def test_checker_flags_a_fence_that_goes_backwards() -> None:
    history = History([section(7, 0.0, 1.0), section(6, 1.5, 2.0, pid=2)])

    found = history.violations()

    assert len(found) == 1
    assert "fence went backwards" in found[0]


def test_checker_flags_a_fence_handed_out_twice() -> None:
    history = History([section(3, 0.0, 1.0, lost=True), section(3, 2.0, 3.0, pid=2)])

    assert any("fence 3 was handed to 2 sections" in v for v in history.violations())


def test_checker_keeps_locks_of_different_names_apart() -> None:
    history = History([section(1, 0.0, 1.0, name="a"), section(1, 0.5, 1.5, name="b")])

    assert history.violations() == []


def test_checker_flags_lost_increments() -> None:
    history = History([section(1, 0.0, 1.0), section(2, 1.0, 2.0)])

    found = history.counter_violations({"x": 1})

    assert found == [
        "lock 'x': counter is 1 after 2 sections (0 told they lost the lock); "
        "expected 2, so 1 increments were lost"
    ]


def test_checker_allows_increments_lost_only_by_sections_told_they_lost() -> None:
    history = History([section(1, 0.0, 3.0, lost=True), section(2, 1.0, 2.0), section(3, 3, 4)])

    assert history.counter_violations({"x": 2}) == []
    assert len(history.counter_violations({"x": 1})) == 1


def test_history_loads_sections_from_worker_output_and_skips_other_events() -> None:
    output = "\n".join(
        [
            json.dumps({"event": "ready", "pid": 9, "t": 1.0}),
            json.dumps(
                {
                    "event": "section",
                    "name": "x",
                    "fence": 4,
                    "enter": 1.0,
                    "exit": 2.0,
                    "pid": 9,
                    "thread": "contender-0",
                    "lost": False,
                    "wait": 0.1,
                }
            ),
            json.dumps({"event": "done", "pid": 9, "t": 3.0}),
        ]
    )
    history = History()

    assert history.load_from_worker_output(output) == 1
    assert history.sections == [Section("x", 4, 1.0, 2.0, 9, "contender-0", False, 0.1)]


# -- the proxy on its own --------------------------------------------------------------------


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Proxy]:
    """A proxy in front of the session's Redis."""
    with Proxy(port_of(redis_url)) as running:
        yield running


def round_trip(client: redis.Redis) -> float:
    started = time.monotonic()
    assert client.ping()
    return time.monotonic() - started


def test_proxy_delays_each_round_trip_by_its_latency_both_ways(proxy: Proxy) -> None:
    client = redis.Redis.from_url(proxy.url, socket_timeout=5)
    try:
        fast = min(round_trip(client) for _ in range(5))
        proxy.latency = 0.05
        slow = min(round_trip(client) for _ in range(3))
    finally:
        client.close()

    assert fast < 0.05
    assert 0.1 <= slow < 0.1 + 0.2


def test_proxy_stall_times_out_a_command_and_resume_serves_a_new_one(proxy: Proxy) -> None:
    client = redis.Redis.from_url(proxy.url, socket_timeout=0.3)
    try:
        assert client.ping()
        proxy.stall()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        proxy.resume()
        assert client.ping()
    finally:
        client.close()


def test_proxy_cut_fails_a_blocked_command_at_once(proxy: Proxy, raw: redis.Redis) -> None:
    # Named, so the wait below sees this client's BLPOP and not one another test left
    # blocked on the shared server (cutting before our BLPOP is sent lets redis-py
    # reconnect quietly, and the BLPOP would then just time out).
    client = redis.Redis.from_url(proxy.url, socket_timeout=5, client_name="proxy-cut-blocker")
    failures: list[tuple[BaseException, float]] = []

    def block() -> None:
        started = time.monotonic()
        try:
            client.blpop(["proxy-test:never"], timeout=4)
        except BaseException as exc:
            failures.append((exc, time.monotonic() - started))

    blocker = threading.Thread(target=block)
    try:
        blocker.start()
        wait_until(
            lambda: any(
                c["cmd"] == "blpop" and c["name"] == "proxy-cut-blocker" for c in raw.client_list()
            ),
            5,
            "the BLPOP reaching Redis",
        )
        assert proxy.cut() == 1
        blocker.join(5)
    finally:
        client.close()

    assert len(failures) == 1
    error, took = failures[0]
    assert isinstance(error, redis.ConnectionError)
    assert took < 1.0


# -- workers -----------------------------------------------------------------------------------


class WorkerRun:
    """A worker script running as its own process; threads read its reports as they come."""

    def __init__(self, script: str, *args: object) -> None:
        self.script = script
        self.process = run_worker(script, *map(str, args))
        self.events: list[dict[str, Any]] = []
        self._stderr: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_events(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line}
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr.append(line)

    def describe(self) -> str:
        stderr = "".join(self._stderr[-30:]).strip()
        last = self.events[-5:]
        return (
            f"worker {self.script} (pid {self.pid}, exit {self.process.poll()}); "
            f"last events {last}; stderr tail:\n{stderr or '(empty)'}"
        )

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Return the reports of one kind received so far."""
        with self._changed:
            return [event for event in self.events if event["event"] == kind]

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Return once ``condition()`` holds; fail naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition():
                bad = [e for e in self.events if e["event"] in ("error", "garbage")]
                if bad:
                    raise AssertionError(f"{bad[0]} from {self.describe()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self._ended and not condition()):
                    raise AssertionError(
                        f"{what} did not happen within {timeout}s: {self.describe()}"
                    )
                self._changed.wait(min(remaining, 0.1))

    def expect(self, kind: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """Return the first report of ``kind``, waiting up to ``timeout`` seconds for it."""
        self.wait_for(
            lambda: any(e["event"] == kind for e in self.events), timeout, f"a {kind!r} report"
        )
        return self.of(kind)[0]

    def finish(self, timeout: float = STEP_TIMEOUT) -> int:
        """Wait for the exit and the end of the output; return the exit code."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"did not exit within {timeout}s: {self.describe()}") from None
        for reader in self._readers:
            reader.join(5)
        return self.process.returncode

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def start() -> Iterator[Callable[..., WorkerRun]]:
    """Start worker scripts; kill whatever is left of them after the test."""
    started: list[WorkerRun] = []

    def launch(script: str, *args: object) -> WorkerRun:
        started.append(WorkerRun(script, *args))
        return started[-1]

    yield launch
    for worker in started:
        worker.close()


@pytest.fixture
def data_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a workload key of this test (outside the lock namespace)."""
    stem = f"faults:{mutex_prefix}"

    def key(purpose: str) -> str:
        return f"{stem}:{purpose}"

    yield key
    stale = list(raw.scan_iter(match=f"{stem}:*"))
    if stale:
        raw.delete(*stale)


def start_together(raw: redis.Redis, barrier: str, workers: list[WorkerRun]) -> None:
    """Wait until every worker is ready, then let them all go at once."""
    for worker in workers:
        worker.expect("ready", timeout=START_TIMEOUT)
    raw.rpush(barrier, *["go"] * len(workers))


def sections_entered_after(workers: list[WorkerRun], moment: float) -> int:
    return sum(1 for w in workers for s in w.of("section") if s["enter"] > moment)


def wait_for_sections(
    workers: list[WorkerRun], after: float, count: int, timeout: float, what: str
) -> None:
    """Wait until ``count`` sections were entered after ``after`` across ``workers``."""
    wait_until(lambda: sections_entered_after(workers, after) >= count, timeout, what)


def stop_and_collect(
    raw: redis.Redis, stop: str, workers: list[WorkerRun], timeout: float
) -> History:
    """Stop the workers, check each exits cleanly in time, and return their history."""
    raw.rpush(stop, *["stop"] * len(workers))
    history = History()
    for worker in workers:
        assert worker.finish(timeout) == 0, worker.describe()
        history.load_from_worker_output(worker.events)
    return history


def counters(raw: redis.Redis, counter: str, history: History) -> dict[str, int]:
    """Return the final counter of every lock name in ``history``."""
    names = history.names()
    values = raw.mget([f"{counter}:{name}" for name in names]) if names else []
    return {name: int(value or 0) for name, value in zip(names, values, strict=True)}


def failures(workers: list[WorkerRun]) -> list[dict[str, Any]]:
    return [event for worker in workers for event in worker.of("failure")]


def socket_options(seconds: float) -> dict[str, float]:
    """Return the default alias's socket timeout OPTIONS, both set to ``seconds``."""
    builtin = settings.CACHES["default"]["BACKEND"].startswith("django.core.")
    names = (
        ("socket_timeout", "socket_connect_timeout")
        if builtin
        else ("SOCKET_TIMEOUT", "SOCKET_CONNECT_TIMEOUT")
    )
    return dict.fromkeys(names, seconds)


def sections_args(name: str, counter: str, barrier: str, **options: object) -> list[str]:
    """Build a fault_sections.py command line."""
    args = ["--name", name, "--counter", counter, "--barrier", barrier]
    for option, value in options.items():
        if value is False:
            continue
        flag = "--" + option.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


# -- a holder is killed -----------------------------------------------------------------------


def test_waiter_takes_over_promptly_when_a_killed_holders_lease_ends(
    start: Callable[..., WorkerRun], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    ttl = 2.0
    counter = data_key("counter")
    holder = start("fault_hold.py", "killed", ttl, counter, data_key("holder-gate"))
    waiter = start(
        "fault_sections.py",
        *sections_args("killed", counter, data_key("waiter-gate"), iterations=1, ttl=5, timeout=10),
    )
    holder.expect("ready", START_TIMEOUT)
    waiter.expect("ready", START_TIMEOUT)

    raw.rpush(data_key("holder-gate"), "go")
    acquired = holder.expect("acquired")
    raw.rpush(data_key("waiter-gate"), "go")
    wait_until(lambda: raw.zcard(Mutex("killed").keys.queue) == 1, 10, "the waiter queueing")
    killed_at = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    assert killed_at < acquired["before"] + ttl, "too slow: the lease ran out before the kill"
    waiter.expect("done")
    assert waiter.finish() == 0, waiter.describe()
    assert holder.finish() == -signal.SIGKILL

    history = History()
    history.add(
        name="killed",
        fence=acquired["fence"],
        enter=acquired["after"],
        exit=killed_at,
        pid=holder.pid,
        thread="MainThread",
    )
    assert history.load_from_worker_output(waiter.events) == 1
    taken = history.sections[1]
    takeover = taken.enter - (acquired["after"] + ttl)
    print(f"\ntakeover {takeover * 1000:.1f} ms after the killed holder's lease ended")
    assert taken.enter >= acquired["before"] + ttl - 0.01, "taken before the lease ended"
    # The waiter's BLPOP times out on Redis's timer, which fires up to one tick late (1/hz:
    # 100 ms at the default hz 10); then one round trip. Plus slack for a loaded machine,
    # still well below the waiter's 1 s check-in.
    assert takeover < 0.1 + 0.05 + 0.35, f"taken {takeover * 1000:.1f} ms after the lease ended"
    assert history.violations() == []
    assert history.counter_violations(counters(raw, counter, history)) == []
    assert not Mutex("killed").locked()


# -- Redis is killed and restarted --------------------------------------------------------------
#
# A thread whose release failed never re-enters its old hold without asking Redis
# (test_failed_release_is_never_reentered_without_asking_redis); the workers below may
# therefore use reentrant handles.


def test_redis_restart_fails_waiters_promptly_and_no_holders_overlap_after_it(
    start: Callable[..., WorkerRun], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    socket_timeout, timeout, ttl = 1.0, 3.0, 2.0
    counter, barrier, stop = data_key("counter"), data_key("barrier"), data_key("stop")
    with RedisServer() as server:
        locks = redis.Redis.from_url(server.url)
        keys = Mutex("restart").keys
        workers = [
            start(
                "fault_sections.py",
                *sections_args(
                    "restart",
                    counter,
                    barrier,
                    stop=stop,
                    threads=2,
                    hold=0.05,
                    ttl=ttl,
                    timeout=timeout,
                    lock_url=server.url,
                    socket_timeout=socket_timeout,
                    no_reentrant=False,
                ),
            )
            for _ in range(3)
        ]
        start_together(raw, barrier, workers)
        wait_for_sections(workers, 0, 10, STEP_TIMEOUT, "10 sections before the restart")
        wait_until(
            lambda: locks.exists(keys.lock) and locks.zcard(keys.queue) >= 2,
            10,
            "a holder with two waiters",
        )

        killed_at = time.time()
        server.kill()
        for worker in workers:
            worker.wait_for(
                lambda w=worker: any(f["t"] > killed_at for f in w.of("failure")),
                STEP_TIMEOUT,
                "a failure after Redis died",
            )
        server.start()
        restarted_at = time.time()
        wait_for_sections(workers, restarted_at, 10, STEP_TIMEOUT, "10 sections after the restart")
        history = stop_and_collect(raw, stop, workers, timeout + 2 * socket_timeout + STEP_TIMEOUT)
        locks.close()

    assert history.violations() == []
    assert history.counter_violations(counters(raw, counter, history)) == []
    # Only sections that straddled the restart can have lost their lock, and they were told.
    assert all(s.enter < restarted_at for s in history.lost()), history.lost()
    problems = failures(workers)
    assert {f["error"] for f in problems} == {"LockBackendUnavailable"}
    first_failures: dict[tuple[int, str], float] = {}
    for f in sorted(problems, key=lambda f: f["t"]):
        if f["t"] > killed_at:
            first_failures.setdefault((f["pid"], f["thread"]), f["t"] - killed_at)
    print(
        f"\nfirst failure per thread after Redis died (s): {sorted(first_failures.values())}; "
        f"{len(history.lost())} sections told they lost the lock at the restart"
    )
    assert max(first_failures.values()) < socket_timeout + SLACK, first_failures
    longest = max(w.expect("done")["max_acquire"] for w in workers)
    assert longest < timeout + 2 * socket_timeout + SLACK, f"an acquire took {longest:.3f}s"


# -- a slow, stalled or broken network ----------------------------------------------------------


def test_sections_stay_exclusive_and_leases_renew_through_20ms_latency(
    start: Callable[..., WorkerRun],
    raw: redis.Redis,
    data_key: Callable[[str], str],
    proxy: Proxy,
) -> None:
    ttl, hold = 0.6, 0.7
    counter, barrier = data_key("counter"), data_key("barrier")
    proxy.latency = 0.02
    workers = [
        start(
            "fault_sections.py",
            *sections_args(
                "slow",
                counter,
                barrier,
                names=2,
                threads=2,
                hold=hold,
                ttl=ttl,
                timeout=15,
                duration=4,
                lock_url=proxy.url,
            ),
        )
        for _ in range(3)
    ]
    start_together(raw, barrier, workers)
    history = History()
    for worker in workers:
        assert worker.finish(STEP_TIMEOUT) == 0, worker.describe()
        history.load_from_worker_output(worker.events)

    assert len(history) >= 8
    assert history.violations() == []
    assert history.lost() == [], "a lease ran out although the watchdog renewed it"
    assert history.counter_violations(counters(raw, counter, history)) == []
    # Every section outlived its lease: renewals went through the delay.
    assert min(s.exit - s.enter for s in history.sections) > ttl
    assert failures(workers) == []


class StallRun:
    """Sections on one lock through the proxy, with a stall longer than the socket timeout."""

    socket_timeout, timeout, ttl = 1.0, 5.0, 3.0

    def __init__(
        self,
        start: Callable[..., WorkerRun],
        raw: redis.Redis,
        data_key: Callable[[str], str],
        proxy: Proxy,
        *,
        reentrant: bool,
    ) -> None:
        counter, barrier, stop = data_key("counter"), data_key("barrier"), data_key("stop")
        self.workers = workers = [
            start(
                "fault_sections.py",
                *sections_args(
                    "stalled",
                    counter,
                    barrier,
                    stop=stop,
                    threads=2,
                    hold=0.2,
                    ttl=self.ttl,
                    timeout=self.timeout,
                    lock_url=proxy.url,
                    socket_timeout=self.socket_timeout,
                    no_reentrant=not reentrant,
                ),
            )
            for _ in range(2)
        ]
        start_together(raw, barrier, workers)
        wait_for_sections(workers, 0, 5, STEP_TIMEOUT, "5 sections before the stall")
        # Stall while a section runs, so its holder's release is caught in the stall.
        wait_until(lambda: bool(raw.exists(Mutex("stalled").keys.lock)), 10, "a holder")

        self.stalled_at = time.time()
        proxy.stall()
        try:
            for worker in workers:
                worker.wait_for(
                    lambda w=worker: len({f["thread"] for f in w.of("failure")}) == 2,
                    STEP_TIMEOUT,
                    "a failure in each thread during the stall",
                )
        finally:
            proxy.resume()
        self.resumed_at = time.time()
        wait_for_sections(workers, self.resumed_at, 5, STEP_TIMEOUT, "5 sections after the stall")
        self.history = stop_and_collect(
            raw, stop, workers, self.timeout + 2 * self.socket_timeout + STEP_TIMEOUT
        )
        self.counts = counters(raw, counter, self.history)


def test_stall_longer_than_socket_timeout_fails_operations_within_a_read_timeout(
    start: Callable[..., WorkerRun],
    raw: redis.Redis,
    data_key: Callable[[str], str],
    proxy: Proxy,
) -> None:
    run = StallRun(start, raw, data_key, proxy, reentrant=False)

    during = [f for f in failures(run.workers) if run.stalled_at < f["t"] <= run.resumed_at]
    print(
        "\nfailures into the stall (s): "
        f"{sorted((f['op'], round(f['t'] - run.stalled_at, 3)) for f in during)}"
    )
    assert {f["error"] for f in during} == {"LockBackendUnavailable"}
    # A release or a first acquire fails after one socket timeout; a queued waiter once
    # its blocking read times out: the socket timeout plus its longest wait slice (a
    # blocking pop must not be cut short by a small socket timeout) plus a grace.
    blocking_read = run.socket_timeout + WAIT_LEASE / 2 + BLOCKING_GRACE
    late = [f for f in during if f["t"] - run.stalled_at > blocking_read + SLACK]
    assert late == [], f"failed later than a blocking read timeout into the stall: {late}"
    releases = [f["took"] for f in during if f["op"] == "release"]
    assert releases, "no release was caught in the stall"
    assert max(releases) < run.socket_timeout + SLACK
    longest = max(w.expect("done")["max_acquire"] for w in run.workers)
    assert longest < run.timeout + 2 * run.socket_timeout + SLACK, f"an acquire took {longest}s"
    assert run.history.violations() == []
    assert run.history.counter_violations(run.counts) == []


def test_reentrant_sections_stay_exclusive_through_a_stall(
    start: Callable[..., WorkerRun],
    raw: redis.Redis,
    data_key: Callable[[str], str],
    proxy: Proxy,
) -> None:
    run = StallRun(start, raw, data_key, proxy, reentrant=True)

    found = run.history.violations()
    if found:
        raise BrokenExclusion(f"{len(found)} violations, first: {found[0]}")


def test_cut_connections_fail_operations_cleanly_and_never_make_two_holders(
    start: Callable[..., WorkerRun],
    raw: redis.Redis,
    data_key: Callable[[str], str],
    proxy: Proxy,
) -> None:
    timeout, ttl, cuts = 5.0, 1.5, 5
    counter, barrier, stop = data_key("counter"), data_key("barrier"), data_key("stop")
    workers = [
        start(
            "fault_sections.py",
            *sections_args(
                "cut",
                counter,
                barrier,
                stop=stop,
                threads=2,
                hold=0.01,
                ttl=ttl,
                timeout=timeout,
                lock_url=proxy.url,
                socket_timeout=2,
                no_reentrant=False,
            ),
        )
        for _ in range(3)
    ]
    start_together(raw, barrier, workers)
    wait_for_sections(workers, 0, 10, STEP_TIMEOUT, "10 sections before the first cut")

    for _ in range(cuts):
        cut_at = time.time()
        assert proxy.cut() > 0
        wait_for_sections(workers, cut_at, 5, STEP_TIMEOUT, "5 sections after a cut")
    history = stop_and_collect(raw, stop, workers, timeout + STEP_TIMEOUT)

    assert history.violations() == []
    assert history.counter_violations(counters(raw, counter, history)) == []
    problems = failures(workers)
    print(f"\n{cuts} cuts: {len(problems)} operations failed, {len(history)} sections")
    assert len(problems) >= cuts, "the cuts broke no operation in flight"
    assert {f["error"] for f in problems} == {"LockBackendUnavailable"}
    assert max((f["took"] for f in problems if f["op"] == "release"), default=0) < 2 + SLACK


# -- the engine bug the stall exposed, on its own -------------------------------------------------


@contextmanager
def default_alias_through(proxy: Proxy) -> Iterator[None]:
    """Send the default alias through ``proxy`` (0.5 s socket timeouts); "direct" bypasses it."""
    caches = copy.deepcopy(settings.CACHES)
    caches["direct"] = copy.deepcopy(caches["default"])
    caches["default"]["LOCATION"] = proxy.url
    caches["default"]["OPTIONS"] = {**caches["default"]["OPTIONS"], **socket_options(0.5)}
    with override_settings(CACHES=caches):
        yield


def test_failed_release_is_never_reentered_without_asking_redis(
    raw: redis.Redis, proxy: Proxy
) -> None:
    with default_alias_through(proxy):
        with Mutex("zombie"):
            pass  # Redis now knows the scripts, so the late release below runs when it arrives
        first = Mutex("zombie", watchdog=False)
        assert first.acquire()
        proxy.stall()
        try:
            with pytest.raises(LockBackendUnavailable):
                first.release()
        finally:
            proxy.resume()
        # The release was only late: it reaches Redis now, and the lock is free.
        wait_until(lambda: not raw.exists(first.keys.lock), 10, "the late release")
        other = Mutex("zombie", using="direct", watchdog=False)
        assert other.acquire(blocking=False)
        try:
            again = Mutex("zombie", watchdog=False)
            if again.acquire(blocking=False):
                raise BrokenExclusion("re-entered a lock another owner holds, without asking Redis")
        finally:
            other.release()


def test_failed_arelease_is_never_reentered_without_asking_redis(
    raw: redis.Redis, proxy: Proxy
) -> None:
    async def scenario() -> None:
        async with Mutex("zombie"):
            pass  # Redis now knows the scripts, so the late release below runs when it arrives
        first = Mutex("zombie", watchdog=False)
        assert await first.aacquire()
        proxy.stall()
        try:
            with pytest.raises(LockBackendUnavailable):
                await first.arelease()
        finally:
            proxy.resume()
        wait_until(lambda: not raw.exists(first.keys.lock), 10, "the late release")
        other = Mutex("zombie", using="direct", watchdog=False)
        assert other.acquire(blocking=False)
        try:
            again = Mutex("zombie", watchdog=False)
            if await again.aacquire(blocking=False):
                raise BrokenExclusion("re-entered a lock another owner holds, without asking Redis")
        finally:
            other.release()

    with default_alias_through(proxy):
        asyncio.run(scenario())
