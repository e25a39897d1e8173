"""An admin entry and permissions for the lock inspector, with no table behind them.

Locks and semaphores live in Redis, never in the database; the admin still
needs a model to list a page under this app and to attach permissions to.
``Lock`` is that model, and ``Semaphore`` gives semaphores their own
permission and their own place in the admin history. Both are unmanaged, so no
migration ever creates a table for them, and they are never queried. Their
migrations exist only so Django creates their permissions and content types.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from .keys import MAX_NAME_LENGTH

__all__ = ["Lock", "Semaphore"]


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


class Semaphore(models.Model):
    """A named counting semaphore, as the admin's history and permissions refer to it.

    Taking every permit of a semaphore from its holders is not releasing a
    lock, so it has its own permission: ``reset_semaphore``. The semaphores
    are listed on the Locks page (``view_lock``), so this model has no admin
    page of its own and no view permission; instances are only built in
    memory to name a semaphore in the ``LogEntry`` history.
    """

    name = models.CharField(_("name"), max_length=MAX_NAME_LENGTH, primary_key=True)

    class Meta:
        managed = False
        # Semaphores are never added, edited or viewed through a page of their own.
        default_permissions = ()
        permissions = [("reset_semaphore", _("Can reset semaphores"))]
        verbose_name = _("semaphore")
        verbose_name_plural = _("semaphores")

    def __str__(self) -> str:
        return self.name
