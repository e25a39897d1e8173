"""One renewer thread per process that keeps held locks alive.

Every hold with the watchdog on is renewed every ttl/3 with a compare-and-
pexpire script, so a lock is only ever extended by the owner that holds it and
never re-created. Renewals of all due locks on one alias go in one pipeline.
When a renewal finds the lock gone, the hold is marked lost (the holder learns
it when it leaves its block) and the watchdog stops renewing it. ``MAX_HOLD``
caps how long one hold is renewed, since renewing forever hides a hung holder.

The thread serves sync and async holds alike: renewal then does not depend on
an event loop being free to run it. It is created lazily and re-created in a
forked child, where threads do not survive (gunicorn preload, Celery prefork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import NoScriptError

from . import scripts, signals
from .holds import Hold

__all__ = ["watchdog"]

logger = logging.getLogger("django_redis_mutex")

# How long the thread sleeps at most when nothing is due; also the retry delay
# after Redis could not be reached.
_IDLE = 1.0


class Watchdog:
    """Renew held locks from a single background thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holds: dict[int, Hold] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = float("inf")

    def watch(self, hold: Hold, first_renewal: float | None = None) -> None:
        """Start renewing ``hold`` every ttl/3 (the first time after ``first_renewal`` s)."""
        hold.renew_at = time.monotonic() + (
            hold.ttl / 3 if first_renewal is None else first_renewal
        )
        with self._cond:
            self._holds[id(hold)] = hold
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="django-redis-mutex-watchdog", daemon=True
                )
                self._thread.start()
            elif hold.renew_at < self._wake_at:
                self._cond.notify()

    def unwatch(self, hold: Hold) -> None:
        """Stop renewing ``hold``."""
        with self._cond:
            self._holds.pop(id(hold), None)

    def watching(self, hold: Hold) -> bool:
        """Return True while ``hold`` is being renewed."""
        with self._cond:
            return id(hold) in self._holds

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h in self._holds.values() if h.renew_at <= now]
                if not due:
                    nxt = min((h.renew_at for h in self._holds.values()), default=now + _IDLE)
                    self._wake_at = min(nxt, now + _IDLE)
                    self._cond.wait(self._wake_at - now)
                    continue
                self._wake_at = now
            try:
                self._renew(due)
            except Exception:
                # Nothing may stop the renewer: every other hold of the process
                # depends on it. The failed round is retried on the next tick.
                logger.exception("The lock watchdog failed a renewal round; retrying.")
                retry = time.monotonic() + _IDLE
                for hold in due:
                    hold.renew_at = retry

    def _renew(self, due: list[Hold]) -> None:
        # Group the renewals by Redis (alias): one pipeline per alias, whatever
        # number of locks (and of quorum members) is due there.
        by_alias: dict[str, list[tuple[Hold, str, int]]] = defaultdict(list)
        # The lease each renewal sends: an extend(ttl) racing this round must
        # not be undone by a renewal to the old length landing after it.
        sent_ttl = {id(hold): hold.ttl for hold in due}
        now = time.monotonic()
        for hold in due:
            if hold.max_hold is not None and now - hold.acquired_at >= hold.max_hold:
                self.unwatch(hold)
                logger.warning(
                    "Stopped renewing lock %r after MAX_HOLD (%ss); it expires in at most %ss.",
                    hold.name,
                    hold.max_hold,
                    hold.ttl,
                )
                continue
            for alias, lock_key in hold.targets:
                by_alias[alias].append((hold, lock_key, int(sent_ttl[id(hold)] * 1000)))
        renewed: dict[int, int] = defaultdict(int)
        refused: dict[int, int] = defaultdict(int)
        broken: set[int] = set()
        sent = time.monotonic()
        for alias, entries in by_alias.items():
            try:
                results = self._extend_all(alias, entries)
            except ImproperlyConfigured as exc:
                # The alias is gone or broken (settings changed): nothing to renew with.
                logger.error("Cannot renew %d lock(s) on %r: %s", len(entries), alias, exc)
                broken.update(id(hold) for hold, _, _ in entries)
                continue
            except Exception as exc:  # Redis down or slow: try again soon, the lease still runs.
                logger.warning("Could not renew %d lock(s) on %r: %s", len(entries), alias, exc)
                continue
            for (hold, _, _), result in zip(entries, results, strict=True):
                if result == 1:
                    renewed[id(hold)] += 1
                else:
                    refused[id(hold)] += 1
        for hold in due:
            if not self.watching(hold):
                continue
            key = id(hold)
            if renewed[key] >= hold.quorum:
                if hold.ttl != sent_ttl[key]:
                    # extend() changed the lease meanwhile: renew to it at once.
                    hold.renew_at = time.monotonic()
                else:
                    hold.renew_at = time.monotonic() + hold.ttl / 3
                    hold.expires_at = sent + hold.ttl
            elif key in broken or refused[key] > len(hold.targets) - hold.quorum:
                # Too many masters say it is not ours: a quorum can no longer hold it.
                self._lost(hold)
            else:
                hold.renew_at = time.monotonic() + min(_IDLE, hold.ttl / 10)

    @staticmethod
    def _extend_all(alias: str, entries: list[tuple[Hold, str, int]]) -> list[Any]:
        from .client import get_client

        client = get_client(alias)
        if hasattr(client, "get_nodes"):
            # A cluster client refuses scripts in pipelines; each renewal goes
            # to the node owning that lock's slot.
            return [
                scripts.run(client, scripts.EXTEND, [lock_key], [hold.token, ttl_ms])
                for hold, lock_key, ttl_ms in entries
            ]
        for attempt in (1, 2):
            pipe = client.pipeline(transaction=False)
            for hold, lock_key, ttl_ms in entries:
                pipe.evalsha(scripts.EXTEND.sha, 1, lock_key, hold.token, ttl_ms)
            try:
                return list(pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                client.script_load(scripts.EXTEND.source)
        raise AssertionError("unreachable")

    def _lost(self, hold: Hold) -> None:
        with self._cond:
            # A release unwatches before it asks Redis: a hold no longer watched
            # was released (or is being released), not lost.
            if self._holds.pop(id(hold), None) is None:
                return
            reason = "the watchdog found it held by another owner or gone"
            if not hold.active or not hold.mark_lost(reason):
                return
        held = time.monotonic() - hold.acquired_at
        logger.error(
            "Lock %r (fence %s) was lost after %.3fs: it expired, was reset, or was taken.",
            hold.name,
            hold.fence,
            held,
        )
        # This thread renews every lock of the process: a receiver's error is
        # logged, never allowed to stop it.
        for receiver, error in signals.lock_lost.send_robust(
            sender=hold.alias, name=hold.name, fence=hold.fence, held=held
        ):
            if isinstance(error, Exception):
                logger.error("lock_lost receiver %r failed: %r", receiver, error)


watchdog = Watchdog()


def _after_fork_in_child() -> None:
    # The parent's renewer thread does not exist here, and the parent's holds
    # are not ours to renew.
    global watchdog
    watchdog = Watchdog()
    from .client import reset_after_fork

    reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_watchdog() -> Watchdog:
    """Return this process's watchdog (a new one in a forked child)."""
    return watchdog
