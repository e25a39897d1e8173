"""Settings for the test suite (the demo project has its own, in testproject/).

The cache LOCATION is filled per test session by tests/conftest.py, which
starts a throwaway redis-server; subprocesses started by tests read it from
DJANGO_REDIS_MUTEX_TEST_URL.
"""

import os

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]

# Never 6379: without the conftest-provided URL, point at a port nothing serves.
REDIS_URL = os.environ.get("DJANGO_REDIS_MUTEX_TEST_URL", "redis://127.0.0.1:9/0")
MUTEX_PREFIX = os.environ.get("DJANGO_REDIS_MUTEX_TEST_PREFIX", "mutex")

# The core suite runs against both supported backends: django-redis (default)
# and Django's own, chosen with DJANGO_REDIS_MUTEX_TEST_BACKEND=django.
if os.environ.get("DJANGO_REDIS_MUTEX_TEST_BACKEND") == "django":
    _BACKEND = "django.core.cache.backends.redis.RedisCache"
    _OPTIONS = {"socket_connect_timeout": 2, "socket_timeout": 5}
else:
    _BACKEND = "django_redis.cache.RedisCache"
    _OPTIONS = {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5}

CACHES = {
    "default": {
        "BACKEND": _BACKEND,
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "tests",
        "OPTIONS": _OPTIONS,
        "MUTEX": {"PREFIX": MUTEX_PREFIX},
    },
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_redis_mutex",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_redis_mutex.middleware.MutexMiddleware",
]

ROOT_URLCONF = "tests.urls"

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}

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

DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
STATIC_URL = "static/"  # the admin's CSS and JS, served by live_server in browser tests
LOGGING_CONFIG = None
