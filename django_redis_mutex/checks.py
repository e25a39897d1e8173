"""System checks: a bad MUTEX block, a non-Redis lock cache, a broken QUORUM, missing telemetry,
a lock Redis that evicts keys.

Settings mistakes should surface at ``manage.py check`` (and at server start),
not at the first lock a request takes.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import RedisError

from .client import backend_kind, probe_client
from .conf import get_settings, parse_settings, validate_prefix
from .eviction import read_policy
from .telemetry import available as telemetry_available


@register(Tags.caches)
def check_mutex_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate every CACHES entry that carries a MUTEX block."""
    errors: list[CheckMessage] = []
    caches = getattr(settings, "CACHES", {})
    for alias, entry in caches.items():
        misspelt = [
            key
            for key in entry
            if isinstance(key, str) and key != "MUTEX" and key.upper() == "MUTEX"
        ]
        if misspelt:
            errors.append(
                Warning(
                    f"CACHES[{alias!r}] has a {misspelt[0]!r} key, which is ignored.",
                    hint='Lock settings go in an upper-case "MUTEX" block.',
                    id="django_redis_mutex.W001",
                )
            )
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
            continue
        if config.telemetry and not telemetry_available():
            errors.append(
                Warning(
                    f"CACHES[{alias!r}]['MUTEX'] turns TELEMETRY on, but opentelemetry-api "
                    "is not installed: no spans or metrics are recorded.",
                    hint="pip install 'django-redis-mutex[telemetry]', or set TELEMETRY to False.",
                    id="django_redis_mutex.W002",
                )
            )
        for member in config.quorum or ():
            member_entry = caches.get(member)
            if member_entry is None:
                problem = "is not configured in settings.CACHES"
            elif backend_kind(str(member_entry.get("BACKEND", ""))) is None:
                problem = (
                    f"uses BACKEND {member_entry.get('BACKEND')!r}, which is not a Redis cache"
                )
            else:
                continue
            errors.append(
                Error(
                    f"CACHES[{alias!r}]['MUTEX']['QUORUM'] names {member!r}, which {problem}.",
                    hint="Every QUORUM member must be a Redis cache alias of its own.",
                    id="django_redis_mutex.E003",
                )
            )
    return errors


def _lock_aliases_to_probe(caches: dict[str, Any]) -> list[str]:
    """Return the aliases that hold locks: those with a MUTEX block, and the QUORUM members.

    A quorum alias itself holds nothing (its members do); an alias that fails
    the settings check is left to that check.
    """
    aliases: list[str] = []
    for alias, entry in caches.items():
        if "MUTEX" not in entry or backend_kind(str(entry.get("BACKEND", ""))) is None:
            continue
        try:
            config = parse_settings(alias, entry["MUTEX"])
        except ImproperlyConfigured:
            continue
        for member in config.quorum or (alias,):
            member_entry = caches.get(member)
            if member_entry is None or backend_kind(str(member_entry.get("BACKEND", ""))) is None:
                continue
            if member not in aliases:
                aliases.append(member)
    return aliases


@register(Tags.caches)
def check_lock_eviction(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about each lock alias whose Redis may evict keys, held locks among them.

    Asks each server once (``INFO memory``, within the probe client's short
    timeout). A server that cannot be reached is passed over in silence: the
    check must not fail a deploy step that runs without Redis, and the first
    lock on that alias asks again and logs the same warning.
    """
    messages: list[CheckMessage] = []
    for alias in _lock_aliases_to_probe(getattr(settings, "CACHES", {})):
        try:
            required = get_settings(alias).require_noeviction
            with probe_client(alias) as client:
                verdict = read_policy(client, alias)
        except (RedisError, OSError, ImproperlyConfigured):
            # Unreachable, or not a client that can be asked: nothing to say.
            continue
        if required and (verdict.evicts or verdict.unreadable is not None):
            messages.append(
                Error(
                    verdict.refusal(),
                    hint="Every lock on this alias raises ImproperlyConfigured until then.",
                    id="django_redis_mutex.E004",
                )
            )
        elif verdict.unreadable is not None:
            messages.append(Info(verdict.unreadable_message(), id="django_redis_mutex.I001"))
        elif verdict.evicts:
            messages.append(
                Warning(
                    verdict.warning(),
                    hint=(
                        "Run a Redis with maxmemory-policy noeviction for locks and point this "
                        "alias at it; set MUTEX REQUIRE_NOEVICTION to refuse locks meanwhile."
                    ),
                    id="django_redis_mutex.W003",
                )
            )
    return messages
