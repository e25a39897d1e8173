"""Run the demo: a private Redis (unless REDIS_URL is set), SQLite, a superuser, runserver."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from django_redis_mutex.testing import RedisServer

DEMO_USER = "admin"
DEMO_PASSWORD = "admin"


class Command(BaseCommand):
    help = "Run the django-redis-mutex demo on 127.0.0.1:8000 (embedded Redis unless REDIS_URL)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("addrport", nargs="?", default="127.0.0.1:8000")

    def handle(self, *args: Any, **options: Any) -> None:
        server = None
        if not os.environ.get("REDIS_URL"):
            server = RedisServer().start()
            for entry in settings.CACHES.values():
                entry["LOCATION"] = server.url
            self.stdout.write(f"Started a private Redis at {server.url} ({server.binary}).")
        try:
            settings.DATA_DIR.mkdir(exist_ok=True)
            call_command("migrate", interactive=False, verbosity=0)
            user_model = get_user_model()
            if not user_model.objects.filter(username=DEMO_USER).exists():
                user_model.objects.create_superuser(DEMO_USER, "admin@example.com", DEMO_PASSWORD)
            self.stdout.write(self.style.SUCCESS(
                f"Demo superuser: {DEMO_USER} / {DEMO_PASSWORD}  ->  http://{options['addrport']}/admin/"
            ))
            call_command("runserver", options["addrport"], use_reloader=False)
        finally:
            if server is not None:
                server.close()
                self.stdout.write("Stopped the private Redis.")
