"""Minimal in-script Django settings, so this app runs without a project.

The benchmark configures one ``default`` cache alias with django-redis on the
benchmark's Redis and leaves every MUTEX option at its default (TTL 30 s,
watchdog on): the numbers are what a user gets out of the box. With
``BENCH_MUTEX_STATS=1`` in the environment, the alias also counts contention
(``"STATS": True``), to measure what that costs the cycle; a revision from
before the setting existed ignores the variable. The request
scenario's views (``webapp.py``) are the URLconf, behind this app's
``MutexMiddleware``.
"""

from __future__ import annotations

import os

# django-redis caps a process's pool at 100 connections by default. Every
# blocked waiter holds one connection, so the many-waiters scenario (1,000
# waiters in one process) needs more; the cap changes nothing else.
POOL_OPTIONS = {"CONNECTION_POOL_KWARGS": {"max_connections": 4096}}


def configure_django(redis_url: str, key_prefix: str, quorum_urls: list[str] | None = None) -> None:
    """Configure and set up Django once per process, with one django-redis cache.

    ``quorum_urls`` (two more private servers) add the aliases ``q1``-``q3``
    for the Redlock (three masters) row of the uncontended table.
    """
    import django
    from django.conf import settings

    if settings.configured:
        return
    mutex = {"STATS": True} if os.environ.get("BENCH_MUTEX_STATS") == "1" else {}
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=[],
        LOGGING_CONFIG=None,
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF="webapp",
        MIDDLEWARE=["django_redis_mutex.middleware.MutexMiddleware"],
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": redis_url,
                "KEY_PREFIX": key_prefix,
                "OPTIONS": POOL_OPTIONS,
                "MUTEX": mutex,
            },
            **{
                f"q{index}": {
                    "BACKEND": "django_redis.cache.RedisCache",
                    "LOCATION": url,
                    "KEY_PREFIX": key_prefix,
                    "OPTIONS": POOL_OPTIONS,
                }
                for index, url in enumerate([redis_url, *(quorum_urls or [])], start=1)
                if quorum_urls
            },
        },
    )
    django.setup()
