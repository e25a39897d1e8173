"""System checks: report a bad MUTEX block or a non-Redis lock cache at ``manage.py check``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.core.exceptions import ImproperlyConfigured

from .client import backend_kind
from .conf import parse_settings, validate_prefix


@register(Tags.caches)
def check_mutex_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Validate every CACHES entry that carries a MUTEX block."""
    errors: list[Error] = []
    for alias, entry in getattr(settings, "CACHES", {}).items():
        if "MUTEX" not in entry:
            continue
        if backend_kind(str(entry.get("BACKEND", ""))) is None:
            errors.append(
                Error(
                    f"CACHES[{alias!r}] has a MUTEX block but BACKEND {entry.get('BACKEND')!r} "
                    "is not a Redis cache.",
                    hint="Use django_redis.cache.RedisCache or "
                    "django.core.cache.backends.redis.RedisCache for caches that carry locks.",
                    id="django_redis_mutex.E001",
                )
            )
            continue
        try:
            config = parse_settings(alias, entry["MUTEX"])
            validate_prefix(alias, config.prefix)
        except ImproperlyConfigured as exc:
            errors.append(Error(str(exc), id="django_redis_mutex.E002"))
    return errors
