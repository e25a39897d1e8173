"""Give back, from a background thread, what an owner that gave up may still hold.

A call whose reply never came (a busy or paused Redis, a connection lost)
leaves its outcome unknown, and the caller has already been told
``LockBackendUnavailable``. An ACQUIRE sent before the timeout may still run
when the server is responsive again and grant the lock or a permit to a token
nobody has; a RELEASE dropped with its connection never runs. Either way the
lock or permit would stay held for its whole lease by an owner that left.

Such a token is handed here with the steps that give it back (leave the line
and release, or release). One daemon thread runs them until Redis answers, or
until the lease the token could hold would have ended anyway, retrying with a
growing delay in between. Nothing here renews a lease. Like the watchdog, the
thread is started lazily and re-created in a forked child, where threads do
not survive and the parent's tokens are not ours to give back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .driver import Steps, run_steps

__all__ = ["give_back_later"]

logger = logging.getLogger("django_redis_mutex")

# The first retry comes this soon after a failed try; each later one waits
# twice as long, up to _LONGEST.
_FIRST_RETRY = 0.1
_LONGEST = 1.0


@dataclass(eq=False)
class _GiveBack:
    """One token to give back: how, until when, and whether it is still needed."""

    what: str  # names it in log lines: "lock 'x'", "a permit of semaphore 'y'"
    steps: Callable[[], Steps[Any]]
    until: float  # monotonic: its lease would have ended by then
    needed: Callable[[], bool]
    due: float = 0.0
    delay: float = _FIRST_RETRY


class _GiveBacks:
    """The pending give-backs of this process and the one thread that runs them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[_GiveBack] = []
        self._thread: threading.Thread | None = None

    def add(self, job: _GiveBack) -> None:
        with self._cond:
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="django-redis-mutex-giveback", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [job for job in self._pending if job.due <= now]
                if not due:
                    wake = min((job.due for job in self._pending), default=now + 60.0)
                    self._cond.wait(max(wake - now, 0.001))
                    continue
            finished = [job for job in due if self._try(job)]
            with self._cond:
                self._pending = [job for job in self._pending if job not in finished]

    def _try(self, job: _GiveBack) -> bool:
        """Try to give ``job`` back once; return True when nothing is left to do."""
        now = time.monotonic()
        if not job.needed():
            return True  # the owner's own retry got there first
        if now >= job.until:
            logger.warning(
                "Stopped trying to give back %s: Redis did not answer before its lease ended.",
                job.what,
            )
            return True
        try:
            run_steps(job.steps())
        except ImproperlyConfigured as exc:
            # The alias is gone (settings changed): no try will find it again,
            # and the lock's own lease ends it.
            logger.warning("Stopped trying to give back %s: %s", job.what, exc)
            return True
        except Exception as exc:  # Redis still busy or away: try again soon
            logger.info("Could not give back %s yet (will retry): %s", job.what, exc)
            job.due = time.monotonic() + job.delay
            job.delay = min(job.delay * 2, _LONGEST)
            return False
        return True


_give_backs = _GiveBacks()


def _after_fork_in_child() -> None:
    global _give_backs
    _give_backs = _GiveBacks()


os.register_at_fork(after_in_child=_after_fork_in_child)


def give_back_later(
    what: str,
    steps: Callable[[], Steps[Any]],
    lease: float,
    needed: Callable[[], bool] | None = None,
) -> None:
    """Run ``steps()`` in the background until Redis answers them, for at most ``lease`` s.

    ``steps`` makes a fresh generator for each try. ``needed`` (default:
    always) is asked before each try: it returns False once the owner's own
    retry gave the token back.
    """
    _give_backs.add(
        _GiveBack(
            what=what,
            steps=steps,
            until=time.monotonic() + lease,
            needed=needed or (lambda: True),
        )
    )
