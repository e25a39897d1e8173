"""Fencing tokens checked by the database: ``FencedModel`` on SQLite and PostgreSQL.

Every test runs against both databases through a connection alias of its own
(a SQLite file, so worker processes can share it, and a throwaway PostgreSQL
database), created for this module and removed after it; the suite's default
in-memory database is not involved. PostgreSQL is taken from
DJANGO_REDIS_MUTEX_TEST_POSTGRES (default ``postgresql://postgres@127.0.0.1:5432/test``,
used only to create and drop the throwaway database); its tests skip, saying
why, when no PostgreSQL driver is installed or the server does not answer.

Locks are real (the session's redis-server), and so is the fault at the end: a
holder process is SIGSTOPped past its lease while another process takes the
lock and writes, then resumed to write late.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import redis
from django.db import OperationalError, connections, transaction
from django.db.utils import load_backend

from django_redis_mutex import LockNotOwned, Mutex, StaleFence, mutex
from tests.testapp.models import FencedRecord

from .worker import Worker

POSTGRES_URL = os.environ.get(
    "DJANGO_REDIS_MUTEX_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)
# A realistic token (microseconds since the epoch): past 32 bits, so a column
# too narrow for it fails here, not in production.
FENCE = 1_795_314_190_355_281
START_TIMEOUT = 30.0
STEP_TIMEOUT = 30.0


@dataclass(frozen=True)
class Database:
    """A database the module's tests write to: its alias here and its settings entry."""

    alias: str
    entry: dict[str, Any]


def _configured(entry: dict[str, Any], alias: str) -> dict[str, Any]:
    """Return ``entry`` with Django's defaults filled in (the handler insists on a default)."""
    return connections.configure_settings({"default": {}, alias: copy.deepcopy(entry)})[alias]


def _postgres_entry(name: str) -> dict[str, Any]:
    url = urlsplit(POSTGRES_URL)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
        "OPTIONS": {"connect_timeout": 3},
    }


@contextmanager
def _throwaway_postgres() -> Iterator[dict[str, Any]]:
    """Create a PostgreSQL database for this module; drop it (and its sessions) afterwards."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        try:
            import psycopg2  # noqa: F401
        except ImportError:
            pytest.skip("PostgreSQL tests need a driver: pip install 'psycopg[binary]'")
    entry = _configured(_postgres_entry(urlsplit(POSTGRES_URL).path.lstrip("/")), "fence_admin")
    admin = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, "fence_admin")
    try:
        admin.ensure_connection()
    except OperationalError as exc:
        pytest.skip(
            f"no PostgreSQL answers at {POSTGRES_URL} (set DJANGO_REDIS_MUTEX_TEST_POSTGRES): "
            f"{str(exc).strip()}"
        )
    name = f"drm_fencing_{uuid.uuid4().hex[:12]}"
    try:
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        yield _postgres_entry(name)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(
    request: pytest.FixtureRequest,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Database]:
    """A database with the FencedRecord table, reachable here as an alias of its own."""
    alias = f"fencing_{request.param}"
    with django_db_blocker.unblock(), ExitStack() as stack:
        if request.param == "sqlite":
            path = tmp_path_factory.mktemp("fencing") / "db.sqlite3"
            entry: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}
        else:
            entry = stack.enter_context(_throwaway_postgres())
        connections.settings[alias] = _configured(entry, alias)
        try:
            with connections[alias].schema_editor() as editor:
                editor.create_model(FencedRecord)
            yield Database(alias, entry)
        finally:
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]


@pytest.fixture
def records(database: Database) -> Any:
    """FencedRecord's manager on the test database, emptied for this test."""
    manager = FencedRecord.objects.db_manager(database.alias)
    manager.all().delete()
    return manager


def row(records: Any, pk: int) -> tuple[int, str, int]:
    """Return what the database holds for row ``pk``: value, written_by, last_fence."""
    return tuple(records.values_list("value", "written_by", "last_fence").get(pk=pk))


# -- fenced writes -------------------------------------------------------------


def test_fenced_writes_in_order_succeed_and_move_last_fence_up(records: Any) -> None:
    pk = records.create(name="in-order").pk

    for fence, value in [(FENCE, 1), (FENCE + 1, 2), (FENCE + 1000, 3)]:
        records.update_fenced(pk, fence, value=value, written_by=str(fence))
        assert row(records, pk) == (value, str(fence), fence)


def test_stale_fence_raises_and_leaves_the_row_unchanged(records: Any) -> None:
    pk = records.create(name="stale").pk
    records.update_fenced(pk, FENCE + 5, value=5, written_by="newer")

    with pytest.raises(StaleFence) as caught:
        records.update_fenced(pk, FENCE, value=1, written_by="older")

    assert (caught.value.fence, caught.value.current, caught.value.name) == (FENCE, FENCE + 5, None)
    assert f"testapp.FencedRecord pk={pk}" in str(caught.value)
    assert row(records, pk) == (5, "newer", FENCE + 5)


def test_same_fence_may_write_again(records: Any) -> None:
    pk = records.create(name="twice").pk
    records.update_fenced(pk, FENCE, value=1, written_by="first")

    records.update_fenced(pk, FENCE, value=2, written_by="second")

    assert row(records, pk) == (2, "second", FENCE)


def test_update_fenced_without_values_claims_the_row_against_older_holders(records: Any) -> None:
    pk = records.create(name="claimed", value=7, written_by="before").pk

    records.update_fenced(pk, FENCE + 1)
    with pytest.raises(StaleFence):
        records.update_fenced(pk, FENCE, value=1)

    assert row(records, pk) == (7, "before", FENCE + 1)


def test_update_fenced_accepts_expressions(records: Any) -> None:
    from django.db.models import F

    pk = records.create(name="expr", value=40).pk

    records.update_fenced(pk, FENCE, value=F("value") + 2)

    assert row(records, pk) == (42, "", FENCE)


def test_fenced_write_of_a_missing_row_raises_does_not_exist(records: Any) -> None:
    with pytest.raises(FencedRecord.DoesNotExist, match=r"pk=12345 .*fence 1795314190355281"):
        records.update_fenced(12345, FENCE, value=1)

    assert not records.exists()


def test_fenced_write_may_not_set_last_fence_itself(records: Any) -> None:
    pk = records.create(name="own-fence").pk

    with pytest.raises(ValueError, match="last_fence"):
        records.update_fenced(pk, FENCE, last_fence=FENCE * 2)

    assert row(records, pk) == (0, "", 0)


@pytest.mark.parametrize("fence", ["1795314190355281", 1.5, True, None])
def test_fence_that_is_not_a_token_or_a_mutex_is_a_type_error(fence: Any) -> None:
    with pytest.raises(TypeError, match="fence must be an int or a held Mutex"):
        FencedRecord.objects.update_fenced(1, fence, value=1)


def test_negative_fence_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        FencedRecord.objects.update_fenced(1, -1, value=1)


# -- save_fenced ----------------------------------------------------------------


def test_save_fenced_writes_the_instance_and_records_its_fence(records: Any) -> None:
    record = records.create(name="saved")
    record.value, record.written_by = 7, "me"

    record.save_fenced(FENCE)

    assert row(records, record.pk) == (7, "me", FENCE)
    assert record.last_fence == FENCE


def test_save_fenced_with_update_fields_writes_only_those(records: Any) -> None:
    record = records.create(name="partial")
    record.value, record.written_by = 7, "not saved"

    record.save_fenced(FENCE, update_fields=["value"])

    assert row(records, record.pk) == (7, "", FENCE)


def test_save_fenced_refuses_unknown_update_fields(records: Any) -> None:
    record = records.create(name="unknown")

    with pytest.raises(ValueError, match=r"\['last_fence', 'nope'\]"):
        record.save_fenced(FENCE, update_fields=["value", "nope", "last_fence"])

    assert row(records, record.pk) == (0, "", 0)


def test_save_fenced_with_a_held_lock_writes_its_fence(records: Any) -> None:
    record = records.create(name="locked")

    with mutex("record") as lock:
        record.value = 3
        record.save_fenced(lock)
        fence = lock.fence

    assert fence is not None
    assert row(records, record.pk) == (3, "", fence)


def test_save_fenced_with_a_lock_not_held_raises_lock_not_owned(records: Any) -> None:
    record = records.create(name="unheld")
    record.value = 9

    with pytest.raises(LockNotOwned, match="'idle'"):
        record.save_fenced(Mutex("idle"))

    assert row(records, record.pk) == (0, "", 0)


def test_write_through_an_expired_lock_after_a_newer_holder_wrote_names_the_lock(
    records: Any,
) -> None:
    record = records.create(name="expired")
    old = Mutex("record", ttl=0.2, watchdog=False)
    assert old.acquire()
    old_fence = old.fence
    deadline = time.monotonic() + 10
    while old.locked():
        assert time.monotonic() < deadline, "the 0.2 s lease never ran out"
        time.sleep(0.01)
    # Not reentrant: in this one thread, the new holder must not join the old hold.
    new = Mutex("record", ttl=30, reentrant=False)
    assert new.acquire()
    new_fence = new.fence
    try:
        records.update_fenced(record.pk, new, value=2, written_by="new")
        record.value, record.written_by = 1, "old"
        with pytest.raises(StaleFence) as caught:
            record.save_fenced(old)
    finally:
        new.release()
        with pytest.raises(LockNotOwned):
            old.release()  # forgets the stale hold

    assert caught.value.name == "record"
    assert (caught.value.fence, caught.value.current) == (old_fence, new_fence)
    assert "lock 'record' fence" in str(caught.value)
    assert row(records, record.pk) == (2, "new", new_fence)


# -- creating rows ----------------------------------------------------------------


def test_save_fenced_inserts_a_new_row_with_its_fence(records: Any, database: Database) -> None:
    record = FencedRecord(name="new", value=4, written_by="creator")

    record.save_fenced(FENCE, using=database.alias)

    assert record.pk is not None
    assert row(records, record.pk) == (4, "creator", FENCE)


def test_save_fenced_of_a_new_instance_over_an_older_row_updates_it(
    records: Any, database: Database
) -> None:
    pk = records.create(name="older", value=1, written_by="first").pk
    records.update_fenced(pk, FENCE)

    FencedRecord(pk=pk, name="older", value=2, written_by="second").save_fenced(
        FENCE + 1, using=database.alias
    )

    assert row(records, pk) == (2, "second", FENCE + 1)


def test_save_fenced_of_a_new_instance_over_a_newer_row_raises_stale_inside_a_transaction(
    records: Any, database: Database
) -> None:
    pk = records.create(name="newer", value=5, written_by="newer").pk
    records.update_fenced(pk, FENCE + 5)
    late = FencedRecord(pk=pk, name="newer", value=1, written_by="late")

    with transaction.atomic(using=database.alias):
        with pytest.raises(StaleFence):
            late.save_fenced(FENCE, using=database.alias)
        # The refused insert rolled back to a savepoint: the transaction goes on.
        count = records.count()

    assert count == 1
    assert row(records, pk) == (5, "newer", FENCE + 5)


# -- the fault: a holder paused past its lease writes late ------------------------


@pytest.fixture
def signal_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a list the test pushes to, to tell a worker to go on."""
    made: list[str] = []

    def key(purpose: str) -> str:
        made.append(f"fencing:{mutex_prefix}:{purpose}")
        return made[-1]

    yield key
    if made:
        raw.delete(*made)


def test_holder_paused_past_its_lease_cannot_overwrite_the_new_owners_write(
    records: Any,
    database: Database,
    spawn: Callable[..., Worker],
    raw: redis.Redis,
    signal_key: Callable[[str], str],
) -> None:
    pk = records.create(name="paused", value=0).pk
    db = json.dumps(database.entry)
    holder_write, holder_leave = signal_key("holder-write"), signal_key("holder-leave")
    new_write, new_leave = signal_key("new-write"), signal_key("new-leave")

    holder = spawn("fence_writer.py", "paused", 1, pk, 111, holder_write, holder_leave, db)
    first = holder.expect("acquired", timeout=START_TIMEOUT)
    successor = spawn("fence_writer.py", "paused", 30, pk, 222, new_write, new_leave, db)
    # Frozen with its watchdog, holding the row it read, the holder's lease runs out.
    os.kill(holder.pid, signal.SIGSTOP)
    taken = successor.expect("acquired", timeout=START_TIMEOUT)
    assert taken["fence"] > first["fence"]
    raw.rpush(new_write, "go")
    successor.expect("written")

    os.kill(holder.pid, signal.SIGCONT)
    raw.rpush(holder_write, "go")
    stale = holder.expect("stale")
    raw.rpush(holder_leave, "go")
    lost = holder.expect("lost")

    assert (stale["name"], stale["fence"], stale["current"]) == (
        "paused",
        first["fence"],
        taken["fence"],
    )
    assert row(records, pk) == (222, f"pid {successor.pid}", taken["fence"])
    assert (lost["error"], lost["name"]) == ("LockLost", "paused")
    assert holder.finish() == 0
    # The late holder's release left the new owner's lock alone.
    assert raw.hget(Mutex("paused").keys.lock, "token") == taken["token"].encode()
    raw.rpush(new_leave, "go")
    successor.expect("released")
    assert successor.finish() == 0
