"""The "Locks" page of the Django admin: held locks read live from Redis.

The unmanaged :class:`~django_redis_mutex.models.Lock` model gives the page its
place in the admin index and its permissions (``view_lock`` to look,
``release_lock`` to force-release a lock); the unmanaged
:class:`~django_redis_mutex.models.Semaphore` model gives the semaphores listed
on the same page theirs (``reset_semaphore``), with no page of its own. The
"Contention" page beside it shows the figures of :mod:`~django_redis_mutex.stats`
(``view_lock`` too). Every request is served by :mod:`django_redis_mutex.admin_views`, never by a
database query.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth import get_permission_codename
from django.db.models.options import Options
from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path

from . import admin_views
from .models import Lock, Semaphore

__all__ = ["LockAdmin"]


def _has_permission(request: HttpRequest, action: str, opts: Options[Any]) -> bool:
    codename = get_permission_codename(action, opts)
    return bool(request.user.has_perm(f"{opts.app_label}.{codename}"))


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """List held locks and force-release them; locks are never added or edited here."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_release_permission(self, request: HttpRequest) -> bool:
        """Return True if the user may force-release locks held by others."""
        return _has_permission(request, "release", self.opts)

    def has_reset_semaphore_permission(self, request: HttpRequest) -> bool:
        """Return True if the user may free the permits of semaphores held by others."""
        return _has_permission(request, "reset", Semaphore._meta)

    def get_urls(self) -> list[URLPattern]:
        # Only the list and the release page: the default add/change/delete/history
        # views would query a table that does not exist.
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path("release/", wrap(self.release_view), name="{}_{}_release".format(*info)),
            path(
                "reset-semaphore/",
                wrap(self.reset_semaphore_view),
                name="{}_{}_reset_semaphore".format(*info),
            ),
            path("contention/", wrap(self.contention_view), name="{}_{}_contention".format(*info)),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return admin_views.lock_list(request, self, extra_context)

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """Confirm (GET) and perform (POST) a force-release of the selected locks."""
        return admin_views.release_locks(request, self)

    def contention_view(self, request: HttpRequest) -> HttpResponse:
        """Show the contention figures of each lock class, with a chart of the hottest."""
        return admin_views.contention(request, self)

    def reset_semaphore_view(self, request: HttpRequest) -> HttpResponse:
        """Confirm (GET) and perform (POST) freeing every permit of the selected semaphores."""
        return admin_views.reset_semaphores(request, self)
