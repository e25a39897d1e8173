"""A holder's idea of its lease never outlasts the key in Redis, and no server stalls another.

Leases are counted from when the command that granted or renewed them was
sent. A waiter woken late (its loop or thread paused) asks Redis before it
claims the lock; a quorum hold counts only on its validity; one Redis that
hangs delays neither another alias's renewals nor a quorum's acquisition; a
small socket timeout does not break blocking waits.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from django_redis_mutex import LockBackendUnavailable, LockLost, Mutex, mutex, signals
from django_redis_mutex.client import get_client
from django_redis_mutex.holds import Hold
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisServer
from django_redis_mutex.topology import _EXPIRY_MARGIN, wait_slice

from .helpers import cache_options, wait_until
from .topologies import extra_caches, master_entries, redis_servers

ALIASES = ["v1", "v2", "v3"]


def _queue_length(name: str) -> int:
    return int(get_client("default").zcard(Mutex(name).keys.queue))


@given(
    pttl=st.integers(min_value=0, max_value=120_000),
    longest=st.floats(min_value=0.01, max_value=5.0),
    deadline_in=st.none() | st.floats(min_value=0.0, max_value=100.0),
)
def test_a_wait_never_outlasts_the_holders_lease(
    pttl: int, longest: float, deadline_in: float | None
) -> None:
    # Whatever the holder has left (0 included: under a millisecond), a waiter
    # checks in again by the time it expires, never a whole interval later.
    now = 1000.0
    deadline = None if deadline_in is None else now + deadline_in
    wait, _local = wait_slice(deadline, pttl, now, longest)
    slack = 1e-9  # float rounding of the deadline
    assert wait <= max(pttl / 1000 + _EXPIRY_MARGIN, 0.001) + slack
    assert wait <= max(longest, 0.001) + slack
    if deadline_in is not None:
        assert wait <= max(deadline_in, 0.001) + slack


def test_a_waiter_whose_loop_stalls_through_its_hand_over_lease_asks_redis_before_entering() -> (
    None
):
    name = "late-wake"
    holder = Mutex(name, ttl=1)
    assert holder.acquire()
    loop_ready = threading.Event()
    stalled = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []
    entered: list[float] = []
    third: dict[str, float] = {}

    async def waiter() -> None:
        loop_box.append(asyncio.get_running_loop())
        loop_ready.set()
        lock = Mutex(name, ttl=1, timeout=20)
        assert await lock.aacquire()
        entered.append(time.monotonic())
        await lock.arelease()

    def third_party() -> None:
        lock = Mutex(name, ttl=1, timeout=20)
        assert lock.acquire()
        third["in"] = time.monotonic()
        # Hold until the stalled waiter's loop has long resumed.
        wait_until(lambda: time.monotonic() - third["in"] > 2.5, 10, "the third party's hold")
        third["out"] = time.monotonic()
        lock.release()

    waiter_thread = threading.Thread(target=lambda: asyncio.run(waiter()))
    waiter_thread.start()
    assert loop_ready.wait(10)
    wait_until(lambda: _queue_length(name) == 1, 10, "the async waiter to queue")
    third_thread = threading.Thread(target=third_party)
    third_thread.start()
    wait_until(lambda: _queue_length(name) == 2, 10, "the third party to queue")

    def stall() -> None:
        stalled.set()
        time.sleep(2.0)  # the event loop is frozen: longer than the 1 s hand-over lease

    loop_box[0].call_soon_threadsafe(stall)
    assert stalled.wait(10)
    holder.release()  # hands the lock to the stalled waiter, with a 1 s lease
    third_thread.join(30)
    waiter_thread.join(30)
    assert entered and "out" in third
    # The third party took the lapsed hand-over; the stalled waiter entered only after it left.
    assert entered[0] >= third["out"], (entered[0] - third["in"], third["out"] - third["in"])


def test_a_waiter_whose_loop_stalls_after_it_was_woken_asks_redis_before_entering() -> None:
    # The wake-up came in time and passed its check; then the loop stalled
    # (here in a callback queued by a lock_waiting receiver) past the 4 s
    # hand-over lease but within the 8 s TTL, before the caller's task ran
    # again. The lapsed hand-over used to go to the next waiter, and the
    # stalled waiter to enter beside it.
    name = "stalled-after-wake"
    holder = Mutex(name, ttl=8, watchdog=False)
    assert holder.acquire()
    loop_box: list[asyncio.AbstractEventLoop] = []
    resumed = threading.Event()
    entered: list[float] = []
    third: dict[str, float] = {}

    def stall() -> None:
        time.sleep(6.0)  # the event loop is frozen: past the hand-over lease, within the TTL
        resumed.set()

    def stall_after_wake(sender: Any, **kwargs: Any) -> None:
        running = asyncio._get_running_loop()
        ours = running is not None and running is loop_box[0]
        if ours and not kwargs["waiting"] and not resumed.is_set():
            running.call_soon(stall)

    async def waiter() -> None:
        loop_box.append(asyncio.get_running_loop())
        lock = Mutex(name, ttl=8, timeout=30)
        assert await lock.aacquire()
        entered.append(time.monotonic())
        entered.append(time.monotonic())  # leaving: the release is sent after this
        await lock.arelease()

    def third_party() -> None:
        lock = Mutex(name, ttl=8, timeout=30)
        assert lock.acquire()
        third["in"] = time.monotonic()
        # Hold until the stalled waiter's loop has resumed, and a while after.
        assert resumed.wait(30)
        wait_until(lambda: time.monotonic() - third["in"] > 4.0, 10, "the third party's hold")
        third["out"] = time.monotonic()
        lock.release()

    signals.lock_waiting.connect(stall_after_wake)
    try:
        waiter_thread = threading.Thread(target=lambda: asyncio.run(waiter()))
        waiter_thread.start()
        wait_until(lambda: _queue_length(name) == 1, 10, "the async waiter to queue")
        third_thread = threading.Thread(target=third_party)
        third_thread.start()
        wait_until(lambda: _queue_length(name) == 2, 10, "the third party to queue")
        holder.release()  # hands the lock to the async waiter, with a 4 s lease
        third_thread.join(40)
        waiter_thread.join(40)
    finally:
        signals.lock_waiting.disconnect(stall_after_wake)
    assert len(entered) == 2 and "out" in third
    # Adopted and watched as soon as Redis handed it over, the hold was renewed
    # through the stall: the stalled waiter kept the lock, and the third party
    # got it only after the waiter left. Never both inside at once.
    assert third["in"] >= entered[1], (third["in"] - entered[0], entered[1] - entered[0])


# -- quorum validity and per-master deadlines -----------------------------------------------


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(ALIASES)) as servers:
        yield servers


@pytest.fixture
def quorum(masters: list[RedisServer], mutex_prefix: str) -> Iterator[list[RedisServer]]:
    with extra_caches(master_entries(masters, ALIASES, mutex_prefix, TIMEOUT=2)):
        yield masters
    for server in masters:
        server.resume()


def test_a_quorum_hold_counts_only_on_its_validity_from_when_the_requests_were_sent(
    quorum: list[RedisServer],
) -> None:
    lock = Mutex("validity", using=ALIASES, ttl=2, watchdog=False)
    before = time.monotonic()
    assert lock.acquire()
    after = time.monotonic()
    hold = lock._current()
    assert hold is not None
    drift = 2 * 0.01 + 0.002
    # Never later than the lease from the first send, less the drift allowance.
    assert before + 2 - drift - 0.001 <= hold.expires_at <= after + 2 - drift
    lock.release()


def test_a_quorum_hold_whose_validity_runs_out_without_a_majority_renewal_is_lost(
    quorum: list[RedisServer],
) -> None:
    lost: list[str] = []

    def on_lost(sender: Any, name: str, **kwargs: Any) -> None:
        if name == "majority-gone":  # not a leftover hold of another test
            lost.append(name)

    signals.lock_lost.connect(on_lost)
    try:
        with (
            pytest.raises(LockLost, match="validity"),
            mutex("majority-gone", using=ALIASES, ttl=1),
        ):
            quorum[0].pause()
            quorum[1].pause()
            wait_until(lambda: lost, 10, "the hold to be declared lost")
            quorum[0].resume()
            quorum[1].resume()
    finally:
        signals.lock_lost.disconnect(on_lost)
        for server in quorum:
            server.resume()
    assert lost == ["majority-gone"]


def test_a_quorum_hold_is_renewed_before_its_validity_runs_out(
    quorum: list[RedisServer],
) -> None:
    with mutex("renewed-in-time", using=ALIASES, ttl=0.8) as lock:
        start = time.monotonic()
        wait_until(lambda: time.monotonic() - start > 2.4, 5, "three leases to pass")
        assert not lock.lost and lock.owned()


def test_one_hung_quorum_master_does_not_delay_a_quorum_acquire(
    quorum: list[RedisServer],
) -> None:
    quorum[2].pause()
    try:
        started = time.monotonic()
        lock = Mutex("hung-master", using=ALIASES, timeout=1)
        assert lock.acquire()
        took = time.monotonic() - started
        lock.release()
        blocker = Mutex("hung-master-busy", using=ALIASES)
        assert blocker.acquire()
        started = time.monotonic()
        assert Mutex("hung-master-busy", using=ALIASES).acquire(timeout=1) is False
        waited = time.monotonic() - started
        blocker.release()
    finally:
        quorum[2].resume()
    # Bounded by QUORUM_TIMEOUT (0.05 s), not the 5 s socket timeout; generous
    # for a loaded machine.
    assert took < 2.5, took
    assert waited < 2.5, waited  # the caller's 1 s timeout, not a socket timeout per master


def test_a_hung_quorum_master_does_not_stall_renewals_of_an_unrelated_lock(
    quorum: list[RedisServer], raw: Any
) -> None:
    with mutex("quorum-side", using=ALIASES, ttl=3), mutex("plain-side", ttl=0.6) as plain:
        token = plain.token
        quorum[0].pause()
        try:
            start = time.monotonic()
            # Six leases of the plain lock while its quorum neighbour's master hangs.
            while time.monotonic() - start < 3.6:
                assert raw.hget(plain.keys.lock, "token").decode() == token
                assert raw.pttl(plain.keys.lock) > 0
                time.sleep(0.05)
        finally:
            quorum[0].resume()
        assert not plain.lost


def test_one_hung_quorum_master_with_a_slow_socket_timeout_still_lets_async_acquire(
    quorum: list[RedisServer],
) -> None:
    async def main() -> float:
        lock = Mutex("hung-async", using=ALIASES, timeout=1)
        started = time.monotonic()
        assert await lock.aacquire()
        took = time.monotonic() - started
        await lock.arelease()
        return took

    quorum[1].pause()
    try:
        took = asyncio.run(main())
    finally:
        quorum[1].resume()
    assert took < 1.0, took


def test_two_hung_quorum_masters_fail_fast_and_clearly(quorum: list[RedisServer]) -> None:
    quorum[0].pause()
    quorum[1].pause()
    try:
        started = time.monotonic()
        with pytest.raises(LockBackendUnavailable, match="2 of 3"):
            Mutex("two-hung", using=ALIASES, timeout=1).acquire()
        took = time.monotonic() - started
    finally:
        quorum[0].resume()
        quorum[1].resume()
    assert took < 1.5, took


# -- small socket timeouts ------------------------------------------------------------------


@pytest.fixture
def small_socket_timeout() -> Iterator[None]:
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["OPTIONS"] = {
        **caches["default"].get("OPTIONS", {}),
        **cache_options(socket_timeout=0.3),
    }
    with override_settings(CACHES=caches):
        yield


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_contended_waits_succeed_with_a_small_socket_timeout(
    small_socket_timeout: None, mode: str
) -> None:
    holder = Mutex("small-timeout")
    assert holder.acquire()
    results: list[Any] = []

    def wait_sync() -> None:
        lock = Mutex("small-timeout", timeout=15)
        try:
            results.append(lock.acquire())
            lock.release()
        except BaseException as exc:
            results.append(exc)

    def wait_async() -> None:
        async def main() -> bool:
            lock = Mutex("small-timeout", timeout=15)
            got = await lock.aacquire()
            await lock.arelease()
            return got

        try:
            results.append(asyncio.run(main()))
        except BaseException as exc:
            results.append(exc)

    waiters = [
        threading.Thread(target=wait_sync if mode == "sync" else wait_async) for _ in range(3)
    ]
    for waiter in waiters:
        waiter.start()
    wait_until(lambda: _queue_length("small-timeout") == 3, 10, "three waiters in line")
    # Hold for several socket timeouts, so each waiter blocks on Redis many times over.
    held_since = time.monotonic()
    wait_until(lambda: time.monotonic() - held_since > 3.0, 6, "the holder's section")
    holder.release()
    for waiter in waiters:
        waiter.join(30)
    assert results == [True, True, True], results
    assert not Mutex("small-timeout").locked()
    assert _queue_length("small-timeout") == 0


def test_a_waiter_process_paused_through_its_hand_over_lease_asks_redis_before_entering(
    spawn: Any,
) -> None:
    import os
    import signal

    name = "paused-waiter"
    holder = Mutex(name)
    assert holder.acquire()
    waiter = spawn("wait.py", name, 60)
    waiter.expect("waiting")
    wait_until(lambda: _queue_length(name) == 1, 10, "the waiter process to queue")
    third: dict[str, float] = {}

    def third_party() -> None:
        lock = Mutex(name, timeout=30)
        assert lock.acquire()
        third["in"] = time.time()
        # Hold until well after the paused waiter was resumed.
        wait_until(lambda: "resumed" in third and time.time() - third["resumed"] > 1.0, 30, "hold")
        third["out"] = time.time()
        lock.release()

    thread = threading.Thread(target=third_party)
    thread.start()
    wait_until(lambda: _queue_length(name) == 2, 10, "the third party to queue")
    os.kill(waiter.pid, signal.SIGSTOP)
    try:
        holder.release()  # handed to the paused waiter with the 4 s hand-over lease
        wait_until(lambda: "in" in third, 15, "the third party to take the lapsed hand-over")
    finally:
        os.kill(waiter.pid, signal.SIGCONT)
        third["resumed"] = time.time()
    acquired = waiter.expect("acquired", timeout=30)
    thread.join(30)
    assert acquired["t"] >= third["out"], (acquired["t"] - third["in"], third["out"] - third["in"])


def test_a_renewal_answered_after_a_later_extend_leaves_the_later_lease_unmarked() -> None:
    # The watchdog's renewal to the old 0.6 s lease was sent first; extend()
    # to 30 s was sent and confirmed before the renewal's answer came. The
    # answer must neither replace the later lease nor mark it for a renewal
    # at once: the mark belongs only to a lease the renewal itself set.
    hold = Hold("default", "h", LockKeys.for_name("tests", "h"), "t", fence=1, ttl=30.0, owner=None)
    hold.confirm("default", sent=10.0, ttl=30.0)
    hold.confirm("default", sent=5.0, ttl=0.6, renew_now=True)
    lease = hold.leases["default"]
    assert (lease.sent, lease.ttl, lease.renew_now) == (10.0, 30.0, False)
    assert hold.next_renewal("default") == 10.0 + 30.0 / 3
    # A renewal that set the lease, to a length extend() changed since, is
    # due again at once.
    hold.confirm("default", sent=20.0, ttl=0.6, renew_now=True)
    assert hold.leases["default"].renew_now
    assert hold.next_renewal("default") == 0.0
