"""Count the Redis commands a lock cycle costs, on the server side.

Two passes over the same number of cycles, each for what it can tell:

* ``INFO commandstats`` before and after (no MONITOR attached, so the server
  times are not inflated): every command the server executed, including those
  a Lua script ran (an EVALSHA counts once for itself plus once per command
  inside it), and the microseconds spent. This is the *total*.
* ``MONITOR``: each line says whether a client or Lua sent the command, so the
  total splits into *round trips* (commands a client sent and waited for) and
  commands run inside scripts.

The benchmark's own bookkeeping commands (INFO, and the ECHO markers that
bracket the MONITOR window) are left out of both.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

_START = "bench-monitor-start"
_STOP = "bench-monitor-stop"
_OWN = {"info", "echo", "monitor"}


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Return the server's cumulative (calls, microseconds) per command name."""
    stats = client.info("commandstats")
    return {
        key.removeprefix("cmdstat_").lower(): (int(value["calls"]), int(value["usec"]))
        for key, value in stats.items()
    }


class _Monitor(threading.Thread):
    """Read MONITOR between the start and stop markers, counting by source."""

    def __init__(self, url: str) -> None:
        super().__init__(name="bench-monitor", daemon=True)
        self.client = redis.Redis.from_url(url)
        self.started = threading.Event()
        self.by_client: Counter[str] = Counter()
        self.by_script: Counter[str] = Counter()

    def run(self) -> None:
        counting = False
        with self.client.monitor() as monitor:
            self.started.set()
            for entry in monitor.listen():
                words = entry["command"].split()
                name = words[0].lower() if words else ""
                marker = words[1] if name == "echo" and len(words) > 1 else ""
                if marker == _START:
                    counting = True
                elif marker == _STOP:
                    return
                elif counting and name not in _OWN:
                    target = self.by_script if entry["client_type"] == "lua" else self.by_client
                    target[name] += 1


def _info_pass(control: redis.Redis, cycle: Callable[[], None], cycles: int) -> dict[str, Any]:
    before = commandstats(control)
    for _ in range(cycles):
        cycle()
    after = commandstats(control)
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for name, (count, spent) in after.items():
        count_before, spent_before = before.get(name, (0, 0))
        if name not in _OWN and count > count_before:
            calls[name] = count - count_before
            usec[name] = spent - spent_before
    return {"calls": calls, "usec": usec}


def _monitor_pass(
    url: str, control: redis.Redis, cycle: Callable[[], None], cycles: int
) -> _Monitor:
    monitor = _Monitor(url)
    monitor.start()
    if not monitor.started.wait(10):
        raise RuntimeError("MONITOR did not start within 10 s")
    # The START marker reaches the monitor stream before the reply reaches us,
    # so every command of the cycles below is counted.
    control.echo(_START)
    for _ in range(cycles):
        cycle()
    control.echo(_STOP)
    monitor.join(30)
    monitor.client.close()
    return monitor


def count_commands(url: str, cycle: Callable[[], None], cycles: int) -> dict[str, Any]:
    """Run ``cycle`` twice ``cycles`` times; return commands per cycle, total and by source."""
    control = redis.Redis.from_url(url)
    try:
        info = _info_pass(control, cycle, cycles)
        monitor = _monitor_pass(url, control, cycle, cycles)
    finally:
        control.close()
    calls, usec = info["calls"], info["usec"]
    total = sum(calls.values())
    round_trips = sum(monitor.by_client.values())
    in_scripts = sum(monitor.by_script.values())
    # Server time on what clients sent (a script's time includes the commands it ran),
    # splitting a command seen from both clients and scripts by its share of calls.
    from_client_usec = sum(
        usec[name] * min(1.0, monitor.by_client.get(name, 0) / calls[name]) for name in calls
    )
    return {
        "cycles": cycles,
        "total_per_cycle": total / cycles,
        "round_trips_per_cycle": round_trips / cycles,
        "in_scripts_per_cycle": in_scripts / cycles,
        "server_us_per_cycle": from_client_usec / cycles,
        # The two passes must agree; a mismatch means something else used the server.
        "passes_agree": round_trips + in_scripts == total,
        "by_command": {
            name: {
                "total": calls[name] / cycles,
                "from_client": monitor.by_client.get(name, 0) / cycles,
                "from_scripts": monitor.by_script.get(name, 0) / cycles,
                "usec_per_call": usec[name] / calls[name],
            }
            for name in sorted(calls)
        },
    }
