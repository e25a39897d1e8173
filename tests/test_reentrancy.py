"""Reentrancy never outlives the block or call that created it.

A lock is nested into through the handle that holds it, or by another handle
only inside a ``with`` block (or decorated call) of the same owner. These tests
take the shapes a Django deployment meets in normal use (a request thread that
hands a lock to a background thread, then serves the next request; a handle
shared by threads; a block nested into a lost hold) and check on real Redis
that nothing ever runs under a lock it does not hold.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest

from django_redis_mutex import LockLost, LockNotOwned, Mutex, mutex, reset
from django_redis_mutex.holds import _scopes

from .helpers import wait_until


class ServerThread:
    """One long-lived thread serving "requests" (callables) one after another, like a worker."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="request-thread", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._results.put((True, job()))
            except BaseException as exc:  # handed back to the test, which re-raises it
                self._results.put((False, exc))

    def run(self, job: Callable[[], Any]) -> Any:
        self._jobs.put(job)
        ok, value = self._results.get(timeout=30)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)


@pytest.fixture
def server_thread() -> Any:
    thread = ServerThread()
    yield thread
    thread.close()


def test_a_request_thread_never_nests_into_a_lock_it_handed_to_a_background_thread(
    server_thread: ServerThread,
) -> None:
    handed: queue.Queue[Mutex] = queue.Queue()

    def hold_view() -> int | None:
        lock = Mutex("inventory")
        assert lock.acquire()
        handed.put(lock)  # a background thread releases it later
        return lock.fence

    @mutex("inventory", timeout=0)
    def reserve_view() -> str:
        return "reserved"

    server_thread.run(hold_view)
    # The next request on the same thread: the lock is held, so it is contended.
    with pytest.raises(Exception) as raised:
        server_thread.run(reserve_view)
    assert type(raised.value).__name__ == "LockContended"
    # Nor does a plain handle of the same thread nest into it.
    assert server_thread.run(lambda: Mutex("inventory").acquire(blocking=False)) is False

    releaser = threading.Thread(target=handed.get().release)
    releaser.start()
    releaser.join()
    assert server_thread.run(reserve_view) == "reserved"


def test_a_lock_taken_with_acquire_is_nested_only_through_its_handle() -> None:
    lock = Mutex("plain")
    assert lock.acquire()
    assert Mutex("plain").acquire(blocking=False) is False
    assert lock.acquire(blocking=False) is True  # the same handle nests
    lock.release()
    assert lock.owned()
    lock.release()
    assert not Mutex("plain").locked()


def test_nesting_is_granted_only_inside_the_block_that_holds_the_lock() -> None:
    with mutex("scoped") as outer:
        inner = Mutex("scoped")
        assert inner.acquire(blocking=False)  # inside the block: reentrant
        inner.release()
        assert outer.owned()
    # After the block: free for everyone, and nothing nests into the old hold.
    later = Mutex("scoped")
    assert later.acquire(blocking=False)
    assert later.fence != outer.fence
    later.release()


def test_nothing_nests_into_a_hold_released_from_another_thread() -> None:
    lock = Mutex("released-elsewhere")
    assert lock.acquire()
    taker = Mutex("released-elsewhere", timeout=0)
    releaser = threading.Thread(target=lock.release)
    releaser.start()
    releaser.join()
    # The original thread cannot nest into the released hold through its handle either.
    assert lock.acquire(blocking=False) is True
    assert lock.fence is not None and lock.owned()
    assert taker.acquire() is False
    lock.release()


def test_a_loss_under_a_nested_block_of_the_same_handle_is_still_reported_at_the_outer_exit() -> (
    None
):
    lock = Mutex("nested-loss", watchdog=False, ttl=30)
    with pytest.raises(LockLost), lock:
        assert reset("nested-loss")
        # The inner block takes the lock afresh (or nests): either way the
        # outer one must not forget that its own hold was lost.
        with lock:
            pass
    assert not Mutex("nested-loss").locked()


def test_a_lease_lapse_under_a_nested_block_of_the_same_handle_is_reported_at_the_outer_exit() -> (
    None
):
    lock = Mutex("nested-lapse", watchdog=False, ttl=0.2)
    with pytest.raises(LockLost), lock:
        wait_until(lambda: not Mutex("nested-lapse").locked(), 5, "the lease to lapse")
        with lock:
            pass


@pytest.mark.parametrize("trial", range(20))
def test_a_handle_shared_by_two_threads_hands_over_and_the_taker_can_release(trial: int) -> None:
    shared = Mutex("shared-handle", timeout=10)
    assert shared.acquire()
    taken = threading.Event()
    released: list[BaseException | None] = []

    def taker() -> None:
        assert shared.acquire()
        taken.set()
        try:
            shared.release()
            released.append(None)
        except BaseException as exc:
            released.append(exc)

    thread = threading.Thread(target=taker)
    thread.start()
    # The taker is queued behind us on the same lock.
    wait_until(lambda: shared._current() is not None and Mutex("shared-handle").locked(), 5, "hold")
    wait_until(lambda: _queued("shared-handle"), 5, "the taker to queue")
    shared.release()
    assert taken.wait(10)
    thread.join(10)
    assert released == [None]
    assert not Mutex("shared-handle").locked()
    assert shared._current() is None


def _queued(name: str) -> bool:
    from django_redis_mutex.client import get_client

    return bool(get_client("default").zcard(Mutex(name).keys.queue))


def test_a_releaser_that_lost_its_hold_does_not_release_the_new_owner_sharing_its_handle() -> None:
    shared = Mutex("shared-lapse", watchdog=False, ttl=0.3, timeout=10)
    assert shared.acquire()
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.extend([shared.acquire(), shared.token]))
    thread.start()
    thread.join(15)
    assert got[0] is True  # the other thread took it once our lease lapsed
    taker_token = got[1]
    with pytest.raises(LockNotOwned):
        shared.release()  # ours is gone; the other thread's hold is not touched
    assert shared.token == taker_token and shared.owned()
    shared.release()  # now the handle's remaining hold: the taker's
    assert not Mutex("shared-lapse").locked()


def test_a_quorum_hold_is_not_nested_into_by_a_plain_lock_on_one_of_its_masters(
    quorum_aliases: list[str],
) -> None:
    with mutex("split", using=quorum_aliases):
        plain = Mutex("split", using=quorum_aliases[0])
        assert plain.acquire(blocking=False) is False
        nested = Mutex("split", using=quorum_aliases)
        assert nested.acquire(blocking=False) is True
        nested.release()


@pytest.fixture
def quorum_aliases(mutex_prefix: str) -> Any:
    from .topologies import LOADED_QUORUM_TIMEOUT, extra_caches, master_entries, redis_servers

    aliases = ["n1", "n2", "n3"]
    with (
        redis_servers(len(aliases)) as servers,
        extra_caches(
            master_entries(
                servers, aliases, mutex_prefix, TIMEOUT=2, QUORUM_TIMEOUT=LOADED_QUORUM_TIMEOUT
            )
        ),
    ):
        yield aliases


def test_a_handle_held_by_one_thread_does_not_nest_for_another():
    shared = Mutex("shared", timeout=0)
    assert shared.acquire()
    results = []
    thread = threading.Thread(target=lambda: results.append(shared.acquire(blocking=False)))
    thread.start()
    thread.join()
    assert results == [False]
    shared.release()


def test_closed_scopes_do_not_pile_up_in_the_task_context():
    async def entries_after(rounds: int) -> int:
        for i in range(rounds):
            async with mutex(f"object:{i}"):
                pass
        return sum(1 for scope in _scopes.get() if scope.hold.name.startswith("object:"))

    # Bounded, whatever the number of names used: only live holds are carried.
    assert asyncio.run(entries_after(200)) == asyncio.run(entries_after(20)) <= 2
