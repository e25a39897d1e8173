"""``manage.py locks``: list the locks and semaphores held in one cache alias, or reset them.

A thin shell over :mod:`django_redis_mutex.introspection`, which the admin
inspector shares, so both see and reset exactly the same keys (found with SCAN
within this app's namespace, never KEYS, never FLUSHDB), on every master of a
quorum alias. The documentation's operations page describes each flag.

Lock names and labels are often built from request data, so the table shows
every field with control and bidi characters escaped (``\\x1b``, ``\\u202e``):
a name cannot clear the operator's screen, retitle the terminal or reorder
what is printed after it. ``--json`` keeps the exact values (JSON escapes them).

``--stats`` prints the contention figures of each lock class instead (see
:mod:`django_redis_mutex.stats`), as a table or, with ``--json``, an object.

A semaphore is reset only by ``--reset-semaphore``, never by ``--reset`` or
``--reset-all``, so a lock and a semaphore of the same name are never confused
and clearing stuck locks never takes permits from their holders. The filters
select locks (or a shared lock's holders): semaphores are listed without one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_redis_mutex import introspection, stats
from django_redis_mutex.chart import figures_row
from django_redis_mutex.client import get_client
from django_redis_mutex.conf import get_settings
from django_redis_mutex.display import duration, terminal_safe
from django_redis_mutex.exceptions import LockBackendUnavailable
from django_redis_mutex.filters import FILTER_FIELDS, FilterError, LockFilter
from django_redis_mutex.introspection import HeldLock, HeldSemaphore, SharedHolder
from django_redis_mutex.owners import Owner

COLUMNS = ("NAME", "HOST", "PID", "THREAD", "LABEL", "HELD FOR", "TIME LEFT", "FENCE", "WAITERS")
# The columns of --stats: one row per lock class.
STATS_COLUMNS = (
    "LOCK CLASS",
    "ACQUIRED",
    "WAITED",
    "GAVE UP",
    "WAIT P50",
    "WAIT P99",
    "HOLD P50",
    "HOLD P99",
    "LOST",
    "DEADLOCKS",
)

# The flag that resets holds of each kind by name.
RESET_FLAGS = {"lock": "--reset", "semaphore": "--reset-semaphore"}


def _cell(value: Any) -> str:
    return "-" if value in (None, "") else terminal_safe(str(value))


def describe_redis(alias: str) -> str:
    """Return where the client of ``alias`` reads: a URL, a Sentinel service, a cluster node.

    Built from the client's connection settings, never from LOCATION, so no
    password (which a LOCATION may carry) is ever printed.
    """
    client = get_client(alias)
    default_node = getattr(client, "get_default_node", None)
    if default_node is not None:  # redis.cluster.RedisCluster
        node = default_node()
        where = "?" if node is None else f"{node.host}:{node.port}"
        return f"Redis Cluster via node {where}"
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    db = kwargs.get("db", 0)
    service = getattr(pool, "service_name", None)
    if service is not None:  # a Sentinel-managed master
        sentinels = ", ".join(
            "{host}:{port}".format(**sentinel.connection_pool.connection_kwargs)
            for sentinel in pool.sentinel_manager.sentinels
        )
        return f"Sentinel service {service!r} db {db} via {sentinels}"
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={db}"
    connection_class = getattr(pool, "connection_class", None)
    scheme = "rediss" if "SSL" in getattr(connection_class, "__name__", "") else "redis"
    host = kwargs.get("host", "localhost")
    if ":" in str(host):
        host = f"[{host}]"  # an IPv6 address
    return f"{scheme}://{host}:{kwargs.get('port', 6379)}/{db}"


def source_line(alias: str, members: tuple[str, ...] | None) -> str:
    """Return the line naming the cache alias and the Redis (or the quorum's masters) it read."""
    if members:
        where = "; ".join(f"{member!r} at {describe_redis(member)}" for member in members)
        return f"Cache {alias!r} (a quorum of {where}):"
    return f"Cache {alias!r} at {describe_redis(alias)}:"


def table_rows(locks: list[HeldLock]) -> list[tuple[str, ...]]:
    """Return the table's rows of display strings, in COLUMNS order, escaped for a terminal.

    One row per lock; a lock held shared has one row per holder, the first
    naming the lock with ``(shared)`` and the count of waiters.
    """
    rows: list[tuple[str, ...]] = []
    for lock in locks:
        name = terminal_safe(lock.name)
        # An exclusive lock is its own one holder.
        holds: tuple[HeldLock | SharedHolder, ...] = lock.holders or (lock,)
        for index, hold in enumerate(holds):
            first = index == 0
            rows.append(
                (
                    # A shared lock's further holders: "+ shared" in the name column.
                    (f"{name} (shared)" if lock.shared else name) if first else "  + shared",
                    *_owner_cells(hold.owner),
                    duration(introspection.seconds_since(hold.acquired_at)),
                    duration(hold.time_left),
                    str(hold.fence),
                    str(lock.waiters) if first else "",
                )
            )
    return rows


def stats_rows(report: stats.StatsReport) -> list[tuple[str, ...]]:
    """Return the --stats table's rows, in STATS_COLUMNS order, hottest class first.

    The figures as the admin page formats them (``figures_row``); the count
    that waited and its share fill one cell: ``2 (50%)``.
    """
    rows: list[tuple[str, ...]] = []
    for figures in report.classes:
        row = figures_row(figures)
        rows.append(
            (
                row["lock_class"],
                str(row["acquired"]),
                f"{row['waited']} ({row['waited_share']})",
                str(row["contended"]),
                row["wait_p50"],
                row["wait_p99"],
                row["hold_p50"],
                row["hold_p99"],
                str(row["lost"]),
                str(row["deadlocks"]),
            )
        )
    return rows


def _owner_cells(owner: Owner) -> tuple[str, str, str, str]:
    label = _cell(owner.label)
    if owner.transaction:
        # The block has ended; the lock waits for its database transaction.
        databases = ", ".join(owner.transaction)
        waiting = terminal_safe(f"(kept until its transaction on {databases} ends)")
        label = waiting if label == "-" else f"{label} {waiting}"
    return (_cell(owner.host), _cell(owner.pid), _cell(owner.thread), label)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _summary(
    alias: str, locks: list[HeldLock], members: tuple[str, ...] | None, chosen: str, total: int
) -> str:
    """Return the line under the table: how many locks (and holders) it shows, of how many."""
    if not locks and chosen:
        if total:
            return (
                f"No held lock in cache {alias!r} matches the filter ({chosen}); "
                f"{_plural(total, 'lock')} held."
            )
        return f"No locks are held in cache {alias!r}, so none matches the filter ({chosen})."
    if not locks:
        return f"No locks are held in cache {alias!r}."
    where = f" (on a majority of {', '.join(members)})" if members else ""
    shared = [lock for lock in locks if lock.shared]
    if shared:
        holders = sum(len(lock.holders) for lock in shared)
        of = "matching " if chosen else ""
        where += f" ({len(shared)} shared, by {_plural(holders, of + 'holder')})"
    if not chosen:
        return f"{_plural(len(locks), 'lock')} held in cache {alias!r}{where}."
    verb = "matches" if len(locks) == 1 else "match"
    return (
        f"{len(locks)} of {_plural(total, 'lock')} held in cache {alias!r}{where} "
        f"{verb} the filter ({chosen})."
    )


def json_entries(locks: list[HeldLock], semaphores: list[HeldSemaphore]) -> list[dict[str, Any]]:
    """Return the ``--json`` array: the locks, then the semaphores, each tagged with its kind.

    One array, as before semaphores were listed, so a reader of locks only
    keeps working by skipping entries whose ``kind`` is not ``"lock"``.
    """
    return [
        *({"kind": "lock", **lock.as_dict()} for lock in locks),
        *({"kind": "semaphore", **held.as_dict()} for held in semaphores),
    ]


def _not_held(alias: str, names: list[str], kind: str) -> str:
    """Say which names no holder has, and which of them are held as the other kind."""
    if kind == "lock":
        message = f"No lock {_names(names, ', ')} is held in cache {alias!r}; nothing reset."
        other, held = "semaphore", {item.name for item in introspection.held_semaphores(alias)}
        hint = "A semaphore of that name has permits held"
    else:
        message = (
            f"No permit of semaphore {_names(names, ', ')} is held in cache {alias!r}; "
            "nothing reset."
        )
        other, held = "lock", {item.name for item in introspection.held_locks(using=alias)}
        hint = "A lock of that name is held"
    clash = sorted(held & set(names))
    if clash:
        message += f" {hint}: use {RESET_FLAGS[other]} {_names(clash, ' ')}."
    return message


def _lock_filter(options: dict[str, Any]) -> LockFilter:
    """Return the filter the options ask for; a bad value is a CommandError naming its flag."""
    try:
        return LockFilter.from_strings(**{field: options.get(field) for field in FILTER_FIELDS})
    except FilterError as exc:
        raise CommandError(f"{_flag(exc.field)} {exc.problem}") from exc


def _names(names: list[str], separator: str) -> str:
    return separator.join(repr(terminal_safe(name)) for name in names)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


class Command(BaseCommand):
    help = (
        "Lists the distributed locks held in a cache alias, or force-releases them. "
        "A force-released lock passes to its first waiter; its holder keeps running "
        "unprotected and learns of the loss when it next renews or finishes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--using",
            default="default",
            help=(
                "Nominates the cache alias whose locks to show or reset; a quorum alias "
                'covers all of its masters. Defaults to "default".'
            ),
        )
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--json",
            action="store_true",
            help=(
                'Prints the held locks and semaphores as a JSON array (each entry\'s "kind" '
                'is "lock" or "semaphore") instead of a table. A lock\'s "ttl" repeats '
                '"time_left" and is deprecated: it is removed in 0.2.0.'
            ),
        )
        for flag, help_text in (
            (
                "--reset",
                "Force-releases the named locks; fails naming those not held, after "
                "releasing the others.",
            ),
            (
                "--reset-semaphore",
                "Frees every permit of the named semaphores; fails naming those with no "
                "permit held.",
            ),
        ):
            action.add_argument(flag, nargs="+", metavar="NAME", help=help_text)
        action.add_argument(
            "--reset-all",
            action="store_true",
            help=(
                "Force-releases every lock of this app in the cache alias; semaphores are "
                "left alone (see --reset-semaphore)."
            ),
        )
        selection = parser.add_argument_group(
            "filters",
            "Narrow the listing (table or --json) and --reset-all to the locks that match "
            "every filter given.",
        )
        selection.add_argument(
            "--host", help="Selects locks whose holder runs on HOST (exact, any case)."
        )
        selection.add_argument("--pid", help="Selects locks whose holder has process id PID.")
        selection.add_argument(
            "--label", help="Selects locks whose holder gave exactly this label."
        )
        selection.add_argument(
            "--older-than",
            metavar="DURATION",
            help="Selects locks held for at least DURATION: seconds (90) or 90s, 10m, 2h, 1h30m.",
        )
        figures = parser.add_argument_group("contention figures")
        figures.add_argument(
            "--stats",
            action="store_true",
            help=(
                "Prints the contention figures of each lock class instead of the held locks: "
                "acquisitions, how many waited, gave up or were lost, wait and hold times "
                "(p50, p99). Needs STATS in the alias's MUTEX block; with --json, as an object."
            ),
        )
        figures.add_argument(
            "--minutes",
            type=int,
            choices=range(1, 61),
            default=60,
            metavar="{1..60}",
            help="The last minutes --stats covers (default 60, all that is kept).",
        )
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Tells Django to NOT prompt the user for input of any kind.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias: str = options["using"]
        lock_filter = _lock_filter(options)
        # --reset and --reset-semaphore are one path, for the kind of hold they name.
        kind = "lock" if options["reset"] else "semaphore"
        names = options["reset"] or options["reset_semaphore"]
        if names and lock_filter:
            raise CommandError(
                f"{RESET_FLAGS[kind]} takes {kind} names; the filters "
                f"({', '.join(map(_flag, FILTER_FIELDS))}) go with a listing or --reset-all."
            )
        if options["stats"] and (names or options["reset_all"] or lock_filter):
            raise CommandError(
                "--stats shows the contention figures; it takes no reset flag and no filter."
            )
        with self.lock_errors(alias):
            if options["stats"]:
                self.show_stats(alias, options["minutes"], as_json=options["json"])
            elif names:
                self.reset_names(alias, names, kind)
            elif options["reset_all"] and lock_filter:
                self.reset_selection(alias, lock_filter, interactive=options["interactive"])
            elif options["reset_all"]:
                self.reset_everything(alias, interactive=options["interactive"])
            else:
                found = introspection.listed_locks(using=alias)
                # A shared lock is narrowed to the holders the filter selects.
                locks = [item.held for item in lock_filter.narrow(found)]
                if options["json"]:
                    semaphores = [] if lock_filter else introspection.held_semaphores(alias)
                    self.stdout.write(json.dumps(json_entries(locks, semaphores), indent=2))
                else:
                    self.show_table(alias, locks, lock_filter, total=len(found))
                    if not lock_filter:
                        for line in introspection.semaphore_lines(alias):
                            self.stdout.write(terminal_safe(line))

    @contextmanager
    def lock_errors(self, alias: str) -> Iterator[None]:
        """Turn a configuration or connection problem into one line on stderr (CommandError)."""
        try:
            yield
        # TypeError, ValueError: a bad lock name, or a member of a quorum.
        except (ImproperlyConfigured, TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        except LockBackendUnavailable as exc:
            if exc.__cause__ is None:
                # A quorum's own error already names the masters it could not reach.
                raise CommandError(str(exc)) from exc
            raise CommandError(
                f"Redis for cache {alias!r} is unavailable: {exc.__cause__}"
            ) from exc

    def show_table(
        self, alias: str, locks: list[HeldLock], lock_filter: LockFilter, *, total: int
    ) -> None:
        """Print the locks as a table under the line naming the Redis that was read.

        With a filter, ``total`` is how many locks are held in all, matching or not.
        """
        members = introspection.quorum_members(alias)
        # Which server was read answers "why is my lock not listed?" at once.
        self.stdout.write(terminal_safe(source_line(alias, members)))
        # So does an eviction: a held lock evicted is simply not listed. (Not in
        # --json, whose top level is an array of entries, with no place for it.)
        for policy in introspection.eviction_policies(alias):
            evictions = policy.evictions_line()
            if evictions is not None:
                self.stdout.write(self.style.WARNING(terminal_safe(evictions)))
        chosen = terminal_safe(lock_filter.describe()) if lock_filter else ""
        self._write_table(COLUMNS, table_rows(locks))
        self.stdout.write(_summary(alias, locks, members, chosen, total))

    def show_stats(self, alias: str, minutes: int, *, as_json: bool) -> None:
        """Print the contention figures of ``alias`` over its last ``minutes``, hottest first."""
        report = stats.read_stats(alias, minutes)
        if as_json:
            entry = {
                "alias": alias,
                "minutes": minutes,
                "windows": list(report.windows),
                "classes": [figures.as_dict() for figures in report.classes],
            }
            self.stdout.write(json.dumps(entry, indent=2))
            return
        self.stdout.write(terminal_safe(source_line(alias, introspection.quorum_members(alias))))
        self._write_table(STATS_COLUMNS, stats_rows(report))
        counted = "" if get_settings(alias).stats else f" (STATS is off for cache {alias!r})"
        classes = len(report.classes)
        self.stdout.write(
            f"{classes} lock class{'' if classes == 1 else 'es'} in the last "
            f"{_plural(minutes, 'minute')}{counted}."
        )

    def _write_table(self, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        """Print ``rows`` aligned under a heading of ``columns``; nothing when there are none."""
        if not rows:
            return
        heading, *lines = _aligned([columns, *rows])
        self.stdout.write(self.style.MIGRATE_HEADING(heading))
        for line in lines:
            self.stdout.write(line)

    def confirmed(self, what: str, caveat: str = "") -> bool:
        """Ask whether to force-release ``what``; unless told "yes", say it is cancelled.

        From cron, CI or a script, standard input is closed or at its end:
        ``input()`` would raise EOFError, printed as a traceback.
        """
        try:
            answer = input(
                f"You have requested to force-release {what}.\n"
                "Their holders keep running without the lock and only learn of it when\n"
                f"they next renew or finish. {caveat}Are you sure you want to do this?\n\n"
                "    Type 'yes' to continue, or 'no' to cancel: "
            )
        except (EOFError, RuntimeError) as exc:  # RuntimeError: no sys.stdin at all
            raise CommandError(
                "Confirmation needs a terminal, and standard input is closed or at its end; "
                "pass --noinput to reset without asking."
            ) from exc
        if answer != "yes":
            self.stdout.write("Reset cancelled.")
        return answer == "yes"

    def reset_names(self, alias: str, names: list[str], kind: str) -> None:
        """Reset each named lock (or semaphore); fail naming those not held.

        A name not held is most often a typo or the other kind's name, so the
        command exits non-zero for a script to notice, after resetting the others.
        """
        # Refuse a member of a quorum before resetting any name.
        introspection.ensure_resettable(alias, kind)
        missing = []
        for name in names:
            if kind == "lock":
                freed = int(introspection.reset(name, using=alias))
                done = f"Released {name!r}."
            else:
                freed = introspection.reset_semaphore(name, using=alias)
                done = f"Reset semaphore {terminal_safe(name)!r}: freed {_plural(freed, 'permit')}."
            if freed:
                self.stdout.write(self.style.SUCCESS(done))
            else:
                missing.append(name)
        if missing:
            raise CommandError(_not_held(alias, missing, kind))

    def reset_everything(self, alias: str, *, interactive: bool) -> None:
        # Refuse a member of a quorum before asking, not after a "yes".
        introspection.ensure_resettable(alias)
        if interactive:
            # Counting first also reports a wrong alias or a dead Redis before asking.
            held = _plural(len(introspection.held_locks(using=alias)), "lock")
            if not self.confirmed(f"every lock in cache {alias!r} ({held} held now)"):
                return
        count = introspection.reset_all(using=alias)
        released = f"Released {_plural(count, 'lock')} in cache {alias!r}."
        self.stdout.write(self.style.SUCCESS(released))
        kept = introspection.held_semaphores(alias)
        if kept:
            self.stdout.write(
                f"{_plural(len(kept), 'semaphore')} with permits held left alone "
                "(--reset-all releases locks only; use --reset-semaphore NAME)."
            )

    def reset_selection(self, alias: str, lock_filter: LockFilter, *, interactive: bool) -> None:
        """Reset the locks ``lock_filter`` selects, each only while its listed holder has it."""
        introspection.ensure_resettable(alias)
        listed = introspection.listed_locks(using=alias)
        # A shared lock narrowed to its matching holders: only they are reset.
        selection = lock_filter.narrow(listed)
        # Shown with --noinput too, so a deploy script's log says what it reset.
        self.show_table(alias, [item.held for item in selection], lock_filter, total=len(listed))
        if not selection:
            self.stdout.write("Nothing to reset.")
            return
        shared = any(item.held.shared for item in selection)
        note = " (of a shared lock, only the holders listed)" if shared else ""
        if interactive and not self.confirmed(
            f"the {_plural(len(selection), 'lock')} listed above{note}",
            "A lock that changes hands before you answer\nis left to its new holder. ",
        ):
            return
        released = 0
        try:
            for item in selection:
                if introspection.reset_listed(item, using=alias):
                    released += 1
                    continue
                gone = (
                    ": none of the shared holders listed holds it any more"
                    if item.held.shared
                    else " was released or changed hands since it was listed"
                )
                self.stdout.write(self.style.WARNING(f"{item.held.name!r}{gone}; left alone."))
        finally:
            # Also when Redis fails half-way: say how far the reset got.
            selected = _plural(len(selection), "selected lock")
            done = selected if released == len(selection) else f"{released} of the {selected}"
            self.stdout.write(self.style.SUCCESS(f"Released {done} in cache {alias!r}."))
