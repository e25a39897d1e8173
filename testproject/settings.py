"""Settings of the demo project. Run it with ``uv run manage.py demo``.

Redis comes from REDIS_URL; without it, the ``demo`` command starts a private
redis-server on a free port, points the caches at it before anything connects
and writes its URL to ``DEMO_REDIS_URL_FILE`` for as long as it runs, so that
``manage.py locks`` in a second terminal finds the same server.
"""

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
# The demo's SQLite database and the URL of its running Redis (git-ignored).
# DEMO_DATA_DIR moves them, so a second demo never shares the first one's files.
DATA_DIR = Path(os.environ.get("DEMO_DATA_DIR") or BASE_DIR / ".demo")
DEMO_REDIS_URL_FILE = DATA_DIR / "redis-url"
# Port 1 (tcpmux) is served by nothing here: without a demo running, commands
# fail fast with "connection refused" instead of touching a Redis on 6379.
NO_REDIS_URL = "redis://127.0.0.1:1/0"
# How long the demo's "Hold the inventory lock" button holds it.
DEMO_HOLD_SECONDS = int(os.environ.get("DEMO_HOLD_SECONDS", "20"))


def _recorded_demo_redis() -> str | None:
    """Return the URL a demo recorded in DEMO_REDIS_URL_FILE, or None without one."""
    try:
        return DEMO_REDIS_URL_FILE.read_text(encoding="utf-8").split()[0]
    except (OSError, IndexError):
        return None


def _answers(url: str) -> bool:
    """Return True if something accepts connections where ``url`` points."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


# The file outlives a demo killed with SIGKILL; a URL whose port nobody
# answers on is stale and ignored (the demo's `locks` command says so).
DEMO_RECORDED_REDIS_URL = _recorded_demo_redis()
_running_demo_redis = (
    DEMO_RECORDED_REDIS_URL
    if DEMO_RECORDED_REDIS_URL and _answers(DEMO_RECORDED_REDIS_URL)
    else None
)


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

REDIS_URL = os.environ.get("REDIS_URL") or _running_demo_redis or NO_REDIS_URL

CACHES = {
    # The project's ordinary cache...
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "demo",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
        # STATS: the contention figures behind the demo page's chart, the admin's
        # Contention page and an honest Retry-After (flushed every 5 s here).
        "MUTEX": {"TTL": 30, "TIMEOUT": 2, "STATS": True, "STATS_FLUSH_INTERVAL": 5},
    },
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Before the app, so that its `locks` command (which says when no demo runs) wins.
    "testproject.demo.apps.DemoConfig",
    "django_redis_mutex",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # LockContended / LockBackendUnavailable from a view -> 503 with Retry-After.
    "django_redis_mutex.middleware.MutexMiddleware",
]

ROOT_URLCONF = "testproject.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# Every request in a transaction, as many projects run: a locked view takes its
# lock before the transaction begins and gives it back after it ends, and a
# lock whose block ends inside a transaction is kept until it commits.
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DATA_DIR / "demo.sqlite3",
        "ATOMIC_REQUESTS": True,
    }
}

USE_TZ = True
# Explicit, not the machine's zone: the pages show lock times with the zone name.
TIME_ZONE = "UTC"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_redis_mutex": {"handlers": ["console"], "level": "INFO"},
        "testproject": {"handlers": ["console"], "level": "INFO"},
    },
}
