"""An admin entry and permissions for the lock inspector, with no table behind them.

Locks live in Redis, never in the database; the admin still needs a model to
list a page under this app and to attach permissions to. ``Lock`` is that
model: unmanaged, so no migration ever creates a table for it, and it is
never queried. Its migration exists only so Django creates its permissions.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from .keys import MAX_NAME_LENGTH

__all__ = ["Lock"]


class Lock(models.Model):
    """A named lock, as the admin's history and permissions refer to it.

    Instances are only ever built in memory (to name a lock in the admin's
    ``LogEntry`` history); the live list comes from
    :func:`django_redis_mutex.introspection.held_locks`.
    """

    name = models.CharField(_("name"), max_length=MAX_NAME_LENGTH, primary_key=True)

    class Meta:
        managed = False
        # Locks are never added or edited through the admin: only viewed and released.
        default_permissions = ("view",)
        permissions = [("release_lock", _("Can force-release locks"))]
        verbose_name = _("lock")
        verbose_name_plural = _("locks")

    def __str__(self) -> str:
        return self.name
