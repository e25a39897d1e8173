"""The demo project (``manage.py demo``) as a real subprocess, for tests that drive it.

The suite never imports ``testproject``: the demo runs the way a person runs
it, in its own process with its own private redis-server, and tests talk to
it over HTTP and through ``manage.py`` subprocesses only. Each demo gets its
own data folder (``DEMO_DATA_DIR``) so it never shares a database or Redis
URL file with a demo someone runs by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from django_redis_mutex.testing import PortTaken, free_port, port_is_free, start_on_a_picked_port

from .helpers import ROOT

T = TypeVar("T")

# A busy two-core machine runs migrations on a fresh SQLite in a few seconds.
START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
_REDIS_LINE = re.compile(r"Started a private Redis at (\S+) \(pid (\d+), folder (\S+),")


def wait_for(check: Callable[[], T | None], timeout: float, what: str, step: float = 0.2) -> T:
    """Return check()'s first truthy result, polling until ``timeout``; fail saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _is_ours(pid: int) -> bool:
    """True if ``pid`` still runs the demo or its redis-server, not a recycled pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"manage.py" in cmdline or b"redis-server" in cmdline


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, found by walking /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def demo_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a person's shell: no REDIS_URL, the demo's own settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "REDIS_URL"
        and key != "DJANGO_SETTINGS_MODULE"
        and not key.startswith("DJANGO_REDIS_MUTEX_TEST")
    }
    env.update(DEMO_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", **extra)
    return env


class Demo:
    """One ``manage.py demo`` process on a free port, with its output in a file."""

    def __init__(self, data_dir: Path, *, hold_seconds: int = 20, **env: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = demo_env(data_dir, DEMO_HOLD_SECONDS=str(hold_seconds), **env)
        self.log = data_dir / "demo.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.redis_url = ""
        self.redis_pid = 0
        self.redis_folder = Path()
        self._seen: set[int] = set()

    def start(self) -> Demo:
        """Start the demo and return once it serves its inventory page.

        A picked port another process took before the demo bound it is
        replaced by a fresh one, a few times.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        start_on_a_picked_port(self._launch, self._pick_again)
        match = _REDIS_LINE.search(self.output())
        if match:
            self.redis_url, pid, folder = match.groups()
            self.redis_pid, self.redis_folder = int(pid), Path(folder)
        return self

    def _launch(self) -> None:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "demo", f"127.0.0.1:{self.port}"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # signals from the test reach the demo alone
            )
        try:
            wait_for(self._serving, START_TIMEOUT, f"the demo on {self.url}", 0.3)
        except TimeoutError:
            raise AssertionError(f"The demo did not serve {self.url}:\n{self.output()}") from None

    def _pick_again(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _serving(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            if not port_is_free(self.port):
                raise PortTaken(self.port, f"the demo's port {self.port} was taken")
            status = self.process.returncode
            raise AssertionError(f"The demo exited with {status}:\n{self.output()}")
        try:
            with urllib.request.urlopen(self.url + "/", timeout=10) as response:
                ok: bool = response.status == 200
        except (OSError, urllib.error.URLError):
            return False
        self._seen |= descendants(self.process.pid)
        return ok

    def output(self) -> str:
        """Everything the demo printed so far."""
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def processes(self) -> set[int]:
        """The demo's process and every process it started that is still alive."""
        assert self.process is not None
        self._seen |= descendants(self.process.pid)
        return {pid for pid in self._seen | {self.process.pid} if pid_alive(pid)}

    def manage(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``manage.py ARGS`` as a second terminal would: no REDIS_URL, same project."""
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=demo_env(self.data_dir),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def held_locks(self) -> list[dict[str, Any]]:
        """The demo's locks, as ``manage.py locks --json`` in a second terminal lists them."""
        result = self.manage("locks", "--json")
        assert result.returncode == 0, result.stderr
        locks: list[dict[str, Any]] = json.loads(result.stdout)
        return locks

    def signal(self, signum: int) -> int:
        """Send ``signum`` to the demo and return its exit status."""
        assert self.process is not None
        self._seen |= descendants(self.process.pid)
        self.process.send_signal(signum)
        return self.process.wait(STOP_TIMEOUT)

    def kill_all(self) -> None:
        """Kill whatever of the demo is still running (a test failed half-way)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._seen |= descendants(self.process.pid)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self._seen | ({self.redis_pid} if self.redis_pid else set()):
            if pid_alive(pid) and _is_ours(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
