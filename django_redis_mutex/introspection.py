"""Look at and force-release the locks held in one cache alias.

Shared by the ``locks`` management command and the admin inspector. Keys are
walked with SCAN on an escaped pattern within this app's namespace, in batches,
never with KEYS, and only this app's lock keys are ever deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from . import scripts
from .client import backend_errors, get_client, namespace
from .holds import decode
from .keys import LockKeys, lock_pattern, validate_name

__all__ = ["HeldLock", "held_locks", "reset", "reset_all"]

SCAN_BATCH = 500


@dataclass(frozen=True)
class HeldLock:
    """One lock held right now, as read from Redis."""

    name: str
    owner: dict[str, Any]
    acquired_at: datetime
    ttl: float
    fence: int
    waiters: int

    @property
    def held_for(self) -> float:
        """Seconds since the lock was acquired (by this server's clock)."""
        return max(0.0, time.time() - self.acquired_at.timestamp())

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as JSON-ready values (acquired_at in ISO 8601)."""
        data = asdict(self)
        data["acquired_at"] = self.acquired_at.isoformat()
        return data


def _lock_keys(client: Any, alias: str) -> Iterator[list[str]]:
    """Yield batches of lock keys of ``alias``'s namespace."""
    batch: list[str] = []
    for key in client.scan_iter(
        match=lock_pattern(namespace(alias)), count=SCAN_BATCH, _type="hash"
    ):
        batch.append(decode(key))
        if len(batch) >= SCAN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _parse(fields: list[Any], pttl: int, waiters: int) -> HeldLock | None:
    token, fence, owner, acquired, name = (decode(v) for v in fields)
    if not token or pttl == -2:
        return None  # released between SCAN and read
    try:
        owner_data = json.loads(owner) if owner else {}
    except ValueError:
        owner_data = {}
    ms = int(acquired) if acquired.isdigit() else 0
    return HeldLock(
        name=name,
        owner={k: owner_data.get(k) for k in ("host", "pid", "thread", "label")},
        acquired_at=datetime.fromtimestamp(ms / 1000, tz=timezone.utc),
        ttl=max(pttl, 0) / 1000,
        fence=int(fence) if fence.isdigit() else 0,
        waiters=waiters,
    )


def held_locks(using: str = "default") -> list[HeldLock]:
    """Return the locks held right now in cache ``using``, sorted by name."""
    client = get_client(using)
    found: list[HeldLock] = []
    with backend_errors("*", using):
        for batch in _lock_keys(client, using):
            pipe = client.pipeline(transaction=False)
            for key in batch:
                keys = LockKeys.for_lock_key(key)
                pipe.hmget(key, ["token", "fence", "owner", "acquired", "name"])
                pipe.pttl(key)
                pipe.zcard(keys.queue)
            replies = pipe.execute()
            for i in range(0, len(replies), 3):
                held = _parse(replies[i], replies[i + 1], replies[i + 2])
                if held is not None:
                    found.append(held)
    found.sort(key=lambda h: h.name)
    return found


def reset(name: str, using: str = "default") -> bool:
    """Force-release lock ``name`` whoever holds it; return True if it was held.

    The first waiter, if any, is handed the lock and woken, as on a release.
    The holder learns of the loss when it next renews or leaves its block.
    """
    validate_name(name)
    keys = LockKeys.for_name(namespace(using), name)
    with backend_errors(name, using):
        done = scripts.run(get_client(using), scripts.RESET, keys.script_keys, [])
    return bool(done)


def reset_all(using: str = "default") -> int:
    """Force-release every lock of this app in cache ``using``; return how many were held."""
    client = get_client(using)
    count = 0
    with backend_errors("*", using):
        for batch in _lock_keys(client, using):
            for key in batch:
                keys = LockKeys.for_lock_key(key)
                count += scripts.run(client, scripts.RESET, keys.script_keys, [])
    return count
