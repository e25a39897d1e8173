"""Scenario: what ``@mutex`` adds to a Django request.

Three views of ``webapp.py`` (no lock, this app's ``@mutex`` behind
``MutexMiddleware``, one raw lock cycle) are requested in interleaved rounds:
each round sends a slice of requests to every view in turn, so a busy spell of
the machine is shared out. *Added time* is the median over rounds of (the
view's median latency in that round - the unlocked view's in the same round).
The raw view's added time is what one raw lock cycle costs in the same place,
the yardstick of the target.

Three ways in: Django's test client in this process (sync views), a gunicorn
with several sync workers (sync views) and several uvicorn processes (async
views; see :func:`server` for why not ``--workers``), started here and
stopped on every way out. The load
generator is Python: one thread per client, each with its own pk (so no request
waits for another's lock) and its own keep-alive connection where the server
keeps connections open.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stats import percentile, summary_us

HERE = Path(__file__).resolve().parent
VIEWS = ("plain", "locked", "raw")


def _added(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """Summarise per-round medians: latency per view, and added time paired by round."""
    out: dict[str, Any] = {
        "latency_us": {view: percentile(meds, 50) for view, meds in rounds.items()},
        "round_p50_us": rounds,
    }
    for view in ("locked", "raw"):
        diffs = [a - b for a, b in zip(rounds[view], rounds["plain"], strict=True)]
        out[f"{view}_added_us"] = percentile(diffs, 50)
    raw = out["raw_added_us"]
    out["ratio_to_raw"] = out["locked_added_us"] / raw if raw > 0 else float("nan")
    return out


def _interleave(
    views: tuple[str, ...], rounds: int, slice_of: Callable[[str], list[float]]
) -> dict[str, Any]:
    per_round: dict[str, list[float]] = {view: [] for view in views}
    every: dict[str, list[float]] = {view: [] for view in views}
    for index in range(rounds):
        # Rotate the order, so no view always runs right after another.
        order = views[index % len(views) :] + views[: index % len(views)]
        for view in order:
            samples = slice_of(view)
            per_round[view].append(percentile(samples, 50))
            every[view] += samples
    out = _added({v: per_round[v] for v in VIEWS})
    out["requests_per_view"] = len(every["plain"])
    out["latency_summary_us"] = {view: summary_us([s / 1e6 for s in every[view]]) for view in views}
    return out


def through_test_client(rounds: int, requests: int) -> dict[str, Any]:
    """Time the sync views through Django's test client, in this process."""
    from django.test import Client

    client = Client()
    for view in VIEWS:  # warm up: URL resolving, first connections, script loading
        for _ in range(20):
            assert client.get(f"/{view}/0").status_code == 200

    def slice_of(view: str) -> list[float]:
        url = f"/{view}/0"
        samples = []
        clock = time.perf_counter_ns
        for _ in range(requests):
            start = clock()
            response = client.get(url)
            samples.append((clock() - start) / 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}")
        return samples

    out = _interleave(VIEWS, rounds, slice_of)
    out["clients"] = 1
    return out


def _free_port() -> int:
    from django_redis_mutex.testing import free_port

    return free_port()


@contextmanager
def server(kind: str, url: str, key_prefix: str, workers: int) -> Iterator[tuple[list[int], str]]:
    """Start gunicorn (sync workers) or uvicorns (one per worker); always stop them.

    Yields the ports to send requests to and the views' name prefix (``a`` for
    the async views). uvicorn runs as ``workers`` single-worker processes, each
    on its own port: ``uvicorn --workers N`` hands its workers a listening
    socket that asyncio does not set TCP_NODELAY on, so every keep-alive
    response written in pieces waits out the client's delayed ACK (40 ms).
    """
    env = dict(os.environ, BENCH_REDIS_URL=url, BENCH_KEY_PREFIX=key_prefix)
    commands: list[tuple[int, list[str]]] = []
    if kind == "gunicorn":
        port = _free_port()
        commands.append(
            (
                port,
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "--chdir",
                    str(HERE),
                    "--workers",
                    str(workers),
                    "--worker-class",
                    "sync",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--log-level",
                    "warning",
                    "webapp:wsgi_app",
                ],
            )
        )
        prefix = ""
    else:
        for _ in range(workers):
            port = _free_port()
            commands.append(
                (
                    port,
                    [
                        sys.executable,
                        "-m",
                        "uvicorn",
                        "--app-dir",
                        str(HERE),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--log-level",
                        "warning",
                        "--no-access-log",
                        "webapp:asgi_app",
                    ],
                )
            )
        prefix = "a"
    processes: list[subprocess.Popen[Any]] = []
    try:
        for _port, args in commands:
            # Its own process group, so stopping it stops its workers too; the
            # benchmark's Ctrl-C reaches it only through the stop below.
            processes.append(
                subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
            )
        for (port, _args), process in zip(commands, processes, strict=True):
            _wait_for(kind, process, port, prefix)
        yield [port for port, _ in commands], prefix
    finally:
        for process in processes:
            stop_group(process)


def _wait_for(kind: str, process: subprocess.Popen[Any], port: int, prefix: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{kind} exited with {process.returncode} before answering")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", f"/{prefix}plain/0")
            status = connection.getresponse().status
            connection.close()
            if status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{kind} did not answer on port {port} within 60 s")
        time.sleep(0.1)


def stop_group(process: subprocess.Popen[Any]) -> None:
    """Stop a process started as the leader of its own process group, and the whole group."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            # The leader is gone; make sure no worker of its group outlived it.
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
        break


def real_server(
    kind: str,
    url: str,
    key_prefix: str,
    *,
    workers: int,
    clients: int,
    rounds: int,
    requests: int,
) -> dict[str, Any]:
    """Load a real server with ``clients`` threads; return latencies and added times."""
    with server(kind, url, key_prefix, workers) as (ports, prefix):
        connections = [
            http.client.HTTPConnection("127.0.0.1", ports[i % len(ports)], timeout=30)
            for i in range(clients)
        ]

        def one_client(index: int, view: str, count: int) -> list[float]:
            connection = connections[index]
            target = f"/{prefix}{view}/{index + 1}"
            samples = []
            clock = time.perf_counter_ns
            for _ in range(count):
                start = clock()
                try:
                    connection.request("GET", target)
                    response = connection.getresponse()
                    response.read()
                except (OSError, http.client.HTTPException):
                    # A server that closes idle keep-alive connections: reconnect once.
                    connection.close()
                    connection.request("GET", target)
                    response = connection.getresponse()
                    response.read()
                samples.append((clock() - start) / 1000)
                if response.status != 200:
                    raise RuntimeError(f"{target} answered {response.status}")
            return samples

        with ThreadPoolExecutor(clients) as pool:
            for view in VIEWS:  # warm up every worker's connections and scripts
                list(pool.map(lambda i, v=view: one_client(i, v, 20), range(clients)))

            def slice_of(view: str) -> list[float]:
                parts = pool.map(lambda i: one_client(i, view, requests), range(clients))
                return [s for part in parts for s in part]

            out = _interleave(VIEWS, rounds, slice_of)
        for connection in connections:
            connection.close()
    out.update({"server": kind, "workers": workers, "clients": clients})
    return out


def run_requests(
    url: str,
    key_prefix: str,
    *,
    rounds: int,
    requests: int,
    servers: list[str],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Run the test-client pass and each real server; return results by way in."""
    out: dict[str, Any] = {}

    def show(way: str, entry: dict[str, Any]) -> None:
        lat = entry["latency_us"]
        log(
            f"  requests {way:<12} plain {lat['plain']:6.0f} µs  locked {lat['locked']:6.0f} µs"
            f"  raw {lat['raw']:6.0f} µs  added: lock {entry['locked_added_us']:5.0f} µs,"
            f" raw cycle {entry['raw_added_us']:5.0f} µs ({entry['ratio_to_raw']:.2f}x)"
        )

    out["test-client"] = through_test_client(rounds, requests * 2)
    show("test-client", out["test-client"])
    for kind in servers:
        # Several workers, fewer clients than cores plus workers: on 2 cores the
        # clients, the server and Redis share the CPU.
        workers, clients = (3, 2) if kind == "gunicorn" else (2, 2)
        out[kind] = real_server(
            kind,
            url,
            key_prefix,
            workers=workers,
            clients=clients,
            rounds=rounds,
            requests=requests,
        )
        show(kind, out[kind])
    return out
