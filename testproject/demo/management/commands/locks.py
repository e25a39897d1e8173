"""``manage.py locks`` of the demo project: the app's command, knowing whether a demo runs.

Without REDIS_URL, the project reads the Redis a running demo recorded; with
no demo running there is none, and the app's command would only report a
refused connection to a port nobody serves. This one says what to do instead.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError

from django_redis_mutex.management.commands import locks

START = "start it with `uv run manage.py demo` (or set REDIS_URL to read another Redis)"


class Command(locks.Command):
    def handle(self, *args: Any, **options: Any) -> None:
        if not os.environ.get("REDIS_URL") and settings.REDIS_URL == settings.NO_REDIS_URL:
            raise CommandError(_not_running())
        super().handle(*args, **options)


def _not_running() -> str:
    recorded = settings.DEMO_RECORDED_REDIS_URL
    if recorded is None:
        return f"The demo is not running, so there is no Redis to read: {START}."
    url_file = settings.DEMO_REDIS_URL_FILE
    if url_file.is_relative_to(settings.BASE_DIR):
        url_file = url_file.relative_to(settings.BASE_DIR)
    return (
        f"The demo is not running: nothing answers at {recorded}, which {url_file} "
        f"names (left by a demo that was killed); {START}."
    )
