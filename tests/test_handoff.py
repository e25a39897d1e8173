"""Handing a released lock to the next waiter, and waking it.

A release hands the lock to the first waiter inside its script, and wakes it
there when that waiter is the successor the holder expected; anyone else is
woken by a second step of the releasing client (``WAKE``). These tests drive
the steps of an acquisition or a release one at a time on a real Redis, so
they can stop a client between two steps, or let another client act there:

* a waiter that is handed the lock gets the successor it should expect;
* a wake-up lost with a releasing client that died after its release script
  costs the waiter one check-in, not the lock;
* a wake-up of a hand-over that lapsed before the waiter took a new place in
  line is never taken for a new one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from django_redis_mutex import Mutex, scripts
from django_redis_mutex.acquisition import start
from django_redis_mutex.driver import Pop, Steps, _do, run_steps

from .helpers import wait_until


def queued(raw: redis.Redis, name: str) -> list[str]:
    return [token.decode() for token in raw.zrange(Mutex(name).keys.queue, 0, -1)]


def drive_until(steps: Steps[Any], stop: type) -> Any:
    """Run ``steps`` against Redis up to their first op of type ``stop``, and return that op."""
    op = next(steps)
    while not isinstance(op, stop):
        op = steps.send(_do(op))
    return op


def test_a_waiter_handed_the_lock_knows_who_is_next(raw: redis.Redis) -> None:
    holder = Mutex("chain", timeout=10)
    assert holder.acquire()
    got: dict[str, Mutex] = {}

    def wait(label: str) -> None:
        lock = Mutex("chain", timeout=10)
        if lock.acquire():
            got[label] = lock

    first = threading.Thread(target=wait, args=("first",))
    first.start()
    wait_until(lambda: len(queued(raw, "chain")) == 1, 5, "the first waiter to queue")
    second = threading.Thread(target=wait, args=("second",))
    second.start()
    wait_until(lambda: len(queued(raw, "chain")) == 2, 5, "the second waiter to queue")
    second_token = queued(raw, "chain")[1]

    holder.release()
    first.join(5)

    lock = got["first"]
    hold = lock._current()
    assert hold is not None and hold.successor == second_token
    lock.release()  # wakes the expected successor inside the release script
    second.join(5)
    assert "second" in got
    got["second"].release()


def test_a_wake_up_lost_with_its_client_costs_the_waiter_one_check_in(raw: redis.Redis) -> None:
    holder = Mutex("lost-wake", timeout=10, watchdog=False)
    assert holder.acquire()
    took: list[float] = []

    def wait() -> None:
        lock = Mutex("lost-wake", timeout=10)
        if lock.acquire():
            took.append(time.monotonic())
            lock.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    (waiter_token,) = wait_until(lambda: queued(raw, "lost-wake"), 5, "the waiter to queue")
    hold = holder._current()
    assert hold is not None and hold.successor is None  # taken uncontended: nobody expected

    # The release script hands the lock over but cannot wake the waiter; the
    # client dies before the WAKE that would.
    steps = holder._where.release_steps(hold)
    release = next(steps)
    assert release.script is scripts.RELEASE
    answer = _do(release)
    assert answer[1] == waiter_token.encode()
    wake = steps.send(answer)
    assert wake.script is scripts.WAKE
    steps.close()
    died_at = time.monotonic()

    waiter.join(10)
    assert took, "the waiter never got the lock it had been handed"
    # One check-in (waiters check in every second) and a margin for a busy machine.
    assert took[0] - died_at < 2.0


def test_a_lapsed_hand_over_is_not_taken_for_a_new_one(raw: redis.Redis) -> None:
    holder = Mutex("lapsed", timeout=10, ttl=0.5, watchdog=False)
    assert holder.acquire()
    waiter = Mutex("lapsed", timeout=10, ttl=0.5, watchdog=False)
    attempt = start(waiter, True, 10)
    token = attempt.token
    steps = waiter._where.acquire_steps(attempt)
    pop = drive_until(steps, Pop)  # queued behind the holder, about to block
    check_in = steps.send(None)  # the wait ran out with nothing popped: a check-in is next
    assert isinstance(pop, Pop) and check_in.script is scripts.ACQUIRE

    # The waiter's process stops here. Meanwhile the lock is handed to it and
    # its wake-up pushed, the hand-over lapses unused, and another takes the lock.
    holder.release()
    assert raw.llen(waiter.keys.wake(token)) == 1
    raw.pexpire(waiter.keys.lock, 1)
    wait_until(lambda: not raw.exists(waiter.keys.lock), 5, "the hand-over to lapse")
    other = Mutex("lapsed", timeout=10)
    assert other.acquire(blocking=False)

    # The waiter resumes: its check-in is refused and puts it back in line...
    pop = steps.send(_do(check_in))
    assert isinstance(pop, Pop)
    # ...and what it pops then must not be the lapsed hand-over.
    assert _do(pop._replace(wait=0.2)) is None
    steps.close()
    run_steps(waiter._where.abandon_steps(token))
    other.release()
