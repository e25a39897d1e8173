"""What an operator does to a running Redis Cluster, done to the ones the tests start.

* **Slot moves by hand**, the way the Redis Cluster specification describes
  them: ``CLUSTER SETSLOT <slot> IMPORTING`` on the target, ``MIGRATING`` on
  the source, ``CLUSTER GETKEYSINSLOT`` and ``MIGRATE ... KEYS`` in small
  batches (so clients meet the slot half-moved), then ``SETSLOT <slot> NODE``
  everywhere (:func:`migrate_slot`).
* **Slot moves with redis-cli**: ``redis-cli --cluster reshard`` and
  ``--cluster rebalance`` (:func:`reshard`, :func:`rebalance`).
* **Failovers**: ``CLUSTER FAILOVER`` on a replica, or a primary killed and
  replaced by its replica once the others declare it failed
  (:func:`fail_over_by_hand`, :func:`wait_for_promotion`).
* **Checks afterwards**: which node stores each key of a namespace, and which
  keys have no expiry (:func:`keys_by_node`, :func:`keys_without_expiry`).

The layout is always read from the cluster itself (``CLUSTER NODES``), never
from the lists a test started with: slot moves and failovers change it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from django_redis_mutex.keys import escape_name, glob_escape
from django_redis_mutex.testing import RedisClusterServers, RedisServer, find_redis_server

from .helpers import wait_until

__all__ = [
    "ClusterNode",
    "MigrationRefused",
    "blocked_clients",
    "cluster_nodes",
    "cut_off",
    "fail_over_by_hand",
    "keys_by_node",
    "keys_without_expiry",
    "lock_slot",
    "migrate_slot",
    "names_in",
    "primary_of_slot",
    "rebalance",
    "replica_of",
    "reshard",
    "server_of",
    "stored_on",
    "wait_for_promotion",
]

# Bounds for a busy 2-core machine shared with other test runs.
MOVE_TIMEOUT = 120.0
FAILOVER_TIMEOUT = 30.0
# MIGRATE's own deadline for the target to answer, in milliseconds.
MIGRATE_TIMEOUT_MS = 5000


class MigrationRefused(AssertionError):
    """MIGRATE was refused with BUSYKEY: the target already had a key the source still held.

    Nothing but a client can have created it there: a script that ran on the
    importing node (after an ASK redirect) and wrote a key it had not declared.
    """


@dataclass(frozen=True)
class ClusterNode:
    """One row of ``CLUSTER NODES``."""

    id: str
    port: int
    primary: bool
    follows: str | None  # the primary's id, for a replica
    failed: bool
    slots: tuple[tuple[int, int], ...]

    def serves(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)

    @property
    def slot_count(self) -> int:
        return sum(last - first + 1 for first, last in self.slots)


def _client(port: int, timeout: float = 5.0) -> Any:
    # redis-py leaves execute_command untyped.
    return redis.Redis(port=port, socket_timeout=timeout, socket_connect_timeout=1)


def lock_slot(name: str) -> int:
    """Return the hash slot of every key of lock ``name`` (its escaped name is the hash tag)."""
    return key_slot(escape_name(name).encode())


def names_in(slots: tuple[tuple[int, int], ...], count: int, stem: str) -> list[str]:
    """Return ``count`` lock names in distinct slots, all within the ``slots`` ranges."""
    names: list[str] = []
    taken: set[int] = set()
    index = 0
    while len(names) < count:
        name = f"{stem}:{index}"
        index += 1
        slot = lock_slot(name)
        if slot not in taken and any(first <= slot <= last for first, last in slots):
            names.append(name)
            taken.add(slot)
    return names


def _live(cluster: RedisClusterServers) -> list[RedisServer]:
    return [node for node in cluster.all_nodes if node.process is not None and node.ping()]


def cluster_nodes(
    cluster: RedisClusterServers, via: RedisServer | None = None
) -> list[ClusterNode]:
    """Return the cluster's layout as one live node (``via``, else the first) sees it."""
    asked = via or _live(cluster)[0]
    client = _client(asked.port)
    try:
        text = client.execute_command("CLUSTER", "NODES")
    finally:
        client.close()
    text = text.decode() if isinstance(text, bytes) else str(text)
    nodes = []
    for row in text.splitlines():
        if not row.strip():
            continue
        fields = row.split()
        flags = fields[2].split(",")
        slots = []
        for part in fields[8:]:
            if part.startswith("["):  # a slot being moved: [slot->-id] or [slot-<-id]
                continue
            first, _, last = part.partition("-")
            slots.append((int(first), int(last or first)))
        nodes.append(
            ClusterNode(
                id=fields[0],
                port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                primary="master" in flags,
                follows=None if fields[3] == "-" else fields[3],
                failed="fail" in flags or "fail?" in flags,
                slots=tuple(slots),
            )
        )
    return nodes


def primary_of_slot(cluster: RedisClusterServers, slot: int) -> ClusterNode:
    """Return the primary serving ``slot`` now."""
    for node in cluster_nodes(cluster):
        if node.primary and not node.failed and node.serves(slot):
            return node
    raise AssertionError(f"No live primary serves slot {slot}.")


def _agreed(cluster: RedisClusterServers, check: Callable[[list[ClusterNode]], bool]) -> bool:
    """Return True when every live node's view of the layout passes ``check``, state ok."""
    for node in _live(cluster):
        client = _client(node.port)
        try:
            if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                return False
        except redis.RedisError:
            return False
        finally:
            client.close()
        if not check(cluster_nodes(cluster, via=node)):
            return False
    return True


# -- slot moves --------------------------------------------------------------------------------


def migrate_slot(
    cluster: RedisClusterServers,
    slot: int,
    target: ClusterNode,
    *,
    batch: int = 1,
    between: Callable[[int], object] | None = None,
) -> int:
    """Move ``slot`` to ``target`` by hand; return how many keys moved.

    Keys go ``batch`` at a time, and ``between(moved)`` runs after each batch
    while the slot is half-moved (some keys on each side), which is when a
    client's script can meet part of a lock's keys on either node. Raise
    :class:`MigrationRefused` naming the keys when MIGRATE fails.
    """
    source = primary_of_slot(cluster, slot)
    assert source.id != target.id, f"slot {slot} is already on {target.port}"
    src, dst = _client(source.port), _client(target.port)
    moved = 0
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.id)
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            try:
                src.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys
                )
            except redis.ResponseError as exc:
                if "BUSYKEY" not in str(exc):
                    raise
                raise MigrationRefused(
                    f"MIGRATE of slot {slot} from {source.port} to {target.port} refused "
                    f"{[k.decode() for k in keys]}: {exc}"
                ) from exc
            moved += len(keys)
            if between is not None:
                between(moved)
        # The order the specification gives: the target first, so it serves the
        # slot before the source starts sending clients there.
        dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.id)
        for node in cluster_nodes(cluster):
            if node.primary and not node.failed and node.id not in (source.id, target.id):
                other = _client(node.port)
                try:
                    other.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.id)
                finally:
                    other.close()
    finally:
        src.close()
        dst.close()
    wait_until(
        lambda: _agreed(cluster, lambda nodes: _owner_id(nodes, slot) == target.id),
        MOVE_TIMEOUT,
        f"every node to agree that {target.port} serves slot {slot}",
        interval=0.05,
    )
    return moved


def _owner_id(nodes: list[ClusterNode], slot: int) -> str | None:
    return next((n.id for n in nodes if n.primary and n.serves(slot)), None)


def redis_cli() -> str:
    """Return the redis-cli beside the redis-server the tests run (the venv's may be older)."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    assert found, f"No redis-cli beside {find_redis_server()} or on PATH."
    return found


def _redis_cli(*args: str | int, timeout: float = MOVE_TIMEOUT) -> str:
    """Run ``redis-cli --cluster ...``; return its output, failing with it on an error."""
    result = subprocess.run(
        [redis_cli(), "--cluster", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0 or "[ERR]" in output:
        tail = "\n".join(output.strip().splitlines()[-15:])
        failure = MigrationRefused if "BUSYKEY" in output else AssertionError
        command = " ".join(map(str, args))
        raise failure(f"redis-cli --cluster {command} failed ({result.returncode}):\n{tail}")
    return output


def reshard(
    cluster: RedisClusterServers, source: ClusterNode, target: ClusterNode, slots: int
) -> None:
    """Move the ``slots`` lowest slots of ``source`` to ``target`` with ``redis-cli --cluster``."""
    _redis_cli(
        "reshard",
        f"127.0.0.1:{source.port}",
        "--cluster-from",
        source.id,
        "--cluster-to",
        target.id,
        "--cluster-slots",
        slots,
        "--cluster-yes",
    )
    expected = source.slot_count - slots
    wait_until(
        lambda: _agreed(
            cluster,
            lambda nodes: next(n for n in nodes if n.id == source.id).slot_count == expected,
        ),
        MOVE_TIMEOUT,
        f"every node to see the {slots} slots moved off {source.port}",
        interval=0.05,
    )


def rebalance(cluster: RedisClusterServers, weights: dict[str, float] | None = None) -> str:
    """Run ``redis-cli --cluster rebalance`` (any imbalance over 1%); return its output."""
    args: list[str | int] = ["rebalance", f"127.0.0.1:{_live(cluster)[0].port}"]
    for node_id, weight in (weights or {}).items():
        args += ["--cluster-weight", f"{node_id}={weight}"]
    args += ["--cluster-threshold", 1, "--cluster-use-empty-masters"]
    output = _redis_cli(*args)
    wait_until(
        lambda: _agreed(cluster, lambda nodes: True),
        MOVE_TIMEOUT,
        "the cluster to settle after the rebalance",
        interval=0.05,
    )
    return output


# -- failovers ---------------------------------------------------------------------------------


def fail_over_by_hand(cluster: RedisClusterServers, replica: ClusterNode) -> None:
    """Run ``CLUSTER FAILOVER`` on ``replica`` and wait until every node sees it promoted."""
    client = _client(replica.port)
    try:
        client.execute_command("CLUSTER", "FAILOVER")
    finally:
        client.close()
    wait_for_promotion(cluster, replica)


@contextmanager
def cut_off(
    cluster: RedisClusterServers, replica: ClusterNode, primary: ClusterNode
) -> Iterator[None]:
    """Stop ``replica`` (SIGSTOP) and close its link, so ``primary``'s writes never reach it.

    What the block writes is acknowledged by the primary alone: asynchronous
    replication losing a write, made certain. The replica runs again after.
    """
    frozen = server_of(cluster, replica)
    frozen.pause()
    try:
        client = _client(primary.port)
        try:
            cut = client.client_kill_filter(_type="replica")
        finally:
            client.close()
        assert cut == 1, f"cut {cut} replica links of the primary on {primary.port}"
        yield
    finally:
        frozen.resume()


def wait_for_promotion(
    cluster: RedisClusterServers, replica: ClusterNode, timeout: float = FAILOVER_TIMEOUT
) -> ClusterNode:
    """Wait until every live node sees ``replica`` as a primary with slots; return it then."""

    def promoted(nodes: list[ClusterNode]) -> bool:
        me = next((n for n in nodes if n.id == replica.id), None)
        return me is not None and me.primary and bool(me.slots)

    wait_until(
        lambda: _agreed(cluster, promoted),
        timeout,
        f"the replica on {replica.port} to be promoted",
        interval=0.05,
    )
    return next(n for n in cluster_nodes(cluster) if n.id == replica.id)


# -- checks ------------------------------------------------------------------------------------


def keys_by_node(cluster: RedisClusterServers, pattern: str) -> dict[int, list[str]]:
    """Return the keys matching ``pattern`` stored on each live primary, by its port."""
    found: dict[int, list[str]] = {}
    for node in cluster_nodes(cluster):
        if not node.primary or node.failed:
            continue
        client = _client(node.port)
        try:
            found[node.port] = sorted(k.decode() for k in client.scan_iter(match=pattern))
        finally:
            client.close()
    return found


def keys_without_expiry(cluster: RedisClusterServers, pattern: str) -> list[str]:
    """Return ``port key`` for every key matching ``pattern`` on a live primary with no expiry."""
    found = []
    for port, keys in keys_by_node(cluster, pattern).items():
        client = _client(port)
        try:
            found += [f"{port} {key}" for key in keys if client.pttl(key) == -1]
        finally:
            client.close()
    return found


def stored_on(port: int, key: str) -> bool:
    """Return True if the node on ``port`` (primary or replica) stores ``key`` right now.

    SCAN names no key, so neither a replica nor a node that no longer serves
    the key's slot redirects it.
    """
    client = _client(port)
    try:
        return any(True for _ in client.scan_iter(match=glob_escape(key), count=1000))
    finally:
        client.close()


def blocked_clients(port: int) -> int:
    """Return how many clients of the node on ``port`` are blocked (a BLPOP, say) right now."""
    client = _client(port)
    try:
        return sum(1 for entry in client.client_list() if "b" in entry.get("flags", ""))
    finally:
        client.close()


def replica_of(cluster: RedisClusterServers, primary: ClusterNode) -> ClusterNode:
    """Return a live replica following ``primary``."""
    for node in cluster_nodes(cluster):
        if node.follows == primary.id and not node.failed:
            return node
    raise AssertionError(f"No live replica follows the primary on {primary.port}.")


def server_of(cluster: RedisClusterServers, node: ClusterNode) -> RedisServer:
    """Return the ``RedisServer`` process behind ``node``."""
    return next(s for s in cluster.all_nodes if s.port == node.port)
