"""One adapter per lock library: the same acquire/release shape for every contender.

Each adapter creates a fresh lock object per cycle, the way each library is
meant to be used (``with Lock(...)``), and gives every lock the same lease
(30 s) and the same wait bound (30 s), so the libraries differ only in how
they acquire, wait and release. ``acquire()`` returns whatever ``release()``
needs and raises :class:`AcquireTimedOut` if the lock could not be had.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis

LEASE = 30  # seconds, for every library
WAIT = 30  # seconds a contended acquire may block before the run counts as failed


class AcquireTimedOut(RuntimeError):
    """A lock could not be acquired within WAIT seconds."""


@cache
def plain_client(url: str) -> redis.Redis:
    """Return this process's plain redis-py client on the benchmark server."""
    return redis.Redis.from_url(url)


class Adapter:
    """Acquire and release one named lock with one library."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.client = plain_client(url)

    @classmethod
    def prepare(cls, client: redis.Redis, name: str) -> None:
        """Set up ``name`` once before anyone uses it (most locks need nothing)."""

    def acquire(self) -> Any:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    def _check(self, acquired: bool) -> None:
        if not acquired:
            raise AcquireTimedOut(f"{type(self).__name__} could not acquire {self.name!r}")


class MutexHandle(Adapter):
    """django-redis-mutex: a new ``Mutex`` per cycle, acquire() then release()."""

    watchdog = True
    shared = False

    def acquire(self) -> Any:
        from django_redis_mutex import Mutex

        lock = Mutex(self.name, timeout=WAIT, watchdog=self.watchdog, shared=self.shared)
        self._check(lock.acquire())
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


class MutexNoWatchdog(MutexHandle):
    """django-redis-mutex with ``watchdog=False``: what the renewal bookkeeping costs."""

    watchdog = False


class MutexShared(MutexHandle):
    """django-redis-mutex with ``shared=True``: a read lock's uncontended cycle."""

    shared = True


class MutexQuorum(MutexHandle):
    """django-redis-mutex as a Redlock quorum lock on three independent masters."""

    def acquire(self) -> Any:
        from django_redis_mutex import Mutex

        lock = Mutex(self.name, using=["q1", "q2", "q3"], timeout=WAIT)
        self._check(lock.acquire())
        return lock


class MutexContext(Adapter):
    """django-redis-mutex through ``with mutex(name):`` (the decorator's path)."""

    def acquire(self) -> Any:
        from django_redis_mutex import mutex

        context = mutex(self.name, timeout=WAIT)
        context.__enter__()
        return context

    def release(self, handle: Any) -> None:
        handle.__exit__(None, None, None)


class RedisPyLock(Adapter):
    """redis-py ``redis.lock.Lock``: SET NX PX, then sleep-and-retry while held."""

    sleep = 0.1

    def acquire(self) -> Any:
        lock = self.client.lock(self.name, timeout=LEASE, sleep=self.sleep)
        self._check(lock.acquire(blocking_timeout=WAIT))
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


class RedisPyLockFastPoll(RedisPyLock):
    """redis-py ``Lock`` polling every millisecond instead of every 100 ms."""

    sleep = 0.001


class PythonRedisLock(Adapter):
    """python-redis-lock: SET NX EX, then BLPOP on a signal list pushed at release."""

    def acquire(self) -> Any:
        import redis_lock

        lock = redis_lock.Lock(self.client, self.name, expire=LEASE)
        self._check(lock.acquire(timeout=WAIT))
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


class PotteryRedlock(Adapter):
    """pottery ``Redlock`` with one master: Redlock over a thread pool, random 0-0.2 s retry."""

    def acquire(self) -> Any:
        from pottery import Redlock

        lock = Redlock(key=self.name, masters={self.client}, auto_release_time=LEASE)
        self._check(lock.acquire(timeout=WAIT))
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


def quorum_clients() -> list[redis.Redis]:
    """Return plain clients on the three quorum masters (the Django aliases q1-q3)."""
    from django.conf import settings

    return [plain_client(settings.CACHES[f"q{i}"]["LOCATION"]) for i in (1, 2, 3)]


class PotteryRedlock3(Adapter):
    """pottery ``Redlock`` over the same three masters as this app's quorum lock."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, name)
        self.masters = set(quorum_clients())

    def acquire(self) -> Any:
        from pottery import Redlock

        lock = Redlock(key=self.name, masters=self.masters, auto_release_time=LEASE)
        self._check(lock.acquire(timeout=WAIT))
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


class BlpopHandoff(Adapter):
    """The cheapest FIFO hand-off: one token in a list, BLPOP to take it, RPUSH to give it back.

    Redis serves blocked BLPOP clients in the order they blocked, so a release
    goes to the longest waiter. Not a lock anyone should ship: no lease (a
    holder that dies keeps the token forever), no owner check, no fencing.
    It is the floor for contended throughput and hand-off latency.
    """

    @classmethod
    def prepare(cls, client: redis.Redis, name: str) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.delete(name)
        pipe.rpush(name, "token")
        pipe.execute()

    def acquire(self) -> Any:
        popped = self.client.blpop([self.name], timeout=WAIT)
        self._check(popped is not None)
        return popped[1]  # type: ignore[index]

    def release(self, handle: Any) -> None:
        self.client.rpush(self.name, handle)


class DjangoRedisLock(Adapter):
    """django-redis ``cache.lock()``: redis-py's Lock on the cache's client (100 ms polling)."""

    def acquire(self) -> Any:
        from django.core.cache import cache

        lock = cache.lock(self.name, timeout=LEASE)
        self._check(lock.acquire(blocking_timeout=WAIT))
        return lock

    def release(self, handle: Any) -> None:
        handle.release()


# KEYS[1] lock key.  ARGV[1] token.  Returns 1 if deleted, 0 if not ours.
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RawBaseline(Adapter):
    """The floor: SET NX PX, then EVALSHA compare-and-delete. No waiting, no bookkeeping."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, name)
        self.sha = self.client.script_load(_COMPARE_AND_DELETE)

    def acquire(self) -> Any:
        token = secrets.token_hex(16)
        self._check(bool(self.client.set(self.name, token, nx=True, px=LEASE * 1000)))
        return token

    def release(self, handle: Any) -> None:
        self.client.evalsha(self.sha, 1, self.name, handle)


@dataclass(frozen=True)
class Contender:
    """A library as the report names it."""

    key: str
    label: str
    factory: Callable[[str, str], Adapter]
    contended: bool = True  # also run in the contended scenario


CONTENDERS: list[Contender] = [
    Contender("drm", "django-redis-mutex Mutex", MutexHandle),
    Contender("drm-context", "django-redis-mutex mutex()", MutexContext, contended=False),
    Contender(
        "drm-no-watchdog", "django-redis-mutex watchdog=False", MutexNoWatchdog, contended=False
    ),
    Contender("drm-shared", "django-redis-mutex shared=True", MutexShared, contended=False),
    Contender("drm-quorum", "django-redis-mutex Redlock (3 masters)", MutexQuorum, contended=False),
    Contender("raw", "raw SET NX PX + EVALSHA", RawBaseline, contended=False),
    Contender("redis-py", "redis-py Lock (sleep 0.1)", RedisPyLock),
    Contender("redis-py-1ms", "redis-py Lock (sleep 0.001)", RedisPyLockFastPoll),
    Contender("python-redis-lock", "python-redis-lock", PythonRedisLock),
    Contender("pottery", "pottery Redlock (1 master)", PotteryRedlock),
    Contender("pottery-quorum", "pottery Redlock (3 masters)", PotteryRedlock3, contended=False),
    Contender("blpop", "raw BLPOP hand-off (token list)", BlpopHandoff),
    Contender("django-redis", "django-redis cache.lock()", DjangoRedisLock),
]

BY_KEY = {contender.key: contender for contender in CONTENDERS}
