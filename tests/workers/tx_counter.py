"""Read-modify-write one Counter row under a lock taken inside ``transaction.atomic()``.

Usage: tx_counter.py MODE NAME PK COUNT DATABASE_JSON [START_KEY | TTL]

DATABASE_JSON is the ``DATABASES["default"]`` entry to use (set before
``django.setup()``). MODE ``bump`` waits at the start barrier on START_KEY,
then COUNT times opens a transaction, takes lock NAME inside it, reads row PK,
pauses a moment and writes the value plus one, reporting ``done`` with how
many bumps committed. MODE ``die`` opens a transaction, takes the lock inside
it with lease TTL, writes the row (so the database holds its row lock), leaves
the lock's block and reports ``inside``; it then waits to be killed in that
transaction.
"""

import json
import sys
import time

import django
from django.conf import settings

settings.DATABASES = {"default": json.loads(sys.argv[5])}
if settings.DATABASES["default"]["ENGINE"].endswith("mysql"):
    try:
        import MySQLdb  # noqa: F401  (mysqlclient, when installed)
    except ImportError:
        import pymysql

        pymysql.install_as_MySQLdb()  # Django's mysql backend imports MySQLdb
django.setup()

from django.db import transaction  # noqa: E402
from django.db.models import F  # noqa: E402
from support import data_client, emit, start_barrier  # noqa: E402

from django_redis_mutex import mutex  # noqa: E402
from tests.testapp.models import Counter  # noqa: E402

# Between the read and the write: wide enough that a lock given back before
# the COMMIT lets the next holder read the old value.
PAUSE = 0.003


def bump(name: str, pk: int, count: int, start_key: str) -> None:
    start_barrier(data_client(), start_key)
    done = 0
    for _ in range(count):
        with transaction.atomic(), mutex(name, timeout=60):
            value = Counter.objects.values_list("value", flat=True).get(pk=pk)
            time.sleep(PAUSE)
            Counter.objects.filter(pk=pk).update(value=value + 1)
        done += 1
    emit("done", bumps=done)


def die(name: str, pk: int, ttl: float) -> None:
    with transaction.atomic():
        with mutex(name, ttl=ttl, timeout=60):
            Counter.objects.filter(pk=pk).update(value=F("value") + 1)
        emit("inside")
        time.sleep(600)  # killed by the test long before


if __name__ == "__main__":
    mode, lock_name, row = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "bump":
        bump(lock_name, row, int(sys.argv[4]), sys.argv[6])
    else:
        die(lock_name, row, float(sys.argv[6]))
