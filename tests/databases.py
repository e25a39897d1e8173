"""Throwaway PostgreSQL and MariaDB servers for tests, started from the machine's packages.

``PostgresServer()`` and ``MariaDBServer()`` are context managers, in the style
of ``django_redis_mutex.testing.RedisServer``: each starts a private server on
a free loopback port, with its data directory and unix socket in a temporary
directory and no password (trust), waits until it accepts connections, and on
leaving stops it and removes the directory. A server that fails to start is
cleaned up the same way, and the error quotes its log.

The binaries are those of Debian's ``postgresql`` (``initdb``, ``postgres`` and
``pg_isready`` under ``/usr/lib/postgresql/<version>/bin``, any version) and
``mariadb-server`` (``mariadbd``, ``mariadb-install-db``) packages, or on PATH;
``POSTGRES_BINDIR``, ``MARIADBD`` and ``MARIADB_INSTALL_DB`` name others. When
one is missing, FileNotFoundError says what to install. Nothing here connects
to a server it did not start.

PostgreSQL refuses to run as root: under root, ``initdb`` and ``postgres`` run
as the ``postgres`` user (else ``nobody``), who is given the temporary
directory. MariaDB runs as root when started by root (``--user=root``).
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from types import TracebackType
from typing import Any, TypeVar

from django_redis_mutex.testing import PortTaken, free_port, port_is_free, start_on_a_picked_port

__all__ = [
    "MariaDBServer",
    "PostgresServer",
    "configured",
    "create_database",
    "find_mariadb",
    "find_postgres_bindir",
]

#: Where Debian's postgresql packages put the server binaries, one dir per major version.
POSTGRES_SEARCH = "/usr/lib/postgresql/*/bin"
#: Where distributions put mariadbd when it is not on PATH (sbin often is not, for non-root).
MARIADB_SEARCH = ("/usr/sbin/mariadbd", "/usr/libexec/mariadbd", "/usr/local/sbin/mariadbd")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def _version_key(bindir: str) -> tuple[int, ...]:
    """Sort key of ``.../postgresql/<version>/bin``: newest version first when reversed."""
    version = os.path.basename(os.path.dirname(bindir))
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def find_postgres_bindir() -> str:
    """Return a directory holding ``initdb``, ``postgres`` and ``pg_isready``, or say what to do."""
    needed = ("initdb", "postgres", "pg_isready")
    explicit = os.environ.get("POSTGRES_BINDIR")
    candidates = [explicit] if explicit else []
    candidates += sorted(glob.glob(POSTGRES_SEARCH), key=_version_key, reverse=True)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    for bindir in candidates:
        if all(os.access(os.path.join(bindir, name), os.X_OK) for name in needed):
            return bindir
    raise FileNotFoundError(
        f"No PostgreSQL server found ({', '.join(needed)} in {POSTGRES_SEARCH} or on PATH): "
        "install it (apt-get install postgresql) or set POSTGRES_BINDIR to its bin directory."
    )


def find_mariadb() -> tuple[str, str]:
    """Return the paths of ``mariadbd`` and ``mariadb-install-db``, or say what to install."""
    server = os.environ.get("MARIADBD") or shutil.which("mariadbd")
    if not server:
        server = next((path for path in MARIADB_SEARCH if os.access(path, os.X_OK)), None)
    install = (
        os.environ.get("MARIADB_INSTALL_DB")
        or shutil.which("mariadb-install-db")
        or shutil.which("mysql_install_db", path="/usr/bin:/usr/local/bin")
    )
    if not server or not install:
        missing = " and ".join(
            name
            for name, found in (("mariadbd", server), ("mariadb-install-db", install))
            if not found
        )
        raise FileNotFoundError(
            f"No MariaDB server found ({missing} missing): install it "
            "(apt-get install mariadb-server) or set MARIADBD and MARIADB_INSTALL_DB."
        )
    return server, install


_S = TypeVar("_S", bound="_Server")


class _Server:
    """What both servers share: the temporary directory, the log, start/stop and cleanup."""

    kind = "server"
    stop_signal = signal.SIGTERM

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._port_picked = port is None
        self.host = "127.0.0.1"
        self.directory = tempfile.mkdtemp(prefix=f"django-redis-mutex-{self.kind.lower()}-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> str:
        return os.path.join(self.directory, "data")

    @property
    def logfile(self) -> str:
        return os.path.join(self.directory, "server.log")

    def log_tail(self, lines: int = 20) -> str:
        """Return the last lines of the server's log, for error messages."""
        try:
            with open(self.logfile, encoding="utf-8", errors="replace") as log:
                tail = log.read().strip().splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(tail) or "(empty log)"

    # -- to be provided by each server ------------------------------------------

    def _prepare(self) -> None:
        """Create the data directory (initdb, mariadb-install-db)."""
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _process_options(self) -> dict[str, Any]:
        return {}

    def ready(self) -> bool:
        """Return True once the server accepts connections."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------

    def _run_setup(self, args: list[str], timeout: float) -> None:
        """Run a setup command to completion; raise with its output if it fails."""
        try:
            result = subprocess.run(
                args,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                **self._process_options(),
            )
        except subprocess.TimeoutExpired as exc:
            # Output caught so far comes as bytes here, even with text=True.
            output = "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part
                for part in (exc.stdout or "", exc.stderr or "")
            )
            raise TimeoutError(
                f"{os.path.basename(args[0])} did not finish within {timeout}s:\n{output}"
            ) from exc
        if result.returncode != 0:
            raise RuntimeError(
                f"{os.path.basename(args[0])} failed with exit status {result.returncode}:\n"
                f"{result.stdout}{result.stderr}".strip()
            )

    def start(self: _S, timeout: float = START_TIMEOUT) -> _S:
        """Initialise the data directory, start the server and return once it is ready.

        A picked port another process took before the server bound it is
        replaced by a fresh one, a few times. On any failure the process is
        stopped and the directory removed before the error propagates.
        """
        try:
            deadline = time.monotonic() + timeout
            self._prepare()
            start_on_a_picked_port(lambda: self._launch(deadline, timeout), self._pick_again)
            return self
        except BaseException:
            self.close()
            raise

    def _pick_again(self) -> None:
        self.port = free_port()

    def _launch(self, deadline: float, timeout: float) -> None:
        """Start the process and return once it is ready; PortTaken if it lost its picked port."""
        with open(self.logfile, "ab") as log:
            self.process = subprocess.Popen(
                self._command(),
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._process_options(),
            )
        while not self.ready():
            if self.process.poll() is not None:
                if self._port_picked and not port_is_free(self.port):
                    raise PortTaken(self.port, f"{self.kind}: port {self.port} was taken")
                raise RuntimeError(
                    f"{self.kind} exited with status {self.process.returncode} on port "
                    f"{self.port} before accepting connections. Its log:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.kind} on port {self.port} did not accept connections within "
                    f"{timeout}s. Its log:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (its whole process group), by force if it does not go in time."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(self.stop_signal)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                # Not gone in time: kill it and whatever else is left of its session.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _unprivileged_user() -> pwd.struct_passwd:
    """The account PostgreSQL runs as when we are root: ``postgres`` if it exists, else nobody."""
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        "Running as root, and neither a 'postgres' nor a 'nobody' account exists for "
        "PostgreSQL to run as (it refuses root)."
    )


class PostgresServer(_Server):
    """A private PostgreSQL server on 127.0.0.1; superuser ``postgres``, trust authentication."""

    kind = "PostgreSQL"
    stop_signal = signal.SIGINT  # "fast" shutdown: ends sessions, no waiting for clients
    user = "postgres"

    def __init__(self, port: int | None = None, *, bindir: str | None = None) -> None:
        self.bindir = bindir or find_postgres_bindir()
        super().__init__(port)
        self._account = _unprivileged_user() if os.geteuid() == 0 else None
        if self._account is not None:
            try:
                os.chown(self.directory, self._account.pw_uid, self._account.pw_gid)
            except BaseException:
                shutil.rmtree(self.directory, ignore_errors=True)
                raise

    def _process_options(self) -> dict[str, Any]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
        if self._account is None:
            return {"env": {**os.environ, **env}}
        env["HOME"] = self.directory
        return {
            "env": env,
            "user": self._account.pw_uid,
            "group": self._account.pw_gid,
            "extra_groups": [],
        }

    def _prepare(self) -> None:
        self._run_setup(
            [
                os.path.join(self.bindir, "initdb"),
                "--pgdata",
                self.data_dir,
                "--username",
                self.user,
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ],
            timeout=START_TIMEOUT,
        )

    def _command(self) -> list[str]:
        settings = {
            "listen_addresses": self.host,
            "port": str(self.port),
            "unix_socket_directories": self.directory,
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "50",
            "logging_collector": "off",
        }
        args = [os.path.join(self.bindir, "postgres"), "-D", self.data_dir]
        for name, value in settings.items():
            args += ["-c", f"{name}={value}"]
        return args

    def ready(self) -> bool:
        result = subprocess.run(
            [
                os.path.join(self.bindir, "pg_isready"),
                "--quiet",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--username",
                self.user,
                "--dbname",
                "postgres",
                "--timeout",
                "2",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        return result.returncode == 0

    def django_settings(self, name: str) -> dict[str, Any]:
        """Return a ``DATABASES`` entry for database ``name`` on this server."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": self.user,
            "PASSWORD": "",
            "HOST": self.host,
            "PORT": str(self.port),
            "OPTIONS": {"connect_timeout": 10},
        }


class MariaDBServer(_Server):
    """A private MariaDB server on 127.0.0.1; user ``root`` without a password."""

    kind = "MariaDB"
    user = "root"

    def __init__(
        self, port: int | None = None, *, server: str | None = None, install: str | None = None
    ) -> None:
        found = (server, install) if server and install else find_mariadb()
        self.server, self.install = found
        super().__init__(port)
        self._as_root = os.geteuid() == 0

    def _prepare(self) -> None:
        args = [
            self.install,
            "--no-defaults",
            f"--datadir={self.data_dir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
        ]
        if self._as_root:
            args.append("--user=root")
        self._run_setup(args, timeout=START_TIMEOUT)

    def _command(self) -> list[str]:
        args = [
            self.server,
            "--no-defaults",
            f"--datadir={self.data_dir}",
            f"--port={self.port}",
            f"--bind-address={self.host}",
            f"--socket={os.path.join(self.directory, 'mariadb.sock')}",
            f"--pid-file={os.path.join(self.directory, 'mariadb.pid')}",
            "--skip-name-resolve",
            "--skip-log-bin",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_unicode_ci",
            "--innodb-buffer-pool-size=32M",
            "--innodb-flush-log-at-trx-commit=0",
        ]
        if self._as_root:
            args.append("--user=root")
        return args

    def ready(self) -> bool:
        """Return True if the server sends its handshake (protocol version 10)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=2) as sock:
                header = sock.recv(5)
        except OSError:
            return False
        return len(header) == 5 and header[4] == 10

    def django_settings(self, name: str) -> dict[str, Any]:
        """Return a ``DATABASES`` entry for database ``name`` (``""``: none) on this server."""
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": name,
            "USER": self.user,
            "PASSWORD": "",
            "HOST": self.host,
            "PORT": str(self.port),
            "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 10},
        }


def configured(entry: dict[str, Any], alias: str) -> dict[str, Any]:
    """Return ``entry`` with Django's defaults filled in (the handler insists on a default)."""
    from django.db import connections

    filled: dict[str, Any] = connections.configure_settings(
        {"default": {}, alias: copy.deepcopy(entry)}
    )[alias]
    return filled


def create_database(server: PostgresServer | MariaDBServer, admin_name: str) -> str:
    """Create a database with a fresh name on ``server`` and return its name.

    ``admin_name`` is a database to connect to for that (``postgres``, or
    ``""`` on MariaDB). The new one is never dropped: the server and its whole
    data directory go at the end of the session.
    """
    from django.db.utils import load_backend

    entry = configured(server.django_settings(admin_name), "drm_admin")
    admin = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, "drm_admin")
    name = f"drm_{uuid.uuid4().hex[:12]}"
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {admin.ops.quote_name(name)}")
    finally:
        admin.close()
    return name
