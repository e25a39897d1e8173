"""Minimal in-script Django settings, so this app runs without a project.

The benchmark configures one ``default`` cache alias with django-redis on the
benchmark's Redis and leaves every MUTEX option at its default (TTL 30 s,
watchdog on): the numbers are what a user gets out of the box.
"""

from __future__ import annotations


def configure_django(redis_url: str, key_prefix: str) -> None:
    """Configure and set up Django once per process, with one django-redis cache."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        USE_TZ=True,
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=[],
        LOGGING_CONFIG=None,
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": redis_url,
                "KEY_PREFIX": key_prefix,
            }
        },
    )
    django.setup()
