"""Run the demo: a private Redis (unless REDIS_URL), SQLite, a superuser, workers, runserver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from django_redis_mutex.testing import RedisServer

DEMO_USER = "admin"
DEMO_PASSWORD = "admin"
PRODUCTS = {"Espresso beans": 40, "Paper filters": 120, "Grinder": 5}


class Command(BaseCommand):
    help = "Run the django-redis-mutex demo on 127.0.0.1:8000 (embedded Redis unless REDIS_URL)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("addrport", nargs="?", default="127.0.0.1:8000")
        parser.add_argument(
            "--no-workers",
            action="store_false",
            dest="workers",
            help="Do not start the background workers that contend for demo locks.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        server = workers = None
        if not os.environ.get("REDIS_URL"):
            server = RedisServer().start()
            for entry in settings.CACHES.values():
                entry["LOCATION"] = server.url
            os.environ["REDIS_URL"] = server.url  # for the worker process
            self.stdout.write(f"Started a private Redis at {server.url} ({server.binary}).")
        try:
            self._prepare_database()
            if options["workers"]:
                workers = subprocess.Popen(
                    [sys.executable, sys.argv[0], "demo_workers"], env=dict(os.environ)
                )
            self.stdout.write(
                self.style.SUCCESS(
                    f"Demo: http://{options['addrport']}/   admin: {DEMO_USER} / {DEMO_PASSWORD}"
                )
            )
            call_command("runserver", options["addrport"], use_reloader=False)
        except KeyboardInterrupt:
            self.stdout.write("Stopping the demo.")
        finally:
            # Ctrl-C reaches every process of the terminal's group, and uv
            # forwards it once more: a second SIGINT must not cut the cleanup.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if workers is not None:
                workers.terminate()
                workers.wait(10)
            if server is not None:
                server.close()
                self.stdout.write("Stopped the private Redis.")

    def _prepare_database(self) -> None:
        from testproject.demo.models import Product

        settings.DATA_DIR.mkdir(exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        user_model = get_user_model()
        if not user_model.objects.filter(username=DEMO_USER).exists():
            user_model.objects.create_superuser(DEMO_USER, "admin@example.com", DEMO_PASSWORD)
        if not Product.objects.exists():
            Product.objects.bulk_create(Product(name=n, stock=s) for n, s in PRODUCTS.items())
