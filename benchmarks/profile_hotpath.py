"""Where an uncontended Mutex cycle spends its time, against the raw SET NX PX baseline.

Part of the benchmark (scenario ``profile``, folded into results/latest.json);
also runs alone, printing what it finds (about 20 s), from the repository root:

    UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/profile_hotpath.py

Three views, all on one Redis:

1. Layers: the same work with one layer more each time, in alternating slices
   of cycles (medians of wall and CPU time per cycle): a bare PING on a raw
   socket (kernel, loopback and Redis's event loop: one round trip), a PING
   through redis-py, the raw pair (SET NX PX + compare-and-delete), the
   engine's ACQUIRE and RELEASE scripts called bare through a plain redis-py
   client and through the client django-redis built, the full ``Mutex`` cycle
   without and with the watchdog. Redis's own execution time per cycle comes
   from ``INFO commandstats``. Subtracting neighbours gives the *breakdown*:
   network round trips, Redis script time, redis-py (packing, parsing, the
   connection pool, for the scripts sent bare), django-redis's client, the
   engine above that (its Python, less any redis-py work it does itself more
   cheaply), the watchdog's bookkeeping; the parts add up to the full cycle.
2. Server time of the ACQUIRE fast path built up one command at a time
   (commandstats µs per EVALSHA, best of a few batches).
3. cProfile (CPU clock) of the full cycle: the engine functions' own time and
   the share of redis-py, Django and the rest.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from django_config import configure_django
from stats import percentile

NETWORK = "network and Redis event loop (2 round trips of a raw-socket PING)"
REDIS = "Redis executing the scripts (commandstats)"
REDIS_PY = "redis-py: packing, parsing, connection pool (bare scripts)"
DJANGO_REDIS = "django-redis's client instead of a plain one"
# Measured as the Mutex cycle less the same scripts sent bare through redis-py:
# the engine's own Python, less whatever redis-py work it does itself more cheaply.
ENGINE = "the engine above the bare scripts (Mutex without watchdog, less them)"
WATCHDOG = "watchdog bookkeeping (register and unregister the hold)"

_COMPARE_AND_DELETE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def _socket_ping(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    client = redis.Redis.from_url(url)
    kwargs = client.connection_pool.connection_kwargs
    client.close()
    sock = socket.create_connection((kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ping() -> None:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        sock.recv(64)

    return ping, sock.close


def _server_us(client: redis.Redis, cycle: Callable[[], None], cycles: int) -> float:
    """Return the µs Redis spent executing one cycle's commands (commandstats)."""

    def usec() -> int:
        return sum(
            int(v["usec"])
            for k, v in client.info("commandstats").items()
            if k not in ("cmdstat_info", "cmdstat_echo")
        )

    before = usec()
    for _ in range(cycles):
        cycle()
    return (usec() - before) / cycles


def layers(url: str, slices: int = 25, per_slice: int = 200) -> dict[str, Any]:
    """Time each layer in alternating slices; return medians and the breakdown."""
    from django_redis_mutex import Mutex, scripts
    from django_redis_mutex.acquisition import start
    from django_redis_mutex.client import get_client

    plain = redis.Redis.from_url(url)
    django_client = get_client("default")
    sha = plain.script_load(_COMPARE_AND_DELETE)
    handle = Mutex("profile", timeout=30)
    keys = handle.keys.script_keys
    for script in (scripts.ACQUIRE, scripts.RELEASE):
        plain.script_load(script.source)
    socket_ping, close_socket = _socket_ping(url)

    def raw(client: redis.Redis) -> Callable[[], None]:
        def cycle() -> None:
            token = secrets.token_hex(16)
            client.set("profile-raw", token, nx=True, px=30000)
            client.evalsha(sha, 1, "profile-raw", token)

        return cycle

    def bare_scripts(client: redis.Redis) -> Callable[[], None]:
        def cycle() -> None:
            attempt = start(handle, True, 30)
            client.evalsha(
                scripts.ACQUIRE.sha, len(keys), *keys, *handle._acquire_args(attempt, True)
            )
            client.evalsha(scripts.RELEASE.sha, len(keys), *keys, attempt.token)

        return cycle

    from django_redis_mutex import mutex

    @mutex("profile:{pk}", timeout=30)
    def decorated(pk: int) -> None:
        return None

    def full(watchdog: bool) -> Callable[[], None]:
        def cycle() -> None:
            lock = Mutex("profile", timeout=30, watchdog=watchdog)
            lock.acquire()
            lock.release()

        return cycle

    cycles: dict[str, Callable[[], None]] = {
        "PING, raw socket": socket_ping,
        "PING, redis-py": plain.ping,
        "raw pair, plain redis-py client": raw(plain),
        "raw pair, django-redis client": raw(django_client),
        "engine scripts, plain redis-py client": bare_scripts(plain),
        "engine scripts, django-redis client": bare_scripts(django_client),
        "Mutex, watchdog=False": full(False),
        "Mutex (defaults)": full(True),
        "@mutex('profile:{pk}') function": lambda: decorated(pk=1),
    }
    try:
        for cycle in cycles.values():
            for _ in range(per_slice):
                cycle()
        cpu: dict[str, list[float]] = {name: [] for name in cycles}
        wall: dict[str, list[float]] = {name: [] for name in cycles}
        for _ in range(slices):
            for name, cycle in cycles.items():
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                for _ in range(per_slice):
                    cycle()
                cpu[name].append((time.process_time() - cpu_start) / per_slice * 1e6)
                wall[name].append((time.perf_counter() - wall_start) / per_slice * 1e6)
        server = {
            "raw pair": _server_us(plain, raw(plain), 500),
            "engine scripts": _server_us(plain, bare_scripts(plain), 500),
        }
    finally:
        close_socket()
        plain.close()
    medians = {
        name: {"wall_us": percentile(wall[name], 50), "cpu_us": percentile(cpu[name], 50)}
        for name in cycles
    }
    w = {name: m["wall_us"] for name, m in medians.items()}
    c = {name: m["cpu_us"] for name, m in medians.items()}
    server_time = {"engine scripts": server["engine scripts"], "raw pair": server["raw pair"]}

    def split(t: dict[str, float], redis_us: dict[str, float]) -> tuple[Any, Any]:
        """Return the Mutex cycle's and the raw pair's parts in ``t`` (wall or CPU) units."""
        trip = t["PING, raw socket"]
        ours = {
            NETWORK: 2 * trip,
            REDIS: redis_us.get("engine scripts", 0.0),
            REDIS_PY: t["engine scripts, plain redis-py client"]
            - 2 * trip
            - redis_us.get("engine scripts", 0.0),
            DJANGO_REDIS: t["engine scripts, django-redis client"]
            - t["engine scripts, plain redis-py client"],
            ENGINE: t["Mutex, watchdog=False"] - t["engine scripts, django-redis client"],
            WATCHDOG: t["Mutex (defaults)"] - t["Mutex, watchdog=False"],
        }
        raw = {
            NETWORK: 2 * trip,
            REDIS: redis_us.get("raw pair", 0.0),
            REDIS_PY: t["raw pair, plain redis-py client"]
            - 2 * trip
            - redis_us.get("raw pair", 0.0),
        }
        return ours, raw

    breakdown, raw_breakdown = split(w, server_time)
    # Client CPU: Redis's own time is not the client's, so it is left out.
    breakdown_cpu, raw_breakdown_cpu = split(c, {})
    return {
        "slices": slices,
        "per_slice": per_slice,
        "layers": medians,
        "server_us": server,
        "breakdown_us": breakdown,
        "breakdown_total_us": w["Mutex (defaults)"],
        "raw_breakdown_us": raw_breakdown,
        "raw_total_us": w["raw pair, plain redis-py client"],
        "breakdown_cpu_us": breakdown_cpu,
        "breakdown_total_cpu_us": c["Mutex (defaults)"],
        "raw_breakdown_cpu_us": raw_breakdown_cpu,
        "raw_total_cpu_us": c["raw pair, plain redis-py client"],
        # What @mutex("...{pk}") on a function adds to the Mutex cycle: the name
        # filled from the call's arguments, and the with block.
        "decorator_us": w["@mutex('profile:{pk}') function"] - w["Mutex (defaults)"],
        "decorator_cpu_us": c["@mutex('profile:{pk}') function"] - c["Mutex (defaults)"],
    }


def lua_steps(url: str, calls: int = 1000, batches: int = 3) -> dict[str, float]:
    """Return the server µs per EVALSHA of the ACQUIRE fast path, built up step by step."""
    from django_redis_mutex import Mutex, scripts
    from django_redis_mutex.acquisition import start

    client = redis.Redis.from_url(url)
    # The helpers every script of the engine starts with (their common prefix),
    # then the commands of an uncontended grant, written here so the steps do
    # not depend on the engine's local names; the last row is the real script.
    shared = os.path.commonprefix([scripts.ACQUIRE.source, scripts.RELEASE.source])  # noqa: RUF071
    shared = shared[: shared.rfind("\n") + 1]
    steps = [
        ("+ TIME", "local t = redis.call('TIME')"),
        ("+ EXISTS lock and queue", "redis.call('EXISTS', KEYS[1], KEYS[1] .. ':queue')"),
        (
            "+ fence SET ... PX GET",
            "redis.call('SET', KEYS[1] .. ':fence', t[1] .. t[2], 'PX', 86400000, 'GET')",
        ),
        (
            "+ HSET 5 fields",
            "redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', t[1] .. t[2], "
            "'owner', ARGV[3], 'acquired', t[1], 'name', ARGV[4])",
        ),
        ("+ PEXPIRE", "redis.call('PEXPIRE', KEYS[1], ARGV[2])"),
    ]
    bodies = [
        ("EVALSHA, 1 key, 5 args, return 1", "return 1"),
        ("+ the engine's shared helpers", shared + "return 1"),
    ]
    built = shared
    for label, line in steps:
        built += line + "\n"
        bodies.append((label, built + "return 1"))
    bodies.append(("the real ACQUIRE", scripts.ACQUIRE.source))
    out: dict[str, float] = {}
    try:
        for label, body in bodies:
            sha = client.script_load(body)
            best = float("inf")
            for attempt in range(batches):
                locks = [Mutex(f"profile-lua-{label}-{attempt}-{i}") for i in range(calls)]
                before = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0})["usec"]
                for lock in locks:
                    keys = lock.keys.script_keys
                    client.evalsha(
                        sha, len(keys), *keys, *lock._acquire_args(start(lock, True, 30), True)
                    )
                after = client.info("commandstats")["cmdstat_evalsha"]["usec"]
                best = min(best, (after - before) / calls)
            out[label] = best
    finally:
        client.close()
    return out


def engine_profile(cycles: int = 2000) -> dict[str, Any]:
    """cProfile the full cycle; return the engine functions' own time and module shares."""
    from django_redis_mutex import Mutex

    def cycle() -> None:
        lock = Mutex("profile-cprofile", timeout=30)
        lock.acquire()
        lock.release()

    for _ in range(300):
        cycle()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(cycles):
        cycle()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    own = [
        (entry[2], f"{Path(fn).name}:{line}({name})")
        for (fn, line, name), entry in stats.items()
        if "django_redis_mutex" in fn
    ]
    groups = {
        "django_redis_mutex": lambda fn: "django_redis_mutex" in fn,
        "redis-py": lambda fn: "/redis/" in fn,
        "django and django-redis": lambda fn: "/django/" in fn or "/django_redis/" in fn,
        "standard library and builtins": lambda fn: True,
    }
    shares: dict[str, float] = dict.fromkeys(groups, 0.0)
    for (fn, _line, _name), entry in stats.items():
        for group, matches in groups.items():
            if matches(fn):
                shares[group] += entry[2] / total
                break
    return {
        "cycles": cycles,
        "cpu_us_per_cycle": total / cycles * 1e6,
        "own_time_share": shares,
        "top_engine_functions": [
            {"function": where, "share": spent / total, "us_per_cycle": spent / cycles * 1e6}
            for spent, where in sorted(own, reverse=True)[:10]
        ],
    }


def profile(url: str, *, quick: bool = False) -> dict[str, Any]:
    """Run all three views on ``url`` (Django already configured); return what they found."""
    return {
        "layers": layers(url, slices=8 if quick else 20, per_slice=100 if quick else 200),
        "lua_steps_us": lua_steps(url, calls=300 if quick else 1000, batches=3),
        "cprofile": engine_profile(cycles=500 if quick else 2000),
    }


def print_profile(found: dict[str, Any]) -> None:
    layer = found["layers"]
    print("1. Layers (median of alternating slices), µs per cycle")
    for name, m in layer["layers"].items():
        print(f"   {name:40} wall {m['wall_us']:7.1f}   CPU {m['cpu_us']:7.1f}")
    print(
        f"   Breakdown of the Mutex cycle ({layer['breakdown_total_us']:.0f} µs wall,"
        f" {layer['breakdown_total_cpu_us']:.0f} µs client CPU):"
    )
    for part, us in layer["breakdown_us"].items():
        print(f"     {us:7.1f}  {layer['breakdown_cpu_us'][part]:7.1f}  {part}")
    print(
        f"   Breakdown of the raw pair ({layer['raw_total_us']:.0f} µs wall,"
        f" {layer['raw_total_cpu_us']:.0f} µs client CPU):"
    )
    for part, us in layer["raw_breakdown_us"].items():
        print(f"     {us:7.1f}  {layer['raw_breakdown_cpu_us'][part]:7.1f}  {part}")
    print(
        f"   @mutex decorator on top: {layer['decorator_us']:.1f} µs wall,"
        f" {layer['decorator_cpu_us']:.1f} µs CPU"
    )
    print("2. Server time of the ACQUIRE fast path (µs per EVALSHA, best batch)")
    for label, us in found["lua_steps_us"].items():
        print(f"   {label:34} {us:6.2f}")
    prof = found["cprofile"]
    print(f"3. cProfile: {prof['cpu_us_per_cycle']:.0f} µs CPU per cycle under the profiler")
    for group, share in prof["own_time_share"].items():
        print(f"   {share:6.1%}  {group}")
    for entry in prof["top_engine_functions"]:
        print(f"   {entry['share']:6.1%}  {entry['function']}")


def main() -> int:
    from django_redis_mutex.testing import RedisServer

    with RedisServer() as server:
        configure_django(server.url, "profile")
        print_profile(profile(server.url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
