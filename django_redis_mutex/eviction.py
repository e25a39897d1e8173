"""Tell whether the Redis of a lock alias may evict keys, and so a held lock.

A cache's Redis is usually set up to evict (``maxmemory`` with
``allkeys-lru``): when it is full it deletes keys to make room, and a lock key
is a key like any other. Under the ``volatile-*`` policies lock keys are
evictable too, as they carry a TTL. A held lock that is evicted lets a second
owner in while the first is still inside, and nothing tells either of them.

``INFO memory`` says whether a server may evict: a non-zero ``maxmemory`` and
a ``maxmemory_policy`` other than ``noeviction``. The policy belongs to the
whole server, not to one database, so the remedy is a Redis of its own for
locks, running with ``noeviction``.

The verdict of an alias is read once per process, when its first client is
made (:mod:`~django_redis_mutex.client`), and remembered until ``CACHES``
changes or the process forks, so no lock cycle but the first pays for it.
The system check (:mod:`~django_redis_mutex.checks`) reads it afresh.
Where ``INFO`` is refused (an ACL without ``+info``, a managed service that
disables it), the verdict says so instead of guessing.

.. versionadded:: 0.2
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from redis.exceptions import ResponseError

__all__ = [
    "NO_EVICTION",
    "EvictionPolicy",
    "first_read",
    "forget",
    "read_policy",
    "refuse_if_evicting",
    "remembered",
]

logger = logging.getLogger("django_redis_mutex")

NO_EVICTION = "noeviction"


@dataclass(frozen=True)
class EvictionPolicy:
    """What the Redis of cache ``alias`` said about evicting keys.

    ``unreadable`` is why ``INFO`` could not be read (then the other fields
    are None); ``evicted_keys`` is only read when asked for (``INFO stats``).
    """

    alias: str
    maxmemory: int | None = None
    policy: str | None = None
    evicted_keys: int | None = None
    unreadable: str | None = None

    @property
    def evicts(self) -> bool:
        """Return True if the server may evict keys, lock keys among them, when memory is full."""
        return bool(self.maxmemory) and self.policy not in (None, NO_EVICTION)

    def warning(self) -> str:
        """Return the message saying this alias's locks can be evicted, and the fix."""
        return (
            f"Cache {self.alias!r} keeps its locks on a Redis that evicts keys "
            f"(maxmemory-policy {self.policy}, maxmemory {self.maxmemory} bytes): when it "
            "fills up, a held lock can be evicted and a second owner let in while the first "
            "is still inside. Keep locks on a Redis running with maxmemory-policy noeviction, "
            "which means a separate server: the policy is per server, not per database."
        )

    def unreadable_message(self) -> str:
        """Return the message saying the eviction policy of this alias could not be read."""
        return (
            f"Cannot tell whether the Redis of cache {self.alias!r} evicts lock keys: it "
            f"refused INFO ({self.unreadable}). Grant the lock user +info, or make sure that "
            "server runs with maxmemory-policy noeviction."
        )

    @property
    def worth_listing(self) -> bool:
        """Return True if listings should show the evictions: the server may evict, or did."""
        return self.evicted_keys is not None and (self.evicts or self.evicted_keys > 0)

    def evictions_line(self) -> str | None:
        """Return what a listing says about evictions, or None when there is nothing to say."""
        count = self.evicted_keys
        if count is None or not self.worth_listing:
            return None
        keys = f"{count} key" if count == 1 else f"{count} keys"
        if self.evicts:
            return (
                f"The Redis of cache {self.alias!r} evicts keys (maxmemory-policy "
                f"{self.policy}): {keys} evicted since it started. A held lock can be "
                "evicted too: keep locks on a Redis with maxmemory-policy noeviction."
            )
        return (
            f"The Redis of cache {self.alias!r} evicted {keys} since it started "
            f"(maxmemory-policy now {self.policy})."
        )

    def refusal(self) -> str:
        """Return why REQUIRE_NOEVICTION refuses to lock on this alias."""
        where = f"CACHES[{self.alias!r}]['MUTEX']['REQUIRE_NOEVICTION']"
        if self.unreadable is not None:
            return (
                f"{where} is set, and the Redis of cache {self.alias!r} refused INFO "
                f"({self.unreadable}), so its eviction policy cannot be checked: no lock is "
                "taken. Grant the lock user +info, or unset REQUIRE_NOEVICTION."
            )
        return (
            f"{where} is set, and the Redis of cache {self.alias!r} evicts keys "
            f"(maxmemory-policy {self.policy}, maxmemory {self.maxmemory} bytes): no lock is "
            "taken there. Point this alias at a Redis running with maxmemory-policy "
            "noeviction (a separate server: the policy is per server, not per database)."
        )


def _per_server(reply: Any) -> list[dict[str, Any]]:
    """Return the INFO reply of each server (a cluster client answers per node)."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return list(reply.values())
    return [reply] if isinstance(reply, dict) else []


def read_policy(client: Any, alias: str, *, stats: bool = False) -> EvictionPolicy:
    """Ask the Redis behind ``client`` whether it evicts keys; with ``stats``, how many it did.

    A refused INFO (an error reply) gives a verdict whose ``unreadable`` says
    why; a transport failure propagates, as the server could not be asked.
    Of a cluster, the verdict of a node that evicts wins.
    """
    # A cluster client asks only its default node unless told: ask every primary.
    where = {"target_nodes": client.PRIMARIES} if hasattr(client, "get_nodes") else {}
    try:
        memory = _per_server(client.info("memory", **where))
        counts = _per_server(client.info("stats", **where)) if stats else []
    except ResponseError as exc:
        return EvictionPolicy(alias, unreadable=str(exc) or type(exc).__name__)
    found = [
        EvictionPolicy(
            alias,
            maxmemory=int(server.get("maxmemory", 0) or 0),
            policy=str(server.get("maxmemory_policy", NO_EVICTION)),
        )
        for server in memory
    ]
    verdict = next((item for item in found if item.evicts), None) or (
        found[0] if found else EvictionPolicy(alias, maxmemory=0, policy=NO_EVICTION)
    )
    evicted = [int(server["evicted_keys"]) for server in counts if "evicted_keys" in server]
    return replace(verdict, evicted_keys=sum(evicted)) if evicted else verdict


# Kept across os.fork(): a child talks to the same servers as its parent.
_verdicts: dict[str, EvictionPolicy] = {}


def remembered(alias: str) -> EvictionPolicy | None:
    """Return the verdict this process read for ``alias`` at its first use, if any."""
    return _verdicts.get(alias)


def forget() -> None:
    """Forget every verdict (after CACHES changed, or in a forked child)."""
    _verdicts.clear()


def first_read(alias: str, client: Any) -> EvictionPolicy:
    """Read ``alias``'s verdict through ``client``, remember it, and say once if it matters.

    The warning (or, where INFO is refused, the note that nothing can be
    told) is logged only by the call that first remembers the verdict in this
    process. A transport failure propagates and nothing is remembered, so a
    later first use asks again.
    """
    read = read_policy(client, alias)
    # setdefault is atomic: of two threads reading at once, one logs.
    verdict = _verdicts.setdefault(alias, read)
    first = verdict is read
    if first and verdict.unreadable is not None:
        logger.warning("%s", verdict.unreadable_message())
    elif first and verdict.evicts:
        logger.warning("%s", verdict.warning())
    return verdict


def refuse_if_evicting(verdict: EvictionPolicy) -> None:
    """Raise ImproperlyConfigured if ``verdict`` does not show a server that never evicts."""
    if verdict.evicts or verdict.unreadable is not None:
        raise ImproperlyConfigured(verdict.refusal())
