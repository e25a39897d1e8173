"""Force-release of quorum (Redlock) locks: on every master, or a clear refusal or error.

Three redis-server processes are the masters ``m1``..``m3``; ``q`` is an
alias whose MUTEX block names them as its QUORUM, on m1's server, as the README
configures one. ``m3`` has its own KEY_PREFIX, so a reset that used one
namespace for every master would miss its copy. A quorum lock's holder renews it on a
majority, so a reset that cleared fewer masters would report "Released" while
the lock stays held; every test checks the keys on each master directly.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.test import Client

from django_redis_mutex import (
    LockBackendUnavailable,
    LockError,
    LockNotOwned,
    Mutex,
    held_locks,
    reset,
    reset_all,
)
from django_redis_mutex.client import namespace
from django_redis_mutex.introspection import listed_locks
from django_redis_mutex.keys import LockKeys
from django_redis_mutex.testing import RedisServer

from .helpers import ROOT, wait_until
from .topologies import LOADED_QUORUM_TIMEOUT, extra_caches, master_entries, redis_servers
from .worker import Worker

ALIASES = ["m1", "m2", "m3"]
QUORUM = "q"
LIST_URL = "/admin/django_redis_mutex/lock/"
RELEASE_URL = LIST_URL + "release/"
# Generous for a busy 2-core machine; a healthy run needs a fraction of it.
STEP = 30.0

# A real OS process holding a quorum lock with its watchdog on. It reports
# "acquired", then "watchdog_lost" if its watchdog finds the lock gone, and
# leaves its block when the test writes a line on its stdin ("left", with
# LockLost when the with statement raised it).
HOLDER = r"""
import json
import os
import sys

from django.conf import settings

settings.CACHES = {**settings.CACHES, **json.loads(sys.argv[1])}

import django

django.setup()

from django_redis_mutex import LockLost, mutex
from django_redis_mutex.signals import lock_lost


def emit(event, **data):
    sys.stdout.write(json.dumps({"event": event, "pid": os.getpid(), **data}) + "\n")
    sys.stdout.flush()


def on_lost(sender, name, fence, **kwargs):
    emit("watchdog_lost", name=name, fence=fence)


lock_lost.connect(on_lost)
name, using, ttl = sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
try:
    with mutex(name, using=using, ttl=ttl, timeout=10) as lock:
        emit("acquired", fence=lock.fence, token=lock.token)
        sys.stdin.readline()
except LockLost as exc:
    emit("left", outcome="LockLost", message=str(exc))
else:
    emit("left", outcome="released")
"""


# -- servers and settings ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    with redis_servers(len(ALIASES)) as servers:
        yield servers


def quorum_entries(masters: list[RedisServer], prefix: str) -> dict[str, dict[str, Any]]:
    """Return the CACHES entries m1..m3 and q (QUORUM over them) for this test's namespace."""
    deadline = LOADED_QUORUM_TIMEOUT
    entries = master_entries(masters, ALIASES, prefix, TIMEOUT=2, QUORUM_TIMEOUT=deadline)
    entries["m3"]["KEY_PREFIX"] = "tests-m3"
    entries[QUORUM] = {
        **copy.deepcopy(entries["m1"]),
        "MUTEX": {"PREFIX": prefix, "QUORUM": ALIASES, "TIMEOUT": 2, "QUORUM_TIMEOUT": deadline},
    }
    return entries


@pytest.fixture
def quorum(masters: list[RedisServer], mutex_prefix: str) -> Iterator[list[RedisServer]]:
    """The aliases m1..m3 and q in this test's namespace; killed masters are started again after."""
    with extra_caches(quorum_entries(masters, mutex_prefix)):
        yield masters
    for server in masters:
        if server.process is None:
            server.start()


@pytest.fixture
def held(quorum: list[RedisServer]) -> Iterator[list[Mutex]]:
    """Handles a test acquires; whatever is still held is released before the aliases go."""
    handles: list[Mutex] = []
    yield handles
    for handle in handles:
        with contextlib.suppress(LockError):
            handle.release()


def hold(held: list[Mutex], name: str, **options: Any) -> Mutex:
    """Acquire ``name`` at once (default: the quorum alias) and remember it for clean-up."""
    options.setdefault("using", QUORUM)
    lock = Mutex(name, **options)
    assert lock.acquire(blocking=False)
    held.append(lock)
    return lock


# -- looking behind the app's back -------------------------------------------------------------


def lock_key(alias: str, name: str) -> str:
    """The lock key of ``name`` on master ``alias``, in that master's own namespace."""
    return LockKeys.for_name(namespace(alias), name).lock


def tokens_on_masters(masters: list[RedisServer], name: str) -> list[str | None]:
    """Return the token at ``name``'s lock key on each master (None: no lock; "down": killed)."""
    found: list[str | None] = []
    for alias, server in zip(ALIASES, masters, strict=True):
        if server.process is None:
            found.append("down")
            continue
        client = redis.Redis(port=server.port, socket_timeout=2)
        try:
            token = client.hget(lock_key(alias, name), "token")
        finally:
            client.close()
        found.append(token.decode() if isinstance(token, bytes) else token)
    return found


def lock_keys_on(server: RedisServer, alias: str) -> list[bytes]:
    """Return every key of ``alias``'s lock namespace on ``server``."""
    client = redis.Redis(port=server.port, socket_timeout=2)
    try:
        return sorted(client.scan_iter(match=f"{namespace(alias)}:*"))
    finally:
        client.close()


def stays(check: Callable[[], bool], seconds: float, what: str) -> None:
    """Fail if ``check()`` is ever false during the next ``seconds`` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), what
        time.sleep(0.02)


def locks(*args: str) -> str:
    """Run ``manage.py locks`` in this process and return its stdout."""
    out = StringIO()
    call_command("locks", *args, stdout=out)
    return out.getvalue()


def locks_error(*args: str) -> tuple[str, str]:
    """Run ``manage.py locks`` expecting a CommandError; return (its message, stdout)."""
    out = StringIO()
    with pytest.raises(CommandError) as failure:
        call_command("locks", *args, stdout=out)
    return str(failure.value), out.getvalue()


# -- a holder in another process ---------------------------------------------------------------


@pytest.fixture
def holder(
    quorum: list[RedisServer], mutex_prefix: str
) -> Iterator[Callable[[str, Any, float], tuple[Worker, subprocess.Popen[str]]]]:
    """Start HOLDER processes on the quorum's settings; kill whatever is left of them after."""
    started: list[tuple[Worker, subprocess.Popen[str]]] = []
    caches = json.dumps(quorum_entries(quorum, mutex_prefix))
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))

    def start(name: str, using: Any, ttl: float) -> tuple[Worker, subprocess.Popen[str]]:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, caches, name, json.dumps(using), str(ttl)],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append((Worker("quorum holder", process), process))
        return started[-1]

    yield start
    for worker, process in started:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        worker.close()


def let_go(process: subprocess.Popen[str]) -> None:
    """Tell a HOLDER process to leave its block."""
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


# -- reset() ----------------------------------------------------------------------------------


def test_reset_through_quorum_alias_frees_every_master_and_the_holder_loses_it(
    quorum: list[RedisServer], holder: Callable[..., tuple[Worker, subprocess.Popen[str]]]
) -> None:
    ttl = 6.0  # renewed every 2 s, so the watchdog runs within the test's wait
    worker, process = holder("payments", QUORUM, ttl)
    token = worker.expect("acquired")["token"]
    assert tokens_on_masters(quorum, "payments") == [token] * 3

    assert reset("payments", using=QUORUM) is True

    assert tokens_on_masters(quorum, "payments") == [None] * 3
    successor = Mutex("payments", using=QUORUM, ttl=60, watchdog=False)
    assert successor.acquire(blocking=False), "the freed lock was not available at once"
    try:
        # The holder's watchdog renews within ttl/3: it must find the lock
        # gone and give up, never re-create or extend it.
        worker.expect("watchdog_lost", timeout=STEP)
        stays(
            lambda: tokens_on_masters(quorum, "payments") == [successor.token] * 3,
            ttl / 3 + 1,
            "a master no longer shows the new owner's token",
        )
        let_go(process)
        assert worker.expect("left")["outcome"] == "LockLost"
        assert worker.finish() == 0
        assert successor.owned()
    finally:
        successor.release()


def test_reset_through_a_list_of_aliases(quorum: list[RedisServer], held: list[Mutex]) -> None:
    lock = hold(held, "report", using=ALIASES, watchdog=False, ttl=60)
    assert tokens_on_masters(quorum, "report") == [lock.token] * 3

    assert reset("report", using=ALIASES) is True

    assert tokens_on_masters(quorum, "report") == [None] * 3
    with pytest.raises(LockNotOwned):
        lock.release()
    assert reset("report", using=ALIASES) is False
    assert reset("report", using=QUORUM) is False


def test_bad_alias_lists_are_rejected(quorum: list[RedisServer]) -> None:
    with pytest.raises(ValueError, match="twice"):
        reset("x", using=["m1", "m1"])
    with pytest.raises(TypeError, match="aliases"):
        reset("x", using=["m1", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        reset_all(using=[])


def test_one_master_down_still_resets_the_majority(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    lock = hold(held, "batch", watchdog=False, ttl=60)
    quorum[2].kill()

    assert reset("batch", using=QUORUM) is True

    # The dead master's copy is one of three: it cannot make a majority.
    assert tokens_on_masters(quorum, "batch") == [None, None, "down"]
    assert not Mutex("batch", using=QUORUM).locked()
    with pytest.raises(LockNotOwned):
        lock.release()


def test_alias_that_lists_itself_in_its_quorum_resets_on_every_master(
    quorum: list[RedisServer], held: list[Mutex], mutex_prefix: str
) -> None:
    entries = quorum_entries(quorum, mutex_prefix)
    entries["m1"]["MUTEX"] = {"PREFIX": mutex_prefix, "QUORUM": ALIASES}
    with extra_caches(entries):
        lock = Mutex("self-member", using="m1", watchdog=False, ttl=60)
        assert lock.acquire(blocking=False)
        try:
            assert tokens_on_masters(quorum, "self-member") == [lock.token] * 3
            assert reset("self-member", using="m1") is True
            assert tokens_on_masters(quorum, "self-member") == [None] * 3
        finally:
            with contextlib.suppress(LockNotOwned):
                lock.release()


# -- held_locks() -------------------------------------------------------------------------------


def test_held_locks_lists_a_quorum_lock_once_with_its_fence_and_owner(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    lock = hold(held, "nightly", label="nightly import", ttl=20)
    hold(held, "m1-only", using="m1")  # a plain lock on one member: no majority

    [found] = held_locks(using=QUORUM)

    assert found.name == "nightly"
    assert found.fence == lock.fence
    assert found.owner.label == "nightly import"
    assert found.owner.pid == os.getpid()
    assert found.masters == 3
    assert 0 < found.time_left <= 20
    assert [h.name for h in held_locks(using=ALIASES)] == ["nightly"]
    out = locks("--using", QUORUM)
    assert [line.split()[0] for line in out.splitlines()[2:-1]] == ["nightly"]
    assert out.splitlines()[-1] == "1 lock held in cache 'q' (on a majority of m1, m2, m3)."
    [item] = json.loads(locks("--using", QUORUM, "--json"))
    assert (item["name"], item["fence"], item["masters"]) == ("nightly", lock.fence, 3)


def test_held_locks_lists_each_shared_holder_a_majority_holds(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    readers = [hold(held, "report", shared=True, watchdog=False, ttl=60) for _ in range(4)]
    # Each master holds another set of readers; the first three are on a majority each.
    drop = {"m1": readers[1:2] + readers[3:], "m2": readers[3:], "m3": readers[2:3]}
    for alias, server in zip(ALIASES, quorum, strict=True):
        client = redis.Redis(port=server.port, socket_timeout=2)
        try:
            client.hdel(lock_key(alias, "report"), *(f"r:{reader.token}" for reader in drop[alias]))
        finally:
            client.close()

    [found] = listed_locks(using=QUORUM)

    assert found.held.shared and found.held.masters == 3
    assert sorted(found.token.split()) == sorted(str(r.token) for r in readers[:3])


# -- manage.py locks ----------------------------------------------------------------------------


def test_command_reset_through_quorum_alias_frees_every_master(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    # Held with the watchdog on, in this process: the reset must beat its renewals.
    lock = hold(held, "imports", ttl=3)

    out = locks("--using", QUORUM, "--reset", "imports")

    assert out.splitlines() == ["Released 'imports'."]
    assert tokens_on_masters(quorum, "imports") == [None] * 3
    wait_until(lambda: lock.lost, STEP, "the watchdog to notice the reset")
    assert tokens_on_masters(quorum, "imports") == [None] * 3
    with pytest.raises(LockNotOwned):
        lock.release()


def test_command_reset_all_through_quorum_alias_counts_each_name_once(
    quorum: list[RedisServer], held: list[Mutex], mutex_prefix: str
) -> None:
    for name in ("shared-name", "reports", "{braces}*?"):
        hold(held, name, watchdog=False, ttl=60)
    hold(held, "m1-only", using="m1", watchdog=False, ttl=60)
    # Keys on m2 that are not this quorum's locks: they must survive.
    lookalikes = [f"{namespace('m2')}:not-a-lock", f"{namespace('m2')}x:{{n}}"]
    client = redis.Redis(port=quorum[1].port, socket_timeout=2)
    # Another namespace on m2's server (another KEY_PREFIX), holding the same name.
    other = {**quorum_entries(quorum, mutex_prefix)["m2"], "KEY_PREFIX": "tests-other"}
    with extra_caches({"other": other}):
        keep = Mutex("shared-name", using="other", watchdog=False, ttl=60)
        assert keep.acquire(blocking=False)
        try:
            client.set(lookalikes[0], 1)
            client.hset(lookalikes[1], mapping={"token": "abc", "name": "n"})

            out = locks("--using", QUORUM, "--reset-all", "--noinput")

            assert out == "Released 4 locks in cache 'q'.\n"
            assert held_locks(using=QUORUM) == []
            for alias, server in zip(ALIASES, quorum, strict=True):
                # Fence counters stay (fences must keep growing); no lock hash does.
                assert [k for k in lock_keys_on(server, alias) if k.endswith(b"}")] == [], alias
            assert client.exists(*lookalikes) == 2
            assert keep.owned()
            assert [h.name for h in held_locks(using="other")] == ["shared-name"]
        finally:
            with contextlib.suppress(LockNotOwned):
                keep.release()
            client.delete(*lookalikes)
            client.close()


# -- a member alias is refused ------------------------------------------------------------------


def test_member_alias_is_refused_and_nothing_is_deleted(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    lock = hold(held, "inventory", watchdog=False, ttl=60)
    refusal = "Cache alias 'm1' is a member of quorum 'q'; reset the lock through 'q'"

    with pytest.raises(ValueError, match=refusal):
        reset("inventory", using="m1")
    with pytest.raises(ValueError, match=refusal):
        reset_all(using="m1")
    for args in (("--reset", "inventory"), ("--reset-all", "--noinput"), ("--reset-all",)):
        message, out = locks_error("--using", "m1", *args)
        assert message.startswith(refusal), message
        assert "Released" not in out

    assert tokens_on_masters(quorum, "inventory") == [lock.token] * 3
    assert lock.owned()
    # Listing one member stays allowed: it only reads.
    assert [h.name for h in held_locks(using="m1")] == ["inventory"]


# -- too many masters down ----------------------------------------------------------------------


def test_two_masters_down_raises_and_nothing_claims_released(
    quorum: list[RedisServer], held: list[Mutex]
) -> None:
    hold(held, "ledger", watchdog=False, ttl=60)
    quorum[0].kill()
    quorum[1].kill()

    with pytest.raises(LockBackendUnavailable, match=r"2 of 3 Redis masters") as failure:
        reset("ledger", using=QUORUM)
    assert "m1: " in str(failure.value) and "m2: " in str(failure.value)
    assert failure.value.name == "ledger"
    with pytest.raises(LockBackendUnavailable, match=r"2 of 3 Redis masters"):
        reset_all(using=QUORUM)
    with pytest.raises(LockBackendUnavailable, match=r"2 of 3 Redis masters"):
        held_locks(using=QUORUM)
    for args in (("--reset", "ledger"), ("--reset-all", "--noinput"), ()):
        message, out = locks_error("--using", QUORUM, *args)
        assert "2 of 3 Redis masters could not be reached" in message, message
        assert "m1: " in message and "m2: " in message
        assert "Released" not in out


# -- the admin ----------------------------------------------------------------------------------


@pytest.fixture
def superuser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password=None))
    return client


def _messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.mark.django_db
def test_admin_lists_and_releases_a_quorum_lock_on_every_master(
    quorum: list[RedisServer], held: list[Mutex], superuser: Client
) -> None:
    lock = hold(held, "orders:7", ttl=3)  # the watchdog keeps renewing it

    page = superuser.get(LIST_URL, {"using": QUORUM})
    assert QUORUM in page.context["aliases"]
    [row] = page.context["locks"]
    assert (row["name"], row["fence"]) == ("orders:7", lock.fence)
    confirm = superuser.get(row["release_url"])
    assert [r["name"] for r in confirm.context["locks"]] == ["orders:7"]

    response = superuser.post(RELEASE_URL, {"using": QUORUM, "name": "orders:7"}, follow=True)

    assert _messages(response) == ["Released 1 lock."]
    assert response.context["locks"] == []
    assert tokens_on_masters(quorum, "orders:7") == [None] * 3
    wait_until(lambda: lock.lost, STEP, "the watchdog to notice the release")
    assert tokens_on_masters(quorum, "orders:7") == [None] * 3
    assert LogEntry.objects.count() == 1


@pytest.mark.django_db
def test_admin_refuses_to_release_through_a_member_alias(
    quorum: list[RedisServer], held: list[Mutex], superuser: Client
) -> None:
    lock = hold(held, "orders:8", watchdog=False, ttl=60)
    for send in (superuser.get, superuser.post):
        response = send(RELEASE_URL, {"using": "m2", "name": "orders:8"}, follow=True)
        [message] = _messages(response)
        assert message.startswith("Cache alias 'm2' is a member of quorum 'q'"), message
    assert tokens_on_masters(quorum, "orders:8") == [lock.token] * 3
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_admin_release_with_two_masters_down_reports_no_release(
    quorum: list[RedisServer], held: list[Mutex], superuser: Client
) -> None:
    hold(held, "orders:9", watchdog=False, ttl=60)
    quorum[0].kill()
    quorum[2].kill()

    response = superuser.post(RELEASE_URL, {"using": QUORUM, "name": "orders:9"}, follow=True)

    [message] = _messages(response)
    assert "2 of 3 Redis masters could not be reached" in message
    assert "Released" not in message
    assert not LogEntry.objects.exists()
