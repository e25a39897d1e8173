"""Processes that hold locks on a topology while it changes, and waiters queued behind them.

Each holder and each waiter is its own OS process running
``tests/workers/topo_hold.py`` with the test's CACHES entries: a holder takes
its lock and keeps it (renewed by its watchdog) until the test lets it go; a
waiter blocks for the lock, retrying through ``LockBackendUnavailable`` within
its timeout, and releases it as soon as it gets it. Both report the section
they ran, so :meth:`Holders.let_go` returns a history to check.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import redis

from django_redis_mutex import held_locks

from .helpers import wait_until
from .history import History
from .topologies import SectionWorkers
from .worker import Worker

__all__ = ["Holders", "ended_early"]

# A busy 2-core machine starts a Django process in seconds, not milliseconds.
START_TIMEOUT = 60.0


class Holders:
    """Holder and waiter processes for locks of one alias (or quorum of aliases)."""

    def __init__(
        self,
        spawn: Callable[..., Worker],
        raw: redis.Redis,
        caches: dict[str, dict[str, Any]],
        using: str | list[str],
        *,
        ttl: float = 2.0,
        timeout: float = 90.0,
    ) -> None:
        self.spawn = spawn
        self.raw = raw
        self.caches = caches
        self.using = using if isinstance(using, str) else ",".join(using)
        self.inspect_using = using
        self.ttl = ttl
        self.timeout = timeout
        self.go = f"holders:{uuid.uuid4().hex[:8]}:go"
        self.holders: dict[str, Worker] = {}
        self.fences: dict[str, int] = {}
        self.tokens: dict[str, str] = {}
        self.waiters: dict[str, list[Worker]] = {}

    def _start(self, name: str, *extra: object) -> Worker:
        return self.spawn(
            "topo_hold.py",
            "--caches",
            json.dumps(self.caches),
            "--using",
            self.using,
            "--name",
            name,
            "--ttl",
            self.ttl,
            "--timeout",
            self.timeout,
            *extra,
        )

    def waiting(self, name: str) -> int:
        """Return how many waiters Redis lists behind the holder of ``name``."""
        return next((h.waiters for h in held_locks(using=self.inspect_using) if h.name == name), 0)

    def hold(self, names: list[str], waiters: int = 0) -> None:
        """Hold each of ``names`` in its own process, with ``waiters`` processes queued behind."""
        for name in names:
            self.holders[name] = self._start(name, "--go", f"{self.go}:{name}")
        for name, worker in self.holders.items():
            if name in names:
                granted = worker.expect("acquired", START_TIMEOUT)
                self.fences[name], self.tokens[name] = granted["fence"], granted["token"]
        for name in names:
            self.waiters[name] = [self._start(name) for _ in range(waiters)]
        for name in names:
            wait_until(
                lambda n=name: self.waiting(n) == waiters,
                START_TIMEOUT,
                f"{waiters} waiters queued behind {name!r}",
            )

    def let_go(self) -> History:
        """Release every held lock; return the history of the holders and their waiters."""
        for name in self.holders:
            self.raw.rpush(f"{self.go}:{name}", "go")
        history = History()
        for worker in self.all():
            assert worker.finish(self.timeout) == 0, worker.events
            history.load_from_worker_output(worker.events)
        self.raw.delete(*(f"{self.go}:{name}" for name in self.holders))
        return history

    def wait_queued(self, name: str, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` waiters are queued behind ``name`` again; fail if one ended."""
        wait_until(
            lambda: self.waiting(name) >= count or self._ended(),
            timeout,
            f"{count} waiters queued behind {name!r}",
        )
        self.check_alive()

    def _ended(self) -> bool:
        return any(worker.process.poll() is not None for worker in self.all())

    def check_alive(self) -> None:
        """Fail with its output if a holder or waiter ended before it was let go."""
        for worker in self.all():
            if worker.process.poll() is not None:
                worker.finish(10)
                raise AssertionError(f"ended before it was let go: {worker._describe()}")

    def all(self) -> list[Worker]:
        return [*self.holders.values(), *(w for ws in self.waiters.values() for w in ws)]

    def reports(self, kind: str) -> list[dict[str, Any]]:
        """Return every holder's and waiter's reports of one kind (after :meth:`let_go`)."""
        return [e for worker in self.all() for e in worker.events if e["event"] == kind]

    def check_handed_in_turn(self, history: History) -> None:
        """Each held lock went to its holder first, then to each of its waiters once."""
        for name, waiters in self.waiters.items():
            sections = history.of(name)
            assert sections and sections[0].pid == self.holders[name].pid, sections
            assert sorted(s.pid for s in sections[1:]) == sorted(w.pid for w in waiters)
            fences = [s.fence for s in sections]
            assert fences == sorted(set(fences)), f"{name!r}: fences {fences}"


def ended_early(workers: SectionWorkers) -> str | None:
    """Describe a section worker that ended before it was told to stop (it failed), or None."""
    for process in workers.processes:
        if process.poll() is not None:
            stdout, _ = process.communicate(timeout=10)
            return f"worker {process.pid} exited with {process.returncode}: {stdout[-1500:]}"
    return None
