"""The four lock signals: each is sent once, by the alias, with its documented kwargs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.dispatch import Signal

from django_redis_mutex import (
    LockBackendUnavailable,
    LockLost,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
    reset,
    signals,
)
from django_redis_mutex.signals import lock_acquired, lock_contended, lock_lost, lock_released
from django_redis_mutex.testing import free_port

from .helpers import await_until, held_elsewhere, take_and_release, wait_until


class Received(list[dict[str, Any]]):
    """Every send of one signal: sender, kwargs (without ``signal``) and the sending thread."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()

    def __call__(self, sender: Any, signal: Signal, **kwargs: Any) -> None:
        self.append({"sender": sender, "kwargs": kwargs, "thread": threading.current_thread()})
        self.arrived.set()


@pytest.fixture
def receive() -> Iterator[Callable[[Signal], Received]]:
    """Return a function connecting a recorder to a signal for the rest of the test."""
    connected: list[tuple[Signal, Received]] = []

    def connect(signal: Signal) -> Received:
        received = Received()
        signal.connect(received, weak=False)
        connected.append((signal, received))
        return received

    yield connect
    for signal, received in connected:
        signal.disconnect(received)


def test_lock_acquired_is_sent_with_name_fence_and_wait(receive: Any) -> None:
    acquired = receive(lock_acquired)
    with mutex("inventory") as lock:
        fence = lock.fence
    [call] = acquired
    assert call["sender"] == "default"
    assert set(call["kwargs"]) == {"name", "fence", "wait", "waited", "shared"}
    assert call["kwargs"]["shared"] is False
    assert call["kwargs"]["waited"] is False  # the lock was free
    assert call["kwargs"]["name"] == "inventory"
    assert call["kwargs"]["fence"] == fence
    assert 0 <= call["kwargs"]["wait"] < 1


def test_lock_acquired_wait_counts_the_time_spent_queued(receive: Any) -> None:
    holder = Mutex("inventory")
    assert holder.acquire()
    acquired = receive(lock_acquired)
    started = time.monotonic()

    def wait_then_release() -> None:
        with mutex("inventory"):
            pass

    waiter = threading.Thread(target=wait_then_release)
    waiter.start()
    wait_until(lambda: held_locks()[0].waiters == 1)
    # Keep the waiter queued a while longer, so its wait is clearly more than a round trip.
    threading.Event().wait(0.2)
    queued_for = time.monotonic() - started
    holder.release()
    waiter.join(5)
    [call] = acquired
    assert call["thread"] is waiter
    assert queued_for - 0.05 <= call["kwargs"]["wait"] <= queued_for + 2
    assert call["kwargs"]["waited"] is True


def test_lock_released_is_sent_with_name_fence_and_time_held(receive: Any) -> None:
    released = receive(lock_released)
    before = time.monotonic()
    with mutex("inventory") as lock:
        fence = lock.fence
        assert released == []
    elapsed = time.monotonic() - before
    [call] = released
    assert call["sender"] == "default"
    assert set(call["kwargs"]) == {"name", "fence", "held", "shared", "databases"}
    assert call["kwargs"]["databases"] == ()
    assert call["kwargs"]["name"] == "inventory"
    assert call["kwargs"]["fence"] == fence
    assert 0 <= call["kwargs"]["held"] <= elapsed


def test_lock_contended_is_sent_with_retry_after_and_owner(receive: Any) -> None:
    contended = receive(lock_contended)
    with held_elsewhere("inventory", ttl=9, label="stock import"):
        assert not Mutex("inventory").acquire(blocking=False)
    [call] = contended
    assert call["sender"] == "default"
    assert set(call["kwargs"]) == {"name", "wait", "retry_after", "owner", "shared"}
    assert call["kwargs"]["name"] == "inventory"
    assert 0 <= call["kwargs"]["wait"] < 1
    assert 7 <= call["kwargs"]["retry_after"] <= 9
    owner = call["kwargs"]["owner"]
    assert owner.label == "stock import"
    assert owner.pid == os.getpid()


def test_lock_contended_wait_is_the_time_spent_before_giving_up(receive: Any) -> None:
    contended = receive(lock_contended)
    with held_elsewhere("inventory"):
        assert not Mutex("inventory", timeout=0.3).acquire()
    [call] = contended
    assert 0.3 <= call["kwargs"]["wait"] < 3


def test_lock_contended_is_not_sent_when_the_lock_is_had(receive: Any) -> None:
    contended = receive(lock_contended)
    with mutex("inventory"):
        pass
    assert contended == []


def test_lock_lost_is_sent_when_the_block_ends_without_the_lock(receive: Any) -> None:
    lost = receive(lock_lost)
    released = receive(lock_released)
    with pytest.raises(LockLost), mutex("inventory", watchdog=False) as lock:
        fence = lock.fence
        assert reset("inventory")
    [call] = lost
    assert call["sender"] == "default"
    assert set(call["kwargs"]) == {"name", "fence", "held", "shared"}
    assert call["kwargs"]["name"] == "inventory"
    assert call["kwargs"]["fence"] == fence
    assert call["kwargs"]["held"] >= 0
    assert call["thread"] is threading.current_thread()
    assert released == []


def test_lock_lost_is_sent_once_from_the_watchdog_when_renewal_fails(receive: Any) -> None:
    lost = receive(lock_lost)
    lock = Mutex("inventory", ttl=0.3)
    assert lock.acquire()
    assert reset("inventory")
    assert lost.arrived.wait(5), "the watchdog did not report the loss"
    [call] = lost
    assert call["thread"] is not threading.current_thread()
    assert call["kwargs"]["name"] == "inventory"
    assert call["kwargs"]["fence"] == lock.fence
    with pytest.raises(LockNotOwned):
        lock.release()
    assert len(lost) == 1


def test_signals_are_sent_by_the_cache_alias(
    receive: Any, settings: Any, mutex_prefix: str
) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "locks": {**settings.CACHES["default"], "MUTEX": {"PREFIX": mutex_prefix}},
    }
    acquired, released = receive(lock_acquired), receive(lock_released)
    with mutex("inventory", using="locks"):
        pass
    assert [call["sender"] for call in acquired + released] == ["locks", "locks"]


def test_reentrant_acquisition_sends_no_second_pair(receive: Any) -> None:
    acquired, released = receive(lock_acquired), receive(lock_released)
    with mutex("inventory"), mutex("inventory"):
        pass
    assert len(acquired) == 1
    assert len(released) == 1


def test_lock_released_tells_the_hold_exclusive_when_a_shared_handle_ends_it(
    receive: Any,
) -> None:
    """A shared handle joins its owner's exclusive hold; what ends is still that exclusive hold."""
    released = receive(lock_released)
    reader = Mutex("inventory", shared=True)
    with mutex("inventory"):
        assert reader.acquire()  # joins the block's exclusive hold
    assert released == []  # the reader still holds a level of it
    reader.release()
    [call] = released
    assert call["kwargs"]["shared"] is False


def test_failing_lock_acquired_receiver_gives_the_lock_back():
    def broken_receiver(**kwargs):
        raise RuntimeError("boom")

    signals.lock_acquired.connect(broken_receiver)
    try:
        with pytest.raises(RuntimeError, match="boom"), mutex("given-back", ttl=1):
            pass
    finally:
        signals.lock_acquired.disconnect(broken_receiver)
    assert not Mutex("given-back").locked()


def test_lock_waiting_is_sent_when_a_wait_starts_and_when_it_ends(receive: Any) -> None:
    waiting = receive(signals.lock_waiting)
    holder = Mutex("inventory")
    assert holder.acquire()
    waiter = threading.Thread(target=take_and_release, args=(Mutex("inventory"),))
    waiter.start()
    assert waiting.arrived.wait(5), "the waiter did not report its wait"
    assert [call["kwargs"] for call in waiting] == [{"name": "inventory", "waiting": True}]
    holder.release()
    waiter.join(5)
    assert [call["kwargs"]["waiting"] for call in waiting] == [True, False]
    assert {call["sender"] for call in waiting} == {"default"}
    assert {call["thread"] for call in waiting} == {waiter}


def test_lock_waiting_ends_when_the_wait_times_out(receive: Any) -> None:
    waiting = receive(signals.lock_waiting)
    with held_elsewhere("inventory"):
        assert not Mutex("inventory", timeout=0.2).acquire()
    assert [call["kwargs"]["waiting"] for call in waiting] == [True, False]


def test_lock_waiting_ends_when_the_waiting_task_is_cancelled(receive: Any) -> None:
    waiting = receive(signals.lock_waiting)

    async def cancel_a_waiter() -> None:
        task = asyncio.ensure_future(Mutex("inventory", timeout=30).aacquire())
        await await_until(lambda: len(waiting) == 1, what="the wait to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with held_elsewhere("inventory"):
        asyncio.run(cancel_a_waiter())
    assert [call["kwargs"]["waiting"] for call in waiting] == [True, False]


def test_lock_waiting_is_not_sent_without_a_wait(receive: Any) -> None:
    waiting = receive(signals.lock_waiting)
    with mutex("inventory"):
        pass
    with held_elsewhere("inventory"):
        assert not Mutex("inventory").acquire(blocking=False)
        assert not Mutex("inventory").acquire(timeout=0)
    assert waiting == []


def test_failing_lock_waiting_receiver_costs_the_waiter_nothing(
    receive: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_receiver(**kwargs: Any) -> None:
        raise RuntimeError("gauge down")

    signals.lock_waiting.connect(broken_receiver)
    try:
        with held_elsewhere("inventory", ttl=0.3, watchdog=False):
            waiter = Mutex("inventory", timeout=5)
            assert waiter.acquire()  # handed over when the holder's lease ran out
            waiter.release()
    finally:
        signals.lock_waiting.disconnect(broken_receiver)
    ours = [record for record in caplog.records if record.name == "django_redis_mutex"]
    assert ["gauge down" in record.getMessage() for record in ours] == [True, True]


def test_lock_unavailable_is_sent_when_redis_cannot_be_reached(receive: Any, settings: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "down": {**settings.CACHES["default"], "LOCATION": f"redis://127.0.0.1:{free_port()}/0"},
    }
    unavailable = receive(signals.lock_unavailable)
    with pytest.raises(LockBackendUnavailable) as raised:
        Mutex("inventory", using="down").acquire()
    [call] = unavailable
    assert call["sender"] == "down"
    assert set(call["kwargs"]) == {"name", "wait", "error"}
    assert call["kwargs"]["name"] == "inventory"
    assert call["kwargs"]["error"] is raised.value
    assert 0 <= call["kwargs"]["wait"] < 5


def test_lock_unavailable_is_not_sent_when_redis_answers(receive: Any) -> None:
    unavailable = receive(signals.lock_unavailable)
    with mutex("inventory"):
        pass
    with held_elsewhere("inventory"):
        assert not Mutex("inventory", timeout=0).acquire()
    assert unavailable == []


def test_two_receivers_of_one_signal_in_a_group_both_receive() -> None:
    group = signals.ReceiverGroup("tests.two-receivers")
    heard: list[str] = []

    @group.on(signals.lock_acquired)
    def first(sender: Any, **kwargs: Any) -> None:
        heard.append("first")

    @group.on(signals.lock_acquired)
    def second(sender: Any, **kwargs: Any) -> None:
        heard.append("second")

    group.connect()
    try:
        assert group.connected()
        with mutex("two-receivers"):
            pass
    finally:
        group.disconnect()
    assert sorted(heard) == ["first", "second"]
    assert not group.connected()
