"""Redis topologies beyond one server, started for a test, and workers that contend on them.

* **Cluster**: ``RedisClusterServers`` (``django_redis_mutex.testing``) gives
  three primaries; :func:`cluster_entry` is the CACHES entry a project writes
  for a lock alias on it, :func:`names_on_every_primary` picks lock names whose
  hash slots land on each primary.
* **Sentinel**: :class:`SentinelGroup` starts one master, its replicas and
  three sentinels, all from the same ``redis-server`` binary (sentinels with
  ``--sentinel`` and a config file each), with a short ``down-after`` so a
  killed master is replaced within seconds. :meth:`SentinelGroup.cache_entry`
  is django-redis's own Sentinel configuration.
* **Independent masters**: plain :class:`RedisServer` processes; a quorum
  (Redlock) lock spans their aliases (:func:`master_entries`).

:class:`SectionWorkers` starts ``tests/workers/topo_sections.py`` processes
with any of these CACHES entries and reads back the history of their critical
sections (``tests/history.py``) and the counters they incremented.
"""

from __future__ import annotations

import copy
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings
from django.test import override_settings

from django_redis_mutex.testing import (
    RedisClusterServers,
    RedisServer,
    find_redis_server,
    free_port,
)

from .helpers import run_worker, wait_until
from .history import History

__all__ = [
    "SectionWorkers",
    "SentinelGroup",
    "cluster_entry",
    "extra_caches",
    "master_entries",
    "names_on_every_primary",
    "primary_port_of_slot",
]

# Bounds for a busy 2-core machine; a healthy topology needs a fraction of them.
START_TIMEOUT = 30.0
FAILOVER_TIMEOUT = 30.0
# Short socket timeouts: a hung server is reported within seconds, a dead one at once.
SOCKET_OPTIONS = {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 2}


@contextmanager
def redis_servers(count: int) -> Iterator[list[RedisServer]]:
    """Start ``count`` independent redis-servers (quorum masters); close them all after.

    A server a test left paused is resumed first, so it can stop cleanly.
    """
    servers = [RedisServer().start() for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.resume()
            server.close()


@contextmanager
def extra_caches(entries: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Add cache aliases to settings.CACHES for the duration of the block."""
    caches = copy.deepcopy(settings.CACHES)
    caches.update(copy.deepcopy(entries))
    with override_settings(CACHES=caches):
        yield


# -- cluster -----------------------------------------------------------------------------------


def cluster_entry(cluster: RedisClusterServers, prefix: str, **mutex: Any) -> dict[str, Any]:
    """Return the CACHES entry of a lock alias on ``cluster`` (MUTEX CLUSTER: True)."""
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": cluster.url,
        "KEY_PREFIX": "tests",
        "OPTIONS": dict(SOCKET_OPTIONS),
        "MUTEX": {"CLUSTER": True, "PREFIX": prefix, **mutex},
    }


def primary_port_of_slot(cluster: RedisClusterServers) -> Callable[[int], int]:
    """Return a function mapping a hash slot to the port of the primary serving it."""
    client = redis.Redis(port=cluster.nodes[0].port)
    try:
        ranges = [
            (int(r[0]), int(r[1]), int(r[2][1])) for r in client.execute_command("CLUSTER", "SLOTS")
        ]
    finally:
        client.close()

    def port_of(slot: int) -> int:
        for first, last, port in ranges:
            if first <= slot <= last:
                return port
        raise AssertionError(f"No primary serves slot {slot}.")

    return port_of


def names_on_every_primary(
    cluster: RedisClusterServers, per_primary: int = 1, stem: str = "spread"
) -> list[str]:
    """Return lock names, ``per_primary`` of them hashing to each primary of ``cluster``."""
    from redis.crc import key_slot

    from django_redis_mutex.keys import escape_name

    port_of = primary_port_of_slot(cluster)
    wanted = {node.port: per_primary for node in cluster.nodes}
    names: list[str] = []
    index = 0
    while any(wanted.values()):
        name = f"{stem}:{index}"
        index += 1
        # The hash tag of every key of a lock is its escaped name.
        port = port_of(key_slot(escape_name(name).encode()))
        if wanted[port]:
            wanted[port] -= 1
            names.append(name)
    return names


# -- independent masters -----------------------------------------------------------------------

# A quorum master's deadline (QUORUM_TIMEOUT) for tests that expect calls to
# succeed: on a loaded machine two masters of three answering later than the
# default 50 ms would refuse them. The tests of the deadline itself keep the
# default (tests/test_reads.py, tests/test_leases.py).
LOADED_QUORUM_TIMEOUT = 0.25


def master_entries(
    masters: Sequence[RedisServer], aliases: Sequence[str], prefix: str, **mutex: Any
) -> dict[str, dict[str, Any]]:
    """Return one CACHES entry per independent master, named by ``aliases``."""
    return {
        alias: {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "KEY_PREFIX": "tests",
            "OPTIONS": dict(SOCKET_OPTIONS),
            "MUTEX": {"PREFIX": prefix, **mutex},
        }
        for alias, server in zip(aliases, masters, strict=True)
    }


# -- sentinel ----------------------------------------------------------------------------------


@dataclass
class Sentinel:
    """One ``redis-server --sentinel`` process."""

    port: int
    config: str
    myid: str
    process: subprocess.Popen[bytes] | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)


@dataclass
class SentinelGroup:
    """A master, its replicas and the sentinels watching them, on loopback.

    The sentinels use ``down-after-milliseconds`` (default 1000) and
    ``failover-timeout`` (default 3000), so a killed master is replaced by a
    replica within about three seconds. Their config files list each other and
    the replicas from the start, and on Redis 7 ``SENTINEL DEBUG`` shortens
    the hello and INFO periods, so a group is ready in a fraction of a second.
    """

    replicas: int = 2
    sentinel_count: int = 3
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    binary: str = field(default_factory=find_redis_server)
    #: The monitored service, unique per group: django-redis caches its
    #: connection pools per URL for the whole process, and the URL names it.
    service: str = field(default_factory=lambda: "locks-" + uuid.uuid4().hex[:8])
    servers: list[RedisServer] = field(default_factory=list)
    sentinels: list[Sentinel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="django-redis-mutex-sentinel-")
        self._port_guards: list[socket.socket] = []

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> SentinelGroup:
        """Start the master, the replicas and the sentinels; return once all have met."""
        try:
            # Redis 7 waits 5 s before a diskless full sync, for more replicas to join.
            fast_sync = ["--repl-diskless-sync-delay", "0"]
            master = RedisServer(binary=self.binary, extra_args=fast_sync).start()
            self.servers = [master]
            for _ in range(self.replicas):
                replica = RedisServer(
                    binary=self.binary,
                    extra_args=[*fast_sync, "--replicaof", "127.0.0.1", str(master.port)],
                )
                self.servers.append(replica.start())
            wait_until(
                lambda: self._replicas_in_sync(master),
                START_TIMEOUT,
                "the replicas to sync with the master",
            )
            self.sentinels = [self._new_sentinel(i) for i in range(self.sentinel_count)]
            for index, sentinel in enumerate(self.sentinels):
                self._write_config(sentinel, index, master.port)
                self._launch(sentinel)
            for sentinel in self.sentinels:
                wait_until(
                    lambda s=sentinel: _pings(s.port),
                    START_TIMEOUT,
                    f"sentinel on port {sentinel.port} to answer",
                )
                self._speed_up(sentinel)
            wait_until(
                self._sentinels_agree,
                START_TIMEOUT,
                "the sentinels to discover each other and the replicas",
            )
        except BaseException:
            self.close()
            raise
        return self

    def _replicas_in_sync(self, master: RedisServer) -> bool:
        info = _info(master.port)
        return (
            info is not None
            and int(info.get("connected_slaves", 0)) == self.replicas
            and all(
                (_info(s.port) or {}).get("master_link_status") == "up" for s in self.servers[1:]
            )
        )

    def _new_sentinel(self, index: int) -> Sentinel:
        config = os.path.join(self._dir, f"sentinel-{index}.conf")
        # A sentinel's run id is 40 hex characters.
        return Sentinel(
            port=free_port(), config=config, myid=uuid.uuid4().hex + uuid.uuid4().hex[:8]
        )

    def _write_config(self, sentinel: Sentinel, index: int, master_port: int) -> None:
        # Sentinels and replicas are listed up front (the lines Sentinel itself
        # writes when it learns them), so the group works at once instead of
        # after the 2 s hello period of Redis before 7.
        lines = [
            f"port {sentinel.port}",
            "bind 127.0.0.1",
            "protected-mode no",
            "daemonize no",
            f"dir {self._dir}",
            f"logfile {self._dir}/sentinel-{index}.log",
            f"sentinel myid {sentinel.myid}",
            f"sentinel monitor {self.service} 127.0.0.1 {master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {self.service} 1",
            *(
                f"sentinel known-replica {self.service} 127.0.0.1 {replica.port}"
                for replica in self.servers[1:]
            ),
            *(
                f"sentinel known-sentinel {self.service} 127.0.0.1 {other.port} {other.myid}"
                for other in self.sentinels
                if other is not sentinel
            ),
        ]
        # Sentinel rewrites its config file as it learns; it must be writable.
        with open(sentinel.config, "w", encoding="utf-8") as conf:
            conf.write("\n".join(lines) + "\n")

    def _launch(self, sentinel: Sentinel) -> None:
        sentinel.process = subprocess.Popen(
            [self.binary, sentinel.config, "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @staticmethod
    def _speed_up(sentinel: Sentinel) -> None:
        client = sentinel.client()
        try:
            client.execute_command("SENTINEL", "DEBUG", "publish-period", 200, "info-period", 200)
        except redis.ResponseError:
            pass  # Redis < 7 has no SENTINEL DEBUG: discovery takes the default 2 s hello period.
        finally:
            client.close()

    def _sentinels_agree(self) -> bool:
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                state = client.sentinel_master(self.service)
            except redis.RedisError:
                return False
            finally:
                client.close()
            if (
                int(state["num-other-sentinels"]) != self.sentinel_count - 1
                or int(state["num-slaves"]) != self.replicas
            ):
                return False
        return True

    # -- looking -------------------------------------------------------------------------------

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def reported_master_ports(self) -> list[int]:
        """Return the master port each reachable sentinel reports right now."""
        ports = []
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                address = client.sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if address:
                ports.append(int(address[1]))
        return ports

    def server(self, port: int) -> RedisServer:
        """Return the data node listening on ``port``."""
        return next(s for s in self.servers if s.port == port)

    @property
    def master(self) -> RedisServer:
        """Return the node every sentinel reports as the master."""
        ports = set(self.reported_master_ports())
        assert len(ports) == 1, f"The sentinels disagree on the master: ports {sorted(ports)}."
        return self.server(ports.pop())

    def replica_servers(self) -> list[RedisServer]:
        """Return the running nodes other than the master."""
        master = self.master
        return [s for s in self.servers if s is not master and s.process is not None]

    def wait_for_failover(self, old: RedisServer, timeout: float = FAILOVER_TIMEOUT) -> RedisServer:
        """Wait until every sentinel reports a new master that says it is one; return it."""

        def promoted() -> RedisServer | None:
            ports = self.reported_master_ports()
            if len(ports) != len(self.sentinels) or len(set(ports)) != 1 or ports[0] == old.port:
                return None
            info = _info(ports[0])
            return self.server(ports[0]) if info and info.get("role") == "master" else None

        return wait_until(
            promoted, timeout, f"the sentinels to replace the master on {old.port}", interval=0.05
        )

    # -- failing over --------------------------------------------------------------------------

    def fail_over(
        self,
        *,
        unreplicated: Callable[[], object] | None = None,
        while_down: Callable[[], object] | None = None,
    ) -> RedisServer:
        """SIGKILL the master and return the replica the sentinels promote.

        ``unreplicated`` runs against the master after its replicas were cut
        off (stopped with SIGSTOP and their links closed with CLIENT KILL), so
        whatever it writes is acknowledged by the master and reaches no
        replica: asynchronous replication losing a write, made certain.
        ``while_down`` runs after the kill, before the sentinels react.
        """
        old = self.master
        replicas = self.replica_servers()
        if unreplicated is not None:
            for replica in replicas:
                _signal(replica, signal.SIGSTOP)
            try:
                client = redis.Redis(port=old.port, socket_timeout=2)
                try:
                    cut = client.client_kill_filter(_type="replica")
                finally:
                    client.close()
                assert cut == len(replicas), f"cut {cut} replica links of {len(replicas)}"
                unreplicated()
                old.kill()
            finally:
                for replica in replicas:
                    _signal(replica, signal.SIGCONT)
        else:
            old.kill()
        self._guard_port(old.port)
        if while_down is not None:
            while_down()
        return self.wait_for_failover(old)

    def _guard_port(self, port: int) -> None:
        # The sentinels keep calling on the dead master's port, to make it a
        # replica when it returns. Holding the port (bound, not listening)
        # keeps a server that another test starts there from being taken over
        # (free_port() cannot pick it while it is bound).
        guard = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        guard.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT links
        try:
            guard.bind(("127.0.0.1", port))
        except OSError:
            guard.close()  # taken already: nothing to protect any more
            return
        self._port_guards.append(guard)

    def cache_entry(self, prefix: str, **mutex: Any) -> dict[str, Any]:
        """Return django-redis's Sentinel configuration of a lock alias on this group."""
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://{self.service}/0",
            "KEY_PREFIX": "tests",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": self.sentinel_addresses,
                **SOCKET_OPTIONS,
            },
            "MUTEX": {"PREFIX": prefix, **mutex},
        }

    # -- stopping ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every sentinel and data node and remove their files."""
        for sentinel in self.sentinels:
            if sentinel.process is not None and sentinel.process.poll() is None:
                sentinel.process.send_signal(signal.SIGKILL)
                sentinel.process.wait(10)
        for server in self.servers:
            if server.process is not None:
                # A test may leave a node stopped with SIGSTOP; SIGKILL ends it anyway.
                server.kill()
            server.close()
        for guard in self._port_guards:
            guard.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _signal(server: RedisServer, signum: int) -> None:
    assert server.process is not None, f"redis-server on {server.port} is not running"
    os.kill(server.process.pid, signum)


def _pings(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _info(port: int) -> dict[str, Any] | None:
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return dict(client.info("replication"))
    except redis.RedisError:
        return None
    finally:
        client.close()


# -- workers -----------------------------------------------------------------------------------


class SectionWorkers:
    """``tests/workers/topo_sections.py`` processes contending for locks on one topology.

    Each worker gets ``caches`` (merged into its settings.CACHES) and locks
    with ``using``: an alias, or a list of aliases for a quorum lock. Workers
    spread over ``names`` (a count, or the names themselves) and
    wait at a barrier until :meth:`start` opens it, then run ``iterations``
    sections each, or run until :meth:`stop`. Their counters and the barrier
    live on the test session's own server (the storage the locks protect).
    """

    def __init__(
        self,
        data: redis.Redis,
        caches: dict[str, dict[str, Any]],
        using: str | Sequence[str],
        *,
        workers: int = 3,
        names: int | Sequence[str] = 1,
        iterations: int | None = None,
        threads: int = 1,
        hold: float = 0.0,
        ttl: float = 5.0,
        timeout: float = 20.0,
        use_async: bool = False,
    ) -> None:
        run = uuid.uuid4().hex[:8]
        self.data = data
        self.stem = f"topo-{run}"
        # Data keys carry the test's namespace and are deleted by close().
        scope = f"topologies:{os.environ.get('DJANGO_REDIS_MUTEX_TEST_PREFIX', '')}:{run}"
        self.counter = f"{scope}:counter"
        self.barrier = f"{scope}:barrier"
        self.stop_key = f"{scope}:stop"
        self._final: dict[str, int] | None = None
        if isinstance(names, int):
            names = [self.stem] if names == 1 else [f"{self.stem}:{i}" for i in range(names)]
        self.lock_names = list(names)
        aliases = using if isinstance(using, str) else ",".join(using)
        args = [
            "--caches",
            json.dumps(caches),
            "--using",
            aliases,
            "--names",
            json.dumps(self.lock_names),
            "--counter",
            self.counter,
            "--barrier",
            self.barrier,
            "--stop",
            self.stop_key,
            "--threads",
            str(threads),
            "--hold",
            str(hold),
            "--ttl",
            str(ttl),
            "--timeout",
            str(timeout),
        ]
        if iterations is not None:
            args += ["--iterations", str(iterations)]
        if use_async:
            args.append("--async")
        self.processes = [run_worker("topo_sections.py", *args) for _ in range(workers)]
        self.events: list[dict[str, Any]] = []

    def start(self, timeout: float = START_TIMEOUT) -> float:
        """Wait until every worker is ready, open the barrier, and return the time it opened."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            assert process.stdout is not None
            waiting = max(deadline - time.monotonic(), 0.0)
            if not select.select([process.stdout], [], [], waiting)[0]:
                self.close()
                raise AssertionError(f"worker {process.pid} was not ready within {timeout}s")
            line = process.stdout.readline()  # each worker's first report is "ready"
            if not line:
                _, stderr = process.communicate(timeout=timeout)
                raise AssertionError(f"worker {process.pid} died before the barrier: {stderr}")
            assert json.loads(line)["event"] == "ready", line
        opened = time.time()
        self.data.rpush(self.barrier, *["go"] * len(self.processes))
        return opened

    def counted(self) -> int:
        """Return the sum of the workers' counters right now."""
        values = self.data.mget([f"{self.counter}:{name}" for name in self.lock_names])
        return sum(int(v or 0) for v in values)

    def stop(self) -> None:
        """Tell every worker to finish its current section and report."""
        self.data.rpush(self.stop_key, *["stop"] * len(self.processes))

    def finish(self, timeout: float = 120.0) -> History:
        """Wait for every worker to exit cleanly; return the history of their sections."""
        history = History()
        for process in self.processes:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                process.kill()
                stdout, stderr = process.communicate()
                raise AssertionError(
                    f"worker {process.pid} did not finish: {stderr[-2000:]}"
                ) from exc
            events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
            self.events += events
            assert process.returncode == 0, (
                f"worker {process.pid} exited with {process.returncode}: "
                f"{[e for e in events if e['event'] == 'error']} {stderr[-2000:]}"
            )
            history.load_from_worker_output(events)
        self._final = self.counters()
        return history

    def counters(self) -> dict[str, int]:
        """Return each lock's counter (the final ones after :meth:`finish`)."""
        if self._final is not None:
            return self._final
        values = self.data.mget([f"{self.counter}:{name}" for name in self.lock_names])
        return {name: int(v or 0) for name, v in zip(self.lock_names, values, strict=True)}

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Return the finished workers' reports of one kind."""
        return [e for e in self.events if e["event"] == kind]

    def close(self) -> None:
        """Kill workers still running (after a failed test) and delete the data keys."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            # Also the pipes of workers that exited but were never read (a
            # failure in finish() stops at the first): left open, the next
            # test would be blamed for their ResourceWarning.
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
            process.wait()
        keys = [f"{self.counter}:{name}" for name in self.lock_names]
        self.data.delete(*keys, self.barrier, self.stop_key)
