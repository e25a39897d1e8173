"""Demo models: a product whose stock changes only under its own lock."""

import time

from django.db import models

from django_redis_mutex import mutex


class Product(models.Model):
    name = models.CharField(max_length=100)
    stock = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @mutex("product:{self.pk}", label="Product.reserve")
    def reserve(self, quantity: int = 1) -> int:
        """Take ``quantity`` from stock; return what is left.

        A deliberately slow read-modify-write: without the lock, two requests
        would read the same stock and one reservation would be lost.
        """
        self.refresh_from_db(fields=["name", "stock"])
        if self.stock < quantity:
            raise ValueError(f"Only {self.stock} {self.name} left.")
        time.sleep(0.3)
        self.stock -= quantity
        self.save(update_fields=["stock"])
        return self.stock
