"""Admin views of the lock inspector: held locks and semaphores, read live, and freed.

Nothing here touches the database but the admin history: every page is read
from Redis. The filter fields build a :class:`~django_redis_mutex.filters.LockFilter`
as the ``locks`` command's options do. The views are reached only through
:class:`django_redis_mutex.admin.LockAdmin`, which wraps them with
``admin_site.admin_view`` (login, staff, CSRF, no caching).

Force-releasing locks and resetting semaphores is one confirm-then-POST flow,
but each needs its own permission (``release_lock``, ``reset_semaphore``):
taking permits from a semaphore's holders is a different power over different
work than taking a lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
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
from django.utils.translation import gettext_lazy, ngettext, ngettext_lazy
from redis.exceptions import RedisError

from . import introspection, stats
from .chart import contention_chart, figures_row
from .client import lock_aliases
from .conf import get_settings
from .display import duration, terminal_safe
from .exceptions import LockBackendUnavailable
from .filters import FILTER_FIELDS, FilterError, LockFilter
from .introspection import HeldLock, HeldSemaphore, ListedLock, SemaphoreHolder, SharedHolder
from .keys import validate_name
from .models import Lock, Semaphore


class LockAdmin(Protocol):
    """What the views need of the admin class that serves them (see admin.py)."""

    opts: Any
    admin_site: Any

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool: ...

    def has_release_permission(self, request: HttpRequest) -> bool: ...

    def has_reset_semaphore_permission(self, request: HttpRequest) -> bool: ...


__all__ = [
    "REFRESH_SECONDS",
    "contention",
    "lock_aliases",
    "lock_list",
    "release_locks",
    "reset_semaphores",
]

# How often the list reloads itself unless paused with ?refresh=0.
REFRESH_SECONDS = 5

# Reading Redis can fail in the transport (wrapped by the client layer as
# LockBackendUnavailable) or with an error reply (ACLs, a wrong server).
_REDIS_FAILURES = (LockBackendUnavailable, RedisError)


class _AliasError(Exception):
    """The requested cache alias cannot carry locks; the message says why."""


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
        self.values = {f: v for f in FILTER_FIELDS if (v := str(data.get(f, "")).strip())}
        self.errors: dict[str, str] = {}
        for field, value in self.values.items():
            try:
                LockFilter.from_strings(**{field: value})
            except FilterError as exc:
                self.errors[field] = exc.problem
        self.lock_filter = LockFilter() if self.errors else LockFilter.from_strings(**self.values)
        self.fields = [
            {
                "name": field,
                "label": _FILTER_LABELS[field],
                "value": self.values.get(field, ""),
                "error": self.errors.get(field, ""),
            }
            for field in FILTER_FIELDS
        ]

    def error_text(self) -> str:
        problems = (f"{_FILTER_LABELS[field]}: {text}" for field, text in self.errors.items())
        return _("The filter cannot be used: %(problems)s") % {"problems": " ".join(problems)}


_FILTER_LABELS = {
    "host": gettext_lazy("Host"),
    "pid": gettext_lazy("PID"),
    "label": gettext_lazy("Label"),
    "older_than": gettext_lazy("Held longer than"),
}


def _unavailable(using: str, exc: Exception) -> str:
    return _(
        "Redis of cache “%(alias)s” could not be read, so the locks cannot be listed or "
        "released right now: %(error)s"
    ) % {"alias": using, "error": exc}


def _url(base: str, **params: Any) -> str:
    query = urlencode([(k, v) for k, v in params.items() if v not in (None, "")], doseq=True)
    return f"{base}?{query}" if query else base


def _admin_url(model_admin: LockAdmin, name: str) -> str:
    opts = model_admin.opts
    return reverse(
        f"admin:{opts.app_label}_{opts.model_name}_{name}", current_app=model_admin.admin_site.name
    )


def _lock_row(
    listed: ListedLock, release_url: str, using: str, filters: Mapping[str, str]
) -> dict[str, Any]:
    # Names and labels may come from request data: what a person reads shows
    # control and bidi characters escaped; ``name`` stays exact for the form.
    # The owner fields are the holder's, or a shared lock's earliest holder's;
    # ``holders`` has one entry per holder either way (one for an exclusive lock).
    held = listed.held
    holders = [_holder(holder) for holder in (held.holders if held.shared else [held])]
    return {
        **holders[0],
        **_duration("time_left", held.time_left),  # a shared lock's longest lease
        "name": held.name,
        "shown_name": terminal_safe(held.name),
        "shared": held.shared,
        "holders": holders,
        "waiters": held.waiters,
        "release_url": _url(release_url, using=using, name=held.name, **filters),
    }


def _semaphore_row(
    held: HeldSemaphore, reset_url: str, using: str, filters: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "name": held.name,
        "shown_name": terminal_safe(held.name),
        "limit": "?" if held.limit is None else held.limit,
        "held": len(held.holders),
        "waiters": held.waiters,
        "holders": [_holder(holder) for holder in held.holders],
        "reset_url": _url(reset_url, using=using, name=held.name, **filters),
    }


def _holder(holder: HeldLock | SharedHolder | SemaphoreHolder) -> dict[str, Any]:
    owner = holder.owner
    shown = {
        "host": terminal_safe(owner.host or ""),
        "pid": "" if owner.pid is None else owner.pid,
        "thread": terminal_safe(owner.thread or ""),
        "label": terminal_safe(owner.label or ""),
        # Set when the block has ended and the hold is kept for a transaction.
        "transaction": terminal_safe(", ".join(owner.transaction)),
        "fence": holder.fence,
        **_duration("time_left", holder.time_left),
    }
    if not isinstance(holder, SemaphoreHolder):  # a permit's record has no acquisition time
        shown["acquired_at"] = holder.acquired_at
        shown.update(_duration("held_for", introspection.seconds_since(holder.acquired_at)))
    return shown


def _duration(key: str, seconds: float) -> dict[str, Any]:
    """Return ``seconds`` as text under ``key``, and under ``key_parts`` in wrappable parts.

    Each part keeps a number with its unit ("1 min", "58 s"), so a column of
    durations can take two lines instead of widening the table past the page.
    """
    text = duration(seconds)
    words = text.split()
    return {
        key: text,
        f"{key}_parts": [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)],
    }


def _render(
    request: HttpRequest,
    model_admin: LockAdmin,
    template: str,
    context: dict[str, Any],
    status: int = 200,
) -> HttpResponse:
    """Render ``template`` as a page of this admin site, ``context`` added to the site's."""
    opts = model_admin.opts
    site = model_admin.admin_site
    request.current_app = site.name
    context = {**site.each_context(request), "opts": opts, "app_label": opts.app_label, **context}
    return TemplateResponse(request, f"django_redis_mutex/admin/{template}", context, status=status)


def lock_list(
    request: HttpRequest, model_admin: LockAdmin, extra_context: dict[str, Any] | None = None
) -> HttpResponse:
    """Show the locks and semaphores held right now in one cache alias, searchable by name."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    changelist_url = _admin_url(model_admin, "changelist")
    query = request.GET.get("q", "").strip()
    paused = request.GET.get("refresh") == "0"
    filters = _Filters(request.GET)
    chosen = filters.values
    aliases = lock_aliases()
    context: dict[str, Any] = {
        "title": _("Locks"),
        "aliases": aliases,
        "query": query,
        "filter_fields": filters.fields,
        "filtered": bool(chosen),
        "paused": paused,
        "refresh_seconds": 0 if paused else REFRESH_SECONDS,
        "can_release": model_admin.has_release_permission(request),
        "can_reset_semaphores": model_admin.has_reset_semaphore_permission(request),
        "release_url": _admin_url(model_admin, _LOCKS.url_name),
        "contention_url": _admin_url(model_admin, "contention"),
        "reset_semaphore_url": _admin_url(model_admin, _SEMAPHORES.url_name),
        "locks": [],
        "semaphores": [],
    }
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
        status = _list_held(context, using, query, filters)
    context.update(extra_context or {})
    return _render(request, model_admin, "locks.html", context, status=status)


def _list_held(context: dict[str, Any], using: str, query: str, filters: _Filters) -> int:
    """Add what ``using`` holds that matches the search to the list page; return its status."""
    if filters.errors:
        # Listing every lock under a filter the operator believes applies would
        # invite releasing the wrong ones: list nothing. Reloading would only
        # repeat the error while the operator fixes it.
        context.update(error=filters.error_text(), filter_error=True, refresh_seconds=0)
        return 400
    try:
        found = introspection.listed_locks(using)
        semaphores = introspection.held_semaphores(using)
        # Said as the ``locks`` command says it.
        evictions = [
            line for p in introspection.eviction_policies(using) if (line := p.evictions_line())
        ]
    except _REDIS_FAILURES as exc:
        context["error"] = _unavailable(using, exc)
        return 503
    except ImproperlyConfigured as exc:  # e.g. a sharded client, which cannot hold locks
        context["error"] = str(exc)
        return 404
    # A shared lock is narrowed to the holders the filter selects, which are
    # those a release through this filtered list frees.
    locks = filters.lock_filter.narrow(found)
    # The holder filters select locks; a semaphore is listed unfiltered or not at all.
    shown = [] if filters.values else semaphores
    context.update(
        locks=[
            _lock_row(item, context["release_url"], using, filters.values)
            for item in locks
            if query.casefold() in item.held.name.casefold()
        ],
        total=len(found),
        semaphores=[
            _semaphore_row(held, context["reset_semaphore_url"], using, {})
            for held in shown
            if query.casefold() in held.name.casefold()
        ],
        semaphores_total=len(semaphores),
        semaphores_hidden=bool(filters.values) and bool(semaphores),
        evictions=evictions,
    )
    return 200


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


def _log_release(
    request: HttpRequest, name: str, using: str, freed: int, listed: ListedLock | None
) -> None:
    holder = _("fence %(fence)d, owner %(owner)s")
    if listed is None:
        details = _("owner unknown: it was not held when the page was read")
    elif listed.held.shared:
        holders = "; ".join(
            holder % {"fence": h.fence, "owner": h.owner} for h in listed.held.holders
        )
        details = _("shared, holders %(holders)s") % {"holders": holders}
    else:
        details = holder % {"fence": listed.held.fence, "owner": listed.held.owner}
    message = _("Force-released lock “%(name)s” in cache “%(alias)s” (%(details)s).") % {
        "name": name,
        "alias": using,
        "details": details,
    }
    _log_entry(request, Lock(name=name), DELETION, message)


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


def _log_entry(
    request: HttpRequest, entry: Lock | Semaphore, action_flag: int, message: str
) -> None:
    user_id = request.user.pk
    if hasattr(LogEntry.objects, "log_actions"):  # Django 5.1+
        LogEntry.objects.log_actions(user_id, [entry], action_flag, change_message=message)
    else:  # pragma: no cover - Django < 5.1 has only log_action
        content_type = ContentType.objects.get_for_model(entry)
        LogEntry.objects.log_action(
            user_id, content_type.pk, entry.pk, str(entry), action_flag, message
        )


@dataclass(frozen=True)
class _Kind:
    """What the confirm-then-POST flow needs to know of the locks or semaphores it frees."""

    noun: str  # "lock" or "semaphore"; its plural names the rows in the templates
    action: str  # "release" or "reset": the verb in the confirmation page's ids
    url_name: str  # after "<app>_<model>_"; LockAdmin.has_<url_name>_permission says who may
    template: str
    title: Any  # the texts are lazy: translated when shown
    select_first: Any
    none_held: Any
    not_held: Any  # plural of "count"
    freed: Any  # plural of "count": said once for all, or for each one freed ("name")
    read: Callable[[str], dict[str, Any]]  # alias -> what is held there, by name
    reset: Callable[[str, str], int]  # (name, alias) -> how many holds it freed
    log: Callable[[HttpRequest, str, str, int, Any], None]
    row: Callable[[Any, str, str, Mapping[str, str]], dict[str, Any]]
    filtered: bool = False  # whether the holder filters apply (they select locks)
    freed_each: bool = False


def _confirm_or_free(request: HttpRequest, model_admin: LockAdmin, kind: _Kind) -> HttpResponse:
    """Confirm (GET) and perform (POST) freeing the locks or semaphores named in the request."""
    if request.method not in ("GET", "HEAD", "POST"):
        return HttpResponseNotAllowed(["GET", "HEAD", "POST"])
    may_act = getattr(model_admin, f"has_{kind.url_name}_permission")
    if not (model_admin.has_view_permission(request) and may_act(request)):
        raise PermissionDenied
    data = request.POST if request.method == "POST" else request.GET
    context: dict[str, Any] = {"title": str(kind.title)}
    try:
        using = _chosen_alias(request, lock_aliases())
    except _AliasError as exc:
        context.update({"error": str(exc), f"{kind.noun}s": []})
        return _render(request, model_admin, kind.template, context, status=404)
    query = data.get("q", "")
    filters = _Filters(data if kind.filtered else {})
    back = _url(_admin_url(model_admin, "changelist"), using=using, q=query, **filters.values)

    def go_back(level: int, text: str) -> HttpResponse:
        messages.add_message(request, level, text)
        return HttpResponseRedirect(back)

    names = _requested_names(data.getlist("name"))
    if not names:
        return go_back(messages.WARNING, str(kind.select_first))
    if filters.errors:
        return go_back(messages.ERROR, filters.error_text())
    try:
        # A member of a quorum would free a quorum lock or permit on one master
        # only, while its holder keeps it alive on the others: say which alias to use.
        introspection.ensure_resettable(using, kind.noun)
        found = {name: item for name, item in kind.read(using).items() if name in names}
    except _REDIS_FAILURES as exc:
        return go_back(messages.ERROR, _unavailable(using, exc))
    except (ValueError, ImproperlyConfigured) as exc:
        return go_back(messages.ERROR, str(exc))
    if request.method == "POST":
        _free(request, kind, names, using, found, filters.lock_filter)
        return HttpResponseRedirect(back)

    # Narrowed as the POST will narrow them: a shared lock to the holders the filter
    # selects. A semaphore, never filtered, comes back whole.
    selected = {
        name: chosen
        for name, item in found.items()
        if (chosen := filters.lock_filter.select(item)) is not None
    }
    unmatched = [terminal_safe(n) for n in names if n in found and n not in selected]
    if not selected:
        if unmatched:
            return go_back(messages.WARNING, _("None of the selected locks matches the filter."))
        return go_back(messages.WARNING, str(kind.none_held))
    url = _admin_url(model_admin, kind.url_name)
    rows = [kind.row(selected[n], url, using, filters.values) for n in names if n in selected]
    context.update(
        {
            "kind": kind,
            "using": using,
            "query": query,
            "back_url": back,
            "action_url": url,
            "items": rows,
            f"{kind.noun}s": rows,
            "gone": [terminal_safe(n) for n in names if n not in found],
            "unmatched": unmatched,
            "filter_values": filters.values,
            "filter_description": filters.lock_filter.describe() if filters.values else "",
        }
    )
    return _render(request, model_admin, kind.template, context)


def _free(
    request: HttpRequest,
    kind: _Kind,
    names: list[str],
    using: str,
    found: dict[str, Any],
    lock_filter: LockFilter,
) -> None:
    """Free each named lock or semaphore, record it in the history, and say how it went.

    Under a filter, the filter is applied again here, not only on the
    confirmation page: a lock that passed to a holder outside the filter since
    then is left alone, and so is one that changes hands between this listing
    and its reset. Of a lock held shared, only the holders that match are
    released; the others keep it.
    """
    done = not_held = unmatched = 0
    try:
        for name in names:
            item = found.get(name)
            if lock_filter:
                chosen = None if item is None else lock_filter.select(item)
                if item is not None and chosen is None:
                    unmatched += 1
                    continue
                item = chosen
                freed = int(chosen is not None and introspection.reset_listed(chosen, using))
            else:
                freed = kind.reset(name, using)
            if not freed:
                not_held += 1
                continue
            done += 1
            kind.log(request, name, using, freed, item)
            if kind.freed_each:
                messages.success(
                    request, kind.freed % {"name": terminal_safe(name), "count": freed}
                )
    except _REDIS_FAILURES as exc:
        # On a quorum this includes too many masters unreachable to free it on
        # a majority: it is not reported as freed.
        messages.error(request, _unavailable(using, exc))
    except (ValueError, ImproperlyConfigured) as exc:  # CACHES changed since the confirmation
        messages.error(request, str(exc))
    else:
        if not_held:
            messages.warning(request, kind.not_held % {"count": not_held})
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
    if done and not kind.freed_each:
        messages.success(request, kind.freed % {"count": done})


_LOCKS = _Kind(
    noun="lock",
    action="release",
    url_name="release",
    template="release.html",
    filtered=True,
    title=gettext_lazy("Release locks"),
    select_first=gettext_lazy("Select the locks to release first."),
    none_held=gettext_lazy("None of the selected locks is held any more."),
    not_held=ngettext_lazy(
        "%(count)d lock was no longer held.", "%(count)d locks were no longer held.", "count"
    ),
    freed=ngettext_lazy("Released %(count)d lock.", "Released %(count)d locks.", "count"),
    read=lambda using: {item.held.name: item for item in introspection.listed_locks(using)},
    reset=lambda name, using: int(introspection.reset(name, using)),
    log=_log_release,
    row=_lock_row,
)

_SEMAPHORES = _Kind(
    noun="semaphore",
    action="reset",
    url_name="reset_semaphore",
    template="semaphore_reset.html",
    title=gettext_lazy("Reset semaphores"),
    select_first=gettext_lazy("Select the semaphores to reset first."),
    none_held=gettext_lazy("None of the selected semaphores is held any more."),
    not_held=ngettext_lazy(
        "%(count)d semaphore had no permit held any more.",
        "%(count)d semaphores had no permit held any more.",
        "count",
    ),
    freed=ngettext_lazy(
        "Reset semaphore “%(name)s”: freed %(count)d permit.",
        "Reset semaphore “%(name)s”: freed %(count)d permits.",
        "count",
    ),
    freed_each=True,
    read=lambda using: {item.name: item for item in introspection.held_semaphores(using)},
    reset=introspection.reset_semaphore,
    log=_log_semaphore_reset,
    row=_semaphore_row,
)


def release_locks(request: HttpRequest, model_admin: LockAdmin) -> HttpResponse:
    """Confirm (GET) and perform (POST) the force-release of the named locks."""
    return _confirm_or_free(request, model_admin, _LOCKS)


def reset_semaphores(request: HttpRequest, model_admin: LockAdmin) -> HttpResponse:
    """Confirm (GET) and perform (POST) freeing every permit of the named semaphores."""
    return _confirm_or_free(request, model_admin, _SEMAPHORES)


# The minutes the Contention page can cover, as ?minutes= choices.
CONTENTION_MINUTES = (5, 15, 60)


def contention(request: HttpRequest, model_admin: LockAdmin) -> HttpResponse:
    """Show the contention figures of one cache alias: a chart of the hottest classes, a table."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    page_url = _admin_url(model_admin, "contention")
    aliases = lock_aliases()
    minutes_asked = request.GET.get("minutes", "")
    minutes = int(minutes_asked) if minutes_asked.isdigit() else 60
    if minutes not in CONTENTION_MINUTES:
        minutes = 60
    context: dict[str, Any] = {
        "title": _("Lock contention"),
        "changelist_url": _admin_url(model_admin, "changelist"),
        "minutes": minutes,
        "classes": [],
        "chart": None,
    }
    try:
        using = _chosen_alias(request, aliases)
    except _AliasError as exc:
        context.update(error=str(exc), using=None)
        return _render(request, model_admin, "contention.html", context, status=404)
    context.update(
        using=using,
        counted=get_settings(using).stats,
        alias_links=[(a, _url(page_url, using=a, minutes=minutes)) for a in aliases],
        minute_links=[(m, _url(page_url, using=using, minutes=m)) for m in CONTENTION_MINUTES],
    )
    try:
        report = stats.read_stats(using, minutes)
    except _REDIS_FAILURES as exc:
        context["error"] = _(
            "Redis of cache “%(alias)s” could not be read, so the contention figures "
            "cannot be shown right now: %(error)s"
        ) % {"alias": using, "error": exc}
        return _render(request, model_admin, "contention.html", context, status=503)
    context.update(
        chart=contention_chart(report),
        classes=[figures_row(figures) for figures in report.classes],
    )
    return _render(request, model_admin, "contention.html", context)
