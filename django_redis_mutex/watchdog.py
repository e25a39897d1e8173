"""Renewer threads that keep held locks and semaphore permits alive, one lane per Redis.

Every hold with the watchdog on is renewed a third into its lease with a
compare-and-pexpire script, so a lock is only ever extended by the owner that
holds it and never re-created. Each cache alias has its own lane (a thread):
renewals of all due locks on that Redis go in one pipeline, and a Redis that
hangs stalls only its own lane, never the leases of locks held elsewhere. A
quorum hold is renewed by the lanes of all its masters; each answer moves that
master's confirmed lease (counted from when the renewal was sent), and the
hold stays valid until the quorum-th latest of them, minus clock drift.

When renewals find the lock gone (on one Redis, or on too many masters for a
majority), or a quorum hold's validity runs out before a majority renewed it,
the hold is marked lost (the holder learns it when it leaves its block) and a
``lock_lost`` signal is sent. ``MAX_HOLD`` caps how long one hold is renewed,
since renewing forever hides a hung holder.

The watchdog renews a :class:`~django_redis_mutex.holds.Hold`, a lock's or a
semaphore permit's alike. Each says which script, keys and arguments renew it,
how it is named in log lines and what ``lock_lost`` is sent with, so lock and
permit renewals on one Redis share its lane, its pipeline and ``MAX_HOLD``.

The lanes serve sync and async holds alike: renewal then does not depend on an
event loop being free to run it. They are created lazily and re-created in a
forked child, where threads do not survive (gunicorn preload, Celery prefork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import NoScriptError, ResponseError

from . import scripts, signals, stats
from .holds import Hold

__all__ = [
    "Watchdog",
    "announce_lost",
    "declare_if_lapsed",
    "declare_lost",
    "get_watchdog",
]

logger = logging.getLogger("django_redis_mutex")

# Why a hold whose local bound lapsed (a quorum lock's validity) is lost.
LAPSED = "its validity ran out before a majority of masters renewed it"

# How long a lane sleeps at most when nothing is due; also the longest retry
# delay after a Redis could not be reached.
_IDLE = 1.0


class Watchdog:
    """Renew held locks and permits from one background lane per cache alias."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[int, Hold] = {}
        self._lanes: dict[str, _Lane] = {}

    def watch(self, hold: Hold) -> None:
        """Start renewing ``hold`` on every Redis it lives on."""
        with self._lock:
            self._holds[id(hold)] = hold
            for alias, lock_key in hold.targets:
                lane = self._lanes.get(alias)
                if lane is None:
                    lane = self._lanes[alias] = _Lane(self, alias)
                lane.add(hold, lock_key)

    def unwatch(self, hold: Hold) -> bool:
        """Stop renewing ``hold``; return True if it was being renewed."""
        with self._lock:
            if self._holds.pop(id(hold), None) is None:
                return False
            lanes = [self._lanes.get(alias) for alias, _ in hold.targets]
        for lane in lanes:
            if lane is not None:
                lane.remove(hold)
        return True

    def watching(self, hold: Hold) -> bool:
        """Return True while ``hold`` is being renewed."""
        with self._lock:
            return id(hold) in self._holds

    def watched(self) -> list[Hold]:
        """Return the holds being renewed now (a test checks none outlives it)."""
        with self._lock:
            return list(self._holds.values())

    def poke(self, hold: Hold) -> None:
        """Make the lanes of ``hold`` look at it now (its lease changed)."""
        with self._lock:
            lanes = [self._lanes.get(alias) for alias, _ in hold.targets]
        for lane in lanes:
            if lane is not None:
                lane.poke()

    def settle(self, hold: Hold, now: float) -> None:
        """Decide, after a renewal or at its deadline, whether ``hold`` is lost or done."""
        if not self.watching(hold):
            return
        if hold.max_hold is not None and now - hold.acquired_at >= hold.max_hold:
            if self.unwatch(hold):
                logger.warning(
                    "Stopped renewing %s %r after MAX_HOLD (%ss); it expires in at most %ss.",
                    hold.kind,
                    hold.name,
                    hold.max_hold,
                    hold.ttl,
                )
            return
        if hold.doomed:
            # One Redis, or too many masters for a majority, say it is not ours.
            self._lost(hold, "the watchdog found it held by another owner or gone")
        elif hold.strict and not hold.valid(now):
            self._lost(hold, LAPSED)

    def _lost(self, hold: Hold, reason: str) -> None:
        # A release unwatches before it asks Redis: a hold no longer watched
        # was released (or is being released), not lost.
        if not self.unwatch(hold):
            return
        if hold.active:
            announce_lost(hold, reason)


def declare_lost(item: Hold, reason: str) -> None:
    """Stop renewing ``item``, mark it lost and send ``lock_lost`` (once), without a log line.

    For a loss its owner learns itself (at a release, a nested acquire), and
    is told by the exception it gets.
    """
    get_watchdog().unwatch(item)
    announce_lost(item, reason, log=False)


def declare_if_lapsed(item: Hold) -> None:
    """Declare ``item`` lost if its local bound lapsed (a quorum lock's validity ran out).

    Its owner asks as it leaves a block, before the watchdog's next look.
    """
    if item.strict and item.active and not item.valid():
        declare_lost(item, LAPSED)


def announce_lost(item: Hold, reason: str, *, log: bool = True) -> bool:
    """Mark ``item`` lost, log it and send ``lock_lost`` (once); return True the first time.

    Receivers' errors are logged, never raised: a lane renews everything on
    its Redis, and a failing receiver must not stop it.
    """
    if not item.mark_lost(reason):
        return False
    held = time.monotonic() - item.acquired_at
    if log:
        logger.error("%s was lost after %.3fs: %s.", item.describe(), held, reason)
    if item.counted_as is not None:
        stats.count(item.alias, item.counted_as, stats.LOST)
    if not signals.lock_lost.receivers:
        return True
    for receiver, error in signals.lock_lost.send_robust(
        sender=item.alias, **item.lost_signal(held)
    ):
        if isinstance(error, Exception):
            logger.error("lock_lost receiver %r failed: %r", receiver, error)
    return True


class _Lane:
    """The renewer thread of one cache alias."""

    def __init__(self, watchdog: Watchdog, alias: str) -> None:
        self.watchdog = watchdog
        self.alias = alias
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, tuple[Hold, str]] = {}
        # When the thread plans to wake next: a new hold due later needs no wake-up.
        self._wake_at = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"django-redis-mutex-watchdog:{alias}", daemon=True
        )
        self._thread.start()

    def add(self, hold: Hold, lock_key: str) -> None:
        with self._cond:
            self._entries[id(hold)] = (hold, lock_key)
            due = hold.next_renewal(self.alias)
            if hold.strict:
                due = min(due, hold.expires_at)
            if due < self._wake_at:
                self._cond.notify()

    def remove(self, hold: Hold) -> None:
        with self._cond:
            self._entries.pop(id(hold), None)

    def poke(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due: list[tuple[Hold, str]] = []
                wake = now + _IDLE
                for hold, lock_key in self._entries.values():
                    at = hold.next_renewal(self.alias)
                    if at <= now:
                        due.append((hold, lock_key))
                    else:
                        wake = min(wake, at)
                    if hold.strict:
                        wake = min(wake, hold.expires_at)
                if not due:
                    self._wake_at = wake
                    self._cond.wait(max(wake - now, 0.0005))
                self._wake_at = 0.0  # awake: a hold added now is seen on the next pass
                entries = list(self._entries.values())
            try:
                if due:
                    self._renew(due)
            except Exception:
                # Nothing may stop a lane: every other hold on this Redis
                # depends on it. The failed round is retried soon.
                logger.exception("The lock watchdog failed a renewal round; retrying.")
                retry = time.monotonic() + _IDLE
                for hold, _ in due:
                    hold.failed(self.alias, retry)
            now = time.monotonic()
            for hold, _ in entries:
                self.watchdog.settle(hold, now)

    def _renew(self, due: list[tuple[Hold, str]]) -> None:
        from .client import get_client, get_member_client

        # Quorum members are asked through a client with the short per-master
        # deadline; a plain lock through the alias's own client.
        groups: dict[bool, list[tuple[Hold, str, float]]] = {}
        for hold, lock_key in due:
            if hold.max_hold is not None and time.monotonic() - hold.acquired_at >= hold.max_hold:
                continue  # settle() stops it
            groups.setdefault(hold.quorum > 1, []).append((hold, lock_key, hold.ttl))
        for member, entries in groups.items():
            try:
                client = get_member_client(self.alias) if member else get_client(self.alias)
                sent = time.monotonic()
                results = _extend_all(client, entries)
            except ImproperlyConfigured as exc:
                # The alias is gone or broken (settings changed): nothing to renew with.
                logger.error("Cannot renew %d lock(s) on %r: %s", len(entries), self.alias, exc)
                for hold, _, _ in entries:
                    hold.refuse(self.alias)
                continue
            except Exception as exc:  # Redis down or slow: try again soon, the lease still runs.
                logger.warning(
                    "Could not renew %d lock(s) on %r: %s", len(entries), self.alias, exc
                )
                now = time.monotonic()
                for hold, _, ttl in entries:
                    hold.failed(self.alias, now + min(_IDLE, ttl / 10))
                continue
            for (hold, _, ttl), result in zip(entries, results, strict=True):
                if isinstance(result, Exception):
                    self._renewal_failed(hold, ttl, result)
                elif result == 1:
                    # extend() may have changed the lease meanwhile: renew to it at once.
                    hold.confirm(self.alias, sent, ttl, renew_now=hold.ttl != ttl)
                else:
                    hold.refuse(self.alias)

    def _renewal_failed(self, hold: Hold, ttl: float, error: Exception) -> None:
        """Judge one renewal that Redis answered with an error, apart from the rest of its round."""
        if isinstance(error, ResponseError) and str(error).startswith("WRONGTYPE"):
            # Its key holds something else now: not ours any more.
            hold.refuse(self.alias)
            return
        logger.warning("Could not renew %s on %r: %s", hold.describe(), self.alias, error)
        hold.failed(self.alias, time.monotonic() + min(_IDLE, ttl / 10))


def _extend_all(client: Any, entries: list[tuple[Hold, str, float]]) -> list[Any]:
    """Return each renewal's reply, or the error Redis answered it with.

    One renewal's error never costs the others their replies: a pipeline that
    raised its first error would drop them all, every round, until the other
    leases ran out. A connection failure still fails the whole round.
    """
    calls = [hold.renewal(key, ttl) for hold, key, ttl in entries]
    if hasattr(client, "get_nodes"):
        # A cluster client refuses scripts in pipelines; each renewal goes
        # to the node owning that key's slot.
        return [_run_one(client, script, keys, args) for script, keys, args in calls]

    def renew() -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        results = list(pipe.execute(raise_on_error=False))
        for result in results:
            if isinstance(result, NoScriptError):
                # The server forgot the scripts: the whole round goes again
                # once they are loaded (renewing twice is harmless).
                raise result
        return results

    def load() -> None:
        for script in {script.sha: script for script, _, _ in calls}.values():
            client.script_load(script.source)

    return scripts.loading(renew, load)


def _run_one(
    client: Any, script: scripts.LuaScript, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    try:
        return scripts.run(client, script, keys, args)
    except ResponseError as exc:  # this renewal's own error: the others still go out
        return exc


watchdog = Watchdog()


def _after_fork_in_child() -> None:
    # The parent's lanes do not exist here, and the parent's holds are not
    # ours to renew.
    global watchdog
    watchdog = Watchdog()
    from .client import reset_after_fork

    reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_watchdog() -> Watchdog:
    """Return this process's watchdog (a new one in a forked child)."""
    return watchdog
