import asyncio
import threading

import pytest

from django_redis_mutex import LockNotOwned, Mutex, held_locks, mutex, reset


def test_with_block_holds_and_releases(raw, namespace_keys):
    with mutex("inventory") as lock:
        assert lock.owned()
        assert lock.fence > 0
        assert Mutex("inventory").locked()
        assert [h.name for h in held_locks()] == ["inventory"]
    assert not Mutex("inventory").locked()
    assert all(not k.endswith(b"}") for k in namespace_keys())


def test_second_owner_is_refused():
    with mutex("inventory"):
        results = []
        t = threading.Thread(
            target=lambda: results.append(Mutex("inventory").acquire(blocking=False))
        )
        t.start()
        t.join()
        assert results == [False]


def test_waiter_is_handed_lock():
    first = Mutex("x")
    assert first.acquire()
    got = threading.Event()
    fences = []

    def waiter():
        m = Mutex("x", timeout=10)
        assert m.acquire()
        fences.append(m.fence)
        got.set()
        m.release()

    t = threading.Thread(target=waiter)
    t.start()
    assert not got.wait(0.2)
    f1 = first.fence
    first.release()
    assert got.wait(5)
    t.join()
    assert fences[0] > f1


def test_async():
    async def main():
        async with mutex("a") as lock:
            assert await lock.aowned()
            async with mutex("a") as inner:
                assert inner.fence == lock.fence
            fence = lock.fence
        return fence

    assert asyncio.run(main()) > 0


def test_reset():
    m = Mutex("r")
    m.acquire()
    assert reset("r")
    assert not m.owned()
    with pytest.raises(LockNotOwned):
        m.release()
