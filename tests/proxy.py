"""A loopback TCP proxy between the app and Redis that can slow, stall and cut the network.

Fault tests point a cache LOCATION at :attr:`Proxy.url` instead of Redis. The
proxy forwards bytes both ways and, on the test's command, adds latency to
every chunk it forwards (``latency``), stops forwarding while keeping every
connection open (``stall()``/``resume()``: a hung network or server, the case
socket timeouts exist for), or closes every open connection at once
(``cut()``: a restarted load balancer or a network blip). Bytes read during a
stall are delivered after it, as a congested network would deliver them late.

Each accepted connection is a link of two sockets and two pump threads. A cut
only shuts the sockets down; the last pump of a link to finish closes them, so
no thread can ever read from a file descriptor that was closed and reused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

__all__ = ["Proxy"]

_CHUNK = 65536
# How often a stalled pump or the accept loop looks up to see if it must stop.
_POLL = 0.05


class _Link:
    """One proxied connection: the app's socket and ours to Redis."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = False
        self._pumps = 2
        self._lock = threading.Lock()

    def shut(self) -> None:
        """Shut both sockets down, which wakes both pumps; they close the sockets."""
        with self._lock:
            self.closed = True
            for sock in (self.client, self.upstream):
                with contextlib.suppress(OSError):  # already shut, or never connected
                    sock.shutdown(socket.SHUT_RDWR)

    def pump_done(self) -> bool:
        """Note that one pump stopped; close the sockets after the last. Return True then."""
        self.shut()
        with self._lock:
            self._pumps -= 1
            if self._pumps:
                return False
        self.client.close()
        self.upstream.close()
        return True


class Proxy:
    """A threaded TCP proxy on 127.0.0.1 to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        #: Seconds each forwarded chunk is held back, in either direction.
        self.latency = 0.0
        self._flowing = threading.Event()
        self._flowing.set()
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        #: Connections accepted so far (a reconnecting client shows up here).
        self.accepted = 0

    @property
    def url(self) -> str:
        """A redis:// URL that reaches Redis through this proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def open_links(self) -> int:
        """Return how many proxied connections are open now."""
        with self._lock:
            return len(self._links)

    def start(self) -> Proxy:
        """Start accepting connections."""
        self._acceptor.start()
        return self

    def stall(self) -> None:
        """Stop forwarding in both directions; connections stay open, bytes wait."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward again, delivering what was held back during the stall."""
        self._flowing.set()

    def cut(self) -> int:
        """Close every open connection (new ones are still accepted); return how many."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.shut()
        return len(links)

    def close(self) -> None:
        """Stop accepting, cut every connection and wait for the accept thread."""
        self._stopping.set()
        self._flowing.set()
        if self._acceptor.is_alive():
            self._acceptor.join(5)
        self._listener.close()
        self.cut()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                # Redis is down: refuse the app as Redis itself would.
                client.close()
                continue
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._lock:
                self._links.add(link)
                self.accepted += 1
            for source, target, direction in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump,
                    args=(link, source, target),
                    name=f"proxy-{direction}-{self.accepted}",
                    daemon=True,
                ).start()

    def _pump(self, link: _Link, source: socket.socket, target: socket.socket) -> None:
        try:
            while not link.closed:
                try:
                    data = source.recv(_CHUNK)
                except OSError:
                    return
                if not data:
                    return
                if self.latency > 0:
                    time.sleep(self.latency)
                while not self._flowing.wait(_POLL):
                    if link.closed:
                        return
                if link.closed:
                    return
                try:
                    target.sendall(data)
                except OSError:
                    return
        finally:
            if link.pump_done():
                with self._lock:
                    self._links.discard(link)
