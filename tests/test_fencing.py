"""Fencing tokens checked by the database: ``FencedModel`` on SQLite, PostgreSQL and MariaDB.

Every test that writes runs against the three databases, each through a
connection alias of its own created for this module: a SQLite file (so worker
processes can share it) and a fresh database on a PostgreSQL and on a MariaDB
server that this module starts itself, on free loopback ports, from the
machine's server packages (``tests/databases.py``), once per test run; the
holder-process test runs on the first two. A missing server binary fails the
tests, saying what to install; nothing is skipped. The suite's default
in-memory database is not involved.

Locks are real (the suite's redis-server), and so are the faults: two
threads on two connections racing a stale write against a newer one held
open in its transaction, and a holder process SIGSTOPped past its lease while
another process takes the lock and writes, then resumed to write late.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.db import connections, models, transaction
from django.db.models import Exists, F, OuterRef

from django_redis_mutex import LockNotOwned, Mutex, StaleFence, fencing, mutex
from tests.testapp.models import (
    FencedChild,
    FencedNotedChild,
    FencedParent,
    FencedRecord,
    FenceNote,
    FenceOwner,
)

from . import databases
from .databases import MariaDBServer, PostgresServer, configured, create_database
from .helpers import held_shared, wait_until
from .worker import Worker

# A realistic token (microseconds since the epoch): past 32 bits, so a column
# too narrow for it fails here, not in production.
FENCE = 1_795_314_190_355_281
START_TIMEOUT = 30.0
STEP_TIMEOUT = 30.0
DATABASES = ["sqlite", "postgresql", "mariadb"]
# Every model the tests write, in an order that satisfies their foreign keys.
MODELS: list[type[models.Model]] = [
    FencedRecord,
    FenceOwner,
    FencedParent,
    FencedChild,
    FenceNote,
    FencedNotedChild,
]


@dataclass(frozen=True)
class Database:
    """A database the module's tests write to: its alias here and its settings entry."""

    alias: str
    entry: dict[str, Any]

    @property
    def vendor(self) -> str:
        return str(connections[self.alias].vendor)


@pytest.fixture(scope="module", params=DATABASES)
def database(
    request: pytest.FixtureRequest,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Database]:
    """A database with the test models' tables, reachable here as an alias of its own."""
    alias = f"fencing_{request.param}"
    with django_db_blocker.unblock():
        entry: dict[str, Any]
        if request.param == "sqlite":
            path = tmp_path_factory.mktemp("fencing") / "db.sqlite3"
            # A generous busy timeout: racing writers wait on the file lock.
            entry = {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(path),
                "OPTIONS": {"timeout": STEP_TIMEOUT},
            }
        elif request.param == "postgresql":
            server: PostgresServer | MariaDBServer = request.getfixturevalue("postgres_server")
            entry = server.django_settings(create_database(server, "postgres"))
        else:
            server = request.getfixturevalue("mariadb_server")
            entry = server.django_settings(create_database(server, ""))
        connections.settings[alias] = configured(entry, alias)
        try:
            with connections[alias].schema_editor() as editor:
                for model in MODELS:
                    editor.create_model(model)
            yield Database(alias, entry)
        finally:
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]


def _empty(alias: str) -> None:
    """Delete every row the tests write, children before parents."""
    for model in reversed(MODELS):
        model._base_manager.using(alias).all().delete()


@pytest.fixture
def records(database: Database) -> Any:
    """FencedRecord's manager on the test database, every test table emptied for this test."""
    _empty(database.alias)
    return FencedRecord.objects.db_manager(database.alias)


@pytest.fixture
def children(database: Database) -> Any:
    """FencedChild's manager on the test database, every test table emptied for this test."""
    _empty(database.alias)
    return FencedChild.objects.db_manager(database.alias)


def row(records: Any, pk: int) -> tuple[int, str, int]:
    """Return what the database holds for row ``pk``: value, written_by, last_fence."""
    return tuple(records.values_list("value", "written_by", "last_fence").get(pk=pk))


def child_row(children: Any, pk: int) -> tuple[int, str, str, int]:
    """Return what both tables hold for child ``pk``: value, detail, written_by, last_fence."""
    return tuple(children.values_list("value", "detail", "written_by", "last_fence").get(pk=pk))


def parent_row(database: Database, pk: int) -> tuple[str, int, int]:
    """Return what the parent table alone holds for ``pk``: name, value, last_fence."""
    return tuple(
        FencedParent.objects.using(database.alias)
        .values_list("name", "value", "last_fence")
        .get(pk=pk)
    )


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


def test_a_fenced_write_under_a_shared_hold_is_refused(records: Any) -> None:
    # Two readers hold the lock at once, each with its own fence: were the
    # later reader's write allowed, the earlier one, still a holder, would be
    # refused as stale. A fenced write must be made under an exclusive hold.
    record = records.create(name="read", value=1, written_by="before")
    with held_shared("record", "first", "second") as (first, second):
        assert first.fence is not None and second.fence is not None
        assert first.fence != second.fence
        for reader in (first, second):
            with pytest.raises(ValueError, match=r"'record'.*shared.*exclusive"):
                records.update_fenced(record.pk, reader, value=2, written_by="reader")
            record.value = 3
            with pytest.raises(ValueError, match=r"'record'.*shared.*exclusive"):
                record.save_fenced(reader)

    assert row(records, record.pk) == (1, "before", 0)
    with mutex("record") as writer:
        records.update_fenced(record.pk, writer, value=4, written_by="writer")
    assert row(records, record.pk)[:2] == (4, "writer")


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


# The worker process builds its Django settings from the entry alone, and only
# the SQLite and PostgreSQL drivers need no setup there (PyMySQL must first be
# installed as MySQLdb); MariaDB's races are the threaded tests further down.
@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
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


# -- multi-table inheritance: last_fence in the parent's table ------------------------


def test_fenced_writes_to_a_child_in_order_write_both_tables(children: Any) -> None:
    pk = children.create(name="mti-order", value=0).pk

    children.update_fenced(pk, FENCE, value=1, detail="first", written_by="update")
    assert child_row(children, pk) == (1, "first", "update", FENCE)

    child = children.get(pk=pk)
    child.value, child.detail, child.written_by = 2, "second", "save"
    child.save_fenced(FENCE + 1)
    assert child_row(children, pk) == (2, "second", "save", FENCE + 1)
    assert child.last_fence == FENCE + 1

    children.update_fenced(pk, FENCE + 2, value=F("value") + 40, detail="third")
    assert child_row(children, pk) == (42, "third", "save", FENCE + 2)

    children.update_fenced(pk, FENCE + 3)  # a claim: only the fence moves
    assert child_row(children, pk) == (42, "third", "save", FENCE + 3)


def test_stale_write_to_a_child_is_refused_and_writes_neither_table(
    children: Any, database: Database
) -> None:
    pk = children.create(name="mti-stale", value=0).pk
    stale = children.get(pk=pk)  # read before the newer holder writes
    children.update_fenced(pk, FENCE + 5, value=5, detail="newer", written_by="newer")

    with pytest.raises(StaleFence) as by_update:
        children.update_fenced(pk, FENCE, value=1, detail="stale", written_by="stale")
    stale.value, stale.detail, stale.written_by = 2, "stale save", "stale save"
    with pytest.raises(StaleFence) as by_save:
        stale.save_fenced(FENCE + 4)

    assert (by_update.value.fence, by_update.value.current) == (FENCE, FENCE + 5)
    assert (by_save.value.fence, by_save.value.current) == (FENCE + 4, FENCE + 5)
    assert f"testapp.FencedChild pk={pk}" in str(by_save.value)
    assert child_row(children, pk) == (5, "newer", "newer", FENCE + 5)
    assert parent_row(database, pk) == ("mti-stale", 5, FENCE + 5)
    assert stale.last_fence == 0  # the refused save did not pretend to have written


def test_stale_save_fenced_of_only_child_fields_is_refused(children: Any) -> None:
    pk = children.create(name="mti-child-fields").pk
    stale = children.get(pk=pk)
    children.update_fenced(pk, FENCE + 1, detail="newer")

    stale.detail = "stale"
    with pytest.raises(StaleFence):
        stale.save_fenced(FENCE, update_fields=["detail"])

    assert child_row(children, pk) == (0, "newer", "", FENCE + 1)


def test_fenced_write_of_a_child_whose_row_is_only_a_parent_changes_nothing(
    children: Any, database: Database
) -> None:
    # The fence table has the row (and would accept the fence): the write is
    # undone when the child's table turns out not to.
    pk = FencedParent.objects.using(database.alias).create(name="parent-only", value=7).pk

    with pytest.raises(FencedChild.DoesNotExist, match=rf"FencedChild pk={pk} .*fence {FENCE}"):
        children.update_fenced(pk, FENCE, value=1, detail="x")
    with pytest.raises(FencedChild.DoesNotExist):
        children.update_fenced(pk, FENCE)  # a claim alone, too

    assert parent_row(database, pk) == ("parent-only", 7, 0)
    assert not children.exists()


def test_save_fenced_inserts_a_new_child_into_both_tables(
    children: Any, database: Database
) -> None:
    child = FencedChild(name="new-child", value=3, detail="d", written_by="creator")

    child.save_fenced(FENCE, using=database.alias)

    assert child_row(children, child.pk) == (3, "d", "creator", FENCE)
    assert parent_row(database, child.pk) == ("new-child", 3, FENCE)


def test_save_fenced_of_a_new_child_over_an_existing_one_is_the_fenced_update(
    children: Any, database: Database
) -> None:
    pk = children.create(name="existing", value=1).pk
    children.update_fenced(pk, FENCE + 5, detail="newer")

    late = FencedChild(pk=pk, name="existing", value=9, detail="late")
    with transaction.atomic(using=database.alias):
        with pytest.raises(StaleFence):
            late.save_fenced(FENCE, using=database.alias)
        count = children.count()  # the refused insert left the transaction usable
    FencedChild(pk=pk, name="existing", value=2, detail="later").save_fenced(
        FENCE + 6, using=database.alias
    )

    assert count == 1
    assert child_row(children, pk) == (2, "later", "", FENCE + 6)


def test_save_fenced_of_a_new_child_over_a_parent_only_row_is_refused(
    children: Any, database: Database
) -> None:
    pk = FencedParent.objects.using(database.alias).create(name="lonely", value=7).pk

    with pytest.raises(ValueError, match="does not add a child to an existing parent row"):
        FencedChild(pk=pk, name="lonely", value=1, detail="x").save_fenced(
            FENCE, using=database.alias
        )

    assert parent_row(database, pk) == ("lonely", 7, 0)
    assert not children.exists()


def test_new_child_with_a_key_is_refused_where_django_cannot_force_parent_inserts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Django before 5.0 would update an existing parent row with no fence check.
    monkeypatch.setattr(fencing, "_FORCE_INSERT_PARENTS", False)
    child = FencedChild(pk=12345, name="old-django")

    with pytest.raises(ValueError, match=r"needs save\(force_insert=\(Parent, \.\.\.\)\)"):
        child.save_fenced(FENCE)

    assert child.last_fence == 0


def test_child_values_for_the_primary_key_or_a_parent_link_are_refused(children: Any) -> None:
    pk = children.create(name="keys").pk

    for field in ("id", "pk", "fencedparent_ptr", "fencedparent_ptr_id"):
        with pytest.raises(ValueError, match="primary key or a parent link"):
            children.update_fenced(pk, FENCE, **{field: pk + 1})

    assert child_row(children, pk) == (0, "", "", 0)


def test_unknown_or_reverse_fields_in_a_fenced_write_are_field_errors(
    children: Any, database: Database
) -> None:
    from django.core.exceptions import FieldDoesNotExist, FieldError

    pk = children.create(name="fields").pk

    with pytest.raises(FieldDoesNotExist, match="nope"):
        children.update_fenced(pk, FENCE, nope=1)
    with pytest.raises(FieldError, match="only non-relations and foreign keys"):
        FencedParent.objects.using(database.alias).update_fenced(pk, FENCE, fencedchild=None)

    assert child_row(children, pk) == (0, "", "", 0)


def test_second_parent_of_multiple_inheritance_is_refused_but_the_first_is_fenced(
    database: Database, children: Any
) -> None:
    noted = FencedNotedChild.objects.db_manager(database.alias)
    item = noted.create(name="noted", value=1, note="before")

    with pytest.raises(TypeError, match="parent link that is not its primary key"):
        noted.update_fenced(item.pk, FENCE, note="after")
    item.note = "after"
    with pytest.raises(TypeError, match=r"save_fenced\(update_fields=\[\.\.\.\]\)"):
        item.save_fenced(FENCE)
    item.value = 2
    item.save_fenced(FENCE, update_fields=["value"])
    with pytest.raises(StaleFence):
        noted.update_fenced(item.pk, FENCE - 1, value=3)

    assert tuple(noted.values_list("value", "note", "last_fence").get(pk=item.pk)) == (
        2,
        "before",
        FENCE,
    )


# -- querysets: filters that stay in the one statement, and those refused -----------


def test_filter_on_the_fenced_tables_own_columns_is_part_of_the_update(
    database: Database, children: Any
) -> None:
    parents = FencedParent.objects.db_manager(database.alias)
    owner = FenceOwner.objects.using(database.alias).create(name="owner")
    pk = parents.create(name="owned", owner=owner).pk

    parents.filter(owner=owner, value__gte=0).update_fenced(pk, FENCE, value=1)
    with pytest.raises(FencedParent.DoesNotExist):
        parents.filter(name="someone else").update_fenced(pk, FENCE + 1, value=2)
    with pytest.raises(StaleFence):
        parents.filter(owner=owner).update_fenced(pk, FENCE - 1, value=3)

    assert parent_row(database, pk) == ("owned", 1, FENCE)


@pytest.mark.parametrize(
    ("shape", "problem"),
    [
        (lambda qs: qs.filter(owner__name="owner"), "a join"),
        (lambda qs: qs.exclude(owner__name="nobody"), "a join"),
        (lambda qs: qs.filter(owner__in=FenceOwner.objects.filter(name="owner")), "a subquery"),
        (
            lambda qs: qs.filter(
                Exists(FenceOwner.objects.filter(pk=OuterRef("owner_id"), name="owner"))
            ),
            "a subquery",
        ),
        (lambda qs: qs.extra(where=["1 = 1"]), "raw SQL"),
    ],
    ids=["related-lookup", "related-exclude", "in-subquery", "exists", "extra"],
)
def test_queryset_filtered_through_another_table_is_refused(
    database: Database, children: Any, shape: Callable[[Any], Any], problem: str
) -> None:
    parents = FencedParent.objects.db_manager(database.alias)
    owner = FenceOwner.objects.using(database.alias).create(name="owner")
    pk = parents.create(name="owned", owner=owner).pk

    with pytest.raises(ValueError, match=f"filtered with {problem}") as caught:
        shape(parents.all()).update_fenced(pk, FENCE, value=1)

    message = str(caught.value)
    assert "testapp.FencedParent queryset" in message
    assert "pass just the primary key" in message
    assert parent_row(database, pk) == ("owned", 0, 0)


@pytest.mark.parametrize(
    "shape",
    [
        lambda qs: qs.filter(detail="d"),
        lambda qs: qs.filter(name="filtered"),
        lambda qs: qs.filter(owner__name="owner"),
    ],
    ids=["own-column", "parent-column", "related"],
)
def test_filtered_queryset_of_a_child_is_refused(
    children: Any, database: Database, shape: Callable[[Any], Any]
) -> None:
    pk = children.create(name="filtered", detail="d").pk

    with pytest.raises(ValueError, match=r"filtered testapp\.FencedChild queryset") as caught:
        shape(children.all()).update_fenced(pk, FENCE, value=1, detail="x")

    assert "FencedChild.objects.update_fenced(pk, ...)" in str(caught.value)
    assert child_row(children, pk) == (0, "d", "", 0)


@pytest.mark.parametrize(
    ("shape", "problem"),
    [
        (lambda qs: qs.all()[:1], "sliced"),
        (lambda qs: qs.distinct(), r"after distinct\(\)"),
        (lambda qs: qs.union(qs), r"combined \(union\)"),
    ],
    ids=["sliced", "distinct", "union"],
)
def test_sliced_distinct_or_combined_queryset_is_a_type_error(
    records: Any, shape: Callable[[Any], Any], problem: str
) -> None:
    pk = records.create(name="shapes").pk

    with pytest.raises(TypeError, match=problem):
        shape(records.all()).update_fenced(pk, FENCE, value=1)

    assert row(records, pk) == (0, "", 0)


# -- a real race: the stale write waits on the newer one's open transaction ----------


def _lock_waiters(database: Database) -> int:
    """Count sessions waiting on a row lock on the test server (PostgreSQL, MariaDB).

    Each query runs in autocommit, so it sees the server as it is now (within a
    transaction PostgreSQL would keep showing the first snapshot).
    """
    with connections[database.alias].cursor() as cursor:
        if database.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            )
        (count,) = cursor.fetchone()
    return int(count)


@pytest.mark.parametrize("method", ["save_fenced", "update_fenced"])
@pytest.mark.parametrize("model", [FencedRecord, FencedChild], ids=["table", "child"])
def test_stale_writer_that_read_before_a_newer_commit_is_refused_after_it(
    database: Database, records: Any, model: type[FencedRecord | FencedChild], method: str
) -> None:
    """Two connections: the stale writer reads, a newer holder writes and keeps its
    transaction open, the stale writer's write starts and (on the servers) waits on
    the row lock, then the newer one commits. The stale write must be refused."""
    alias = database.alias
    manager = model.objects.db_manager(alias)
    pk = manager.create(name="race", value=0).pk
    stale_read, newer_wrote = threading.Event(), threading.Event()
    stale_updating, newer_may_commit = threading.Event(), threading.Event()
    outcome: dict[str, BaseException | None] = {}

    def announce(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith("UPDATE"):
            stale_updating.set()
        return execute(sql, *args)

    def stale_writer() -> None:
        try:
            mine = manager.get(pk=pk)
            stale_read.set()
            assert newer_wrote.wait(STEP_TIMEOUT), "the newer writer never wrote"
            with connections[alias].execute_wrapper(announce):
                if method == "save_fenced":
                    mine.value, mine.written_by = mine.value + 1, "stale"
                    mine.save_fenced(FENCE)
                else:
                    manager.update_fenced(pk, FENCE, value=mine.value + 1, written_by="stale")
        except BaseException as exc:
            outcome["stale"] = exc
        else:
            outcome["stale"] = None
        finally:
            stale_updating.set()
            connections[alias].close()

    def newer_writer() -> None:
        try:
            assert stale_read.wait(STEP_TIMEOUT), "the stale writer never read"
            with transaction.atomic(using=alias):
                manager.update_fenced(pk, FENCE + 1, value=10, written_by="newer")
                newer_wrote.set()
                assert newer_may_commit.wait(STEP_TIMEOUT), "never told to commit"
        except BaseException as exc:
            outcome["newer"] = exc
        else:
            outcome["newer"] = None
        finally:
            newer_wrote.set()
            connections[alias].close()

    stale_thread = threading.Thread(target=stale_writer)
    threads = [stale_thread, threading.Thread(target=newer_writer)]
    for thread in threads:
        thread.start()
    try:
        assert stale_updating.wait(STEP_TIMEOUT), "the stale writer never started its write"
        if database.vendor != "sqlite":
            # SQLite shows no lock waits; its writer waits on the file lock all the same.
            # A stale writer that ended instead is reported by the checks below.
            wait_until(
                lambda: _lock_waiters(database) > 0 or not stale_thread.is_alive(),
                STEP_TIMEOUT,
                f"the stale write to wait on the newer writer's row lock ({outcome})",
                # InnoDB refreshes its INNODB_TRX view only after 0.1 s without a read.
                interval=0.25 if database.vendor == "mysql" else 0.01,
            )
    finally:
        newer_may_commit.set()
        for thread in threads:
            thread.join(STEP_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a writer thread hung"

    assert outcome["newer"] is None, outcome
    stale = outcome["stale"]
    assert isinstance(stale, StaleFence), outcome
    assert (stale.fence, stale.current) == (FENCE, FENCE + 1)
    assert tuple(manager.values_list("value", "written_by", "last_fence").get(pk=pk)) == (
        10,
        "newer",
        FENCE + 1,
    )


# -- the servers these tests start ------------------------------------------------------


def test_missing_postgresql_binaries_name_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv("POSTGRES_BINDIR", raising=False)
    monkeypatch.setattr(databases, "POSTGRES_SEARCH", str(tmp_path / "*" / "bin"))
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(FileNotFoundError, match=r"apt-get install postgresql\)"):
        PostgresServer()


def test_missing_mariadb_binaries_name_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv("MARIADBD", raising=False)
    monkeypatch.setattr(databases, "MARIADB_SEARCH", ())
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(
        FileNotFoundError, match=r"mariadbd missing.*apt-get install mariadb-server"
    ):
        MariaDBServer()


def test_server_that_dies_at_start_is_cleaned_up_and_its_log_quoted(tmp_path: Any) -> None:
    install = tmp_path / "install-db"
    install.write_text("#!/bin/sh\nexit 0\n")
    server = tmp_path / "server"
    server.write_text("#!/bin/sh\necho 'cannot open the data directory' >&2\nexit 3\n")
    for script in (install, server):
        script.chmod(0o755)
    fake = MariaDBServer(server=str(server), install=str(install))

    with pytest.raises(RuntimeError, match="exited with status 3") as caught:
        fake.start(timeout=STEP_TIMEOUT)

    assert "cannot open the data directory" in str(caught.value)
    assert fake.process is None
    assert not os.path.exists(fake.directory)
