"""Fencing tokens that the database checks: refuse the late write of a holder that lost its lock.

A Redis lock is a lease. A holder paused longer than its lease (a GC pause,
SIGSTOP, a VM migration) wakes up still believing it holds the lock, and
nothing on the Redis side can stop the write it is about to make. The storage
can: every acquisition of a name gets a larger ``Mutex.fence``, so if each
write of a row carries its writer's fence and the database refuses a fence
smaller than the last one that wrote the row, the paused holder's write is
refused once a newer holder has written (or claimed) the row.

:class:`FencedModel` adds the ``last_fence`` column and the writes that check
it. Each write is ONE statement,
``UPDATE ... SET <fields>, last_fence = %(fence)s WHERE pk = %(pk)s AND last_fence <= %(fence)s``,
so no other writer can come between the check and the write: the database's
row lock orders concurrent writers, and a writer that waited on it re-checks
the condition against the row as the other left it (PostgreSQL, READ COMMITTED)
or never ran concurrently at all (SQLite).

Semantics, chosen on purpose:

* **Equal fences are allowed** (``<=``). A holder may write the same row
  several times under one acquisition (a nested reentrant block shares the
  acquisition, and so its fence), or retry a write whose reply it never saw.
  Another holder never has the same fence: fences strictly increase with each
  acquisition of a name.
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
  insert that violates one raises ``IntegrityError`` as ``save()`` would.
* **Not fenced:** deletes, ``QuerySet.update()`` and plain ``save()`` (which
  writes ``last_fence`` as the instance holds it, and so can lower it). A
  model that needs fenced deletes can mark rows deleted with a fenced write.
* The fenced update is a queryset update: it sends no ``pre_save`` /
  ``post_save`` signals (the insert path is a ``save()`` and does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar

from django.db import IntegrityError, models, router, transaction

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
    rather than a write that nothing fences.
    """
    if isinstance(fence, Mutex):
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


def _write(
    queryset: models.QuerySet[Any], pk: Any, token: int, name: str | None, values: dict[str, Any]
) -> None:
    """Update row ``pk`` with ``values`` unless a larger fence than ``token`` already wrote it."""
    if FENCE_FIELD in values:
        raise ValueError(
            f"Do not set {FENCE_FIELD!r} in a fenced write; it is set to the writer's fence."
        )
    model = queryset.model
    # The UPDATE alone decides; a refused one is read back only to say why. A
    # second try covers a row that appeared (or that a plain save() lowered)
    # between the refused update and the read-back.
    current = 0
    for _ in range(2):
        if queryset.filter(pk=pk, last_fence__lte=token).update(**values, last_fence=token):
            return
        found = queryset.filter(pk=pk).values_list(FENCE_FIELD, flat=True).first()
        if found is None:
            by = f" of lock {name!r}" if name is not None else ""
            raise model.DoesNotExist(f"No {_target(model, pk)} to write with fence {token}{by}.")
        current = int(found)
        if current > token:
            break
    raise StaleFence(name, fence=token, current=current, target=_target(model, pk))


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
        """Insert this instance with ``token``; return False if its primary key already exists."""
        previous, self.last_fence = self.last_fence, token
        if self.pk is None:
            # Nothing to collide with: the database picks the key.
            self.save(force_insert=True, using=db)
            return True
        try:
            # A savepoint, so the failed insert leaves an outer transaction usable.
            with transaction.atomic(using=db):
                self.save(force_insert=True, using=db)
        except IntegrityError:
            self.last_fence = previous
            if not queryset.filter(pk=self.pk).exists():
                raise  # another unique constraint: not ours to resolve
            return False
        return True

    def _fenced_fields(self, update_fields: Iterable[str] | None) -> list[Field[Any, Any]]:
        """Return the fields a fenced update writes, checking ``update_fields``."""
        writable = [
            field
            for field in self._meta.concrete_fields
            if not field.primary_key
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
