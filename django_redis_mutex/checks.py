"""System checks: a bad MUTEX block, a non-Redis lock cache, a broken QUORUM, missing telemetry,
a lock Redis that evicts keys.

Settings mistakes should surface at ``manage.py check`` (and at server start),
not at the first lock a request takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import RedisError

from .client import UNAVAILABLE, backend_kind, probe_client
from .conf import get_settings, parse_settings
from .eviction import read_policy
from .telemetry import available as telemetry_available


def _is_redis(entry: Any) -> bool:
    """Return True if ``entry`` is the CACHES entry of a Redis cache."""
    return isinstance(entry, dict) and backend_kind(str(entry.get("BACKEND", ""))) is not None


@register(Tags.caches)
def check_mutex_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate every CACHES entry that carries a MUTEX block."""
    caches = getattr(settings, "CACHES", {})
    return [message for alias in caches for message in _entry_messages(alias, caches)]


def _entry_messages(alias: str, caches: dict[str, Any]) -> Iterator[CheckMessage]:
    entry = caches[alias]
    misspelt = [
        key for key in entry if isinstance(key, str) and key != "MUTEX" and key.upper() == "MUTEX"
    ]
    if misspelt:
        yield Warning(
            f"CACHES[{alias!r}] has a {misspelt[0]!r} key, which is ignored.",
            hint='Lock settings go in an upper-case "MUTEX" block.',
            id="django_redis_mutex.W001",
        )
    if "MUTEX" not in entry:
        return
    if not _is_redis(entry):
        yield Error(
            f"CACHES[{alias!r}] has a MUTEX block but BACKEND {entry.get('BACKEND')!r} "
            "is not a Redis cache.",
            hint="Use django_redis.cache.RedisCache or "
            "django.core.cache.backends.redis.RedisCache for caches that carry locks.",
            id="django_redis_mutex.E001",
        )
        return
    try:
        config = parse_settings(alias, entry["MUTEX"])
    except ImproperlyConfigured as exc:
        yield Error(str(exc), id="django_redis_mutex.E002")
        return
    if config.telemetry and not telemetry_available():
        yield Warning(
            f"CACHES[{alias!r}]['MUTEX'] turns TELEMETRY on, but opentelemetry-api "
            "is not installed: no spans or metrics are recorded.",
            hint="pip install 'django-redis-mutex[telemetry]', or set TELEMETRY to False.",
            id="django_redis_mutex.W002",
        )
    for member in config.quorum or ():
        if member not in caches:
            problem = "is not configured in settings.CACHES"
        elif not _is_redis(caches[member]):
            problem = f"uses BACKEND {caches[member].get('BACKEND')!r}, which is not a Redis cache"
        else:
            continue
        yield Error(
            f"CACHES[{alias!r}]['MUTEX']['QUORUM'] names {member!r}, which {problem}.",
            hint="Every QUORUM member must be a Redis cache alias of its own.",
            id="django_redis_mutex.E003",
        )


def _lock_aliases_to_probe(caches: dict[str, Any]) -> list[str]:
    """Return the aliases that hold locks: those with a MUTEX block, and the QUORUM members.

    A quorum alias itself holds nothing (its members do); an alias that fails
    the settings check is left to that check.
    """
    aliases: dict[str, None] = {}  # in order, once each
    for alias, entry in caches.items():
        if "MUTEX" not in entry or not _is_redis(entry):
            continue
        try:
            members = parse_settings(alias, entry["MUTEX"]).quorum or (alias,)
        except ImproperlyConfigured:
            continue
        aliases.update(dict.fromkeys(m for m in members if _is_redis(caches.get(m))))
    return list(aliases)


@register(Tags.caches)
def check_lock_eviction(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about each lock alias whose Redis may evict keys, held locks among them.

    Asks each server once (``INFO memory``, within the probe client's short
    timeout). A server that cannot be reached is passed over in silence: the
    check must not fail a deploy step that runs without Redis, and the first
    lock on that alias asks again and logs the same warning.
    """
    return [
        message
        for alias in _lock_aliases_to_probe(getattr(settings, "CACHES", {}))
        for message in _eviction_messages(alias)
    ]


def _eviction_messages(alias: str) -> Iterator[CheckMessage]:
    try:
        required = get_settings(alias).require_noeviction
        with probe_client(alias) as client:
            verdict = read_policy(client, alias)
    except (*UNAVAILABLE, RedisError, ImproperlyConfigured):
        return  # unreachable, or not a client that can be asked: nothing to say
    if required and (verdict.evicts or verdict.unreadable is not None):
        yield Error(
            verdict.refusal(),
            hint="Every lock on this alias raises ImproperlyConfigured until then.",
            id="django_redis_mutex.E004",
        )
    elif verdict.unreadable is not None:
        yield Info(verdict.unreadable_message(), id="django_redis_mutex.I001")
    elif verdict.evicts:
        yield Warning(
            verdict.warning(),
            hint=(
                "Run a Redis with maxmemory-policy noeviction for locks and point this "
                "alias at it; set MUTEX REQUIRE_NOEVICTION to refuse locks meanwhile."
            ),
            id="django_redis_mutex.W003",
        )
