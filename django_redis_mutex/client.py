"""The only module that reaches django-redis and redis-py for a client.

Everything else asks this module for a raw client of a cache alias, and for
the namespace that alias's lock keys live under. Redis connection failures are
translated into :class:`LockBackendUnavailable` here, once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from redis import exceptions as redis_errors

from . import eviction
from .conf import cache_entry, get_settings
from .exceptions import LockBackendUnavailable

if TYPE_CHECKING:
    import redis
    import redis.asyncio

__all__ = [
    "REDIS_BACKENDS",
    "UNAVAILABLE",
    "backend_errors",
    "backend_kind",
    "clear_clients",
    "get_async_client",
    "get_blocking_client",
    "get_client",
    "get_member_client",
    "lock_aliases",
    "namespace",
    "probe_client",
]

DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"
DJANGO_BUILTIN_BACKEND = "django.core.cache.backends.redis.RedisCache"
# The cache backends whose raw redis-py client locks can use (subclasses too).
REDIS_BACKENDS = (DJANGO_REDIS_BACKEND, DJANGO_BUILTIN_BACKEND)

# Failures of the transport, not of a command: the lock could not be asked.
# A Redis Cluster that answers TRYAGAIN (a lock's keys split by a slot
# migration) until redis-py's retries run out, or that is down, ran nothing.
# A server demoted to replica under a plain client (a failover it was not
# told of) answers READONLY at a script's first write, so nothing was written.
# redis-py's cluster client also raises RedisClusterException, which is not a
# RedisError: a slot no node covers while a failover is under way, or no seed
# node answering while it looks for the cluster.
UNAVAILABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    OSError,
    redis_errors.TryAgainError,
    redis_errors.ClusterError,
    redis_errors.ReadOnlyError,
    redis_errors.RedisClusterException,
)

logger = logging.getLogger("django_redis_mutex")

_lock = threading.Lock()
_sync_clients: dict[str, redis.Redis] = {}
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_namespaces: dict[str, str] = {}
# Counts the times CACHES changed (clear_clients): a client built across a
# change is not cached.
_generation = 0
_derived_clients: dict[tuple[str, str, float | None], Any] = {}
# Aliases whose Redis could not be asked for its eviction policy at first use,
# with the monotonic time to ask again (see _vet).
_unvetted: dict[str, float] = {}
# Aliases whose eviction policy is being asked in the background.
_probing: set[str] = set()

# How long asking a Redis for its eviction policy may take (connect and read),
# and how long to wait before asking again a Redis that did not answer.
PROBE_TIMEOUT = 1.0
VET_RETRY = 5.0


def server_ms(reply: Any) -> int:
    """Return a TIME reply in ms (a cluster client answers per node: any node will do).

    Send TIME on its own, never in a pipeline: a cluster client refuses it there.
    """
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


# Django's own backend first: a subclass is matched against it before django-redis.
_KINDS = {DJANGO_BUILTIN_BACKEND: "django", DJANGO_REDIS_BACKEND: "django_redis"}


def backend_kind(backend: str) -> str | None:
    """Return "django_redis" or "django" for a Redis cache BACKEND (or a subclass), else None."""
    if backend in _KINDS:
        return _KINDS[backend]
    from django.utils.module_loading import import_string

    try:
        backend_class = import_string(backend)
    except ImportError:
        return None
    if not isinstance(backend_class, type):
        return None
    for path, kind in _KINDS.items():
        try:
            if issubclass(backend_class, import_string(path)):
                return kind
        except ImportError:  # django-redis is not installed
            return None
    return None


def lock_aliases() -> list[str]:
    """Return the cache aliases in settings.CACHES that can carry locks."""
    from django.conf import settings

    return [
        alias
        for alias, entry in getattr(settings, "CACHES", {}).items()
        if backend_kind(str(entry.get("BACKEND", ""))) is not None
    ]


def _check_backend(alias: str) -> str:
    backend = str(cache_entry(alias).get("BACKEND", ""))
    kind = backend_kind(backend)
    if kind is None:
        raise ImproperlyConfigured(
            f"Cache alias {alias!r} uses BACKEND {backend!r}, which is not a Redis cache; "
            f"django-redis-mutex needs {DJANGO_REDIS_BACKEND!r} or {DJANGO_BUILTIN_BACKEND!r}."
        )
    return kind


def _raw_client(alias: str, kind: str) -> redis.Redis:
    from django.core.cache import caches

    if kind == "django":
        # Django's own backend: the primary (first LOCATION) takes the writes.
        client: redis.Redis = caches[alias]._cache.get_client(write=True)  # type: ignore[attr-defined]
        return client
    from django_redis import get_redis_connection

    try:
        connection: redis.Redis = get_redis_connection(alias, write=True)
    except NotImplementedError as exc:
        raise ImproperlyConfigured(
            f"Cache alias {alias!r} does not give access to a raw Redis client "
            "(sharded or custom django-redis clients are not supported)."
        ) from exc
    return connection


def _cluster_client(alias: str, *, asynchronous: bool = False, **overrides: Any) -> Any:
    """Return a redis-py cluster client (``redis.asyncio``'s if ``asynchronous``) on ``alias``.

    django-redis and Django's backend cannot talk to a Redis Cluster; for a
    lock alias marked CLUSTER the app asks redis-py's own cluster client,
    which routes each script by its keys' (shared) hash slot.

    LOCATION may name several nodes (a list, or URLs separated by commas):
    the first gives the connection options, and every one is a seed the
    client may start from, so a client made while the first is down still
    finds the cluster. Once connected, redis-py keeps every node it has seen
    as a seed for finding the cluster again after a failover. ``overrides``
    (socket timeouts) replace the alias's OPTIONS.
    """
    entry = cache_entry(alias)
    location = entry.get("LOCATION", "")
    if isinstance(location, str):
        locations = [part.strip() for part in location.split(",") if part.strip()]
    elif isinstance(location, (list, tuple)):
        locations = [part for part in location if isinstance(part, str) and part]
    else:
        locations = []
    if not locations:
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}] has MUTEX CLUSTER set but no LOCATION naming a cluster node."
        )
    options = {str(k).lower(): v for k, v in (entry.get("OPTIONS") or {}).items()}
    kwargs: dict[str, Any] = {
        name: options[name]
        for name in ("socket_timeout", "socket_connect_timeout", "password", "username")
        if options.get(name) is not None
    }
    seeds = [_host_port(alias, url) for url in locations[1:]]
    # redis-py leaves its cluster classes untyped.
    cluster: Any = importlib.import_module(f"redis{'.asyncio' if asynchronous else ''}.cluster")
    return cluster.RedisCluster.from_url(
        locations[0],
        startup_nodes=[cluster.ClusterNode(host, port) for host, port in seeds],
        **{**kwargs, **overrides},
    )


def _host_port(alias: str, url: str) -> tuple[str, int]:
    """Return the host and port a cluster seed URL names."""
    parts = urlsplit(url)
    try:
        port = parts.port or 6379
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ImproperlyConfigured(
            f"CACHES[{alias!r}] LOCATION {url!r} does not name a cluster node as redis://host:port."
        )
    return parts.hostname, port


def get_client(alias: str) -> Any:
    """Return the raw redis-py client the cache ``alias`` holds (django-redis or Django's own).

    For an alias whose MUTEX block sets ``CLUSTER``, return a
    ``redis.cluster.RedisCluster`` on its LOCATION instead.

    The first client of an alias in a process asks its Redis whether it may
    evict keys (one ``INFO``, see :mod:`~django_redis_mutex.eviction`): a
    warning is logged once if it may, and with ``REQUIRE_NOEVICTION`` the
    alias is refused with ImproperlyConfigured on every call.
    """
    client = _sync_clients.get(alias)
    if client is not None:
        if _unvetted and alias in _unvetted:
            try:
                _vet(alias, client)
            except ImproperlyConfigured:
                with _lock:
                    _sync_clients.pop(alias, None)
                raise
        return client
    generation = _generation
    client = _new_client(alias)
    _vet(alias, client)
    return _keep(_sync_clients, alias, client, generation)


def _keep(store: dict[Any, Any], key: Any, value: Any, generation: int) -> Any:
    """Keep ``value`` in ``store`` unless CACHES changed since ``generation``; return what is kept.

    A client or namespace built while CACHES changed (another thread's
    override_settings) may point at the old server: it serves the call that
    built it, and is never kept for the callers after the change.
    """
    with _lock:
        if generation != _generation:
            return value
        return store.setdefault(key, value)


def _new_client(alias: str) -> Any:
    kind = _check_backend(alias)
    return _cluster_client(alias) if get_settings(alias).cluster else _raw_client(alias, kind)


def _vet(alias: str, client: Any) -> None:
    """Read ``alias``'s eviction verdict once per process; refuse if REQUIRE_NOEVICTION says so.

    A Redis that cannot be reached right now is asked again at a later use,
    at most every VET_RETRY seconds: the lock operation itself then reports
    the outage, not this check, and a slow answer never fails a lock.
    """
    verdict = eviction.remembered(alias)
    if verdict is None:
        if time.monotonic() < _unvetted.get(alias, 0.0) or alias in _probing:
            return
        if not get_settings(alias).require_noeviction:
            # Only a warning hangs on the answer: ask in the background, so a
            # slow or paused server (a quorum master) never delays a lock.
            _probing.add(alias)
            threading.Thread(
                target=_vet_quietly, args=(alias, client), daemon=True, name="mutex-vet"
            ).start()
            return
        verdict = _read_eviction(alias, client)
        if verdict is None:
            return
    if get_settings(alias).require_noeviction:
        eviction.refuse_if_evicting(verdict)


def _read_eviction(alias: str, client: Any) -> eviction.EvictionPolicy | None:
    """Ask ``alias``'s Redis for its eviction policy; None (to ask again later) if silent."""
    try:
        with probe_client(alias, base=client) as probe:
            verdict = eviction.first_read(alias, probe)
    except UNAVAILABLE:
        _unvetted[alias] = time.monotonic() + VET_RETRY
        return None
    _unvetted.pop(alias, None)
    return verdict


def _vet_quietly(alias: str, client: Any) -> None:
    """Ask ``alias``'s Redis for its eviction policy off the caller's path; warn if it may evict."""
    try:
        _read_eviction(alias, client)
    except Exception:  # a settings change mid-way; never a thread dying with a traceback
        logger.debug("Could not ask %r for its eviction policy.", alias, exc_info=True)
    finally:
        _probing.discard(alias)


def socket_timeout(client: Any) -> float | None:
    """Return the read timeout a client uses (a pool's, or a cluster's nodes'), or None."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        value = pool.connection_kwargs.get("socket_timeout")
    else:
        nodes = getattr(client, "nodes_manager", None)
        kwargs = getattr(nodes, "connection_kwargs", None) or getattr(
            client, "connection_kwargs", {}
        )
        value = kwargs.get("socket_timeout")
    return None if value is None else float(value)


def _derive(alias: str, kind: str, timeout: float | None, **overrides: Any) -> Any:
    """Return a client on ``alias``'s Redis with other socket timeouts, or the alias's own.

    Only plain connection pools can be copied with new timeouts; a Sentinel or
    Cluster alias keeps its own client (its own timeouts then apply).
    """
    key = (alias, kind, timeout)
    client = _derived_clients.get(key)
    if client is None:
        generation = _generation
        client = _copy_with(alias, get_client(alias), **overrides)
        client = _keep(_derived_clients, key, client, generation)
    return client


def _copy_with(alias: str, base: Any, **overrides: Any) -> Any:
    """Return a new client like ``base`` with ``overrides`` (socket timeouts), or ``base``."""
    import redis as redis_module

    pool: Any = getattr(base, "connection_pool", None)
    if get_settings(alias).cluster:
        return _cluster_client(alias, **overrides)
    if type(pool) not in (redis_module.ConnectionPool, redis_module.BlockingConnectionPool):
        return base
    new_pool = type(pool)(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **{**pool.connection_kwargs, **overrides},
    )
    return redis_module.Redis(connection_pool=new_pool)


def get_member_client(alias: str, timeout: float | None = None) -> Any:
    """Return a client for ``alias`` as a quorum master: every request bounded by ``timeout``.

    The Redlock algorithm asks each master with a deadline small against the
    lease, so one master that hangs (sockets open, no answer) cannot eat the
    validity of a lock the others granted. ``timeout`` defaults to the alias's
    ``QUORUM_TIMEOUT``.
    """
    if timeout is None:
        timeout = get_settings(alias).quorum_timeout
    return _derive(alias, "member", timeout, socket_timeout=timeout, socket_connect_timeout=timeout)


@contextmanager
def probe_client(alias: str, *, base: Any = None) -> Iterator[Any]:
    """Give a client for ``alias`` whose every request gives up after PROBE_TIMEOUT seconds.

    For questions about the server (its eviction policy) that must never hold
    up a lock, a system check or a listing for long. ``base`` is the alias's
    own client, if the caller has it. Making it asks the server nothing, so
    it works for an alias that REQUIRE_NOEVICTION refuses. Its connection is
    closed on leaving: it serves a question asked once, not every lock.
    """
    if base is None:
        _check_backend(alias)
        # A cluster alias's probe is a cluster client of its own (_copy_with):
        # the alias's client is not needed, and making one would connect
        # (to read the slots) without the probe's timeouts.
        if not get_settings(alias).cluster:
            base = _sync_clients.get(alias)
            if base is None:
                base = _new_client(alias)
    client = _copy_with(
        alias, base, socket_timeout=PROBE_TIMEOUT, socket_connect_timeout=PROBE_TIMEOUT
    )
    try:
        yield client
    finally:
        if client is not base:
            client.close()
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                pool.disconnect()


# How much longer than the longest blocking wait a blocking connection reads.
BLOCKING_GRACE = 0.5


def blocking_read_timeout(alias: str, longest_wait: float) -> float | None:
    """Return the read timeout for blocking waits of up to ``longest_wait`` seconds on ``alias``."""
    base = socket_timeout(get_client(alias))
    return None if base is None else base + longest_wait + BLOCKING_GRACE


def get_blocking_client(alias: str, longest_wait: float) -> Any:
    """Return a client for ``alias`` whose reads outlast a blocking pop of ``longest_wait`` s.

    A small SOCKET_TIMEOUT (common in production) would otherwise cut every
    blocking wait short and report Redis as down while it is only quiet.
    """
    timeout = blocking_read_timeout(alias, longest_wait)
    return _derive(alias, "blocking", timeout, socket_timeout=timeout)


# Connection settings a user sets (URL, OPTIONS) that mean the same to the
# async client. Transport internals of the sync pool are not carried over.
_SHARED_KWARGS = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "credential_provider",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "encoding",
    "encoding_errors",
    "decode_responses",
    "client_name",
    "health_check_interval",
    "protocol",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_ca_path",
    "ssl_password",
    "ssl_check_hostname",
    "ssl_min_version",
    "ssl_ciphers",
    "ssl_include_verify_flags",
    "ssl_exclude_verify_flags",
)


def _shared_kwargs(pool: Any, *skip: str) -> dict[str, Any]:
    """Return the settings (but ``skip``) of the sync ``pool`` that an async pool takes as well."""
    return {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k in _SHARED_KWARGS and k not in skip and v is not None
    }


def _async_pool_for(sync_client: redis.Redis) -> Any:
    """Build a redis.asyncio pool with the same connection settings as ``sync_client``."""
    import redis.asyncio as aioredis
    from redis import connection as sync_conn
    from redis.asyncio import connection as async_conn
    from redis.sentinel import SentinelConnectionPool

    pool = sync_client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return _async_sentinel_pool(pool)
    kwargs = _shared_kwargs(pool)
    conn_class: Any = async_conn.Connection
    if issubclass(pool.connection_class, sync_conn.UnixDomainSocketConnection):
        conn_class = async_conn.UnixDomainSocketConnection
    elif issubclass(pool.connection_class, sync_conn.SSLConnection):
        conn_class = async_conn.SSLConnection
    return aioredis.ConnectionPool(
        connection_class=conn_class,
        max_connections=getattr(pool, "max_connections", None),
        **kwargs,
    )


def _async_sentinel_pool(pool: Any) -> Any:
    """Build a redis.asyncio Sentinel master pool asking the same sentinels for the same service."""
    from redis.asyncio import sentinel

    manager = pool.sentinel_manager
    sentinels = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in manager.sentinels
    ]
    kwargs = _shared_kwargs(pool, "host", "port")
    sentinel_module: Any = sentinel  # redis-py leaves these constructors untyped
    async_manager = sentinel_module.Sentinel(
        sentinels, sentinel_kwargs=manager.sentinel_kwargs, **kwargs
    )
    # redis-py turns ``ssl=True`` into its TLS connection class and drops the
    # flag, so TLS to the master shows only in the sync pool's connection class.
    from redis.connection import SSLConnection

    pool_kwargs = dict(kwargs)
    if issubclass(pool.connection_class, SSLConnection):
        pool_kwargs["ssl"] = True
    return sentinel_module.SentinelConnectionPool(pool.service_name, async_manager, **pool_kwargs)


async def _close_with_loop(clients: dict[str, Any]) -> Any:
    """An async generator whose only job is to close ``clients`` when the loop shuts down.

    ``asyncio.run()`` (and uvicorn, Django's ASGI servers) call
    ``loop.shutdown_asyncgens()`` on exit, which closes this generator, so the
    loop's Redis connections are closed inside the loop that owns them instead
    of leaking as "unclosed connection" warnings.
    """
    try:
        yield
    finally:
        for key, client in list(clients.items()):
            if key == "__closer__":
                continue
            if hasattr(client, "get_nodes"):  # a cluster client owns its connections
                await client.aclose()
                continue
            manager = getattr(client.connection_pool, "sentinel_manager", None)
            await client.aclose(close_connection_pool=True)
            for sentinel in getattr(manager, "sentinels", ()):
                await sentinel.aclose()
        clients.clear()


async def get_async_client(
    alias: str, *, read_timeout: float | None = None, connect_timeout: float | None = None
) -> Any:
    """Return a redis.asyncio client for ``alias`` bound to the running event loop.

    It shares the cache's connection settings (host, db, password, socket
    timeouts) but has its own pool, since asyncio connections belong to one
    loop. With ``read_timeout`` (and ``connect_timeout``), another client of
    that loop uses those timeouts instead: blocking waits longer than the
    alias's socket timeout, or a quorum master's short deadline.
    """
    import redis.asyncio as aioredis

    if alias not in _sync_clients or (_unvetted and alias in _unvetted):
        # The alias's first use in this process (or a refused one): its
        # eviction check is a blocking INFO, so it runs off the event loop.
        await asyncio.to_thread(get_client, alias)
    loop = asyncio.get_running_loop()
    per_loop = _async_clients.get(loop)
    if per_loop is None:
        per_loop = {}
        closer = _close_with_loop(per_loop)
        await closer.__anext__()
        # The loop keeps only a weak reference to its async generators.
        per_loop["__closer__"] = closer
        _async_clients[loop] = per_loop
    timeouts = {"socket_timeout": read_timeout, "socket_connect_timeout": connect_timeout}
    timeouts = {name: value for name, value in timeouts.items() if value is not None}
    key = f"{alias}\0read={read_timeout}\0connect={connect_timeout}" if timeouts else alias
    client = per_loop.get(key)
    if client is None:
        if get_settings(alias).cluster:
            client = _cluster_client(alias, asynchronous=True, **timeouts)
        else:
            pool = _async_pool_for(get_client(alias))
            if not hasattr(pool, "sentinel_manager"):  # a Sentinel alias keeps its own timeouts
                pool.connection_kwargs.update(timeouts)
            client = aioredis.Redis(connection_pool=pool)
        per_loop[key] = client
    return client


def namespace(alias: str) -> str:
    """Return the key namespace of ``alias``: its cache KEY_PREFIX plus the MUTEX PREFIX.

    Cache keys are ``<KEY_PREFIX>:<VERSION>:<key>`` with a numeric version; a
    lock key's second part is the (never all-digit) PREFIX, so the two cannot meet.
    """
    ns = _namespaces.get(alias)
    if ns is None:
        generation = _generation
        _check_backend(alias)
        prefix = get_settings(alias).prefix
        key_prefix = cache_entry(alias).get("KEY_PREFIX", "") or ""
        if not isinstance(key_prefix, str):
            raise ImproperlyConfigured(f"CACHES[{alias!r}]['KEY_PREFIX'] must be a string.")
        if "{" in key_prefix or "}" in key_prefix:
            raise ImproperlyConfigured(
                f"CACHES[{alias!r}]['KEY_PREFIX'] contains a brace, which would change "
                "the Redis Cluster hash tag of every lock key."
            )
        ns = f"{key_prefix}:{prefix}" if key_prefix else prefix
        ns = _keep(_namespaces, alias, ns, generation)
    return ns


def reset_after_fork() -> None:
    """Start a forked child with a fresh lock and no clients of the parent's.

    The parent's lock may have been held by another thread at fork time; in
    the child it would never be released, so it is replaced, not acquired.
    """
    global _lock
    _lock = threading.Lock()
    _forget()
    # A background eviction check of the parent's is not running in the child:
    # left marked, its alias would never be checked there.
    _probing.clear()


def clear_clients() -> None:
    """Forget cached clients and namespaces (after CACHES changed, or in a forked child)."""
    global _generation
    with _lock:
        _generation += 1
        _close_idle([*_sync_clients.values(), *_derived_clients.values()])
        _forget()
        eviction.forget()


def _forget() -> None:
    for store in (_sync_clients, _derived_clients, _namespaces, _async_clients, _unvetted):
        store.clear()


def _close_idle(clients: list[Any]) -> None:
    """Close the idle connections of clients being forgotten.

    A pool dropped with its sockets open warns (ResourceWarning) whenever it
    is collected; a connection in use is left to finish its command.
    """
    import redis as redis_module

    for client in clients:
        pool = getattr(client, "connection_pool", None)
        if isinstance(pool, redis_module.ConnectionPool):
            pool.disconnect(inuse_connections=False)


@receiver(setting_changed)
def _clear_on_caches_change(*, setting: str, **kwargs: Any) -> None:
    # Clients and namespaces are built from CACHES (override_settings in tests).
    if setting == "CACHES":
        # Django's cache handler and the MUTEX settings are reset by receivers
        # of their own, which may run after this one: until then a client or
        # namespace built in another thread would come from the old settings.
        # Reset them first, so whatever is built after the clear is current.
        from django.test.signals import clear_cache_handlers

        clear_cache_handlers(setting=setting)
        get_settings.cache_clear()  # the same for the MUTEX settings (conf.py)
        clear_clients()


class backend_errors:  # lower case: it replaced a function of that name
    """Translate a transport failure talking to Redis into LockBackendUnavailable.

    A plain class rather than ``@contextmanager``: it sits twice on every
    lock cycle, and a generator-based context manager costs several times more.
    """

    __slots__ = ("alias", "name")

    def __init__(self, name: str | None, alias: str) -> None:
        # None: an operation on every lock of the alias (listing, reset-all).
        self.name = name
        self.alias = alias

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is not None and isinstance(exc, UNAVAILABLE):
            about = "" if self.name is None else f" while handling lock {self.name!r}"
            raise LockBackendUnavailable(
                f"Redis for cache {self.alias!r} is unavailable{about}: {exc}",
                name=self.name,
            ) from exc
        return False
