"""``async with``, async decorators and the ``a``-prefixed twins, on redis.asyncio.

Each test drives its own event loop with ``asyncio.run``. An asyncio task is a
lock owner of its own: reentrant within itself, a contender to every other task
(its own children included), and to sync holders in other threads.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import pytest
from django.test import override_settings

from django_redis_mutex import (
    LockContended,
    LockLost,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
    reset,
    scripts,
    signals,
)

from .helpers import (
    await_until,
    cache_options,
    caches_with,
    cancel_repeatedly,
    dedicated_redis,
    forget_scripts_but,
    script_parked,
    wait_until,
)


async def waiters(name: str) -> int:
    found = [h for h in await asyncio.to_thread(held_locks) if h.name == name]
    return found[0].waiters if found else 0


# -- async with and the async twins -------------------------------------------


def test_async_with_holds_lock_only_inside():
    async def main() -> tuple[bool, bool, bool, bool]:
        async with mutex("inventory") as lock:
            inside = (await lock.aowned(), await Mutex("inventory").alocked())
        return (*inside, await Mutex("inventory").alocked(), await lock.aowned())

    assert asyncio.run(main()) == (True, True, False, False)


def test_async_with_gives_handle_with_name_token_and_fence():
    async def main() -> Mutex:
        async with mutex("inventory") as lock:
            assert lock.name == "inventory"
            assert isinstance(lock.token, str)
            assert isinstance(lock.fence, int) and lock.fence > 0
            return lock

    assert isinstance(asyncio.run(main()), Mutex)


def test_aacquire_and_arelease_explicitly():
    async def main() -> tuple[bool, bool, bool]:
        lock = Mutex("explicit")
        got = await lock.aacquire()
        held = await lock.alocked()
        await lock.arelease()
        return got, held, await lock.alocked()

    assert asyncio.run(main()) == (True, True, False)


def test_attl_and_aextend():
    async def main() -> tuple[float, float]:
        async with mutex("leased", ttl=5, watchdog=False) as lock:
            before = await lock.atime_left()
            await lock.aextend(60)
            return before, await lock.atime_left()

    before, after = asyncio.run(main())
    assert 0 < before <= 5
    assert 55 < after <= 60


def test_aowner_names_the_task_and_label():
    async def main() -> dict[str, Any] | None:
        async with mutex("owned", label="async job"):
            return await Mutex("owned").aowner()

    async def run_named() -> dict[str, Any] | None:
        return await asyncio.create_task(main(), name="the-worker-task")

    owner = asyncio.run(run_named())
    assert owner is not None
    assert owner.thread == "the-worker-task"
    assert owner.label == "async job"
    assert owner.pid == os.getpid()


def test_arelease_on_handle_not_holding_raises_lock_not_owned():
    async def main() -> None:
        await Mutex("never").arelease()

    with pytest.raises(LockNotOwned, match="never"):
        asyncio.run(main())


def test_aextend_on_handle_not_holding_raises_lock_not_owned():
    async def main() -> None:
        await Mutex("never").aextend(5)

    with pytest.raises(LockNotOwned, match="never"):
        asyncio.run(main())


# -- async decorators -------------------------------------------------------------


def test_async_decorated_function_holds_lock_during_call():
    @mutex("order:{order_id}")
    async def process(order_id: int) -> bool:
        return await Mutex(f"order:{order_id}").alocked()

    assert asyncio.run(process(5)) is True
    assert not Mutex("order:5").locked()


def test_async_decorated_method_fills_template_from_self():
    class Product:
        pk = 9

        @mutex("product:{self.pk}")
        async def restock(self) -> list[str]:
            return [h.name for h in await asyncio.to_thread(held_locks)]

    assert asyncio.run(Product().restock()) == ["product:9"]


def test_async_decorated_function_raises_lock_contended_when_held():
    ran = []

    @mutex("busy", blocking=False)
    async def work() -> None:
        ran.append(1)

    holder = Mutex("busy")
    assert holder.acquire()
    try:
        with pytest.raises(LockContended) as caught:
            asyncio.run(work())
    finally:
        holder.release()
    assert ran == []
    assert caught.value.name == "busy"
    assert caught.value.retry_after >= 1


def test_async_template_missing_argument_raises_at_call():
    @mutex("order:{nope}")
    async def process(order_id: int) -> None:
        pytest.fail("the body must not run")

    with pytest.raises(ValueError, match="nope"):
        asyncio.run(process(1))


# -- owners: tasks ------------------------------------------------------------------


def test_nested_async_with_in_one_task_reenters():
    async def main() -> tuple[int | None, int | None, bool]:
        async with mutex("nested") as outer:
            async with mutex("nested") as inner:
                fences = (outer.fence, inner.fence)
            still = await outer.aowned()
        return (*fences, still)

    outer_fence, inner_fence, still_held = asyncio.run(main())
    assert outer_fence == inner_fence
    assert still_held


def test_child_task_contends_with_its_parent():
    async def main() -> bool:
        async with mutex("family"):
            child = asyncio.create_task(Mutex("family").aacquire(blocking=False))
            return await child

    assert asyncio.run(main()) is False


def test_tasks_on_one_thread_get_different_tokens():
    async def take(name: str) -> str | None:
        lock = Mutex(name)
        assert await lock.aacquire()
        token = lock.token
        await lock.arelease()
        return token

    async def main() -> list[str | None]:
        return list(await asyncio.gather(take("a"), take("b"), take("a")))

    tokens = asyncio.run(main())
    assert len(set(tokens)) == 3


def test_concurrent_tasks_never_overlap_inside_the_lock():
    inside = 0
    most = 0

    async def worker() -> None:
        nonlocal inside, most
        async with mutex("counter", timeout=10):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    async def main() -> None:
        await asyncio.gather(*(worker() for _ in range(8)))

    asyncio.run(main())
    assert most == 1


def test_waiting_task_gets_lock_when_other_task_releases():
    async def main() -> float:
        holder = Mutex("handoff")
        assert await holder.aacquire()
        waiter_lock = Mutex("handoff", timeout=10)
        waiter = asyncio.create_task(waiter_lock.aacquire())
        assert await await_until(lambda: _one_waiter("handoff"))
        released = time.monotonic()
        await holder.arelease()
        assert await waiter
        handed_over = time.monotonic() - released
        await waiter_lock.arelease()
        return handed_over

    assert asyncio.run(main()) < 0.8  # woken by the release, not a 1 s check-in


async def _one_waiter(name: str) -> bool:
    return await waiters(name) == 1


def test_lock_can_be_released_by_another_task():
    async def main() -> bool:
        lock = Mutex("shared-handle")
        assert await lock.aacquire()
        await asyncio.create_task(lock.arelease())
        return await lock.alocked()

    assert asyncio.run(main()) is False


def test_non_reentrant_nested_async_with_contends():
    async def main() -> None:
        async with mutex("strict"), mutex("strict", reentrant=False, blocking=False):
            pytest.fail("the body must not run")

    with pytest.raises(LockContended):
        asyncio.run(main())


# -- sync and async together ---------------------------------------------------------


def test_sync_holder_blocks_async_contender():
    holder = Mutex("mixed")
    assert holder.acquire()
    try:
        got = asyncio.run(Mutex("mixed").aacquire(blocking=False))
    finally:
        holder.release()
    assert got is False


def test_async_holder_blocks_sync_contender_in_another_thread():
    async def main() -> bool | None:
        async with mutex("mixed"):
            return await asyncio.to_thread(Mutex("mixed").acquire, blocking=False)

    assert asyncio.run(main()) is False


# -- waiting without blocking the loop -----------------------------------------------


def test_aacquire_timeout_returns_false_after_timeout():
    holder = Mutex("busy")
    assert holder.acquire()
    try:

        async def main() -> tuple[bool, float]:
            started = time.monotonic()
            got = await Mutex("busy").aacquire(timeout=0.3)
            return got, time.monotonic() - started

        got, elapsed = asyncio.run(main())
    finally:
        holder.release()
    assert got is False
    assert 0.28 <= elapsed < 2.0


def test_waiting_does_not_block_the_event_loop():
    holder = Mutex("busy")
    assert holder.acquire()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> bool:
        tick_task = asyncio.create_task(ticker())
        got = await Mutex("busy").aacquire(timeout=0.5)
        tick_task.cancel()
        return got

    try:
        assert asyncio.run(main()) is False
    finally:
        holder.release()
    assert ticks >= 10


def test_cancelled_waiter_leaves_the_queue_without_the_lock():
    async def main() -> tuple[int, bool, bool]:
        holder = Mutex("busy")
        assert await holder.aacquire()
        waiter_lock = Mutex("busy", timeout=10)
        waiter = asyncio.create_task(waiter_lock.aacquire())
        assert await await_until(lambda: _one_waiter("busy"))
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        queued = await waiters("busy")
        await holder.arelease()
        return queued, await Mutex("busy").alocked(), waiter_lock.token is not None

    queued, locked_after, waiter_has_token = asyncio.run(main())
    assert queued == 0
    assert not locked_after
    assert not waiter_has_token


def test_cancelling_a_waiter_is_never_swallowed():
    # On Python 3.11 redis-py's send (asyncio.wait_for) can swallow a cancel()
    # landing as it completes; repeat so that window is hit at least once.
    async def cancel_one() -> tuple[bool, float]:
        holder = Mutex("busy")
        assert await holder.aacquire()
        waiter = asyncio.create_task(Mutex("busy", timeout=10).aacquire())
        assert await await_until(lambda: _one_waiter("busy"))
        started = time.monotonic()
        waiter.cancel()
        try:
            await waiter
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        await holder.arelease()
        return cancelled, time.monotonic() - started

    async def main() -> list[tuple[bool, float]]:
        return [await cancel_one() for _ in range(6)]

    results = asyncio.run(main())
    assert all(cancelled for cancelled, _ in results)
    assert max(elapsed for _, elapsed in results) < 3.0


def test_async_with_raises_lock_contended_with_owner():
    holder = Mutex("busy", label="sync holder")
    assert holder.acquire()

    async def main() -> None:
        async with mutex("busy", timeout=0):
            pytest.fail("the body must not run")

    try:
        with pytest.raises(LockContended) as caught:
            asyncio.run(main())
    finally:
        holder.release()
    assert caught.value.owner is not None
    assert caught.value.owner.label == "sync holder"


# -- losing the lock -------------------------------------------------------------------


def test_async_exit_raises_lock_lost_when_reset_during_successful_body():
    async def main() -> None:
        async with mutex("victim", watchdog=False):
            assert await asyncio.to_thread(reset, "victim")

    with pytest.raises(LockLost, match="victim"):
        asyncio.run(main())


def test_async_exit_keeps_body_exception_when_lock_lost():
    async def main() -> None:
        async with mutex("victim", watchdog=False):
            await asyncio.to_thread(reset, "victim")
            raise KeyError("from the body")

    with pytest.raises(KeyError, match="from the body"):
        asyncio.run(main())


def test_watchdog_renews_async_hold_beyond_ttl():
    async def main() -> bool:
        async with mutex("renewed", ttl=0.8) as lock:
            deadline = time.monotonic() + 2.4
            while time.monotonic() < deadline:
                if not await lock.aowned():
                    return False
                await asyncio.sleep(0.05)
            return True

    assert asyncio.run(main()) is True


def test_watchdog_renews_async_hold_while_loop_is_blocked():
    async def main() -> bool:
        async with mutex("renewed", ttl=0.8) as lock:
            time.sleep(2.0)  # a blocking call inside async code: the loop cannot run
            return await lock.aowned()

    assert asyncio.run(main()) is True


def test_async_hold_in_other_thread_loop_is_another_owner():
    async def main() -> bool:
        async with mutex("threads"):
            result: list[bool] = []
            thread = threading.Thread(
                target=lambda: result.append(asyncio.run(Mutex("threads").aacquire(blocking=False)))
            )
            thread.start()
            await asyncio.to_thread(thread.join, 10)
            return result[0]

    assert asyncio.run(main()) is False


def test_async_default_timeout_comes_from_settings():
    holder = Mutex("busy")
    assert holder.acquire()

    async def main() -> tuple[bool, float]:
        started = time.monotonic()
        return await Mutex("busy").aacquire(), time.monotonic() - started

    try:
        with override_settings(CACHES=caches_with(TIMEOUT=0.2)):
            got, elapsed = asyncio.run(main())
    finally:
        holder.release()
    assert got is False
    assert elapsed < 2.0


# -- cancellation and give-back never leave a lock behind --------------------------------------


@pytest.fixture
def slow_redis(redis_url: str) -> Any:
    """Route the default alias through a proxy that delays every chunk by 0.3 s."""
    import copy
    from urllib.parse import urlsplit

    from django.conf import settings

    from .proxy import Proxy

    with Proxy(urlsplit(redis_url).port or 6379) as proxy:
        caches = copy.deepcopy(settings.CACHES)
        caches["default"]["LOCATION"] = proxy.url
        with override_settings(CACHES=caches):
            proxy.latency = 0.3
            yield proxy


def test_cancelling_aacquire_during_its_first_round_trip_leaves_no_lock_held(
    slow_redis: Any, raw: Any
) -> None:
    key = Mutex("first-trip").keys.lock

    async def main() -> None:
        task = asyncio.ensure_future(Mutex("first-trip", ttl=30).aacquire())

        # Redis granted the lock; its reply is still on its way back.
        async def granted() -> bool:
            return bool(raw.exists(key))

        assert await await_until(granted, timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    # Given back once the reply came, not after the 30 s lease.
    deadline = time.monotonic() + 10
    while raw.exists(key) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not raw.exists(key)


def test_an_acquisition_cancelled_again_while_it_stops_never_leaves_the_lock_to_nobody(
    raw: Any,
) -> None:
    # A second cancel used to cut short the wait for the ACQUIRE in flight: its
    # CANCEL reached Redis first, and the ACQUIRE then granted the lock (or a
    # place in line) to a token nobody had, for the whole lease. An emptied
    # script cache (a restart, a failover) makes the ACQUIRE three round trips
    # (NOSCRIPT, SCRIPT LOAD, EVALSHA) while the give-back scripts take one.
    rng = random.Random(20)
    name = "cancelled-twice"

    async def attempt(contended: bool) -> None:
        holder = Mutex(name, ttl=8, watchdog=False)
        if contended:
            assert await holder.aacquire(blocking=False)
        forget_scripts_but(raw, scripts.CANCEL, scripts.RELEASE, scripts.WAKE)
        contender = Mutex(name, ttl=8, watchdog=False, timeout=10)
        if await cancel_repeatedly(contender.aacquire, rng):
            await contender.arelease()  # it got the lock before the cancels: its to give back
        assert contender.token is None
        if contended:
            await holder.arelease()
        # Nobody holds the lock, nobody waits for it: another owner gets it at once.
        probe = Mutex(name, ttl=8, watchdog=False)
        assert await probe.aacquire(timeout=1.0), f"held by {raw.hgetall(probe.keys.lock)}"
        await probe.arelease()

    async def main() -> None:
        for i in range(60):
            await attempt(contended=i % 2 == 1)

    asyncio.run(main())


def test_a_release_cancelled_before_it_was_sent_still_gives_the_lock_back() -> None:
    # Taken in sync code, so this event loop's client has no connection yet:
    # the cancel lands while the release connects, before its script is sent.
    # Its owner is gone (as after `finally: await lock.arelease()` in a
    # cancelled task), so nothing but the background may give the lock back.
    held = Mutex("cancelled-release", ttl=30)
    assert held.acquire()

    async def main() -> None:
        release = asyncio.ensure_future(held.arelease())
        await asyncio.sleep(0)  # the release has begun
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release

    asyncio.run(main())
    wait_until(
        lambda: not [h for h in held_locks() if h.name == "cancelled-release"],
        what="the lock given back, long before its 30 s lease ends",
    )


def test_a_waiter_cancelled_while_lengthening_its_hand_over_lease_gives_the_lock_back() -> None:
    # Without the watchdog, a waiter handed the lock lengthens the short
    # hand-over lease itself before aacquire() returns. A cancel landing there
    # used to leave the hold on the handle with nothing to give it back.
    with dedicated_redis() as (_server, client):

        async def attempt(name: str) -> float | None:
            """Return how soon after the cancel another owner got the lock.

            None when the cancel did not land on the waiter's EXTEND (it ran
            before the pause, or the send swallowed the cancel).
            """
            holder = Mutex(name, ttl=8, watchdog=False)
            assert await holder.aacquire()
            waiter = Mutex(name, ttl=8, watchdog=False, timeout=10)
            waiting = asyncio.ensure_future(waiter.aacquire())
            assert await await_until(lambda: _one_waiter(name))
            await holder.arelease()  # hands the lock to the waiter and wakes it
            # Before the waiter runs again: its EXTEND will wait 1 s at the server.
            client.client_pause(1000, all=False)
            await await_until(
                lambda: waiting.done() or script_parked(client),
                what="the waiter's EXTEND, or its end",
            )
            if waiting.done():
                # The loop ran the woken waiter's EXTEND before the pause began (a
                # busy machine): no cancel can land on it in this attempt.
                client.client_unpause()
                assert waiting.result() is True
                await waiter.arelease()
                return None
            waiting.cancel()
            try:
                await waiting
            except asyncio.CancelledError:
                pass
            else:
                # On Python < 3.12 redis-py's send (asyncio.wait_for) can swallow a
                # cancel landing as the send completes: the caller then has the lock.
                await waiter.arelease()
                return None
            cancelled = time.monotonic()
            assert waiter.token is None
            probe = Mutex(name, ttl=8, watchdog=False)
            assert await probe.aacquire(timeout=6.0)
            took = time.monotonic() - cancelled
            await probe.arelease()
            return took

        async def main() -> list[float]:
            # Until a cancel lands: on a busy machine, or where the send can
            # swallow it (Python < 3.12), many attempts may not.
            landed: list[float] = []
            for i in range(16):
                took = await attempt(f"handed-{i}")
                if took is not None:
                    landed.append(took)
                    if len(landed) == 2:
                        break
            return landed

        took = asyncio.run(main())
    assert took, "no attempt's cancel landed on the waiter's EXTEND"
    # Free once the pause ends, not when the 4 s hand-over lease runs out.
    assert max(took) < 2.5, took


def test_a_failing_lock_acquired_receiver_gives_back_without_blocking_the_loop(
    slow_redis: Any, raw: Any
) -> None:
    def refuse(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver refused")

    async def main() -> float:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(RuntimeError, match="receiver refused"):
                await Mutex("given-back").aacquire()
        finally:
            stop.set()
            await beat
        return max(gaps)

    signals.lock_acquired.connect(refuse)
    try:
        longest_gap = asyncio.run(main())
    finally:
        signals.lock_acquired.disconnect(refuse)
    assert not raw.exists(Mutex("given-back").keys.lock)
    # A blocking give-back would have frozen the loop for a whole slow round trip (>= 0.6 s).
    assert longest_gap < 0.45, longest_gap


def test_an_async_generator_using_a_shared_mutex_closed_from_another_task_releases_it() -> None:
    shared = mutex("agen-shared")

    async def numbers() -> Any:
        async with shared:
            yield 1
            yield 2

    async def main() -> bool:
        gen = numbers()
        assert await asyncio.ensure_future(gen.__anext__()) == 1
        assert await Mutex("agen-shared").alocked()
        await asyncio.ensure_future(gen.aclose())  # closed by another task
        return await Mutex("agen-shared").alocked()

    assert asyncio.run(main()) is False
    # Nothing is left for the watchdog to renew.
    from django_redis_mutex.watchdog import get_watchdog

    assert not get_watchdog()._holds


# -- Tasks on one thread are separate owners; a cancelled release keeps its token. ---


def test_tasks_on_one_thread_do_not_share_a_token():
    async def other_task(name: str) -> tuple[bool, bool]:
        intruder = Mutex(name)
        got = await intruder.aacquire(blocking=False)
        try:
            await intruder.arelease()
            released = True
        except LockNotOwned:
            released = False
        return got, released

    async def main() -> tuple[bool, bool, bool]:
        async with mutex("shared-thread") as lock:
            got, released = await asyncio.create_task(other_task("shared-thread"))
            return got, released, await lock.aowned()

    assert asyncio.run(main()) == (False, False, True)


def test_cancelled_async_release_keeps_token_so_retry_works():
    with dedicated_redis() as (_server, client):

        async def main() -> tuple[str | None, bool, bool]:
            lock = Mutex("payment", watchdog=False)
            assert await lock.aacquire()
            client.client_pause(5000, all=False)  # hold writes (EVALSHA) at the server
            try:
                releasing = asyncio.create_task(lock.arelease())
                # Cancel only once the release is in flight, parked at the server.
                deadline = time.monotonic() + 5
                while not any(c.get("cmd") == "evalsha" for c in client.client_list()):
                    assert time.monotonic() < deadline, "the release never reached Redis"
                    await asyncio.sleep(0.005)
                releasing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await releasing
            finally:
                client.client_unpause()
            token_after_cancel = lock.token
            still_held = await lock.aowned()
            await lock.arelease()  # the retry
            return token_after_cancel, still_held, await lock.alocked()

        token, still_held, locked_after_retry = asyncio.run(main())
    assert token is not None
    assert still_held
    assert not locked_after_retry


# -- Async clients built with decode_responses work. -------------------------------


def test_async_client_with_decode_responses_works():
    entries = caches_with()
    entries["default"]["OPTIONS"] = {
        **entries["default"].get("OPTIONS", {}),
        **cache_options(decode_responses=True),
    }

    async def main() -> tuple[bool, float, bool]:
        async with mutex("decoded", ttl=20) as lock:
            owned, left = await lock.aowned(), await lock.atime_left()
        return owned, left, await lock.alocked()

    with override_settings(CACHES=entries):
        owned, left, locked_after = asyncio.run(main())
    assert owned and 15 < left <= 20 and not locked_after
