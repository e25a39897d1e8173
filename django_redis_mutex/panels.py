"""A django-debug-toolbar panel: the locks a request took, waited for and held.

Add ``"django_redis_mutex.panels.LocksPanel"`` to ``DEBUG_TOOLBAR_PANELS``.
The panel listens to the lock signals while at least one request with the
toolbar is in flight (no receiver is connected otherwise) and keeps, per
request, what the request's own thread or task did: a context variable set
around the view scopes the record, so locks taken at the same time by other
requests, threads or the watchdog never show up in it.

Below them, for each cache alias the request used that counts contention
(``"STATS": True``), the hottest lock classes of the last minutes, read from
Redis after this process's figures are flushed (see :mod:`~.stats`).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

from debug_toolbar.panels import Panel
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext
from redis.exceptions import RedisError

from . import signals, stats
from .chart import figures_row
from .conf import get_settings
from .display import terminal_safe
from .exceptions import LockBackendUnavailable
from .signals import ReceiverGroup

__all__ = ["LocksPanel"]

# The column titles of the panel's two tables: the summary, and the locks.
_SUMMARY_COLUMNS = (_("Acquisitions"), _("Contended"), _("Time waiting"), _("Time held"))
_LOCK_COLUMNS = (
    _("At"),
    _("Lock"),
    _("Cache"),
    _("Outcome"),
    _("Fence"),
    _("Waited"),
    _("Held"),
    _("Detail"),
)
_CONTENTION_COLUMNS = (
    _("Cache"),
    _("Lock class"),
    _("Acquired"),
    _("Waited"),
    _("Gave up"),
    _("Wait p99"),
    _("Hold p50"),
    _("Hold p99"),
)
# How many classes and minutes the contention section shows.
_HOTTEST, _MINUTES = 5, 15


@dataclass
class _Row:
    """One acquisition attempt; times in milliseconds, as the toolbar shows them."""

    outcome: str  # acquired, contended or unavailable
    alias: str
    name: str
    at: float  # when the attempt began, from the start of the request
    wait: float
    fence: int | None = None
    held: float | None = None  # set at release (or loss); None while held
    lost: bool = False
    detail: str = ""


@dataclass
class _Record:
    """What one request did with locks: one row per acquisition attempt, in order."""

    started: float
    rows: list[_Row] = field(default_factory=list)
    aliases: set[str] = field(default_factory=set)

    def add(self, outcome: str, alias: str, name: str, wait: float, **extra: Any) -> None:
        self.aliases.add(alias)
        at = (time.monotonic() - wait - self.started) * 1000
        self.rows.append(
            _Row(
                outcome=outcome,
                # Names often come from request data: control and bidi characters escaped.
                alias=terminal_safe(alias),
                name=terminal_safe(name),
                at=round(max(at, 0.0), 2),
                wait=round(wait * 1000, 2),
                **extra,
            )
        )


_current: ContextVar[_Record | None] = ContextVar("django_redis_mutex_panel", default=None)
_RECEIVERS = ReceiverGroup("django_redis_mutex.panels")


@_RECEIVERS.on(signals.lock_acquired)
def _on_acquired(
    sender: str, name: str, fence: int, wait: float, shared: bool = False, **kwargs: Any
) -> None:
    record = _current.get()
    if record is not None:
        record.add(
            "acquired", sender, name, wait, fence=fence, detail=_("shared") if shared else ""
        )


@_RECEIVERS.on(signals.lock_contended)
def _on_contended(
    sender: str,
    name: str,
    wait: float,
    retry_after: int,
    owner: Any,
    shared: bool = False,
    **kwargs: Any,
) -> None:
    record = _current.get()
    if record is not None:
        held_by = terminal_safe(str(owner)) if owner is not None else _("unknown owner")
        detail = _("held by %(owner)s; retry after %(seconds)d s") % {
            "owner": held_by,
            "seconds": retry_after,
        }
        if shared:
            detail = _("shared; %(detail)s") % {"detail": detail}
        record.add("contended", sender, name, wait, detail=detail)


@_RECEIVERS.on(signals.lock_unavailable)
def _on_unavailable(
    sender: str, name: str, wait: float, error: BaseException, **kwargs: Any
) -> None:
    record = _current.get()
    if record is not None:
        record.add("unavailable", sender, name, wait, detail=terminal_safe(str(error)))


@_RECEIVERS.on(signals.lock_released)
@_RECEIVERS.on(signals.lock_lost)
def _on_ended(
    sender: str,
    name: str,
    fence: int,
    held: float,
    signal: Signal,
    databases: tuple[str, ...] = (),
    **kwargs: Any,
) -> None:
    """Record the end of the hold ``fence`` of ``name``, if this request took it.

    ``databases``: the transactions the lock was kept for after its block.
    """
    record = _current.get()
    key = ("acquired", terminal_safe(sender), terminal_safe(name), fence)
    for row in reversed(record.rows if record is not None else []):
        if row.held is None and (row.outcome, row.alias, row.name, row.fence) == key:
            row.held = round(held * 1000, 2)
            row.lost = signal is signals.lock_lost
            if databases:
                row.detail = terminal_safe(
                    f"kept until its transaction on {', '.join(databases)} ended"
                )
            return


# Requests with this panel enabled in flight; the receivers are connected
# only while there is one.
_listening = 0
_listening_lock = threading.Lock()


def _listen(change: int) -> None:
    """Count a request in (+1) or out (-1); connect for the first, disconnect after the last."""
    global _listening
    with _listening_lock:
        _listening += change
        if _listening == 1 and change > 0:
            _RECEIVERS.connect()
        elif _listening == 0:
            _RECEIVERS.disconnect()


class LocksPanel(Panel):
    """The locks of this request: outcome, wait, fence and time held, in order."""

    is_async = True
    title = _("Locks")
    template = "django_redis_mutex/panels/locks.html"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._record: _Record | None = None
        self._listening = False

    @property
    def nav_subtitle(self) -> str:
        stats: dict[str, Any] = self.get_stats()  # type: ignore[no-untyped-call]
        count = len(stats.get("locks", ()))
        subtitle = ngettext("%(count)d lock", "%(count)d locks", count) % {"count": count}
        if contended := stats.get("contended", 0):
            subtitle += ", " + _("%(count)d contended") % {"count": contended}
        if waited := stats.get("waited", 0.0):
            subtitle += ", " + _("%(ms).1f ms waiting") % {"ms": waited}
        return subtitle

    @property
    def content(self) -> str:
        stats = self.get_stats()  # type: ignore[no-untyped-call]
        columns = {
            "summary_columns": _SUMMARY_COLUMNS,
            "lock_columns": _LOCK_COLUMNS,
            "contention_columns": _CONTENTION_COLUMNS,
            "contention_minutes": _MINUTES,
        }
        return render_to_string(self.template, {**stats, **columns})

    def enable_instrumentation(self) -> None:
        if not self._listening:
            self._listening = True
            _listen(+1)

    def disable_instrumentation(self) -> None:
        if self._listening:
            self._listening = False
            _listen(-1)

    def process_request(self, request: HttpRequest) -> Any:
        record = self._record = _Record(started=time.monotonic())
        token = _current.set(record)
        try:
            response = self.get_response(request)
        finally:
            _current.reset(token)
        if inspect.isawaitable(response):
            # The toolbar runs async: the view runs when this is awaited.
            return self._aprocess(response, record)
        return response

    async def _aprocess(self, response: Awaitable[HttpResponse], record: _Record) -> HttpResponse:
        token = _current.set(record)
        try:
            return await response
        finally:
            _current.reset(token)

    def generate_stats(self, request: HttpRequest, response: HttpResponse) -> None:
        rows = self._record.rows if self._record is not None else []
        aliases = self._record.aliases if self._record is not None else set()
        # Plain values only: the toolbar stores them as JSON for its history.
        self.record_stats(  # type: ignore[no-untyped-call]
            {
                "locks": [asdict(row) for row in rows],
                "contention": _hottest(sorted(aliases)),
                "contended": sum(row.outcome == "contended" for row in rows),
                "waited": round(sum(row.wait for row in rows), 2),
                "held": round(sum(row.held or 0.0 for row in rows), 2),
            }
        )


def _hottest(aliases: list[str]) -> list[dict[str, Any]]:
    """Return the rows of the hottest lock classes of each alias that counts contention."""
    found: list[dict[str, Any]] = []
    for alias in aliases:
        try:
            if not get_settings(alias).stats:
                continue
            stats.flush(alias)  # this request's own figures included
            report = stats.read_stats(alias, _MINUTES)
        except (LockBackendUnavailable, RedisError) as exc:
            found.append({"alias": terminal_safe(alias), "error": terminal_safe(str(exc))})
            continue
        for figures in report.hottest(_HOTTEST):
            found.append({"alias": terminal_safe(alias), **figures_row(figures)})
    return found
