"""Where an uncontended Mutex cycle spends its time, against the raw SET NX PX baseline.

Run from the repository root (about 30 s):

    UV_PYTHON_DOWNLOADS=never uv run --group bench python benchmarks/profile_hotpath.py

Three views, all on a private redis-server:

1. Client cost, by layers: raw SET NX PX + compare-and-delete on a plain
   redis-py client and on django-redis's client; the engine's ACQUIRE and
   RELEASE scripts called bare; the full ``Mutex`` cycle with and without the
   watchdog. Slices of 200 cycles alternate between the layers; medians of
   CPU (process time) and wall time per cycle are printed.
2. Server cost of the ACQUIRE fast path, built up one command at a time
   (``INFO commandstats`` microseconds per EVALSHA, best of 5 x 2000 calls).
3. cProfile (CPU clock) of the full cycle: the engine functions' own time.
"""

from __future__ import annotations

import cProfile
import pstats
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from django_config import configure_django
from stats import percentile

_COMPARE_AND_DELETE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def layers(url: str) -> None:
    from django_redis_mutex import Mutex, scripts
    from django_redis_mutex.client import get_client

    plain = redis.Redis.from_url(url)
    django_client = get_client("default")
    sha = plain.script_load(_COMPARE_AND_DELETE)
    handle = Mutex("profile", timeout=30)
    keys = handle.keys.script_keys
    for script in (scripts.ACQUIRE, scripts.RELEASE):
        django_client.script_load(script.source)

    def raw(client: redis.Redis) -> Callable[[], None]:
        def cycle() -> None:
            token = secrets.token_hex(16)
            client.set("profile-raw", token, nx=True, px=30000)
            client.evalsha(sha, 1, "profile-raw", token)

        return cycle

    def bare_scripts() -> None:
        token = secrets.token_hex(16)
        django_client.evalsha(scripts.ACQUIRE.sha, 5, *keys, *handle._acquire_args(token, True))
        django_client.evalsha(scripts.RELEASE.sha, 5, *keys, *handle._release_args(token))

    def full(watchdog: bool) -> Callable[[], None]:
        def cycle() -> None:
            lock = Mutex("profile", timeout=30, watchdog=watchdog)
            lock.acquire()
            lock.release()

        return cycle

    cycles = {
        "raw, plain redis-py client": raw(plain),
        "raw, django-redis client": raw(django_client),
        "engine scripts called bare": bare_scripts,
        "Mutex, watchdog=False": full(False),
        "Mutex (defaults)": full(True),
    }
    for cycle in cycles.values():
        for _ in range(300):
            cycle()
    cpu: dict[str, list[float]] = {name: [] for name in cycles}
    wall: dict[str, list[float]] = {name: [] for name in cycles}
    for _ in range(25):
        for name, cycle in cycles.items():
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            for _ in range(200):
                cycle()
            cpu[name].append((time.process_time() - cpu_start) / 200 * 1e6)
            wall[name].append((time.perf_counter() - wall_start) / 200 * 1e6)
    print("1. Client cost per cycle (median of 25 alternating slices of 200 cycles)")
    for name in cycles:
        print(
            f"   {name:28} CPU {percentile(cpu[name], 50):6.1f} µs"
            f"   wall {percentile(wall[name], 50):6.1f} µs"
        )
    plain.close()


def lua_steps(url: str) -> None:
    from django_redis_mutex import Mutex, scripts

    client = redis.Redis.from_url(url)
    common, _ = scripts.ACQUIRE.source.split("local token, ttl, owner, name", 1)
    head = "local token, ttl, owner, name = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]\n"
    steps = [
        ("+ TIME", "local now = now_us()"),
        ("+ HGET token", "local holder = redis.call('HGET', KEYS[1], 'token')"),
        ("+ EXISTS queue", "local waiting = redis.call('EXISTS', KEYS[3])"),
        ("+ fence SET ... PX GET", "local fence = next_fence(now)"),
        (
            "+ HSET 5 fields",
            "redis.call('HSET', KEYS[1], 'token', token, 'fence', fence, 'owner', owner, "
            "'acquired', string.format('%.0f', math.floor(now / 1000)), 'name', name)",
        ),
        ("+ PEXPIRE", "redis.call('PEXPIRE', KEYS[1], ttl)"),
    ]
    bodies = [
        ("EVALSHA, 5 keys, 5 args", "return 1"),
        ("+ shared function definitions", common + "return 1"),
    ]
    built = common + head
    for label, line in steps:
        built += line + "\n"
        bodies.append((label, built + "return 1"))
    bodies.append(("the real ACQUIRE", scripts.ACQUIRE.source))
    calls = 2000
    print("2. Server time of the ACQUIRE fast path (µs per EVALSHA, best of 5)")
    for label, body in bodies:
        sha = client.script_load(body)
        best = float("inf")
        for attempt in range(5):
            locks = [Mutex(f"profile-lua-{label}-{attempt}-{i}") for i in range(calls)]
            before = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0})["usec"]
            for lock in locks:
                token = secrets.token_hex(16)
                client.evalsha(sha, 5, *lock.keys.script_keys, *lock._acquire_args(token, True))
            after = client.info("commandstats")["cmdstat_evalsha"]["usec"]
            best = min(best, (after - before) / calls)
        print(f"   {label:32} {best:6.2f}")
    client.close()


def engine_profile() -> None:
    from django_redis_mutex import Mutex

    def cycle() -> None:
        lock = Mutex("profile-cprofile", timeout=30)
        lock.acquire()
        lock.release()

    for _ in range(300):
        cycle()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(3000):
        cycle()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    own = [
        (entry[2], f"{Path(fn).name}:{line}({name})")
        for (fn, line, name), entry in stats.items()
        if "django_redis_mutex" in fn
    ]
    engine = sum(t for t, _ in own)
    print(f"3. cProfile: engine functions' own time is {engine / total:.0%} of the cycle's CPU")
    for spent, where in sorted(own, reverse=True)[:12]:
        print(f"   {spent / total:6.1%}  {where}")
    for module in ("contextlib", "threading", "redis/connection.py"):
        share = sum(entry[2] for key, entry in stats.items() if module in key[0]) / total
        print(f"   {share:6.1%}  everything in {module}")


def main() -> int:
    from django_redis_mutex.testing import RedisServer

    with RedisServer() as server:
        configure_django(server.url, "profile")
        layers(server.url)
        lua_steps(server.url)
        engine_profile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
