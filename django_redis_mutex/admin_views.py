"""Admin views of the lock inspector: the live list of held locks and force-release.

Nothing here touches the database except the admin history: the list is read
from Redis on every request through :func:`~django_redis_mutex.introspection.listed_locks`,
and a release is :func:`~django_redis_mutex.introspection.reset`. The filter
fields (``host``, ``pid``, ``label``, ``older_than`` query parameters) build a
:class:`~django_redis_mutex.filters.LockFilter`, as the ``locks`` command's
options do; a filtered release resets only the selected locks that still match
when it is confirmed, each with
:func:`~django_redis_mutex.introspection.reset_listed`. The views are
reached only through :class:`django_redis_mutex.admin.LockAdmin`, which wraps
them with ``admin_site.admin_view`` (login, staff, CSRF, no caching).

A lock held shared is listed once, marked shared, with a line per holder; its
release frees every holder, or under a filter only the holders the filter
selects (:meth:`~django_redis_mutex.filters.LockFilter.select`).

The same page lists the counting semaphores with a permit held (read with
:func:`~django_redis_mutex.introspection.held_semaphores`), one row per permit, and
:func:`reset_semaphores` frees every permit of the chosen ones with
:func:`~django_redis_mutex.introspection.reset_semaphore`, through the
confirm-then-POST flow of a lock release but behind a permission of its own
(``reset_semaphore``, of :class:`~django_redis_mutex.models.Semaphore`), and
recorded in the admin history as a semaphore, not a lock. On a quorum alias
both are listed and reset as the introspection functions do, on every master,
and a member alias of a quorum is refused for either reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext
from redis.exceptions import RedisError

from .client import lock_aliases
from .display import duration, terminal_safe
from .eviction import EvictionPolicy
from .exceptions import LockBackendUnavailable
from .filters import FILTER_FIELDS, FilterError, LockFilter
from .introspection import (
    HeldLock,
    HeldSemaphore,
    ListedLock,
    ensure_resettable,
    eviction_policies,
    held_semaphores,
    listed_locks,
    reset,
    reset_listed,
    reset_semaphore,
    seconds_since,
)
from .keys import validate_name
from .models import Lock, Semaphore
from .owners import Owner


class LockAdmin(Protocol):
    """What the views need of the admin class that serves them (see admin.py)."""

    opts: Any
    admin_site: Any

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool: ...

    def has_release_permission(self, request: HttpRequest) -> bool: ...

    def has_reset_semaphore_permission(self, request: HttpRequest) -> bool: ...


__all__ = ["REFRESH_SECONDS", "lock_aliases", "lock_list", "release_locks", "reset_semaphores"]

# How often the list reloads itself unless paused with ?refresh=0.
REFRESH_SECONDS = 5

# Reading Redis can fail in the transport (wrapped by the client layer as
# LockBackendUnavailable) or with an error reply (ACLs, a wrong server).
_REDIS_FAILURES = (LockBackendUnavailable, RedisError)


class _AliasError(Exception):
    """The requested cache alias cannot carry locks; the message says why."""


class _BadFilter(Exception):
    """A filter field of the request cannot be used; the message says which and why."""


def _chosen_alias(request: HttpRequest, aliases: list[str]) -> str:
    """Return the alias named by ``?using=`` (or the default one), else raise _AliasError."""
    using = request.GET.get("using") or request.POST.get("using")
    if not using:
        if not aliases:
            raise _AliasError(
                _(
                    "No cache in settings.CACHES is a Redis cache, so no lock can "
                    "be held. Set a cache BACKEND to 'django_redis.cache.RedisCache'."
                )
            )
        return "default" if "default" in aliases else aliases[0]
    if using not in aliases:
        raise _AliasError(
            _(
                "Cache alias “%(alias)s” does not carry locks: it is not a Redis cache in "
                "settings.CACHES. Choose one of: %(choices)s."
            )
            % {"alias": using, "choices": ", ".join(aliases) or _("none")}
        )
    return using


class _Filters:
    """The filter fields of one request: the text typed, the LockFilter, any errors."""

    def __init__(self, data: Mapping[str, str]) -> None:
        # A blank field is an unset filter here (a form sends every field).
        self.values = {
            field: str(data.get(field, "")).strip()
            for field in FILTER_FIELDS
            if str(data.get(field, "")).strip()
        }
        self.errors: dict[str, str] = {}
        for field, value in self.values.items():
            try:
                LockFilter.from_strings(**{field: value})
            except FilterError as exc:
                self.errors[field] = exc.problem
        self.lock_filter = LockFilter() if self.errors else LockFilter.from_strings(**self.values)

    def error_text(self) -> str:
        labels = _filter_labels()
        return _("The filter cannot be used: %(problems)s") % {
            "problems": " ".join(
                f"{labels[field]}: {problem}" for field, problem in self.errors.items()
            )
        }

    def fields(self) -> list[dict[str, str]]:
        """Return what the template shows of each filter field, in FILTER_FIELDS order."""
        labels = _filter_labels()
        return [
            {
                "name": field,
                "label": labels[field],
                "value": self.values.get(field, ""),
                "error": self.errors.get(field, ""),
            }
            for field in FILTER_FIELDS
        ]


def _filter_labels() -> dict[str, str]:
    return {
        "host": _("Host"),
        "pid": _("PID"),
        "label": _("Label"),
        "older_than": _("Held longer than"),
    }


def _unavailable(using: str, exc: Exception) -> str:
    return _(
        "Redis of cache “%(alias)s” could not be read, so the locks cannot be listed or "
        "released right now: %(error)s"
    ) % {"alias": using, "error": exc}


def _url(base: str, **params: Any) -> str:
    query = urlencode([(k, v) for k, v in params.items() if v not in (None, "")], doseq=True)
    return f"{base}?{query}" if query else base


def _urls(model_admin: LockAdmin) -> tuple[str, str]:
    """Return the changelist and release URLs of this admin site."""
    opts = model_admin.opts
    site = model_admin.admin_site.name
    base = f"admin:{opts.app_label}_{opts.model_name}"
    return (
        reverse(f"{base}_changelist", current_app=site),
        reverse(f"{base}_release", current_app=site),
    )


def _row(
    held: HeldLock, release_url: str, using: str, filters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    # Names and labels may come from request data: what a person reads shows
    # control and bidi characters escaped; ``name`` stays exact for the form.
    # The owner fields are the holder's, or a shared lock's earliest holder's;
    # ``holders`` has one entry per holder either way (one for an exclusive lock).
    if held.shared:
        holders = [
            _holder(h.owner, h.acquired_at, seconds_since(h.acquired_at), h.time_left, h.fence)
            for h in held.holders
        ]
    else:
        holders = [_holder(held.owner, held.acquired_at, held.held_for, held.time_left, held.fence)]
    return {
        **holders[0],
        "name": held.name,
        "shown_name": terminal_safe(held.name),
        "shared": held.shared,
        "holders": holders,
        "time_left": duration(held.time_left),
        "time_left_parts": _wrap_points(duration(held.time_left)),
        "waiters": held.waiters,
        "release_url": _url(release_url, using=using, name=held.name, **(filters or {})),
    }


def _holder(
    owner: Owner, acquired_at: datetime, held_for: float, time_left: float, fence: int
) -> dict[str, Any]:
    """Return what the templates show of one holder: owner, times and fence."""
    return {
        "host": terminal_safe(owner.host or ""),
        "pid": "" if owner.pid is None else owner.pid,
        "thread": terminal_safe(owner.thread or ""),
        "label": terminal_safe(owner.label or ""),
        # Set when the lock's block has ended and it is kept for a transaction.
        "transaction": terminal_safe(", ".join(owner.transaction)),
        "acquired_at": acquired_at,
        "held_for": duration(held_for),
        "time_left": duration(time_left),
        "held_for_parts": _wrap_points(duration(held_for)),
        "time_left_parts": _wrap_points(duration(time_left)),
        "fence": fence,
    }


def _wrap_points(text: str) -> list[str]:
    """Split a duration ("1 min 58 s") into the parts a narrow cell may wrap between.

    Each part keeps a number with its unit ("1 min", "58 s"), so a column of
    durations can take two lines instead of widening the table past the page.
    """
    words = text.split()
    return [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]


def _base_context(request: HttpRequest, model_admin: LockAdmin, title: str) -> dict[str, Any]:
    opts = model_admin.opts
    return {
        **model_admin.admin_site.each_context(request),
        "opts": opts,
        "app_label": opts.app_label,
        "title": title,
    }


def lock_list(
    request: HttpRequest, model_admin: LockAdmin, extra_context: dict[str, Any] | None = None
) -> HttpResponse:
    """Show the locks held right now in one cache alias, searchable by name."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    changelist_url, release_url = _urls(model_admin)
    query = request.GET.get("q", "").strip()
    paused = request.GET.get("refresh") == "0"
    filters = _Filters(request.GET)
    chosen = filters.values
    aliases = lock_aliases()
    context = _base_context(request, model_admin, _("Locks"))
    context.update(
        {
            "aliases": aliases,
            "query": query,
            "filter_fields": filters.fields(),
            "filtered": bool(chosen),
            "paused": paused,
            "refresh_seconds": 0 if paused else REFRESH_SECONDS,
            "can_release": model_admin.has_release_permission(request),
            "can_reset_semaphores": model_admin.has_reset_semaphore_permission(request),
            "release_url": release_url,
            "locks": [],
            "total": 0,
            "semaphores": [],
            "semaphores_total": 0,
            "evictions": [],
            "error": None,
        }
    )
    status = 200
    try:
        using = _chosen_alias(request, aliases)
    except _AliasError as exc:
        context.update(error=str(exc), using=None)
        status = 404
    else:
        context.update(
            using=using,
            alias_links=[(a, _url(changelist_url, using=a, q=query, **chosen)) for a in aliases],
            pause_url=_url(changelist_url, using=using, q=query, refresh="0", **chosen),
            resume_url=_url(changelist_url, using=using, q=query, **chosen),
            clear_search_url=_url(changelist_url, using=using),
            clear_filters_url=_url(
                changelist_url, using=using, q=query, refresh="0" if paused else ""
            ),
        )
        try:
            if filters.errors:
                # Listing every lock under a filter the operator believes applies
                # would invite releasing the wrong ones: list nothing.
                raise _BadFilter(filters.error_text())
            found = listed_locks(using)
            found_semaphores = held_semaphores(using)
            evictions = [text for p in eviction_policies(using) if (text := _evictions(p))]
        except _BadFilter as exc:
            # Reloading would only repeat the error while the operator fixes it.
            context.update(error=str(exc), filter_error=True, refresh_seconds=0)
            status = 400
        except _REDIS_FAILURES as exc:
            context["error"] = _unavailable(using, exc)
            status = 503
        except ImproperlyConfigured as exc:  # e.g. a sharded client, which cannot hold locks
            context["error"] = str(exc)
            status = 404
        else:
            # A shared lock is narrowed to the holders the filter selects, which
            # are those a release through this filtered list frees.
            matching = [
                h.held
                for h in _selected(found, filters.lock_filter)
                if query.casefold() in h.held.name.casefold()
            ]
            context["locks"] = [_row(h, release_url, using, chosen) for h in matching]
            context["evictions"] = evictions
            context["total"] = len(found)
            reset_url = _reset_semaphore_url(model_admin)
            context.update(_semaphore_context(found_semaphores, reset_url, using, query))
            # The holder filters select locks; a semaphore is listed unfiltered or not at all.
            context["semaphores_hidden"] = bool(chosen) and bool(found_semaphores)
            if chosen:
                context["semaphores"] = []
    context.update(extra_context or {})
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "django_redis_mutex/admin/locks.html", context, status=status)


def _evictions(policy: EvictionPolicy) -> str | None:
    """Return what the page says about keys the Redis evicted, or None (as ``locks`` does)."""
    count = policy.evicted_keys
    if count is None or not policy.worth_listing:
        return None
    values = {"alias": policy.alias, "policy": policy.policy, "count": count}
    if policy.evicts:
        return (
            ngettext(
                "The Redis of cache “%(alias)s” evicts keys (maxmemory-policy %(policy)s): "
                "%(count)d key evicted since it started. A held lock can be evicted too: keep "
                "locks on a Redis with maxmemory-policy noeviction.",
                "The Redis of cache “%(alias)s” evicts keys (maxmemory-policy %(policy)s): "
                "%(count)d keys evicted since it started. A held lock can be evicted too: keep "
                "locks on a Redis with maxmemory-policy noeviction.",
                count,
            )
            % values
        )
    return (
        ngettext(
            "The Redis of cache “%(alias)s” evicted %(count)d key since it started "
            "(maxmemory-policy now %(policy)s).",
            "The Redis of cache “%(alias)s” evicted %(count)d keys since it started "
            "(maxmemory-policy now %(policy)s).",
            count,
        )
        % values
    )


def _selected(listed: Iterable[ListedLock], lock_filter: LockFilter) -> list[ListedLock]:
    """Return the locks ``lock_filter`` selects, a shared one narrowed to its matching holders."""
    if not lock_filter:
        return list(listed)
    return [chosen for item in listed if (chosen := lock_filter.select(item)) is not None]


def _requested_names(values: Iterable[str]) -> list[str]:
    """Return the distinct, valid lock names among ``values``, in their order."""
    names: list[str] = []
    for value in values:
        try:
            validate_name(value)
        except (TypeError, ValueError):
            continue  # cannot name a lock, so it cannot be held either
        if value not in names:
            names.append(value)
    return names


def _describe(held: HeldLock | None) -> str:
    if held is None:
        return _("owner unknown: it was not held when the page was read")
    if held.shared:
        return _("shared, holders %(holders)s") % {
            "holders": "; ".join(
                _("fence %(fence)d, owner %(owner)s") % {"fence": h.fence, "owner": h.owner}
                for h in held.holders
            )
        }
    return _("fence %(fence)d, owner %(owner)s") % {"fence": held.fence, "owner": held.owner}


def _log_release(request: HttpRequest, name: str, using: str, held: HeldLock | None) -> None:
    """Record one force-release in the admin history of the Lock model."""
    message = _("Force-released lock “%(name)s” in cache “%(alias)s” (%(details)s).") % {
        "name": name,
        "alias": using,
        "details": _describe(held),
    }
    _log_entry(request, Lock(name=name), DELETION, message)


def _log_entry(
    request: HttpRequest, entry: Lock | Semaphore, action_flag: int, message: str
) -> None:
    """Add an entry for ``entry`` to the admin history, under the content type of its model."""
    user_id = request.user.pk
    if hasattr(LogEntry.objects, "log_actions"):  # Django 5.1+
        LogEntry.objects.log_actions(user_id, [entry], action_flag, change_message=message)
    else:  # pragma: no cover - Django < 5.1 has only log_action
        LogEntry.objects.log_action(
            user_id=user_id,
            content_type_id=ContentType.objects.get_for_model(type(entry)).pk,
            object_id=entry.pk,
            object_repr=str(entry),
            action_flag=action_flag,
            change_message=message,
        )


def _reset_request(
    request: HttpRequest,
    model_admin: LockAdmin,
    has_permission: Callable[[HttpRequest], bool],
    title: str,
    template: str,
    listing: str,
) -> HttpResponse | tuple[Any, str, str]:
    """Check what every confirm-then-POST view starts with; return (data, query, alias).

    The method (GET shows the confirmation, POST acts), the permission to see
    the page and ``has_permission``, the one this view's action needs
    (``release_lock`` for a lock, ``reset_semaphore`` for a semaphore), and the
    alias; a refusal comes back as the response to send instead.
    """
    if request.method not in ("GET", "HEAD", "POST"):
        return HttpResponseNotAllowed(["GET", "HEAD", "POST"])
    if not (model_admin.has_view_permission(request) and has_permission(request)):
        raise PermissionDenied
    data = request.POST if request.method == "POST" else request.GET
    try:
        using = _chosen_alias(request, lock_aliases())
    except _AliasError as exc:
        context = _base_context(request, model_admin, title)
        context.update({"error": str(exc), listing: []})
        request.current_app = model_admin.admin_site.name
        return TemplateResponse(request, template, context, status=404)
    return data, data.get("q", ""), using


def release_locks(request: HttpRequest, model_admin: LockAdmin) -> HttpResponse:
    """Confirm (GET) and perform (POST) the force-release of the named locks."""
    checked = _reset_request(
        request,
        model_admin,
        model_admin.has_release_permission,
        _("Release locks"),
        "django_redis_mutex/admin/release.html",
        "locks",
    )
    if isinstance(checked, HttpResponse):
        return checked
    data, query, using = checked
    changelist_url, release_url = _urls(model_admin)
    filters = _Filters(data)
    back = _url(changelist_url, using=using, q=query, **filters.values)
    names = _requested_names(data.getlist("name"))
    if not names:
        messages.warning(request, _("Select the locks to release first."))
        return HttpResponseRedirect(back)
    if filters.errors:
        messages.error(request, filters.error_text())
        return HttpResponseRedirect(back)
    try:
        # A member of a quorum would release a quorum lock on one master only,
        # while its holder keeps it alive on the others: say which alias to use.
        ensure_resettable(using)
    except (ValueError, ImproperlyConfigured) as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    try:
        listed = {item.held.name: item for item in listed_locks(using) if item.held.name in names}
    except _REDIS_FAILURES as exc:
        messages.error(request, _unavailable(using, exc))
        return HttpResponseRedirect(back)
    except ImproperlyConfigured as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    held = {name: item.held for name, item in listed.items()}

    if request.method == "POST" and filters.values:
        return _perform_filtered_release(request, names, using, listed, filters.lock_filter, back)
    if request.method == "POST":
        return _perform_release(request, names, using, held, back)

    # Narrowed as the release will be: a shared lock to the holders the filter selects.
    selected = {
        item.held.name: item.held for item in _selected(listed.values(), filters.lock_filter)
    }
    unmatched = [n for n in names if n in held and n not in selected]
    chosen = [n for n in names if n in selected]
    if not chosen:
        if unmatched:
            messages.warning(request, _("None of the selected locks matches the filter."))
        else:
            messages.warning(request, _("None of the selected locks is held any more."))
        return HttpResponseRedirect(back)
    context = _base_context(request, model_admin, _("Release locks"))
    context.update(
        {
            "error": None,
            "using": using,
            "query": query,
            "back_url": back,
            "release_url": release_url,
            "locks": [_row(selected[n], release_url, using, filters.values) for n in chosen],
            "gone": [n for n in names if n not in held],
            "unmatched": [terminal_safe(n) for n in unmatched],
            "filter_values": filters.values,
            "filter_description": filters.lock_filter.describe() if filters.values else "",
        }
    )
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "django_redis_mutex/admin/release.html", context)


def _perform_release(
    request: HttpRequest, names: list[str], using: str, held: dict[str, HeldLock], back: str
) -> HttpResponse:
    released = 0
    try:
        for name in names:
            if reset(name, using):
                released += 1
                _log_release(request, name, using, held.get(name))
    except _REDIS_FAILURES as exc:
        # For a quorum this includes too many masters unreachable to release it
        # on a majority: the lock is not reported as released.
        messages.error(request, _unavailable(using, exc))
    except ValueError as exc:  # CACHES changed since the confirmation page
        messages.error(request, str(exc))
    else:
        not_held = len(names) - released
        if not_held:
            messages.warning(
                request,
                ngettext(
                    "%(count)d lock was no longer held.",
                    "%(count)d locks were no longer held.",
                    not_held,
                )
                % {"count": not_held},
            )
    if released:
        messages.success(
            request,
            ngettext(
                "Released %(count)d lock.",
                "Released %(count)d locks.",
                released,
            )
            % {"count": released},
        )
    return HttpResponseRedirect(back)


def _perform_filtered_release(
    request: HttpRequest,
    names: list[str],
    using: str,
    listed: dict[str, ListedLock],
    lock_filter: LockFilter,
    back: str,
) -> HttpResponse:
    """Release the named locks that match ``lock_filter`` now, each only from its listed holder.

    The filter is applied again here, not only on the confirmation page: a lock
    that passed to a holder outside the filter since then is left alone, and so
    is one that changes hands between this listing and its reset. Of a lock
    held shared, only the holders that match are released; the others keep it.
    """
    released = not_held = unmatched = 0
    try:
        for name in names:
            found = listed.get(name)
            item = None if found is None else lock_filter.select(found)
            if found is None:
                not_held += 1
            elif item is None:
                unmatched += 1
            elif reset_listed(item, using):
                released += 1
                _log_release(request, name, using, item.held)
            else:
                not_held += 1
    except _REDIS_FAILURES as exc:
        messages.error(request, _unavailable(using, exc))
    except ValueError as exc:  # CACHES changed since the confirmation page
        messages.error(request, str(exc))
    else:
        if not_held:
            messages.warning(
                request,
                ngettext(
                    "%(count)d lock was no longer held.",
                    "%(count)d locks were no longer held.",
                    not_held,
                )
                % {"count": not_held},
            )
        if unmatched:
            messages.warning(
                request,
                ngettext(
                    "%(count)d lock no longer matched the filter and was left alone.",
                    "%(count)d locks no longer matched the filter and were left alone.",
                    unmatched,
                )
                % {"count": unmatched},
            )
    if released:
        messages.success(
            request,
            ngettext(
                "Released %(count)d lock.",
                "Released %(count)d locks.",
                released,
            )
            % {"count": released},
        )
    return HttpResponseRedirect(back)


# -- semaphores ------------------------------------------------------------------


def _reset_semaphore_url(model_admin: LockAdmin) -> str:
    opts = model_admin.opts
    return reverse(
        f"admin:{opts.app_label}_{opts.model_name}_reset_semaphore",
        current_app=model_admin.admin_site.name,
    )


def _semaphore_row(held: HeldSemaphore, reset_url: str, using: str) -> dict[str, Any]:
    """Return what the templates show of one semaphore: its limit and one entry per permit."""
    return {
        "name": held.name,
        "shown_name": terminal_safe(held.name),
        "limit": "?" if held.limit is None else held.limit,
        "held": len(held.holders),
        "waiters": held.waiters,
        "holders": [
            {
                "host": terminal_safe(holder.owner.host or ""),
                "pid": "" if holder.owner.pid is None else holder.owner.pid,
                "thread": terminal_safe(holder.owner.thread or ""),
                "label": terminal_safe(holder.owner.label or ""),
                "transaction": terminal_safe(", ".join(holder.owner.transaction)),
                "time_left": duration(holder.time_left),
                "time_left_parts": _wrap_points(duration(holder.time_left)),
            }
            for holder in held.holders
        ],
        "reset_url": _url(reset_url, using=using, name=held.name),
    }


def _semaphore_context(
    found: list[HeldSemaphore], reset_url: str, using: str, query: str
) -> dict[str, Any]:
    """Return the semaphore part of the list page: those matching the search, and the total."""
    matching = [held for held in found if query.casefold() in held.name.casefold()]
    return {
        "semaphores": [_semaphore_row(held, reset_url, using) for held in matching],
        "semaphores_total": len(found),
        "reset_semaphore_url": reset_url,
    }


def reset_semaphores(request: HttpRequest, model_admin: LockAdmin) -> HttpResponse:
    """Confirm (GET) and perform (POST) freeing every permit of the named semaphores.

    Resetting a semaphore takes permits from their holders as a release takes a
    lock, so it goes through the same confirmation page and CSRF-protected
    POST; it is a different power over different work, so it needs its own
    permission (``reset_semaphore``), not the lock's ``release_lock``.
    """
    checked = _reset_request(
        request,
        model_admin,
        model_admin.has_reset_semaphore_permission,
        _("Reset semaphores"),
        "django_redis_mutex/admin/semaphore_reset.html",
        "semaphores",
    )
    if isinstance(checked, HttpResponse):
        return checked
    data, query, using = checked
    changelist_url, _release_url = _urls(model_admin)
    back = _url(changelist_url, using=using, q=query)
    names = _requested_names(data.getlist("name"))
    if not names:
        messages.warning(request, _("Select the semaphores to reset first."))
        return HttpResponseRedirect(back)
    try:
        # As for a lock: a member of a quorum would free a quorum permit on one
        # master only, while its holder keeps renewing it on the others.
        ensure_resettable(using, "semaphore")
    except (ValueError, ImproperlyConfigured) as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    try:
        held = {item.name: item for item in held_semaphores(using) if item.name in names}
    except _REDIS_FAILURES as exc:
        messages.error(request, _unavailable(using, exc))
        return HttpResponseRedirect(back)
    except ImproperlyConfigured as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    if request.method == "POST":
        return _perform_semaphore_reset(request, names, using, held, back)
    if not held:
        messages.warning(request, _("None of the selected semaphores is held any more."))
        return HttpResponseRedirect(back)
    context = _base_context(request, model_admin, _("Reset semaphores"))
    context.update(
        {
            "error": None,
            "using": using,
            "query": query,
            "back_url": back,
            "reset_semaphore_url": _reset_semaphore_url(model_admin),
            "semaphores": [
                _semaphore_row(held[n], _reset_semaphore_url(model_admin), using)
                for n in names
                if n in held
            ],
            "gone": [terminal_safe(n) for n in names if n not in held],
        }
    )
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "django_redis_mutex/admin/semaphore_reset.html", context)


def _perform_semaphore_reset(
    request: HttpRequest,
    names: list[str],
    using: str,
    held: dict[str, HeldSemaphore],
    back: str,
) -> HttpResponse:
    """Free every permit of each named semaphore, saying how many each had."""
    not_held = 0
    try:
        for name in names:
            freed = reset_semaphore(name, using)
            if not freed:
                not_held += 1
                continue
            _log_semaphore_reset(request, name, using, freed, held.get(name))
            messages.success(
                request,
                ngettext(
                    "Reset semaphore “%(name)s”: freed %(count)d permit.",
                    "Reset semaphore “%(name)s”: freed %(count)d permits.",
                    freed,
                )
                % {"name": terminal_safe(name), "count": freed},
            )
    except _REDIS_FAILURES as exc:
        messages.error(request, _unavailable(using, exc))
    except (ValueError, ImproperlyConfigured) as exc:  # CACHES changed since the confirmation
        messages.error(request, str(exc))
    else:
        if not_held:
            messages.warning(
                request,
                ngettext(
                    "%(count)d semaphore had no permit held any more.",
                    "%(count)d semaphores had no permit held any more.",
                    not_held,
                )
                % {"count": not_held},
            )
    return HttpResponseRedirect(back)


def _log_semaphore_reset(
    request: HttpRequest, name: str, using: str, freed: int, held: HeldSemaphore | None
) -> None:
    """Record one semaphore reset in the admin history of the Semaphore model.

    The entry is a change, not a deletion as a lock release is: the semaphore
    outlives its reset (its limit stays, the waiters in line are handed the
    freed permits), only who holds its permits changed.
    """
    holders = (
        "; ".join(str(holder.owner) for holder in held.holders)
        if held is not None
        else _("holders unknown: none was held when the page was read")
    )
    message = ngettext(
        "Reset semaphore “%(name)s” in cache “%(alias)s”, freeing %(count)d permit (%(holders)s).",
        "Reset semaphore “%(name)s” in cache “%(alias)s”, freeing %(count)d permits (%(holders)s).",
        freed,
    ) % {"name": name, "alias": using, "count": freed, "holders": holders}
    _log_entry(request, Semaphore(name=name), CHANGE, message)
