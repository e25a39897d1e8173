"""Locks that protect the data: held until the database transaction around them ends.

Every test here checks rows, not code sections: concurrent read-modify-writes
of one counter row under the lock, on SQLite, PostgreSQL and MariaDB (servers
the suite starts itself, see tests/databases.py), in the three shapes users
write (a view under ``ATOMIC_REQUESTS``, a lock inside ``transaction.atomic()``,
a decorated model method inside it). Each shape is first run with the lock
given back at the end of its block (``release_at_block_end=True``, how every
lock behaved before), to show that the test can see lost updates; then as the
lock now behaves, with none lost.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.db.models import F
from django.test import Client

from django_redis_mutex import (
    LockAfterReadWarning,
    LockLost,
    Mutex,
    Semaphore,
    held_locks,
    held_semaphores,
    mutex,
    reset,
    semaphore,
    signals,
)
from django_redis_mutex.testing import RedisServer
from tests.testapp.models import Counter

from .databases import MariaDBServer, PostgresServer, configured, create_database
from .helpers import wait_until
from .test_declared_keys import Monitor, monitored  # noqa: F401  (the imported fixture)
from .worker import Worker

DATABASES = ["sqlite", "postgresql", "mariadb"]
THREADS = 4
ROUNDS = 12
# Between each read and its write: wide enough that a next holder let in
# before the COMMIT reads the old value.
PAUSE = 0.004
STEP_TIMEOUT = 30.0
# SQLite's busy timeout: a control run that lets two writers into one file
# fails fast instead of waiting out the default.
SQLITE_BUSY = 2.0


@pytest.fixture(scope="module", params=DATABASES)
def alias(
    request: pytest.FixtureRequest,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A database holding the Counter table, reachable as an alias of its own."""
    name = f"tx_{request.param}"
    with django_db_blocker.unblock():
        entry = _database_entry(request, request.param, tmp_path_factory)
        connections.settings[name] = configured(entry, name)
        try:
            with connections[name].schema_editor() as editor:
                editor.create_model(Counter)
            yield name
        finally:
            for connection in connections.all(initialized_only=True):
                if connection.alias == name:
                    connection.close()
            del connections[name]
            del connections.settings[name]


def _database_entry(
    request: pytest.FixtureRequest, vendor: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    if vendor == "sqlite":
        path = tmp_path_factory.mktemp("transactions") / "db.sqlite3"
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(path),
            "OPTIONS": {"timeout": SQLITE_BUSY},
        }
    if vendor == "postgresql":
        server: PostgresServer | MariaDBServer = request.getfixturevalue("postgres_server")
        return server.django_settings(create_database(server, "postgres"))
    server = request.getfixturevalue("mariadb_server")
    return server.django_settings(create_database(server, ""))


@pytest.fixture
def row(alias: str, django_db_blocker: Any) -> Iterator[int]:
    """The primary key of a fresh counter row at 0 on ``alias``."""
    with django_db_blocker.unblock():
        Counter.objects.using(alias).all().delete()
        pk = Counter.objects.using(alias).create(name="stock", value=0).pk
        yield pk
        _close_connections()


@pytest.fixture
def second_alias(django_db_blocker: Any, tmp_path: Any) -> Iterator[str]:
    """Another database (a SQLite file), for transactions open on two aliases at once."""
    name = "tx_second"
    entry = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "second.sqlite3")}
    with django_db_blocker.unblock():
        connections.settings[name] = configured(entry, name)
        try:
            with connections[name].schema_editor() as editor:
                editor.create_model(Counter)
            yield name
        finally:
            _close_connections()
            del connections[name]
            del connections.settings[name]


@pytest.fixture
def atomic_requests(alias: str) -> Iterator[None]:
    """Turn ATOMIC_REQUESTS on for ``alias`` during the test, as a project's settings would."""
    settings = connections.settings[alias]
    settings["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        settings["ATOMIC_REQUESTS"] = False


def _close_connections() -> None:
    for connection in connections.all(initialized_only=True):
        connection.close()


def value_of(alias: str, pk: int) -> int:
    return int(Counter.objects.using(alias).values_list("value", flat=True).get(pk=pk))


@dataclass
class Outcome:
    """What concurrent bumps did: how many said they committed, and what they raised."""

    committed: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_concurrently(bump: Callable[[], Any], django_db_blocker: Any) -> Outcome:
    """Run ``bump`` ROUNDS times in each of THREADS threads, all started at once."""
    outcome = Outcome()
    start = threading.Barrier(THREADS)

    def thread() -> None:
        try:
            start.wait(timeout=STEP_TIMEOUT)
            for _ in range(ROUNDS):
                try:
                    bump()
                except Exception as exc:  # a database error is an outcome to count
                    with outcome.lock:
                        outcome.errors.append(exc)
                else:
                    with outcome.lock:
                        outcome.committed += 1
        finally:
            _close_connections()

    with django_db_blocker.unblock():
        threads = [threading.Thread(target=thread) for _ in range(THREADS)]
        for started in threads:
            started.start()
        for started in threads:
            started.join(timeout=STEP_TIMEOUT * 4)
        assert not any(t.is_alive() for t in threads), "a bumping thread never finished"
    return outcome


def assert_data_wrong(outcome: Outcome, final: int) -> None:
    """The control run: the row lost updates, or the database refused some of them."""
    assert final < outcome.committed or outcome.errors, (
        f"the control run kept every update ({final} of {outcome.committed}): "
        "this test could not see a lost update"
    )


def assert_data_right(outcome: Outcome, final: int) -> None:
    assert not outcome.errors, outcome.errors[:3]
    assert outcome.committed == THREADS * ROUNDS
    assert final == THREADS * ROUNDS, f"{THREADS * ROUNDS - final} updates lost"


def _bump_in_atomic(alias: str, pk: int, **options: Any) -> Callable[[], None]:
    def bump() -> None:
        with transaction.atomic(using=alias):
            with mutex(f"rows:{alias}:{pk}", timeout=60, **options):
                value = value_of(alias, pk)
                threading.Event().wait(PAUSE)
                Counter.objects.using(alias).filter(pk=pk).update(value=value + 1)
            # More work in the transaction after the locked section (rendering,
            # logging): before the COMMIT.
            threading.Event().wait(PAUSE)

    return bump


# -- the three shapes, each with its control ----------------------------------


def test_a_lock_given_back_inside_the_transaction_loses_updates(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    outcome = run_concurrently(
        _bump_in_atomic(alias, row, release_at_block_end=True), django_db_blocker
    )
    with django_db_blocker.unblock():
        assert_data_wrong(outcome, value_of(alias, row))


def test_a_lock_inside_a_transaction_is_kept_until_it_commits(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    outcome = run_concurrently(_bump_in_atomic(alias, row), django_db_blocker)
    with django_db_blocker.unblock():
        assert_data_right(outcome, value_of(alias, row))


def _method_bump(alias: str, pk: int, method: str) -> Callable[[], None]:
    # The instance is loaded before the transaction: the lock is the first
    # thing the transaction does (reading the row inside it first would let
    # the transaction see an older row, lock or no lock; see the docs).
    def bump() -> None:
        counter = Counter.objects.using(alias).get(pk=pk)
        with transaction.atomic(using=alias):
            getattr(counter, method)(pause=PAUSE)
            threading.Event().wait(PAUSE)  # more work before the COMMIT

    return bump


def test_a_decorated_method_giving_back_inside_the_transaction_loses_updates(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    outcome = run_concurrently(
        _method_bump(alias, row, "bump_releasing_at_block_end"), django_db_blocker
    )
    with django_db_blocker.unblock():
        assert_data_wrong(outcome, value_of(alias, row))


def test_a_decorated_method_inside_a_transaction_keeps_its_lock_until_the_commit(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    outcome = run_concurrently(_method_bump(alias, row, "bump"), django_db_blocker)
    with django_db_blocker.unblock():
        assert_data_right(outcome, value_of(alias, row))


def _view_bump(path: str) -> Callable[[], None]:
    local = threading.local()

    def bump() -> None:
        client = getattr(local, "client", None) or Client()
        local.client = client
        response = client.post(f"{path}?pause={PAUSE}")
        if response.status_code != 200:
            raise AssertionError(f"{path} answered {response.status_code}")

    return bump


def test_a_view_whose_lock_sits_inside_the_request_transaction_loses_updates(
    alias: str, row: int, atomic_requests: None, django_db_blocker: Any
) -> None:
    outcome = run_concurrently(_view_bump(f"/rows/{alias}/{row}/bump-early/"), django_db_blocker)
    with django_db_blocker.unblock():
        assert_data_wrong(outcome, value_of(alias, row))


@pytest.mark.parametrize("kind", ["bump", "bump-class"])
def test_a_locked_view_under_atomic_requests_loses_no_update(
    alias: str, row: int, atomic_requests: None, django_db_blocker: Any, kind: str
) -> None:
    outcome = run_concurrently(_view_bump(f"/rows/{alias}/{row}/{kind}/"), django_db_blocker)
    with django_db_blocker.unblock():
        assert_data_right(outcome, value_of(alias, row))


@pytest.mark.parametrize("kind", ["bump", "bump-class", "bump-unless-busy"])
def test_a_locked_view_takes_its_lock_before_the_request_transaction_begins(
    alias: str, row: int, atomic_requests: None, django_db_blocker: Any, kind: str
) -> None:
    seen: list[tuple[bool, bool]] = []

    def acquired(sender: str, name: str, **kwargs: Any) -> None:
        seen.append((name == f"rows:{alias}:{row}", connections[alias].in_atomic_block))

    signals.lock_acquired.connect(acquired)
    try:
        with django_db_blocker.unblock():
            response = Client().post(f"/rows/{alias}/{row}/{kind}/")
            assert response.status_code == 200
            assert value_of(alias, row) == 1
    finally:
        signals.lock_acquired.disconnect(acquired)
    assert seen == [(True, False)], "the lock was taken inside the request's transaction"


# -- when the lock comes back --------------------------------------------------


def _free_for_others(name: str, limit: int | None = None) -> bool:
    """Return True if another thread can take ``name`` at once (and gives it back).

    A lock, or with ``limit`` a permit of the semaphore ``name``.
    """
    answer: list[bool] = []

    def other() -> None:
        handle: Any = (
            Mutex(name, blocking=False) if limit is None else Semaphore(name, limit, blocking=False)
        )
        answer.append(handle.acquire())
        if answer[-1]:
            handle.release()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(STEP_TIMEOUT)
    return answer == [True]


class Boom(Exception):
    """Raised inside a transaction to roll it back."""


def test_the_lock_is_free_at_once_after_the_commit(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with mutex(name, ttl=30):
                Counter.objects.using(alias).filter(pk=row).update(value=7)
            assert not _free_for_others(name), "given back before the transaction ended"
        assert _free_for_others(name), "still held after the COMMIT"
        assert value_of(alias, row) == 7


def _redis_round_trips(server: RedisServer, action: Callable[[], None]) -> list[str]:
    """Run ``action``; return the commands it sent to ``server`` (not those scripts ran).

    The monitor's own stop marker comes on a connection of its own, whose
    greeting (HELLO) is left out too.
    """
    monitor = Monitor(server.port)
    try:
        action()
    finally:
        commands = monitor.stop()
    return [
        command.name for command in commands if command.source != "lua" and command.name != "HELLO"
    ]


def test_a_transaction_costs_a_lock_one_round_trip_and_no_transaction_none(
    alias: str,
    row: int,
    django_db_blocker: Any,
    monitored: tuple[RedisServer, Any],  # noqa: F811  (the imported fixture)
) -> None:
    server, _ = monitored
    name = f"rows:{alias}:{row}"

    def bump() -> None:
        with mutex(name, ttl=30):
            Counter.objects.using(alias).filter(pk=row).update(value=F("value") + 1)

    def bump_in_transaction() -> None:
        with transaction.atomic(using=alias):
            bump()

    with django_db_blocker.unblock():
        bump()  # every script loaded, connections made: the runs below are steady
        bump_in_transaction()
        outside = _redis_round_trips(server, bump)
        inside = _redis_round_trips(server, bump_in_transaction)
        assert value_of(alias, row) == 4
    # Take and give back; in a transaction, the mark of the kept hold as well
    # (the give-back itself is only put off to the commit).
    assert outside == ["EVALSHA", "EVALSHA"]
    assert inside == ["EVALSHA", "EVALSHA", "EVALSHA"]
    assert _free_for_others(name)


def test_the_lock_is_free_at_once_after_a_rollback(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with pytest.raises(Boom), transaction.atomic(using=alias):
            with mutex(name, ttl=30):
                Counter.objects.using(alias).filter(pk=row).update(value=7)
            assert not _free_for_others(name)
            raise Boom
        # Long before the 30 s lease: Django's rollback gave it back.
        assert _free_for_others(name), "still held after the ROLLBACK"
        assert value_of(alias, row) == 0


def test_a_rolled_back_savepoint_keeps_the_lock_while_the_outer_transaction_goes_on(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with pytest.raises(Boom), transaction.atomic(using=alias):
                with mutex(name, ttl=30):
                    Counter.objects.using(alias).filter(pk=row).update(value=2)
                raise Boom
            assert not _free_for_others(name), "given back by the savepoint's rollback"
            Counter.objects.using(alias).filter(pk=row).update(value=1)
            with transaction.atomic(using=alias), mutex(name, ttl=30, timeout=2):
                pass  # the same thread takes it again in its transaction: no self-deadlock
            assert not _free_for_others(name)
        assert _free_for_others(name), "still held after the outer COMMIT"
        assert value_of(alias, row) == 1


def test_a_lock_waits_for_every_database_with_an_open_transaction(
    alias: str, row: int, second_alias: str, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with transaction.atomic(using=second_alias), mutex(name, ttl=30):
                Counter.objects.using(alias).filter(pk=row).update(value=3)
            assert not _free_for_others(name), "given back when only one transaction ended"
        assert _free_for_others(name)


def test_taking_the_lock_again_in_the_same_transaction_joins_the_kept_hold(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock(), transaction.atomic(using=alias):
        with mutex(name) as first:
            fence = first.fence
        with mutex(name, timeout=2, reentrant=False) as again:
            assert again.fence == fence
        assert not _free_for_others(name)
    assert _free_for_others(name)


def test_a_semaphore_permit_inside_a_transaction_is_kept_until_it_ends(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"permits:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with semaphore(name, 1):
                Counter.objects.using(alias).filter(pk=row).update(value=5)
            assert not _free_for_others(name, 1), "the permit went back before the COMMIT"
            [held] = [sem for sem in held_semaphores() if sem.name == name]
            assert held.holders[0].owner.transaction == (alias,)
            assert f"kept until its transaction on {alias} ends" in admin_locks_page()
        assert _free_for_others(name, 1)
        with pytest.raises(Boom), transaction.atomic(using=alias):
            with semaphore(name, 1):
                pass
            raise Boom
        assert _free_for_others(name, 1), "the permit stayed taken after the ROLLBACK"
        with transaction.atomic(using=alias):
            with semaphore(name, 1, release_at_block_end=True):
                pass
            assert _free_for_others(name, 1)


def test_a_shared_hold_inside_a_transaction_keeps_writers_out_until_it_ends(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with mutex(name, shared=True):
                assert value_of(alias, row) == 0
            assert not _free_for_others(name), "a writer got in before the reader's COMMIT"
            with mutex(name, shared=True, timeout=2):
                pass  # the reader reads again in its transaction: no self-deadlock
        assert _free_for_others(name)


def test_a_lock_taken_after_the_transaction_read_warns_with_the_fix(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        warned = pytest.warns(LockAfterReadWarning, match="Take the lock before the transaction")
        with warned, transaction.atomic(using=alias):
            value_of(alias, row)
            with mutex(name):
                pass
        with pytest.warns(LockAfterReadWarning, match=repr(alias)), transaction.atomic(alias):
            value_of(alias, row)
            with semaphore(name, 2):
                pass


def test_a_read_in_an_earlier_call_of_an_atomic_function_does_not_warn(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    # One Atomic object serves every call of a decorated function.
    @transaction.atomic(using=alias)
    def read_then_lock(first: bool) -> None:
        if first:
            value_of(alias, row)
        else:
            with mutex(f"rows:{alias}:{row}"):
                value_of(alias, row)

    with django_db_blocker.unblock(), warnings.catch_warnings():
        warnings.simplefilter("error", LockAfterReadWarning)
        read_then_lock(True)
        read_then_lock(False)


def test_a_lock_taken_first_in_its_transaction_does_not_warn(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock(), warnings.catch_warnings():
        warnings.simplefilter("error", LockAfterReadWarning)
        value_of(alias, row)  # outside any transaction: nothing to protect
        # Savepoints of nested blocks read nothing.
        with transaction.atomic(using=alias), transaction.atomic(using=alias):
            with mutex(name):
                value_of(alias, row)
            with mutex(name):  # taken again after reading under it: still ours
                pass
        with transaction.atomic(using=alias), semaphore(name, 2):
            value_of(alias, row)


def admin_locks_page() -> str:
    """Render the admin Locks page for a superuser (kept in memory: no database of users)."""
    from django.contrib.auth.models import User
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.test import RequestFactory
    from django.urls import resolve

    request = RequestFactory().get("/admin/django_redis_mutex/lock/")
    request.user = User(username="root", is_staff=True, is_superuser=True, is_active=True)
    request.session = {}  # type: ignore[assignment]
    request._messages = FallbackStorage(request)  # type: ignore[attr-defined]
    response = resolve(request.path).func(request)
    assert response.status_code == 200
    response.render()
    return str(response.content.decode())


def test_a_kept_lock_says_so_in_listings_the_locks_command_and_the_admin(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    waiting = f"kept until its transaction on {alias} ends"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with mutex(name, label="reserve"):
                [listed] = [lock for lock in held_locks() if lock.name == name]
                assert listed.owner.transaction == ()  # the block still runs
            [listed] = [lock for lock in held_locks() if lock.name == name]
            assert listed.owner.transaction == (alias,)
            assert listed.owner.label == "reserve"
            assert waiting in str(listed.owner)
            out = io.StringIO()
            call_command("locks", stdout=out)
            assert waiting in out.getvalue()
            out = io.StringIO()
            call_command("locks", "--json", stdout=out)
            [entry] = [e for e in json.loads(out.getvalue()) if e["name"] == name]
            assert entry["owner"]["transaction"] == [alias]
            assert waiting in admin_locks_page()
        assert name not in [lock.name for lock in held_locks()]


def test_a_kept_shared_hold_says_so_in_its_holder_record(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock(), transaction.atomic(using=alias):
        with mutex(name, shared=True):
            pass
        [listed] = [lock for lock in held_locks() if lock.name == name]
        [holder] = listed.holders
        assert holder.owner.transaction == (alias,)


@pytest.mark.parametrize("noticed", [False, True], ids=["found-at-exit", "noticed-before"])
def test_a_lock_lost_inside_its_transaction_raises_and_the_transaction_rolls_back(
    alias: str, row: int, django_db_blocker: Any, noticed: bool
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        locked = mutex(name, ttl=1, watchdog=noticed)
        with pytest.raises(LockLost), transaction.atomic(using=alias), locked as lock:
            Counter.objects.using(alias).filter(pk=row).update(value=9)
            assert reset(name)  # an operator takes it away
            if noticed:
                wait_until(lambda: lock.lost, 5, "the watchdog to notice the loss")
        # The block raised before the COMMIT: nothing written under the lost lock stays.
        assert value_of(alias, row) == 0
        assert _free_for_others(name)


def test_release_at_block_end_gives_the_lock_back_inside_the_transaction(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock(), transaction.atomic(using=alias):
        with mutex(name, release_at_block_end=True):
            pass
        assert _free_for_others(name)


def test_an_explicit_release_inside_a_transaction_waits_for_it_too(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    lock = Mutex(name)
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            assert lock.acquire()
            lock.release()
            assert lock.token is None  # the handle no longer holds it ...
            assert not _free_for_others(name)  # ... but the transaction does
        assert _free_for_others(name)


def test_signals_tell_a_kept_lock_and_its_real_release(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    events: list[tuple[str, Any]] = []

    def kept(sender: str, name: str, databases: tuple[str, ...], **kwargs: Any) -> None:
        events.append(("kept", databases))

    def released(sender: str, name: str, databases: tuple[str, ...], **kwargs: Any) -> None:
        events.append(("released", databases))

    signals.lock_held_for_transaction.connect(kept)
    signals.lock_released.connect(released)
    try:
        with django_db_blocker.unblock():
            with transaction.atomic(using=alias):
                with mutex(name):
                    pass
                assert events == [("kept", (alias,))]
            assert events == [("kept", (alias,)), ("released", (alias,))]
            with mutex(name):
                pass
            assert events[-1] == ("released", ())
    finally:
        signals.lock_held_for_transaction.disconnect(kept)
        signals.lock_released.disconnect(released)


def test_the_watchdog_renews_a_lock_kept_for_a_long_transaction(
    alias: str, row: int, django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    with django_db_blocker.unblock():
        with transaction.atomic(using=alias):
            with mutex(name, ttl=1):
                pass
            lock = Mutex(name)
            # Well past the 1 s lease: still held, renewed by the watchdog.
            threading.Event().wait(2.5)
            assert lock.locked()
        wait_until(lambda: not lock.locked(), timeout=1, what="the release after the COMMIT")


# -- real processes ------------------------------------------------------------


def _entry(alias: str) -> str:
    return json.dumps(connections.settings[alias])


def test_processes_bumping_inside_their_transactions_lose_no_update(
    alias: str, row: int, spawn: Callable[..., Worker], raw: Any, django_db_blocker: Any
) -> None:
    start_key = f"tx:{uuid.uuid4().hex}:start"
    rounds = 10
    workers = [
        spawn("tx_counter.py", "bump", f"rows:{alias}:{row}", row, rounds, _entry(alias), start_key)
        for _ in range(3)
    ]
    for worker in workers:
        worker.expect("ready")
    raw.rpush(start_key, *["go"] * len(workers))
    for worker in workers:
        assert worker.expect("done", timeout=120)["bumps"] == rounds
        assert worker.finish() == 0
    with django_db_blocker.unblock():
        assert value_of(alias, row) == rounds * len(workers)


def test_a_process_killed_inside_its_transaction_gives_back_lock_and_row(
    alias: str, row: int, spawn: Callable[..., Worker], django_db_blocker: Any
) -> None:
    name = f"rows:{alias}:{row}"
    worker = spawn("tx_counter.py", "die", name, row, 0, _entry(alias), 2)
    worker.expect("inside")
    assert not _free_for_others(name), "the lock went back before the transaction ended"
    worker.process.send_signal(signal.SIGKILL)
    worker.process.wait(STEP_TIMEOUT)
    # The lease (2 s) ends the lock; the dead connection ends the transaction
    # and its row lock, and the database rolled the write back.
    wait_until(lambda: _free_for_others(name), timeout=10, what="the lock after the lease")
    with django_db_blocker.unblock(), transaction.atomic(using=alias):
        Counter.objects.using(alias).filter(pk=row).update(value=10)
    with django_db_blocker.unblock():
        assert value_of(alias, row) == 10


@pytest.mark.django_db
def test_a_test_cases_own_transaction_does_not_keep_a_lock() -> None:
    # pytest-django wraps this test in a transaction that is never committed.
    assert connections["default"].in_atomic_block
    with mutex("test-case"):
        pass
    assert _free_for_others("test-case")


@pytest.mark.django_db(transaction=True)
def test_a_transaction_opened_in_a_transactional_test_keeps_the_lock() -> None:
    with transaction.atomic():
        with mutex("transactional-test"):
            pass
        assert not _free_for_others("transactional-test")
    assert _free_for_others("transactional-test")
