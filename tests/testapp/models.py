import time

from django.db import models

from django_redis_mutex import mutex
from django_redis_mutex.fencing import FencedModel


class Counter(models.Model):
    """A row whose value tests increment under a lock."""

    name = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.name

    @mutex("counter:{self.pk}")
    def bump(self, pause: float = 0.0) -> int:
        self.refresh_from_db()
        time.sleep(pause)  # widens the window between the read and the write
        self.value += 1
        self.save(update_fields=["value"])
        return self.value

    @mutex("counter:{self.pk}", release_at_block_end=True)
    def bump_releasing_at_block_end(self, pause: float = 0.0) -> int:
        """``bump`` with the lock given back when the method returns, in a transaction or not."""
        self.refresh_from_db()
        time.sleep(pause)
        self.value += 1
        self.save(update_fields=["value"])
        return self.value


class FencedRecord(FencedModel):
    """A row that only lock holders write, each with its fence; tests check who wrote last."""

    name = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.name

    written_by = models.CharField(max_length=50, default="")


class FenceOwner(models.Model):
    """Who a fenced row belongs to: lets tests filter fenced querysets through a relation."""

    name = models.CharField(max_length=50, unique=True)

    def __str__(self) -> str:
        return self.name


class FencedParent(FencedModel):
    """A concrete fenced model with children: its table holds ``last_fence`` for them too."""

    name = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)
    owner = models.ForeignKey(FenceOwner, null=True, blank=True, on_delete=models.SET_NULL)

    def __str__(self) -> str:
        return self.name


class FencedChild(FencedParent):
    """A multi-table child: its own columns are in another table than ``last_fence``."""

    detail = models.CharField(max_length=50, default="")
    written_by = models.CharField(max_length=50, default="")

    def __str__(self) -> str:
        return f"{self.name} ({self.detail})"


class FenceNote(models.Model):
    """A second concrete parent with a key of its own, for multiple inheritance."""

    code = models.AutoField(primary_key=True)
    note = models.CharField(max_length=50, default="")

    def __str__(self) -> str:
        return self.note


class FencedNotedChild(FencedParent, FenceNote):
    """Fenced through its first parent; the row of its second parent has another key."""

    def __str__(self) -> str:
        return f"{self.name} ({self.note})"
