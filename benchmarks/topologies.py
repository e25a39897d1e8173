"""Scenario: this app's lock on every topology it supports.

For each topology the benchmark starts its own servers: one Redis; Sentinel
(one master, one replica, one sentinel); a Redis Cluster of three primaries
(``MUTEX: {"CLUSTER": True}``); Redlock quorums of three and of five
independent masters (``MUTEX: {"QUORUM": [...]}``). A pool of worker
processes (4 x 2 threads by default) then loops for a fixed time: pick a lock
name at random (out of 1,000, then out of one), acquire, read-modify-write a
counter kept on the benchmark's own Redis (one counter per name, so a broken
lock shows up as a lost update), release.

Reported per topology and number of names: cycles per second, the cycle's time
(acquire + counter GET and SET + release: p50, p99), Redis commands per cycle
on the servers that hold locks (primaries or masters; the counter's two are on
another server and not counted), Redis CPU per cycle on every server of the
topology (replicas and the sentinel included), client CPU per cycle and lost
updates. The servers are stopped after each topology's runs.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from adapters import WAIT
from contended import ServerMeter, WorkerPool
from stats import summary_us

from django_redis_mutex.testing import RedisClusterServers, RedisServer, free_port

# Key, label, in the order of the tables.
TOPOLOGIES = {
    "single": "one Redis",
    "sentinel": "Sentinel (master + replica + sentinel)",
    "cluster": "Redis Cluster, 3 primaries",
    "quorum3": "Redlock quorum, 3 masters",
    "quorum5": "Redlock quorum, 5 masters",
}
ALIAS = "locks"  # the cache alias every worker locks with


@dataclass
class Topology:
    """Running servers of one topology and the CACHES that reach them."""

    caches: dict[str, Any]
    primaries: list[str]  # URLs of the servers that hold locks (commands counted)
    servers: list[str]  # URLs of every server of the topology (CPU counted)
    notes: list[str] = field(default_factory=list)


def _cache(location: str, key_prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "KEY_PREFIX": key_prefix,
        **extra,
    }


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@contextmanager
def _sentinel(master: RedisServer, service: str) -> Iterator[int]:
    """Run one ``redis-server --sentinel`` watching ``master``; yield its port."""
    folder = tempfile.mkdtemp(prefix="bench-sentinel-")
    port = free_port()
    config = os.path.join(folder, "sentinel.conf")
    with open(config, "w", encoding="utf-8") as conf:
        conf.write(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    "protected-mode no",
                    "daemonize no",
                    f"dir {folder}",
                    f"logfile {folder}/sentinel.log",
                    f"sentinel monitor {service} 127.0.0.1 {master.port} 1",
                ]
            )
            + "\n"
        )
    process = subprocess.Popen(
        [master.binary, config, "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        try:
            _wait_for(
                lambda: client.sentinel_get_master_addr_by_name(service) is not None,
                "the sentinel to answer",
            )
        finally:
            client.close()
        yield port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def start_topology(key: str, key_prefix: str) -> Iterator[Topology]:
    """Start the servers of topology ``key``; stop them all when the block ends."""
    with ExitStack() as stack:
        if key == "single":
            server = stack.enter_context(RedisServer())
            caches = {ALIAS: _cache(server.url, key_prefix)}
            yield Topology(caches, [server.url], [server.url])
        elif key == "sentinel":
            fast_sync = ["--repl-diskless-sync-delay", "0"]
            master = stack.enter_context(RedisServer(extra_args=fast_sync))
            replica = stack.enter_context(
                RedisServer(extra_args=[*fast_sync, "--replicaof", "127.0.0.1", str(master.port)])
            )
            probe = redis.Redis.from_url(replica.url)
            stack.callback(probe.close)
            _wait_for(
                lambda: probe.info("replication").get("master_link_status") == "up",
                "the replica to sync",
            )
            service = f"bench-{key_prefix}"
            port = stack.enter_context(_sentinel(master, service))
            options = {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [("127.0.0.1", port)],
            }
            caches = {ALIAS: _cache(f"redis://{service}/0", key_prefix, OPTIONS=options)}
            sentinel_url = f"redis://127.0.0.1:{port}/0"
            yield Topology(caches, [master.url], [master.url, replica.url, sentinel_url])
        elif key == "cluster":
            cluster = stack.enter_context(RedisClusterServers(primaries=3))
            urls = [node.url for node in cluster.nodes]
            caches = {ALIAS: _cache(cluster.url, key_prefix, MUTEX={"CLUSTER": True})}
            yield Topology(caches, urls, urls)
        elif key in ("quorum3", "quorum5"):
            servers = [stack.enter_context(RedisServer()) for _ in range(int(key[-1]))]
            members = {f"m{i}": _cache(s.url, key_prefix) for i, s in enumerate(servers, 1)}
            urls = [s.url for s in servers]
            caches = {
                **members,
                ALIAS: _cache(urls[0], key_prefix, MUTEX={"QUORUM": list(members)}),
            }
            yield Topology(caches, urls, urls)
        else:
            raise ValueError(f"unknown topology {key!r}")


@dataclass(frozen=True)
class TopologyJob:
    """One timed run: every worker runs ``threads`` threads on ``names`` lock names."""

    caches: dict[str, Any]
    prefix: str  # lock names are f"{prefix}:{i}", counters f"{prefix}:n:{i}"
    names: int
    threads: int
    duration: float


def _configure(caches: dict[str, Any]) -> None:
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
        CACHES=caches,
    )
    django.setup()


def topology_worker(
    index: int,
    url: str,
    key_prefix: str,
    quorum_urls: list[str],
    jobs: Any,
    results: Any,
    barrier: Any,
) -> None:
    """Run TopologyJobs (all for one topology) until a None arrives; report cycle times."""
    from adapters import plain_client

    # Ctrl-C reaches the whole process group: the parent stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = plain_client(url)
    while (job := jobs.get()) is not None:
        try:
            _configure(job.caches)
            from django_redis_mutex import Mutex

            warm = Mutex(f"{job.prefix}:warm:{index}", using=ALIAS, timeout=WAIT)
            if not warm.acquire():
                raise RuntimeError("warm-up lock not acquired")
            warm.release()
            barrier.wait(timeout=120)
        except Exception as exc:
            barrier.abort()
            results.put({"worker": index, "error": f"before start: {exc!r}"})
            continue
        end = time.monotonic() + job.duration
        times: list[list[float]] = [[] for _ in range(job.threads)]
        errors: list[str] = []
        started = time.time()
        cpu_started = time.process_time()
        threads = [
            threading.Thread(target=_loop, args=(times[t], job, client, end, errors))
            for t in range(job.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report: dict[str, Any] = {
            "worker": index,
            "cycles": [s for per_thread in times for s in per_thread],
            "started": started,
            "finished": time.time(),
            "cpu_s": time.process_time() - cpu_started,
        }
        if errors:
            report["error"] = errors[0]
        results.put(report)


def _loop(mine: list[float], job: TopologyJob, client: Any, end: float, errors: list[str]) -> None:
    from django_redis_mutex import Mutex

    rng = random.Random()
    perf = time.perf_counter
    try:
        while time.monotonic() < end:
            i = rng.randrange(job.names)
            t0 = perf()
            lock = Mutex(f"{job.prefix}:{i}", using=ALIAS, timeout=WAIT)
            if not lock.acquire():
                raise RuntimeError(f"lock {i} not acquired within {WAIT} s")
            counter = f"{job.prefix}:n:{i}"
            client.set(counter, int(client.get(counter) or 0) + 1)
            lock.release()
            mine.append(perf() - t0)
    except Exception as exc:
        errors.append(repr(exc))


def _counted(client: redis.Redis, prefix: str, names: int) -> int:
    keys = [f"{prefix}:n:{i}" for i in range(names)]
    return sum(int(v) for v in client.mget(keys) if v is not None)


def _summarise(reports: list[dict[str, Any]], cost: Any, commands: int, counted: int) -> Any:
    times = [s for r in reports for s in r.get("cycles", [])]
    count = len(times)
    started = [r["started"] for r in reports if "started" in r]
    finished = [r["finished"] for r in reports if "finished" in r]
    window = max(finished) - min(started) if started and finished else 0.0
    return {
        "cycles": count,
        "window_s": window,
        "cycles_per_s": count / window if window > 0 else 0.0,
        "cycle_us": summary_us(times),
        "redis_commands_per_cycle": commands / count if count else math.nan,
        "redis_cpu_us_per_cycle": cost / count * 1e6 if count else math.nan,
        "client_cpu_us_per_cycle": (
            sum(r.get("cpu_s", 0.0) for r in reports) / count * 1e6 if count else math.nan
        ),
        "lost_updates": count - counted,
        "errors": [r["error"] for r in reports if "error" in r],
    }


def run_topologies(
    url: str,
    key_prefix: str,
    run_id: str,
    *,
    topologies: list[str],
    processes: int,
    threads: int,
    names: list[int],
    seconds: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run every topology with every number of names; return summaries by topology."""
    client = redis.Redis.from_url(url)
    results: dict[str, Any] = {}
    try:
        for key in topologies:
            entry: dict[str, Any] = {"label": TOPOLOGIES[key], "names": {}}
            with start_topology(key, key_prefix) as topology:
                servers = [redis.Redis.from_url(u) for u in topology.servers]
                primaries = [redis.Redis.from_url(u) for u in topology.primaries]
                try:
                    entry["servers"] = len(servers)
                    cpu, commands = ServerMeter(servers), ServerMeter(primaries)
                    pool = WorkerPool(processes, url, key_prefix, target=topology_worker)
                    with pool:
                        for count in names:
                            prefix = f"bench-{run_id}:topologies:{key}:{count}"
                            job = TopologyJob(topology.caches, prefix, count, threads, seconds)
                            cpu0, calls0 = cpu.read()[0], commands.read()[1]
                            reports = pool.run(job, timeout=seconds + WAIT + 90)
                            cost = cpu.read()[0] - cpu0
                            calls = commands.read()[1] - calls0
                            counted = _counted(client, prefix, count)
                            found = _summarise(reports, cost, calls, counted)
                            entry["names"][str(count)] = found
                            log(
                                f"  {entry['label']:<40} {count:>5} names"
                                f" {found['cycles_per_s']:7.0f} cycles/s"
                                f"  p50 {found['cycle_us']['p50'] / 1000:6.2f} ms"
                                f"  p99 {found['cycle_us']['p99'] / 1000:7.1f} ms"
                                f"  commands {found['redis_commands_per_cycle']:4.1f}"
                                f"  lost {found['lost_updates']}"
                                + (f"  errors {found['errors'][:1]}" if found["errors"] else "")
                            )
                finally:
                    for server in [*servers, *primaries]:
                        server.close()
            results[key] = entry
    finally:
        client.close()
    return results
