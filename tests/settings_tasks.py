"""Settings for processes running Django's task framework on a database (Django 6.0+).

The suite's settings plus django-tasks-db's DatabaseBackend as the default
task backend, on the SQLite file DJANGO_REDIS_MUTEX_TEST_TASKS_DB that the test
made, so the process that enqueues and the ``db_worker`` processes share one
queue. Used by tests/test_django_tasks.py for its subprocesses only.
"""

import os

from tests.settings import *  # noqa: F403  (the suite's settings, extended below)
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["DJANGO_REDIS_MUTEX_TEST_TASKS_DB"],
        # Workers claim tasks in exclusive transactions; others wait this long.
        "OPTIONS": {"timeout": 30},
    }
}

TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
