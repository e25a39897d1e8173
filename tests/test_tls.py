"""Locks over TLS: a ``rediss://`` LOCATION works for every client the app builds.

A throwaway CA signs a certificate for 127.0.0.1; redis-server listens on a
TLS port only (its plain port is off), so any connection the app opened
without TLS, or with TLS but without the CA, would fail instead of passing
silently. The async client is built from the sync pool's settings, which is
where TLS options could be dropped.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import override_settings

from django_redis_mutex import LockContended, Mutex, held_locks, mutex, reset, reset_all
from django_redis_mutex.client import get_async_client, get_client
from django_redis_mutex.testing import RedisServer, free_port

from .helpers import await_until, wait_until
from .test_server_ports import listening_on

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@dataclass(frozen=True)
class Certificates:
    """The files of a throwaway CA and of a server certificate it signed."""

    directory: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_dir: Path  # the CA certificate under its OpenSSL hash name, for ssl_ca_path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> Certificates:
    """Create a CA and a certificate for 127.0.0.1 / localhost signed by it."""
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=django-redis-mutex test CA",
        "-keyout", "ca.key", "-out", "ca.crt", cwd=directory,
    )  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr", cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "server.crt",
        cwd=directory,
    )  # fmt: skip
    ca_dir = directory / "cas"
    ca_dir.mkdir()
    shutil.copy(directory / "ca.crt", ca_dir / "ca.crt")
    _openssl("rehash", str(ca_dir), cwd=directory)
    return Certificates(
        directory, directory / "ca.crt", directory / "server.crt", directory / "server.key", ca_dir
    )


class TLSRedisServer(RedisServer):
    """A RedisServer that serves TLS only, on ``port``; the plain TCP port is off."""

    def __init__(self, certs: Certificates, *, cluster: bool = False) -> None:
        super().__init__(cluster=cluster)
        self.certs = certs
        if cluster:  # the cluster bus (port + 10000) speaks TLS too
            self.extra_args += ["--tls-cluster", "yes"]
        self.extra_args += [
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(certs.server_cert),
            "--tls-key-file", str(certs.server_key),
            "--tls-ca-cert-file", str(certs.ca_cert),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def _pick_again(self) -> None:
        # Moved off a port taken since it was picked: the TLS port moves with it.
        super()._pick_again()
        self.extra_args[self.extra_args.index("--tls-port") + 1] = str(self.port)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def admin(self) -> redis.Redis:
        """Return an unrestricted client that verifies the server against the test CA."""
        return redis.Redis(
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.certs.ca_cert),
            ssl_cert_reqs="required",
        )

    def ping(self) -> bool:
        """Return True if the server answers PING over a verified TLS connection."""
        context = ssl.create_default_context(cafile=str(self.certs.ca_cert))
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
            ):
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture(scope="module")
def certs() -> Iterator[Certificates]:
    directory = Path(tempfile.mkdtemp(prefix="django-redis-mutex-tls-"))
    try:
        yield make_certificates(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_server(certs: Certificates) -> Iterator[TLSRedisServer]:
    try:
        server = TLSRedisServer(certs).start()
    except RuntimeError as exc:  # a redis-server built without TLS refuses --tls-port
        pytest.skip(f"redis-server cannot serve TLS: {exc}")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(autouse=True)
def _fresh_django_redis_pools(tls_server: TLSRedisServer) -> Iterator[None]:
    """Drop django-redis's pools for this server around each test.

    django-redis keeps one pool per LOCATION for the whole process, so a test
    changing only the TLS options of the same URL would otherwise reuse the
    previous test's pool and its settings.
    """
    from django_redis.pool import ConnectionFactory

    def drop() -> None:
        for key in [key for key in ConnectionFactory._pools if f":{tls_server.port}" in key]:
            ConnectionFactory._pools.pop(key).disconnect()

    drop()
    yield
    drop()


@pytest.fixture
def admin(tls_server: TLSRedisServer, certs: Certificates) -> Iterator[redis.Redis]:
    client = tls_server.admin()
    yield client
    client.flushall()
    client.close()


def tls_caches(server: TLSRedisServer, certs: Certificates, style: str) -> dict[str, Any]:
    """Return CACHES for a TLS lock alias, configured the way ``style`` names."""
    verify = {"ssl_ca_certs": str(certs.ca_cert), "ssl_cert_reqs": "required"}
    if style == "pool-kwargs":  # django-redis: TLS options through CONNECTION_POOL_KWARGS
        entry: dict[str, Any] = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"SOCKET_TIMEOUT": 5, "CONNECTION_POOL_KWARGS": verify},
        }
    elif style == "url-query":  # django-redis: TLS options as URL query parameters
        entry = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"{server.url}?ssl_cert_reqs=required&ssl_ca_certs={certs.ca_cert}",
            "OPTIONS": {"SOCKET_TIMEOUT": 5},
        }
    elif style == "ca-path":  # a directory of hashed CA certificates instead of one file
        entry = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {
                "SOCKET_TIMEOUT": 5,
                "CONNECTION_POOL_KWARGS": {
                    "ssl_ca_path": str(certs.ca_dir),
                    "ssl_cert_reqs": "required",
                },
            },
        }
    else:  # Django's own backend: OPTIONS go to the connection pool as they are
        entry = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"socket_timeout": 5, **verify},
        }
    entry.update(KEY_PREFIX="tests", MUTEX={"PREFIX": "mutextls"})
    return {"default": entry}


def sync_workload() -> None:
    """A contended lock, watchdog renewal and the operator tools, all over TLS."""
    with mutex("tls:job", ttl=5) as lock:
        assert lock.owned()
        with pytest.raises(LockContended), Mutex("tls:job", blocking=False, reentrant=False):
            pass
    # ttl 0.6 s, held for 2 s: only the watchdog's renewals keep it.
    with mutex("tls:renew", ttl=0.8) as renewed:
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            assert renewed.owned()
            time.sleep(0.05)
        assert not renewed.lost
    assert Mutex("tls:a", ttl=30, watchdog=False).acquire()
    assert Mutex("tls:b", ttl=30, watchdog=False).acquire()
    assert {held.name for held in held_locks()} == {"tls:a", "tls:b"}
    assert reset("tls:a") is True
    assert reset_all() == 1
    assert held_locks() == []


async def async_workload(admin: redis.Redis) -> None:
    """The async client (its own pool, built from the sync one) over TLS."""
    client = await get_async_client("default")
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    async with mutex("tls:async", ttl=5) as first:
        assert await first.aowned()
        second = Mutex("tls:async", ttl=5)
        waiting = asyncio.ensure_future(second.aacquire(timeout=10))
        await await_until(
            lambda: admin.zcard("tests:mutextls:{tls:async}:queue"), 5, "the async waiter to queue"
        )
    assert await waiting  # handed over and woken over TLS (BLPOP on the async client)
    assert await second.atime_left() > 0
    await second.arelease()
    async with mutex("tls:async-renew", ttl=0.8) as renewed:
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            assert await renewed.aowned()
            await asyncio.sleep(0.05)
        assert not renewed.lost


def test_a_tls_server_whose_picked_port_was_taken_serves_tls_on_the_port_it_moved_to(
    tls_server: TLSRedisServer, certs: Certificates
) -> None:
    """The TLS port is the server's port: a move off a taken port takes it along."""
    server = TLSRedisServer(certs)
    picked = server.port
    with listening_on(picked), server.start():
        assert server.port != picked
        assert server.ping()  # over TLS, verified against the test CA


@pytest.mark.parametrize("style", ["pool-kwargs", "url-query", "ca-path", "django"])
def test_locks_work_over_tls(
    tls_server: TLSRedisServer, certs: Certificates, admin: redis.Redis, style: str
) -> None:
    with override_settings(CACHES=tls_caches(tls_server, certs, style)):
        assert get_client("default").connection_pool.connection_class.__name__ == "SSLConnection"
        sync_workload()
        asyncio.run(async_workload(admin))


def test_the_async_client_carries_every_tls_setting_of_the_sync_pool(
    tls_server: TLSRedisServer, certs: Certificates
) -> None:
    """Each TLS option a project sets must reach the async pool unchanged."""
    tls_options = {
        "ssl_ca_certs": str(certs.ca_cert),
        "ssl_ca_path": str(certs.ca_dir),
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
        "ssl_password": "unused",
        "ssl_min_version": ssl.TLSVersion.TLSv1_2,
        "ssl_ciphers": "HIGH:!aNULL",
        "ssl_include_verify_flags": [ssl.VerifyFlags.VERIFY_X509_STRICT],
        "ssl_exclude_verify_flags": [ssl.VerifyFlags.VERIFY_X509_PARTIAL_CHAIN],
    }
    caches = tls_caches(tls_server, certs, "pool-kwargs")
    caches["default"]["OPTIONS"]["CONNECTION_POOL_KWARGS"] = tls_options

    async def async_kwargs() -> dict[str, Any]:
        client = await get_async_client("default")
        return dict(client.connection_pool.connection_kwargs)

    with override_settings(CACHES=caches):
        carried = asyncio.run(async_kwargs())
    assert {name: carried.get(name) for name in tls_options} == tls_options


def test_a_client_that_does_not_trust_the_ca_is_refused(
    tls_server: TLSRedisServer, certs: Certificates
) -> None:
    """The server's certificate is really checked: without the CA, no lock can be taken."""
    from django_redis_mutex import LockBackendUnavailable

    caches = tls_caches(tls_server, certs, "pool-kwargs")
    caches["default"]["OPTIONS"]["CONNECTION_POOL_KWARGS"] = {"ssl_cert_reqs": "required"}
    with (
        override_settings(CACHES=caches),
        pytest.raises(LockBackendUnavailable, match="certificate verify failed"),
        mutex("tls:untrusted", timeout=1),
    ):
        pass


@contextmanager
def tls_cluster(certs: Certificates, primaries: int = 3) -> Iterator[list[TLSRedisServer]]:
    """Start a Redis Cluster whose clients and bus all speak TLS; stop it afterwards."""
    nodes = [TLSRedisServer(certs, cluster=True) for _ in range(primaries)]
    clients: list[redis.Redis] = []
    try:
        for node in nodes:
            node.start()
        clients = [node.admin() for node in nodes]
        share = 16384 // primaries
        for index, client in enumerate(clients):
            last = 16383 if index == primaries - 1 else (index + 1) * share - 1
            client.execute_command("CLUSTER", "ADDSLOTS", *range(index * share, last + 1))
        for client in clients[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        wait_until(
            lambda: all(
                b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients
            ),
            30,
            "the TLS cluster to reach state ok",
        )
        yield nodes
    finally:
        for client in clients:
            client.close()
        for node in nodes:
            node.close()


def test_a_cluster_lock_alias_works_over_tls(certs: Certificates) -> None:
    """MUTEX CLUSTER over rediss://: TLS options ride in the LOCATION's query string.

    The app builds its own redis-py cluster clients for a CLUSTER alias from
    the LOCATION (and OPTIONS' timeouts and credentials only), so the CA goes
    in the URL.
    """
    from redis.crc import key_slot

    with tls_cluster(certs) as nodes:
        location = (
            f"rediss://127.0.0.1:{nodes[0].port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={certs.ca_cert}"
        )
        caches = {
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": location,
                "KEY_PREFIX": "tests",
                "OPTIONS": {"SOCKET_TIMEOUT": 5},
                "MUTEX": {"CLUSTER": True, "PREFIX": "mutextls"},
            }
        }
        # Names whose slots land on different primaries, so more than one node is used.
        names = [f"tls:c{i}" for i in range(30)]
        slots = {key_slot(name.encode()) * len(nodes) // 16384 for name in names}
        assert len(slots) > 1
        with override_settings(CACHES=caches):
            for name in names:
                with mutex(name, ttl=5) as lock:
                    assert lock.owned()
            with mutex("tls:cluster-renew", ttl=0.8) as renewed:
                started = time.monotonic()
                while time.monotonic() - started < 2.0:
                    assert renewed.owned()
                    time.sleep(0.05)
                assert not renewed.lost

            async def async_locks() -> None:
                async with mutex("tls:cluster-async", ttl=5) as lock:
                    assert await lock.aowned()

            asyncio.run(async_locks())
            assert Mutex("tls:cluster-held", ttl=30, watchdog=False).acquire()
            assert [held.name for held in held_locks()] == ["tls:cluster-held"]
            assert reset_all() == 1


@contextmanager
def tls_sentinel(certs: Certificates, service: str) -> Iterator[tuple[TLSRedisServer, int]]:
    """Start a TLS-only master, one replica and one TLS-only sentinel watching them."""
    master = TLSRedisServer(certs)
    master.extra_args += ["--tls-replication", "yes", "--repl-diskless-sync-delay", "0"]
    replica = TLSRedisServer(certs)
    replica.extra_args += ["--tls-replication", "yes", "--repl-diskless-sync-delay", "0"]
    process: subprocess.Popen[bytes] | None = None
    admin: redis.Redis | None = None
    try:
        master.start()
        replica.extra_args += ["--replicaof", "127.0.0.1", str(master.port)]
        replica.start()
        # Written once the master runs: it names the master's port.
        sentinel_port = free_port()
        config = certs.directory / f"sentinel-{service}.conf"
        config.write_text(
            "\n".join(
                [
                    "port 0",
                    f"tls-port {sentinel_port}",
                    "bind 127.0.0.1",
                    "protected-mode no",
                    f"dir {certs.directory}",
                    f"logfile {certs.directory}/sentinel-{service}.log",
                    f"tls-cert-file {certs.server_cert}",
                    f"tls-key-file {certs.server_key}",
                    f"tls-ca-cert-file {certs.ca_cert}",
                    "tls-auth-clients no",
                    "tls-replication yes",  # how a sentinel reaches the data nodes
                    f"sentinel monitor {service} 127.0.0.1 {master.port} 1",
                ]
            )
            + "\n"
        )
        process = subprocess.Popen(
            [master.binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        admin = redis.Redis(
            port=sentinel_port,
            ssl=True,
            ssl_ca_certs=str(certs.ca_cert),
            ssl_cert_reqs="required",
            socket_timeout=1,
        )

        def sentinel_knows_master() -> bool:
            try:
                found = admin.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service)
            except redis.exceptions.ConnectionError:
                return False
            return bool(found) and int(found[1]) == master.port

        wait_until(sentinel_knows_master, 15, "the TLS sentinel to answer for the master")
        yield master, sentinel_port
    finally:
        if admin is not None:
            admin.close()
        if process is not None:
            process.kill()
            process.wait(10)
        replica.close()
        master.close()


def test_a_sentinel_lock_alias_works_over_tls(certs: Certificates) -> None:
    """django-redis's Sentinel client with TLS to the sentinels and to the master.

    The LOCATION stays ``redis://<service>``: a ``rediss://`` one would make
    redis-py connect to the service name as a host. TLS for the data nodes is
    ``ssl: True`` in CONNECTION_POOL_KWARGS, for the sentinels SENTINEL_KWARGS.
    """
    verify = {"ssl_ca_certs": str(certs.ca_cert), "ssl_cert_reqs": "required"}
    service = "tls-" + uuid.uuid4().hex[:8]
    with tls_sentinel(certs, service) as (master, sentinel_port):
        caches = {
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{service}/0",
                "KEY_PREFIX": "tests",
                "OPTIONS": {
                    "CLIENT_CLASS": "django_redis.client.SentinelClient",
                    "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                    "SENTINELS": [("127.0.0.1", sentinel_port)],
                    "SENTINEL_KWARGS": {"ssl": True, **verify, "socket_timeout": 2},
                    "CONNECTION_POOL_KWARGS": {"ssl": True, **verify},
                    "SOCKET_TIMEOUT": 5,
                },
                "MUTEX": {"PREFIX": "mutextls"},
            }
        }
        check = master.admin()
        with override_settings(CACHES=caches):
            with mutex("tls:sentinel", ttl=0.8) as lock:
                assert check.hget("tests:mutextls:{tls:sentinel}", "token") == lock.token.encode()
                started = time.monotonic()
                while time.monotonic() - started < 1.5:
                    assert lock.owned()
                    time.sleep(0.05)
                assert not lock.lost
                assert [held.name for held in held_locks()] == ["tls:sentinel"]

            async def async_lock() -> None:
                async with mutex("tls:sentinel-async", ttl=5) as held:
                    assert await held.aowned()

            asyncio.run(async_lock())
            assert Mutex("tls:sentinel-held", ttl=30, watchdog=False).acquire()
            assert reset_all() == 1
        try:
            assert check.keys("tests:mutextls:{*}") == []
        finally:
            check.close()
