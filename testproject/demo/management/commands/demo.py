"""Run the demo: a private Redis (unless REDIS_URL), SQLite, a superuser, workers, runserver."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import FrameType
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from django_redis_mutex.testing import RedisServer

from ...process import die_with_parent

# In a demo Redis's folder: the pids of the demo and its server. A folder
# whose processes are all gone was left by a demo killed with SIGKILL (or by
# the OOM killer), where no cleanup runs; the next demo removes it.
OWNERS_FILE = "demo-pids"
FOLDER_PATTERN = "django-redis-mutex-redis-*"  # RedisServer's temporary folders

DEMO_USER = "admin"
DEMO_PASSWORD = "admin"
PRODUCTS = {"Espresso beans": 40, "Paper filters": 120, "Grinder": 5}


class DemoStopped(SystemExit):
    """Raised from the SIGTERM/SIGHUP handler so the demo's cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)  # the exit status a shell shows for a signal
        self.signum = signum


class DemoRedisServer(RedisServer):
    """A private redis-server that the kernel stops if the demo dies unannounced.

    The demo stops its server itself on Ctrl-C, SIGTERM and SIGHUP; the
    parent-death signal covers SIGKILL and crashes, where no Python code runs.
    """

    def start(self, timeout: float = 10.0) -> DemoRedisServer:
        """Start the server (as RedisServer does) and return once it answers PING."""
        args = [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", self._dir),
            *("--daemonize", "no", "--protected-mode", "no", "--logfile", self.logfile),
            *self.extra_args,
        ]
        parent = os.getpid()
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the terminal is the demo's to handle
            preexec_fn=lambda: die_with_parent(parent),
        )
        owners = os.path.join(self._dir, OWNERS_FILE)
        with open(owners + ".new", "w", encoding="utf-8") as file:
            file.write(f"{parent} {self.process.pid}\n")
        os.replace(owners + ".new", owners)  # never read half-written
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self.log_tail()}")
            if self.ping():
                return self
            time.sleep(0.01)
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    @property
    def folder(self) -> str:
        """The server's temporary working folder (removed by close())."""
        return self._dir


def _alive(pid: int) -> bool:
    """Return True while ``pid`` runs; a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but it exists
    try:
        # A killed demo's redis-server is re-parented, and may wait a while to be reaped.
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill said it exists


def remove_stale_folders() -> list[str]:
    """Remove the folders of demo Redis servers whose demo and server are gone; return them.

    Only folders of this user that a demo marked with its OWNERS_FILE are
    considered: a test server's folder, or a demo's still being started, has
    none and is left alone, as is any folder one of whose processes still runs.
    """
    removed = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), FOLDER_PATTERN)):
        try:
            if os.lstat(folder).st_uid != os.getuid() or os.path.islink(folder):
                continue
            with open(os.path.join(folder, OWNERS_FILE), encoding="utf-8") as file:
                pids = [int(pid) for pid in file.read().split()]
        except (OSError, ValueError):
            continue
        if pids and not any(_alive(pid) for pid in pids):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def address_in_use(addrport: str) -> bool:
    """Return True if another process already listens where ``addrport`` would serve.

    runserver finds out only after the demo has started its Redis, and then
    leaves with os._exit(), past every cleanup; asking first spares that. An
    address this cannot parse is left to runserver to refuse.
    """
    host, _, port = addrport.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as runserver binds
        try:
            sock.bind((host, int(port)))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise DemoStopped(signum)


class Command(BaseCommand):
    help = "Run the django-redis-mutex demo on 127.0.0.1:8000 (embedded Redis unless REDIS_URL)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("addrport", nargs="?", default="127.0.0.1:8000")
        parser.add_argument(
            "--no-workers",
            action="store_false",
            dest="workers",
            help="Do not start the background workers that contend for demo locks.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if address_in_use(options["addrport"]):
            raise CommandError(
                f"{options['addrport']} is already in use: stop what serves there, or give "
                "the demo another address, e.g. `uv run manage.py demo 127.0.0.1:8001`."
            )
        server: DemoRedisServer | None = None
        workers: subprocess.Popen[bytes] | None = None
        url_file = settings.DEMO_REDIS_URL_FILE
        # A closed terminal (SIGHUP) or a plain `kill` (SIGTERM) must clean up
        # like Ctrl-C does, or the private redis-server is orphaned.
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _stop_on_signal)
        try:
            if not os.environ.get("REDIS_URL"):
                for folder in remove_stale_folders():
                    self.stdout.write(f"Removed {folder}, left by a demo that was killed.")
                server = DemoRedisServer()
                server.start()
                for entry in settings.CACHES.values():
                    entry["LOCATION"] = server.url
                os.environ["REDIS_URL"] = server.url  # for the worker process
                settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
                url_file.write_text(server.url + "\n", encoding="utf-8")
                assert server.process is not None
                self.stdout.write(
                    f"Started a private Redis at {server.url} (pid {server.process.pid}, "
                    f"folder {server.folder}, {server.binary}); "
                    f"`manage.py locks` finds it through {url_file}."
                )
            self._prepare_database()
            if options["workers"]:
                workers = subprocess.Popen(
                    [sys.executable, sys.argv[0], "demo_workers"],
                    env={**os.environ, "DEMO_PARENT_PID": str(os.getpid())},
                )
            self.stdout.write(
                self.style.SUCCESS(
                    f"Demo: http://{options['addrport']}/   admin: {DEMO_USER} / {DEMO_PASSWORD}"
                )
            )
            call_command("runserver", options["addrport"], use_reloader=False)
        except KeyboardInterrupt:
            self.stdout.write("Stopping the demo.")
        except DemoStopped as stopped:
            self.stdout.write(f"Stopping the demo ({signal.Signals(stopped.signum).name}).")
            raise
        finally:
            # Ctrl-C reaches every process of the terminal's group, and uv
            # forwards it once more: a second signal must not cut the cleanup.
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            if workers is not None:
                workers.terminate()
                try:
                    workers.wait(10)
                except subprocess.TimeoutExpired:
                    workers.kill()
                    workers.wait()
            if server is not None:
                self._forget_url(server.url)
                server.close()
                self.stdout.write("Stopped the private Redis.")
            self.stdout.flush()

    def _forget_url(self, url: str) -> None:
        """Remove the URL file, unless another demo has written its own since."""
        url_file = settings.DEMO_REDIS_URL_FILE
        try:
            if url_file.read_text(encoding="utf-8").strip() == url:
                url_file.unlink()
        except OSError:
            pass

    def _prepare_database(self) -> None:
        from testproject.demo.models import Product

        settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        user_model = get_user_model()
        if not user_model.objects.filter(username=DEMO_USER).exists():
            user_model.objects.create_superuser(DEMO_USER, "admin@example.com", DEMO_PASSWORD)
        if not Product.objects.exists():
            Product.objects.bulk_create(Product(name=n, stock=s) for n, s in PRODUCTS.items())
