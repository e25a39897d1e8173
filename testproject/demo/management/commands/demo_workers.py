"""Background workers for the demo: contend for a few locks so the inspector shows live owners."""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any

from django.core.management.base import BaseCommand

from django_redis_mutex import LockBackendUnavailable, LockLost, LockNotOwned, Mutex

from ...process import die_with_parent

# No product lock among them: a Reserve click should meet a 503 only when the
# visitor holds "inventory" (or another visitor reserves the same product),
# never because a background worker happened to hold the product's lock.
LOCKS = ["report:nightly", "sync:crm", "export:catalog", "billing:run"]
# After a lost lock or an unreachable Redis: wait this long, then try again.
BACKOFF_SECONDS = 2.0

log = logging.getLogger(__name__)


def work(stop: threading.Event, index: int) -> None:
    """Take and release random demo locks until ``stop`` is set.

    Force releases (admin, ``locks --reset-all``) and Redis going away are
    what the demo shows off, so they cost one log line and a short pause,
    never the thread: the inspector keeps showing live owners afterwards.
    """
    rng = random.Random(index)
    while not stop.is_set():
        name = rng.choice(LOCKS)
        lock = Mutex(name, ttl=6, timeout=5, label=f"demo worker {index}")
        try:
            if lock.acquire():
                try:
                    stop.wait(rng.uniform(1.0, 4.0))
                finally:
                    lock.release()
        except (LockNotOwned, LockLost, LockBackendUnavailable) as exc:
            log.warning("demo worker %d: %s Retrying in %.0f s.", index, exc, BACKOFF_SECONDS)
            stop.wait(BACKOFF_SECONDS)
            continue
        stop.wait(rng.uniform(0.2, 1.5))


class Command(BaseCommand):
    help = "Run a few threads that take and release demo locks until interrupted."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--workers", type=int, default=3)

    def handle(self, *args: Any, **options: Any) -> None:
        # The demo may be SIGKILLed: never outlive it.
        parent = os.environ.get("DEMO_PARENT_PID")
        die_with_parent(int(parent) if parent else None)
        stop = threading.Event()
        threads = [
            threading.Thread(target=work, args=(stop, i), name=f"worker-{i}", daemon=True)
            for i in range(options["workers"])
        ]
        for thread in threads:
            thread.start()
        try:
            stop.wait()
        except KeyboardInterrupt:
            stop.set()
