"""Background workers for the demo: contend for a few locks so the inspector shows live owners."""

from __future__ import annotations

import random
import threading
from typing import Any

from django.core.management.base import BaseCommand

from django_redis_mutex import Mutex

LOCKS = ["report:nightly", "sync:crm", "product:1", "billing:run"]


def work(stop: threading.Event, index: int) -> None:
    rng = random.Random(index)
    while not stop.is_set():
        name = rng.choice(LOCKS)
        lock = Mutex(name, ttl=6, timeout=5, label=f"demo worker {index}")
        if lock.acquire():
            try:
                stop.wait(rng.uniform(1.0, 4.0))
            finally:
                lock.release()
        stop.wait(rng.uniform(0.2, 1.5))


class Command(BaseCommand):
    help = "Run a few threads that take and release demo locks until interrupted."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--workers", type=int, default=3)

    def handle(self, *args: Any, **options: Any) -> None:
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
