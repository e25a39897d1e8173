"""``manage.py locks``: list the locks held in one cache alias, or force-release them.

A thin shell over :mod:`django_redis_mutex.introspection`, which the admin
inspector shares, so both see and reset exactly the same keys (found with SCAN
within this app's namespace, never KEYS, never FLUSHDB). ``--using`` may name a
quorum alias (one whose MUTEX block has a QUORUM): its locks are listed when a
majority of the masters hold them, its semaphores' permits when enough masters
hold them for their limit, and both are reset on every master. A member alias
of a quorum is refused for resets, which would clear one master only.

Lock names and labels are often built from request data, so the table shows
every field with control and bidi characters escaped (``\\x1b``, ``\\u202e``):
a name cannot clear the operator's screen, retitle the terminal or reorder
what is printed after it. ``--json`` keeps the exact values (JSON escapes them).

``--host``, ``--pid``, ``--label`` and ``--older-than`` narrow the listing and
``--reset-all`` to the locks a :class:`~django_redis_mutex.filters.LockFilter`
matches. A filtered reset shows its selection first and resets each lock only
while the acquisition that was listed still holds it.

A lock held shared (``mutex(name, shared=True)``) is one entry with
``(shared)`` after its name and a line per holder below it; ``--json`` gives
it ``"shared": true`` and its ``holders``. The filters select holders of a
shared lock: a filtered listing shows, and a filtered ``--reset-all`` frees,
only the holders that match, leaving the others their hold.

Under the line naming the Redis read, a warning line says how many keys
that server evicted since it started, when it may evict keys (a
``maxmemory`` with a policy other than ``noeviction``) or did. ``--json``
is unchanged: its top level is an array of entries, with no place for it.

Counting semaphores are listed too, unless a filter is given (the filters
select locks): below the table, and in ``--json`` as entries whose ``kind`` is
``"semaphore"`` (every lock entry has ``"kind": "lock"``). A semaphore is reset
only by ``--reset-semaphore NAME``, never by ``--reset`` or ``--reset-all``, so a
lock and a semaphore of the same name are never confused and clearing stuck
locks never takes permits from their holders.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_redis_mutex.client import get_client
from django_redis_mutex.display import duration, terminal_safe
from django_redis_mutex.exceptions import LockBackendUnavailable
from django_redis_mutex.filters import FILTER_FIELDS, FilterError, LockFilter
from django_redis_mutex.introspection import (
    HeldLock,
    HeldSemaphore,
    ListedLock,
    ensure_resettable,
    eviction_policies,
    held_locks,
    held_semaphores,
    listed_locks,
    quorum_members,
    reset,
    reset_all,
    reset_listed,
    reset_semaphore,
    seconds_since,
    semaphore_lines,
)
from django_redis_mutex.owners import Owner

COLUMNS = ("NAME", "HOST", "PID", "THREAD", "LABEL", "HELD FOR", "TIME LEFT", "FENCE", "WAITERS")


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


# After a shared lock's name, and in the name column of its further holders' lines.
SHARED_MARK = "(shared)"
MORE_HOLDERS = "  + shared"


def table_rows(locks: list[HeldLock]) -> list[tuple[str, ...]]:
    """Return the table's rows of display strings, in COLUMNS order, escaped for a terminal.

    One row per lock; a lock held shared has one row per holder, the first
    naming the lock with ``(shared)`` and the count of waiters.
    """
    rows: list[tuple[str, ...]] = []
    for lock in locks:
        if not lock.shared:
            rows.append(
                (
                    terminal_safe(lock.name),
                    *_owner_cells(lock.owner),
                    duration(lock.held_for),
                    duration(lock.time_left),
                    str(lock.fence),
                    str(lock.waiters),
                )
            )
            continue
        for index, holder in enumerate(lock.holders):
            first = index == 0
            rows.append(
                (
                    f"{terminal_safe(lock.name)} {SHARED_MARK}" if first else MORE_HOLDERS,
                    *_owner_cells(holder.owner),
                    duration(seconds_since(holder.acquired_at)),
                    duration(holder.time_left),
                    str(holder.fence),
                    str(lock.waiters) if first else "",
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


def _selected(listed: list[ListedLock], lock_filter: LockFilter) -> list[ListedLock]:
    """Return the locks ``lock_filter`` selects, a shared one narrowed to its matching holders."""
    if not lock_filter:
        return listed
    return [chosen for item in listed if (chosen := lock_filter.select(item)) is not None]


def json_entries(locks: list[HeldLock], semaphores: list[HeldSemaphore]) -> list[dict[str, Any]]:
    """Return the ``--json`` array: the locks, then the semaphores, each tagged with its kind.

    One array, as before semaphores were listed, so a reader of locks only
    keeps working by skipping entries whose ``kind`` is not ``"lock"``.
    """
    return [
        *({"kind": "lock", **lock.as_dict()} for lock in locks),
        *({"kind": "semaphore", **held.as_dict()} for held in semaphores),
    ]


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
        action.add_argument(
            "--reset",
            nargs="+",
            metavar="NAME",
            help=(
                "Force-releases the named locks; fails naming those not held, after "
                "releasing the others."
            ),
        )
        action.add_argument(
            "--reset-semaphore",
            nargs="+",
            metavar="NAME",
            help=(
                "Frees every permit of the named semaphores; fails naming those with no "
                "permit held."
            ),
        )
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
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Tells Django to NOT prompt the user for input of any kind.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias: str = options["using"]
        lock_filter = self.lock_filter(options)
        for names_option, kind in (("reset", "lock"), ("reset_semaphore", "semaphore")):
            if lock_filter and options[names_option]:
                raise CommandError(
                    f"{_flag(names_option)} takes {kind} names; the filters "
                    f"({', '.join(map(_flag, FILTER_FIELDS))}) go with a listing or --reset-all."
                )
        with self.lock_errors(alias):
            if options["reset"]:
                self.reset_names(alias, options["reset"])
            elif options["reset_semaphore"]:
                self.reset_semaphore_names(alias, options["reset_semaphore"])
            elif options["reset_all"] and lock_filter:
                self.reset_selection(alias, lock_filter, interactive=options["interactive"])
            elif options["reset_all"]:
                self.reset_everything(alias, interactive=options["interactive"])
            else:
                found = listed_locks(using=alias)
                # A shared lock is narrowed to the holders the filter selects.
                locks = [item.held for item in _selected(found, lock_filter)]
                if options["json"]:
                    semaphores = [] if lock_filter else held_semaphores(alias)
                    self.stdout.write(json.dumps(json_entries(locks, semaphores), indent=2))
                else:
                    self.show_table(alias, locks, lock_filter, total=len(found))
                    if not lock_filter:
                        for line in semaphore_lines(alias):
                            self.stdout.write(terminal_safe(line))

    def reset_semaphore_names(self, alias: str, names: list[str]) -> None:
        """Free every permit of each named semaphore; fail naming those with none held.

        A name with no permit held is most often a typo or a lock's name: the
        command exits non-zero so a script notices, after resetting the others.
        """
        # Refuse a member of a quorum before resetting any name, as for locks.
        ensure_resettable(alias, "semaphore")
        missing = []
        for name in names:
            freed = reset_semaphore(name, using=alias)
            if freed:
                self.stdout.write(
                    self.style.SUCCESS(
                        f"Reset semaphore {terminal_safe(name)!r}: "
                        f"freed {_plural(freed, 'permit')}."
                    )
                )
            else:
                missing.append(name)
        if missing:
            raise CommandError(self.not_held_semaphores(alias, missing))

    def not_held_semaphores(self, alias: str, names: list[str]) -> str:
        """Say which semaphores had no permit held, and which of those names are held locks."""
        shown = ", ".join(repr(terminal_safe(name)) for name in names)
        message = f"No permit of semaphore {shown} is held in cache {alias!r}; nothing reset."
        locks = sorted({lock.name for lock in held_locks(using=alias)} & set(names))
        if locks:
            as_locks = " ".join(repr(terminal_safe(name)) for name in locks)
            message += f" A lock of that name is held: use --reset {as_locks}."
        return message

    def lock_filter(self, options: dict[str, Any]) -> LockFilter:
        """Return the filter the options ask for; a bad value is a CommandError naming its flag."""
        try:
            return LockFilter.from_strings(**{field: options.get(field) for field in FILTER_FIELDS})
        except FilterError as exc:
            raise CommandError(f"{_flag(exc.field)} {exc.problem}") from exc

    @contextmanager
    def lock_errors(self, alias: str) -> Iterator[None]:
        """Turn a configuration or connection problem into one line on stderr (CommandError)."""
        try:
            yield
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        except LockBackendUnavailable as exc:
            if exc.__cause__ is None:
                # A quorum's own error already names the masters it could not reach.
                raise CommandError(str(exc)) from exc
            raise CommandError(
                f"Redis for cache {alias!r} is unavailable: {exc.__cause__}"
            ) from exc
        except (TypeError, ValueError) as exc:  # a bad lock name, or a member of a quorum
            raise CommandError(str(exc)) from exc

    def source_line(self, alias: str) -> str:
        """Return the line naming the cache alias and the Redis (or the masters) it read."""
        members = quorum_members(alias)
        if members:
            where = "; ".join(f"{member!r} at {describe_redis(member)}" for member in members)
            return f"Cache {alias!r} (a quorum of {where}):"
        return f"Cache {alias!r} at {describe_redis(alias)}:"

    def show_table(
        self,
        alias: str,
        locks: list[HeldLock],
        lock_filter: LockFilter | None = None,
        *,
        total: int | None = None,
    ) -> None:
        """Print the locks as a table under the line naming the Redis that was read.

        With a filter, ``total`` is how many locks are held in all, matching or not.
        """
        # Which server was read answers "why is my lock not listed?" at once.
        self.stdout.write(terminal_safe(self.source_line(alias)))
        # So does an eviction: a held lock evicted is simply not listed.
        for policy in eviction_policies(alias):
            evictions = policy.evictions_line()
            if evictions is not None:
                self.stdout.write(self.style.WARNING(terminal_safe(evictions)))
        chosen = terminal_safe(lock_filter.describe()) if lock_filter else ""
        if not locks:
            if chosen and total:
                self.stdout.write(
                    f"No held lock in cache {alias!r} matches the filter ({chosen}); "
                    f"{_plural(total, 'lock')} held."
                )
            elif chosen:
                self.stdout.write(
                    f"No locks are held in cache {alias!r}, so none matches the filter ({chosen})."
                )
            else:
                self.stdout.write(f"No locks are held in cache {alias!r}.")
            return
        rows = table_rows(locks)
        widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]

        def line(cells: tuple[str, ...]) -> str:
            padded = (cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
            return "  ".join(padded).rstrip()

        self.stdout.write(self.style.MIGRATE_HEADING(line(COLUMNS)))
        for row in rows:
            self.stdout.write(line(row))
        members = quorum_members(alias)
        where = f" (on a majority of {', '.join(members)})" if members else ""
        shared = [lock for lock in locks if lock.shared]
        if shared:
            holders = sum(len(lock.holders) for lock in shared)
            of = "matching " if chosen else ""
            where += f" ({len(shared)} shared, by {_plural(holders, of + 'holder')})"
        if chosen:
            verb = "matches" if len(locks) == 1 else "match"
            self.stdout.write(
                f"{len(locks)} of {_plural(total or 0, 'lock')} held in cache {alias!r}{where} "
                f"{verb} the filter ({chosen})."
            )
            return
        self.stdout.write(f"{_plural(len(locks), 'lock')} held in cache {alias!r}{where}.")

    def ask(self, question: str) -> str:
        """Return the answer typed to ``question``; fail in one line when nothing can answer.

        From cron, CI or a script, standard input is closed or at its end:
        ``input()`` would raise EOFError, printed as a traceback.
        """
        try:
            return input(question)
        except (EOFError, RuntimeError) as exc:  # RuntimeError: no sys.stdin at all
            raise CommandError(
                "Confirmation needs a terminal, and standard input is closed or at its end; "
                "pass --noinput to reset without asking."
            ) from exc

    def reset_names(self, alias: str, names: list[str]) -> None:
        """Force-release each named lock; fail naming those that were not held.

        The rule of ``--reset-semaphore`` too: a name not held is most often a
        typo or a semaphore's name, so the command exits non-zero for a script
        to notice, after releasing the others.
        """
        missing = []
        for name in names:
            if reset(name, using=alias):
                self.stdout.write(self.style.SUCCESS(f"Released {name!r}."))
            else:
                missing.append(name)
        if missing:
            raise CommandError(self.not_held_locks(alias, missing))

    def not_held_locks(self, alias: str, names: list[str]) -> str:
        """Say which locks were not held, and which of those names are held semaphores."""
        shown = ", ".join(repr(terminal_safe(name)) for name in names)
        message = f"No lock {shown} is held in cache {alias!r}; nothing reset."
        semaphores = sorted({held.name for held in held_semaphores(alias)} & set(names))
        if semaphores:
            as_semaphores = " ".join(repr(terminal_safe(name)) for name in semaphores)
            message += (
                " A semaphore of that name has permits held: "
                f"use --reset-semaphore {as_semaphores}."
            )
        return message

    def reset_everything(self, alias: str, *, interactive: bool) -> None:
        # Refuse a member of a quorum before asking, not after a "yes".
        ensure_resettable(alias)
        if interactive:
            # Counting first also reports a wrong alias or a dead Redis before asking.
            held = len(held_locks(using=alias))
            confirm = self.ask(
                f"You have requested to force-release every lock in cache {alias!r} "
                f"({_plural(held, 'lock')} held now).\n"
                "Their holders keep running without the lock and only learn of it when\n"
                "they next renew or finish. Are you sure you want to do this?\n\n"
                "    Type 'yes' to continue, or 'no' to cancel: "
            )
        else:
            confirm = "yes"
        if confirm != "yes":
            self.stdout.write("Reset cancelled.")
            return
        count = reset_all(using=alias)
        released = f"Released {_plural(count, 'lock')} in cache {alias!r}."
        self.stdout.write(self.style.SUCCESS(released))
        kept = held_semaphores(alias)
        if kept:
            self.stdout.write(
                f"{_plural(len(kept), 'semaphore')} with permits held left alone "
                "(--reset-all releases locks only; use --reset-semaphore NAME)."
            )

    def reset_selection(self, alias: str, lock_filter: LockFilter, *, interactive: bool) -> None:
        """Reset the locks ``lock_filter`` selects, each only while its listed holder has it."""
        ensure_resettable(alias)
        listed = listed_locks(using=alias)
        # A shared lock narrowed to its matching holders: only they are reset.
        selection = _selected(listed, lock_filter)
        # Shown with --noinput too, so a deploy script's log says what it reset.
        self.show_table(alias, [item.held for item in selection], lock_filter, total=len(listed))
        if not selection:
            self.stdout.write("Nothing to reset.")
            return
        shared_note = (
            " (of a shared lock, only the holders listed)"
            if any(item.held.shared for item in selection)
            else ""
        )
        if interactive:
            confirm = self.ask(
                f"You have requested to force-release the {_plural(len(selection), 'lock')} "
                f"listed above{shared_note}.\n"
                "Their holders keep running without the lock and only learn of it when\n"
                "they next renew or finish. A lock that changes hands before you answer\n"
                "is left to its new holder. Are you sure you want to do this?\n\n"
                "    Type 'yes' to continue, or 'no' to cancel: "
            )
            if confirm != "yes":
                self.stdout.write("Reset cancelled.")
                return
        released = 0
        try:
            for item in selection:
                if reset_listed(item, using=alias):
                    released += 1
                elif item.held.shared:
                    self.stdout.write(
                        self.style.WARNING(
                            f"{item.held.name!r}: none of the shared holders listed holds it "
                            "any more; left alone."
                        )
                    )
                else:
                    self.stdout.write(
                        self.style.WARNING(
                            f"{item.held.name!r} was released or changed hands since it was "
                            "listed; left alone."
                        )
                    )
        finally:
            # Also when Redis fails half-way: say how far the reset got.
            selected = _plural(len(selection), "selected lock")
            done = selected if released == len(selection) else f"{released} of the {selected}"
            self.stdout.write(self.style.SUCCESS(f"Released {done} in cache {alias!r}."))
