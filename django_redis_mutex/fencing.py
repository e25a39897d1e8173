"""Fencing tokens that the database checks: refuse the late write of a holder that lost its lock.

A Redis lock is a lease. A holder paused longer than its lease (a GC pause,
SIGSTOP, a VM migration) wakes up still believing it holds the lock, and
nothing on the Redis side can stop the write it is about to make. The storage
can: every acquisition of a name gets a larger ``Mutex.fence``, so if each
write of a row carries its writer's fence and the database refuses a fence
smaller than the last one that wrote the row, the paused holder's write is
refused once a newer holder has written (or claimed) the row.

:class:`FencedModel` adds the ``last_fence`` column and the writes that check
it. The check is ONE statement on the table that holds ``last_fence``::

    UPDATE ... SET <its fields>, last_fence = %(fence)s
    WHERE pk = %(pk)s AND last_fence <= %(fence)s

so no other writer can come between the check and the write: the database's
row lock orders concurrent writers, and a writer that waited on it re-checks
the condition against the row as the other left it (PostgreSQL, READ COMMITTED;
MySQL/MariaDB read the latest row version for an UPDATE) or never ran
concurrently at all (SQLite).

A child of a concrete fenced model (multi-table inheritance) keeps
``last_fence`` in its parent's table. Django would write such a row as a
SELECT of the matching keys followed by ``UPDATE ... WHERE id IN (...)``, with
the fence checked only by the SELECT: a newer write committed in between would
be overwritten and the fence lowered. So a fenced write splits the values by
table itself: the conditional UPDATE of the fence table first and, only if it
changed the row (which it now holds locked), plain UPDATEs of the other
tables by primary key, all in one ``transaction.atomic()``. A refused or
failed write changes no table.

Shapes whose check could not stay in that one statement are refused with a
``ValueError`` or ``TypeError`` saying what to do instead, before anything is
written: a queryset filtered through a join (a related lookup) or with a
subquery or raw SQL, any filter on a multi-table child's queryset, a sliced,
distinct or combined queryset, values for the primary key or a parent link,
and values for a parent reached through a link that is not the primary key
(the second parent of multiple inheritance). Filters on the fenced table's
own columns are fine: they go into the same UPDATE.

Semantics, chosen on purpose:

* **Equal fences are allowed** (``<=``). A holder may write the same row
  several times under one acquisition (a nested reentrant block shares the
  acquisition, and so its fence), or retry a write whose reply it never saw.
  Another holder never has the same fence: fences strictly increase with each
  acquisition of a name.
* **Exclusive holds only.** A fenced write through a ``Mutex`` held shared
  is refused with ``ValueError`` before anything is written: readers holding
  the lock at the same time have different fences, so one reader's write
  would refuse another current reader's as stale. Take the lock exclusively
  to write fenced (a shared handle's ``fence`` passed as a number cannot be
  told apart; do not).
* **One lock name per row.** Fences are ordered per name; rows fenced by two
  different names are not protected from each other.
* **Claim before you read.** The fence protects the row from holders that
  come *before* the last writer. A newer holder that reads a row, while the
  old one is still paused, and writes it later still wins, but it cannot know
  that the old one's write slipped in between. Bump the fence first
  (``Model.objects.update_fenced(pk, lock)`` with no values) and every older
  holder is refused from that moment.
* **Creating rows.** ``save_fenced()`` on an unsaved instance inserts it with
  ``last_fence = fence``; there is no earlier row to compare with. If the
  instance's primary key is set and that row already exists, the insert turns
  into the fenced update, so a late holder cannot overwrite a newer holder's
  row by "creating" it again. Other unique constraints are not looked at: an
  insert that violates one raises ``IntegrityError`` as ``save()`` would. A
  new multi-table child with its key set is inserted into every table
  (Django 5.0+; refused on older Django, which would update an existing
  parent row unfenced), and is refused when only a parent row has that key.
* **Not fenced:** deletes, ``QuerySet.update()`` and plain ``save()`` (which
  writes ``last_fence`` as the instance holds it, and so can lower it). A
  model that needs fenced deletes can mark rows deleted with a fenced write.
* The fenced update is a queryset update: it sends no ``pre_save`` /
  ``post_save`` signals (the insert path is a ``save()`` and does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar

import django
from django.core.exceptions import FieldError
from django.db import IntegrityError, models, router, transaction
from django.db.models.expressions import BaseExpression, RawSQL, Subquery
from django.db.models.lookups import Lookup
from django.db.models.sql.query import Query
from django.db.models.sql.where import ExtraWhere, WhereNode

from .exceptions import LockNotOwned, StaleFence
from .lock import Mutex

if TYPE_CHECKING:
    from django.db.models.fields import Field

__all__ = ["FENCE_FIELD", "Fence", "FencedManager", "FencedModel", "FencedQuerySet"]

#: The column holding the fence of the last write that reached a row.
FENCE_FIELD = "last_fence"

#: What a fenced write accepts: a fencing token, or the held Mutex whose token to use.
Fence: TypeAlias = int | Mutex

_M = TypeVar("_M", bound="FencedModel")


def _resolve_fence(fence: Fence) -> tuple[int, str | None]:
    """Return the token to write with and the lock name, if ``fence`` is a Mutex.

    A Mutex that holds nothing has no token to write with: LockNotOwned,
    rather than a write that nothing fences. A Mutex held shared is refused:
    readers holding it at the same time each have a fence of their own, so
    one reader's write would make another current reader's write stale.
    """
    if isinstance(fence, Mutex):
        if fence.shared:
            raise ValueError(
                f"Cannot write fenced by lock {fence.name!r}: this handle holds it shared, and "
                "other readers holding it at the same time have fences of their own, so one "
                "reader's write would refuse another's. Take the lock exclusively "
                "(without shared=True) to write fenced."
            )
        token = fence.fence
        if token is None:
            raise LockNotOwned(
                f"Cannot write fenced by lock {fence.name!r}: this handle does not hold it.",
                name=fence.name,
            )
        return token, fence.name
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError(f"fence must be an int or a held Mutex, not {type(fence).__name__}.")
    if fence < 0:
        raise ValueError(f"fence must not be negative, got {fence}.")
    return fence, None


def _target(model: type[models.Model], pk: Any) -> str:
    return f"{model._meta.label} pk={pk!r}"


#: Django 5.0 added ``save(force_insert=(Parent, ...))``, which inserts the
#: parents' rows of a multi-table child too, where older versions update a
#: parent row that already exists (without the fence check).
_FORCE_INSERT_PARENTS = django.VERSION >= (5, 0)


def _concrete(model: type[models.Model]) -> type[models.Model]:
    return model._meta.concrete_model or model


def _fence_model(model: type[models.Model]) -> type[models.Model]:
    """Return the concrete model whose table holds ``last_fence`` for rows of ``model``."""
    field = model._meta.get_field(FENCE_FIELD)
    return _concrete(field.model)


def _shares_primary_key(model: type[models.Model], ancestor: type[models.Model]) -> bool:
    """Whether the ``ancestor`` row of a ``model`` row has the same primary key value.

    True for the model itself and for parents reached through primary-key
    parent links only (plain multi-table inheritance). False for a second
    parent of multiple inheritance, whose link is an ordinary column: its row
    has a key of its own, which a write by ``pk`` cannot name.
    """
    if model is ancestor:
        return True
    return all(
        path.join_field.primary_key and all(target.primary_key for target in path.target_fields)
        for path in model._meta.get_path_to_parent(ancestor)
    )


def _is_parent_link(field: Any) -> bool:
    remote = getattr(field, "remote_field", None)
    return bool(getattr(remote, "parent_link", False))


def _tables(model: type[models.Model]) -> list[type[models.Model]]:
    """Return the concrete models whose tables hold ``model``'s rows, root parent first."""
    return [*reversed(model._meta.get_parent_list()), model]


def _split_values(model: type[models.Model], values: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """Group ``values`` by the concrete model whose table holds each column.

    Raise, before anything is written, for what a fenced write cannot do: set
    ``last_fence``, change the primary key or a parent link (the keys the
    write finds the row by), or write a parent that does not share the
    primary key (see :func:`_shares_primary_key`).
    """
    if FENCE_FIELD in values:
        raise ValueError(
            f"Do not set {FENCE_FIELD!r} in a fenced write; it is set to the writer's fence."
        )
    label = model._meta.label
    tables: dict[Any, dict[str, Any]] = {}
    for key, value in values.items():
        # FieldDoesNotExist names the model and the key.
        field = model._meta.pk if key == "pk" else model._meta.get_field(key)
        if not field.concrete or field.many_to_many:
            raise FieldError(
                f"Cannot update model field {field!r} in a fenced write "
                "(only non-relations and foreign keys permitted)."
            )
        if getattr(field, "primary_key", False) or _is_parent_link(field):
            raise ValueError(
                f"Cannot change {key!r} of {label} in a fenced write: it is the primary key "
                "or a parent link, which the write finds the row by."
            )
        owner = _concrete(field.model)
        if not _shares_primary_key(model, owner):
            raise TypeError(
                f"Cannot write {key!r} of {label} in a fenced write: the column is in the "
                f"table of {owner._meta.label}, which {label} reaches through a parent link "
                "that is not its primary key, so that row has a key of its own. Leave the "
                "field out (save_fenced(update_fields=[...])) and write it under the lock "
                "in a separate statement."
            )
        tables.setdefault(owner, {})[key] = value
    return tables


def _unsafe_part(node: Any) -> str | None:
    """Name what in a filter cannot be checked inside one single-table UPDATE, if anything."""
    if isinstance(node, (ExtraWhere, RawSQL)):
        return "raw SQL (extra() or RawSQL)"
    if isinstance(node, (Query, Subquery, models.QuerySet)):
        return "a subquery"
    parts: Iterable[Any]
    if isinstance(node, WhereNode):
        parts = node.children
    elif isinstance(node, Lookup):
        parts = (node.lhs, node.rhs)
    elif isinstance(node, BaseExpression):
        parts = node.get_source_expressions()
    elif isinstance(node, (list, tuple)):
        parts = node
    else:
        return None
    for part in parts:
        found = _unsafe_part(part)
        if found is not None:
            return found
    return None


def _fence_queryset(
    queryset: models.QuerySet[Any],
    model: type[models.Model],
    fence_model: type[models.Model],
    db: str,
) -> models.QuerySet[Any]:
    """Return the queryset the conditional UPDATE runs on; refuse shapes that would split it.

    Django turns an UPDATE whose filter needs another table into a SELECT of
    the keys (MySQL/MariaDB, and every multi-table child) or a subquery
    (PostgreSQL) holding the fence check, and neither is re-checked against a
    newer write that commits in between. So the filter must name only the
    fence table's own columns.
    """
    label = queryset.model._meta.label
    query = queryset.query
    if query.is_sliced:
        raise TypeError(
            f"Cannot update_fenced() through a sliced {label} queryset; "
            "slice after, or filter instead."
        )
    if query.combinator:
        raise TypeError(
            f"Cannot update_fenced() through a combined ({query.combinator}) {label} queryset."
        )
    if query.distinct:
        raise TypeError(f"Cannot update_fenced() through a {label} queryset after distinct().")
    if model is not fence_model:
        if query.where:
            raise ValueError(
                f"Cannot update_fenced() through a filtered {label} queryset: its "
                f"{FENCE_FIELD!r} column is in the table of {fence_model._meta.label}, and a "
                "filter could not be checked in the one UPDATE of that table that refuses "
                f"stale writes. Use the unfiltered manager ({queryset.model.__name__}"
                ".objects.update_fenced(pk, ...)) and check other conditions under the lock."
            )
        manager: models.Manager[Any] = fence_model._base_manager
        return manager.using(db)
    unsafe = _unsafe_part(query.where)
    probe = query.chain()
    probe.get_initial_alias()
    if unsafe is None and probe.count_active_tables() > 1:
        unsafe = "a join (a lookup through a relation)"
    if unsafe is not None:
        raise ValueError(
            f"Cannot update_fenced() through a {label} queryset filtered with {unsafe}: "
            "Django would check the fence in a separate SELECT or a subquery, which a "
            "concurrent newer write is not checked against. Filter on the model's own "
            "columns only, or pass just the primary key and check related rows under the lock."
        )
    # Ordering means nothing for one row, and a related one would add a join.
    unordered: models.QuerySet[Any] = queryset.using(db).order_by()
    return unordered


def _missing(model: type[Any], pk: Any, token: int, name: str | None) -> Exception:
    by = f" of lock {name!r}" if name is not None else ""
    error: type[Exception] = model.DoesNotExist
    return error(f"No {_target(model, pk)} to write with fence {token}{by}.")


def _claim(
    fenced: models.QuerySet[Any],
    readback: models.QuerySet[Any],
    pk: Any,
    token: int,
    name: str | None,
    values: dict[str, Any],
) -> None:
    """Run the conditional UPDATE of the fence table; raise if it changed no row."""
    # The UPDATE alone decides; a refused one is read back only to say why. A
    # second try covers a row that appeared (or that a plain save() lowered)
    # between the refused update and the read-back.
    model = readback.model
    current = 0
    for _ in range(2):
        if fenced.filter(pk=pk, last_fence__lte=token).update(**values, last_fence=token):
            return
        found = readback.filter(pk=pk).values_list(FENCE_FIELD, flat=True).first()
        if found is None:
            raise _missing(model, pk, token, name)
        current = int(found)
        if current > token:
            break
    raise StaleFence(name, fence=token, current=current, target=_target(model, pk))


def _write(
    queryset: models.QuerySet[Any], pk: Any, token: int, name: str | None, values: dict[str, Any]
) -> None:
    """Update row ``pk`` with ``values`` unless a larger fence than ``token`` already wrote it.

    The fence table's conditional UPDATE goes first; the other tables of a
    multi-table child are written only after it changed the row, in the same
    transaction, so a refused write changes nothing anywhere.
    """
    model = _concrete(queryset.model)
    fence_model = _fence_model(model)
    if not _shares_primary_key(model, fence_model):
        raise TypeError(
            f"Cannot write {model._meta.label} fenced: its {FENCE_FIELD!r} column is in the "
            f"table of {fence_model._meta.label}, which it reaches through a parent link that "
            "is not its primary key. Make the fenced model its first parent."
        )
    tables = _split_values(model, values)
    # The queryset's own database if it was given one, else the router's choice for writes.
    db = getattr(queryset, "_db", None) or router.db_for_write(queryset.model)
    fenced = _fence_queryset(queryset, model, fence_model, db)
    readback = queryset.using(db)
    own = tables.pop(fence_model, {})
    if model is fence_model and not tables:
        # One statement: its own transaction.
        _claim(fenced, readback, pk, token, name, own)
        return
    with transaction.atomic(using=db):
        _claim(fenced, readback, pk, token, name, own)
        # The fence row is locked until commit: no other fenced writer of it
        # comes between here and there.
        for table in _tables(model):
            if table in tables and not (
                table._base_manager.using(db).filter(pk=pk).update(**tables[table])
            ):
                raise _missing(queryset.model, pk, token, name)
        if (
            model is not fence_model
            and model not in tables
            and not model._base_manager.using(db).filter(pk=pk).exists()
        ):
            # The fence table has the row, but it is not one of this model.
            raise _missing(queryset.model, pk, token, name)


class FencedQuerySet(models.QuerySet[_M]):
    """A queryset whose rows can be written only with a fence no older than their last one."""

    def update_fenced(self, pk: Any, fence: Fence, /, **values: Any) -> None:
        """Set ``values`` on row ``pk`` in one UPDATE, if ``fence`` is no older than its last.

        ``fence`` is a token or the held Mutex (its ``fence`` and ``name`` are
        used). ``values`` are what ``QuerySet.update()`` takes (F() too);
        with none, only ``last_fence`` moves up, which claims the row: every
        older holder's write is refused from then on. Raise StaleFence, having
        changed nothing, when a larger fence already wrote the row;
        ``Model.DoesNotExist`` when this queryset has no row ``pk``.

        A multi-table child's other tables are written after the fence
        table's conditional UPDATE, in the same transaction. This queryset
        may be filtered on the fenced table's own columns only; the shapes
        refused before anything is written are listed in the module docstring.
        """
        token, name = _resolve_fence(fence)
        _write(self, pk, token, name, values)


class FencedManager(models.Manager[_M]):
    """The default manager of :class:`FencedModel`: adds ``update_fenced``."""

    def get_queryset(self) -> FencedQuerySet[_M]:
        return FencedQuerySet(self.model, using=self._db)

    def update_fenced(self, pk: Any, fence: Fence, /, **values: Any) -> None:
        """See :meth:`FencedQuerySet.update_fenced`."""
        self.get_queryset().update_fenced(pk, fence, **values)


class FencedModel(models.Model):
    """An abstract model whose rows refuse writes from a lock holder older than the last writer.

    Subclass it, then write rows you protect with a lock through
    :meth:`save_fenced` or ``Model.objects.update_fenced``, passing the lock
    (or its ``fence``). The semantics are in this module's docstring.
    """

    last_fence = models.BigIntegerField(
        default=0,
        editable=False,
        help_text="Fencing token of the lock holder whose write reached this row last.",
    )

    objects: ClassVar[FencedManager[Any]] = FencedManager()

    class Meta:
        abstract = True

    def save_fenced(
        self,
        fence: Fence,
        update_fields: Iterable[str] | None = None,
        *,
        using: str | None = None,
    ) -> None:
        """Write this instance if ``fence`` is no older than the row's last fence.

        ``fence`` is a token or the held Mutex. ``update_fields`` limits the
        columns written (default: every concrete field but the primary key).
        On success ``last_fence`` becomes ``fence``, here and in the database.
        Raise StaleFence, having changed nothing, when a larger fence already
        wrote the row. An unsaved instance is inserted (see the module
        docstring for when that turns into the fenced update).
        """
        token, name = _resolve_fence(fence)
        db = using or self._state.db or router.db_for_write(type(self), instance=self)
        queryset = type(self)._base_manager.using(db)
        if self._state.adding and self._insert_fenced(queryset, db, token):
            return
        if self.pk is None:
            raise ValueError(
                f"Cannot save_fenced() {type(self)._meta.label}: it has no primary key."
            )
        values = {
            field.attname: field.pre_save(self, False)
            for field in self._fenced_fields(update_fields)
        }
        _write(queryset, self.pk, token, name, values)
        self.last_fence = token
        self._state.adding = False
        self._state.db = db

    def _insert_fenced(self, queryset: models.QuerySet[Any], db: str, token: int) -> bool:
        """Insert this instance with ``token``; return False if its primary key already exists.

        A multi-table child is inserted into every table (Django 5.0's
        ``force_insert=(models.Model,)``): Django's default would update a
        parent row that already has the key, without the fence check.
        """
        model = _concrete(type(self))
        parents = model._meta.get_parent_list()
        keys = [getattr(self, table._meta.pk.attname) for table in (model, *parents)]
        previous, self.last_fence = self.last_fence, token
        try:
            if all(key is None for key in keys):
                # Nothing to collide with: the database picks the key.
                self.save(force_insert=True, using=db)
                return True
            if parents and not _FORCE_INSERT_PARENTS:
                raise ValueError(
                    f"Cannot save_fenced() a new {model._meta.label} with its primary key set "
                    f"on Django {django.get_version()}: inserting a multi-table child with a "
                    "given key needs save(force_insert=(Parent, ...)) from Django 5.0, or an "
                    "existing parent row would be updated without the fence check. Save it "
                    "without a primary key, or write the existing row with update_fenced()."
                )
            try:
                # A savepoint, so the failed insert leaves an outer transaction usable.
                with transaction.atomic(using=db):
                    self.save(force_insert=(models.Model,) if parents else True, using=db)
            except IntegrityError as exc:
                if self.pk is None:
                    raise
                if queryset.filter(pk=self.pk).exists():
                    self.last_fence = previous
                    return False
                fence_model = _fence_model(model)
                if (
                    fence_model is not model
                    and fence_model._base_manager.using(db).filter(pk=self.pk).exists()
                ):
                    raise ValueError(
                        f"Cannot save_fenced() a new {model._meta.label} pk={self.pk!r}: a "
                        f"{fence_model._meta.label} row with that key exists that is not a "
                        f"{model._meta.label}, and save_fenced() does not add a child to an "
                        "existing parent row."
                    ) from exc
                raise  # another unique constraint: not ours to resolve
        except BaseException:
            self.last_fence = previous
            raise
        return True

    def _fenced_fields(self, update_fields: Iterable[str] | None) -> list[Field[Any, Any]]:
        """Return the fields a fenced update writes, checking ``update_fields``."""
        writable = [
            field
            for field in self._meta.concrete_fields
            if not field.primary_key
            and not _is_parent_link(field)
            and field.name != FENCE_FIELD
            and not getattr(field, "generated", False)
        ]
        if update_fields is None:
            return writable
        if isinstance(update_fields, str):
            raise TypeError("update_fields must be a list of field names, not a string.")
        wanted = set(update_fields)
        chosen = [field for field in writable if field.name in wanted or field.attname in wanted]
        unknown = wanted - {f.name for f in chosen} - {f.attname for f in chosen}
        if unknown:
            raise ValueError(
                f"Cannot save_fenced() {type(self)._meta.label} fields {sorted(unknown)}: "
                f"not writable fields of the model ({FENCE_FIELD!r} and the primary key "
                "are set by the write itself)."
            )
        return chosen
