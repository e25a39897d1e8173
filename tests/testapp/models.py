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
    def bump(self) -> int:
        self.refresh_from_db()
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
