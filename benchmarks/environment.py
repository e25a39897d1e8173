"""Where the benchmark ran: the Redis server it used, versions, the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import redis

PACKAGES = [
    "django-redis-mutex",
    "Django",
    "django-redis",
    "redis",
    "python-redis-lock",
    "pottery",
    "matplotlib",
]


@contextmanager
def benchmark_redis() -> Iterator[tuple[str, str]]:
    """Yield (url, description) of the Redis to use: REDIS_URL, else a private server."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external, "REDIS_URL"
        return
    from django_redis_mutex.testing import RedisServer

    with RedisServer() as server:
        yield server.url, f"private redis-server on port {server.port}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _engine_revision() -> str:
    """Return the git commit of this checkout, noting uncommitted engine changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "django_redis_mutex"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in django_redis_mutex/" if dirty else "")


def describe(url: str, where: str) -> dict[str, object]:
    """Return versions of Python, Redis and every library, and the machine's CPU."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = "not installed"
    client = redis.Redis.from_url(url)
    server = client.info("server")
    client.close()
    return {
        "python": sys.version.split()[0] + f" ({platform.python_implementation()})",
        "redis_version": server["redis_version"],
        "redis_where": where,
        "packages": packages,
        "revision": _engine_revision(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        # Other work on the machine skews every number; say how busy it was.
        "loadavg_at_start": list(os.getloadavg()),
    }
