"""A worker script running as a real OS process, and the events it reports.

Workers (tests/workers/) print one JSON object per line; :class:`Worker`
reads them with deadlines, so a test waits for an event, never for a sleep.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from typing import Any

# Generous bounds: these tests run on a busy 2-core machine.
STEP_TIMEOUT = 30.0


class Worker:
    """A running worker script and the events it has reported so far."""

    def __init__(self, script: str, process: subprocess.Popen[str]) -> None:
        self.script = script
        self.process = process
        self.events: list[dict[str, Any]] = []
        self._next = 0
        self._partial = b""
        self._stderr = b""
        self._selector = selectors.DefaultSelector()
        assert process.stdout is not None and process.stderr is not None
        self._selector.register(process.stdout.fileno(), selectors.EVENT_READ, "out")
        self._selector.register(process.stderr.fileno(), selectors.EVENT_READ, "err")

    @property
    def pid(self) -> int:
        return self.process.pid

    def _describe(self) -> str:
        stderr = self._stderr.decode("utf-8", "replace").strip()
        return (
            f"worker {self.script} (pid {self.pid}, exit {self.process.poll()}); "
            f"events {self.events}; stderr:\n{stderr or '(empty)'}"
        )

    def _pump(self, timeout: float) -> bool:
        """Read what the worker wrote within ``timeout``; return False once both pipes closed."""
        if not self._selector.get_map():
            return False
        for key, _ in self._selector.select(max(timeout, 0.0)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self._selector.unregister(key.fd)
            elif key.data == "err":
                self._stderr += chunk
            else:
                *lines, self._partial = (self._partial + chunk).split(b"\n")
                for line in lines:
                    event = json.loads(line)
                    if event["event"] == "error":
                        raise AssertionError(f"{event['message']}: {self._describe()}")
                    self.events.append(event)
        return True

    def expect(self, event: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """Return the worker's next ``event`` report, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(self._next, len(self.events)):
                if self.events[index]["event"] == event:
                    self._next = index + 1
                    return self.events[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {event!r} within {timeout}s from {self._describe()}")
            if not self._pump(remaining):
                raise AssertionError(f"no {event!r} before the output ended: {self._describe()}")

    def finish(self, timeout: float = STEP_TIMEOUT) -> int:
        """Read the rest of the output, wait for the exit and return the exit code."""
        deadline = time.monotonic() + timeout
        while self._pump(deadline - time.monotonic()):
            if time.monotonic() > deadline:
                raise AssertionError(f"output did not end within {timeout}s: {self._describe()}")
        self.process.wait(max(deadline - time.monotonic(), 0.1))
        return self.process.returncode

    def close(self) -> None:
        """Kill the worker if it still runs (resuming it first if stopped) and close its pipes."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)
        self._selector.close()
        assert self.process.stdout is not None and self.process.stderr is not None
        self.process.stdout.close()
        self.process.stderr.close()
