"""The data the nemesis's transactional bodies guard: counter rows on a real PostgreSQL database.

Why a real database: a lock taken inside ``transaction.atomic()`` is kept until
the transaction ends (django_redis_mutex/transactions.py), and only a real
database, with real COMMITs, row locks and READ COMMITTED reads, shows whether
that keeps the data whole under faults.

Each lock of a run has a row in ``nemesis_counters``: its ``value``, and
``writes``, the number of updates it took. A transactional body reads the
value, pauses, writes it plus one with ``writes = writes + 1 ... RETURNING
writes``, and inserts a row of its own into ``nemesis_increments`` (its body
id, the lock, the value it wrote and that ``writes``), all in one transaction.
The UPDATE holds the row's lock until the COMMIT and PostgreSQL evaluates
``writes + 1`` on the newest committed version, so ``seq`` numbers the
committed writes of a row in commit order, and the increments table says
exactly which transactions committed: a worker killed mid-transaction left
no row (the database rolled it back), one killed right after its COMMIT did.

The nemesis process creates the database and reads the final state with
psycopg directly (no Django settings, no test-runner database guard); the
workers write through Django's connection, inside Django's transactions.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataState", "Increment", "create_database", "increment", "read_state"]

SCHEMA = (
    "CREATE TABLE nemesis_counters ("
    " name text PRIMARY KEY, value integer NOT NULL, writes integer NOT NULL)",
    "CREATE TABLE nemesis_increments ("
    " body text PRIMARY KEY, name text NOT NULL, value integer NOT NULL, seq integer NOT NULL)",
)
READ = "SELECT value FROM nemesis_counters WHERE name = %s"
WRITE = (
    "UPDATE nemesis_counters SET value = %s, writes = writes + 1 WHERE name = %s RETURNING writes"
)
RECORD = "INSERT INTO nemesis_increments (body, name, value, seq) VALUES (%s, %s, %s, %s)"


@dataclass(frozen=True)
class Increment:
    """One committed read-modify-write of a lock's counter row, as the database kept it."""

    body: str
    #: The lock's counter row: "space:name".
    lock: str
    #: The value it wrote (the value it read, plus one).
    value: int
    #: Its place among the row's committed writes (1, 2, ...), in commit order.
    seq: int


@dataclass
class DataState:
    """The database at the end of a run: each counter row, and every committed increment."""

    counters: dict[str, int]
    increments: list[Increment] = field(default_factory=list)
    #: Each counter row's number of committed writes (``writes``).
    writes: dict[str, int] = field(default_factory=dict)


def _connect(entry: dict[str, Any]) -> Any:
    import psycopg

    return psycopg.connect(
        host=entry["HOST"],
        port=int(entry["PORT"]),
        user=entry["USER"],
        dbname=entry["NAME"],
        autocommit=True,
        connect_timeout=10,
    )


def create_database(server: Any, locks: list[str]) -> dict[str, Any]:
    """Create a fresh database on ``server`` (a PostgresServer) with a counter row per lock.

    Return its ``DATABASES`` entry. The database is never dropped: it goes
    with the server's data directory.
    """
    name = f"nemesis_{uuid.uuid4().hex[:12]}"
    with _connect(server.django_settings("postgres")) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    entry: dict[str, Any] = server.django_settings(name)
    with _connect(entry) as connection:
        for statement in SCHEMA:
            connection.execute(statement)
        with connection.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO nemesis_counters (name, value, writes) VALUES (%s, 0, 0)",
                [(lock,) for lock in locks],
            )
    return entry


def read_state(entry: dict[str, Any]) -> DataState:
    """Read every counter row and every committed increment."""
    with _connect(entry) as connection:
        counters = connection.execute("SELECT name, value, writes FROM nemesis_counters").fetchall()
        increments = connection.execute(
            "SELECT body, name, value, seq FROM nemesis_increments ORDER BY name, seq"
        ).fetchall()
    return DataState(
        counters={name: value for name, value, _ in counters},
        increments=[Increment(*row) for row in increments],
        writes={name: writes for name, _, writes in counters},
    )


def increment(cursor: Any, lock: str, body: str, pause: float, intent: Any) -> tuple[int, int]:
    """Read ``lock``'s counter, call ``intent(read)``, pause, write it plus one.

    Return the value written and its place in the row's commit order. Runs
    inside the caller's transaction; ``intent`` journals what is about to be
    written before the write goes out.
    """
    cursor.execute(READ, [lock])
    (read,) = cursor.fetchone()
    intent(read)
    time.sleep(pause)
    cursor.execute(WRITE, [read + 1, lock])
    (seq,) = cursor.fetchone()
    cursor.execute(RECORD, [body, lock, read + 1, seq])
    return read + 1, seq
