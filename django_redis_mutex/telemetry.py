"""OpenTelemetry spans and metrics for locks, built on the lock signals.

Turned on per cache alias with ``"TELEMETRY": True`` in its ``MUTEX`` block.
The receivers here are connected (in ``AppConfig.ready()``, and again whenever
``CACHES`` changes) only while at least one alias asks for telemetry and
``opentelemetry-api`` can be imported; otherwise nothing is connected, the
lock skips building every signal's arguments, and ``opentelemetry`` is never
imported.

Spans and instruments come from the global tracer and meter providers, so
they go wherever the project's OpenTelemetry SDK sends them. Signals are sent
after the fact, so the span of an acquisition is started ``wait`` seconds
before it is ended: it covers the acquisition, and is a child of whatever span
was current in the acquiring thread or task (a request's, for instance).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, wraps
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import Signal, receiver

from . import signals
from .conf import get_settings, parse_settings
from .signals import ReceiverGroup

__all__ = [
    "SPAN_NAME",
    "TRANSACTION_SPAN_NAME",
    "available",
    "connect",
    "connected",
    "disconnect",
    "telemetry_aliases",
    "update_receivers",
]

logger = logging.getLogger("django_redis_mutex")

SPAN_NAME = "mutex.acquire"
#: The span sent when a lock's block ends inside a database transaction.
TRANSACTION_SPAN_NAME = "mutex.held_for_transaction"

# Seconds: waits and holds run from well under a millisecond (a free lock) to
# minutes (a long job); OpenTelemetry's default buckets are meant for milliseconds.
BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)


# (name between "mutex." and ".duration", description) of the histograms of
# _Instruments, in seconds.
_DURATIONS = (
    ("wait", "Time an acquisition took, waiting included, by outcome."),
    ("hold", "Time a lock was held, from acquisition to release."),
)
# (name after "mutex.", unit, description) of its counters.
_COUNTERS = (
    ("waited", "{acquisition}", "Acquisitions that found the lock held and waited for it."),
    ("contended", "{acquisition}", "Acquisitions that gave up because the lock stayed held."),
    ("lost", "{hold}", "Holds lost before release: expired, reset or taken."),
)


class _Instruments:
    """The tracer and the instruments, from the global providers."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace

        from . import __version__

        meter = metrics.get_meter("django_redis_mutex", __version__)
        self.tracer = trace.get_tracer("django_redis_mutex", __version__)
        self.wait, self.hold = (
            meter.create_histogram(
                f"mutex.{what}.duration",
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=BUCKETS,
            )
            for what, description in _DURATIONS
        )
        # Counted once per acquisition that waited, gave up, or lost its hold.
        self.waited, self.contended, self.lost = (
            meter.create_counter(f"mutex.{what}", unit=unit, description=description)
            for what, unit, description in _COUNTERS
        )
        self.waiters = meter.create_up_down_counter(
            "mutex.waiters",
            unit="{waiter}",
            description="Acquisitions of this process waiting for a held lock right now.",
        )


@cache
def _instruments() -> _Instruments | None:
    """Return the tracer and instruments, or None when opentelemetry-api is not installed."""
    try:
        from opentelemetry import metrics, trace  # noqa: F401
    except ImportError:
        return None
    return _Instruments()


def available() -> bool:
    """Return True if ``opentelemetry-api`` can be imported (importing it, once)."""
    return _instruments() is not None


def telemetry_aliases() -> list[str]:
    """Return the cache aliases whose ``MUTEX`` block turns telemetry on.

    A block that does not validate is skipped here: the system checks report it.
    """
    from django.conf import settings

    aliases = []
    for alias, entry in getattr(settings, "CACHES", {}).items():
        block = entry.get("MUTEX") if isinstance(entry, dict) else None
        if not isinstance(block, dict) or not block.get("TELEMETRY"):
            continue
        try:
            if parse_settings(alias, block).telemetry:
                aliases.append(alias)
        except ImproperlyConfigured:
            continue
    return aliases


def _attributes(alias: str, name: str) -> dict[str, str] | None:
    """Return the attributes of ``alias``'s telemetry, or None if the alias has it off."""
    try:
        config = get_settings(alias)
    except ImproperlyConfigured:  # the alias went away with a settings change
        return None
    if not config.telemetry:
        return None
    if config.telemetry_names:
        return {"mutex.alias": alias, "mutex.name": name}
    return {"mutex.alias": alias}


@dataclass(frozen=True)
class _Report:
    """Where a receiver records: the instruments, and the attributes of the alias and lock."""

    tools: _Instruments
    attributes: dict[str, str]

    def span(
        self, name: str, wait: float, extra: dict[str, Any], error: BaseException | None = None
    ) -> None:
        """Send the span ``name``, started ``wait`` seconds ago and ended now."""
        end = time.time_ns()
        span = self.tools.tracer.start_span(
            name,
            start_time=end - max(int(wait * 1e9), 0),
            attributes={**self.attributes, **extra},
        )
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end(end_time=end)

    def acquisition(
        self, outcome: str, extra: dict[str, Any], wait: float, error: Any = None, **kwargs: Any
    ) -> None:
        """Record an acquisition's span and wait; ``kwargs``: the rest of the signal's arguments."""
        self.span(SPAN_NAME, wait, {"mutex.outcome": outcome, "mutex.wait": wait, **extra}, error)
        self.tools.wait.record(wait, {**self.attributes, "mutex.outcome": outcome})


_RECEIVERS = ReceiverGroup("django_redis_mutex.telemetry")
# (receiver, error type) already logged with a traceback: later ones go to DEBUG,
# so a broken exporter does not log once per lock.
_logged_failures: set[tuple[str, str]] = set()


def _receiver(signal: Signal) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Connect ``record(report, **kwargs)`` to ``signal`` as a receiver that never raises.

    A broken exporter or span processor must cost the lock nothing: an error
    of a ``lock_acquired`` receiver would make the acquisition give its lock
    back. It is logged instead, with its traceback the first time.
    """

    def connect(record: Callable[..., None]) -> Callable[..., None]:
        @_RECEIVERS.on(signal)
        @wraps(record)
        def receive(sender: str, name: str, **kwargs: Any) -> None:
            attributes = _attributes(sender, name)
            tools = _instruments()
            if attributes is None or tools is None:
                return
            try:
                record(_Report(tools, attributes), **kwargs)
            except Exception as exc:
                failure = (record.__name__, type(exc).__qualname__)
                if failure not in _logged_failures:
                    _logged_failures.add(failure)
                    logger.warning("Lock telemetry failed in %s", record.__name__, exc_info=exc)
                else:
                    logger.debug("Lock telemetry failed in %s: %r", record.__name__, exc)

        return receive

    return connect


@_receiver(signals.lock_acquired)
def _on_acquired(
    report: _Report, fence: int, shared: bool = False, waited: bool = False, **kwargs: Any
) -> None:
    report.acquisition("acquired", {"mutex.fence": fence, "mutex.shared": shared}, **kwargs)
    if waited:
        report.tools.waited.add(1, report.attributes)


@_receiver(signals.lock_contended)
def _on_contended(report: _Report, retry_after: int, shared: bool = False, **kwargs: Any) -> None:
    extra = {"mutex.retry_after": retry_after, "mutex.shared": shared}
    report.acquisition("contended", extra, **kwargs)
    report.tools.contended.add(1, report.attributes)


@_receiver(signals.lock_unavailable)
def _on_unavailable(report: _Report, **kwargs: Any) -> None:
    report.acquisition("unavailable", {}, **kwargs)


@_receiver(signals.lock_released)
def _on_released(report: _Report, held: float, **kwargs: Any) -> None:
    report.tools.hold.record(held, report.attributes)


@_receiver(signals.lock_held_for_transaction)
def _on_held_for_transaction(
    report: _Report, fence: int, databases: tuple[str, ...], shared: bool = False, **kwargs: Any
) -> None:
    # A span of its own, at the moment the block ended: the lock is kept from
    # here until the transaction on ``databases`` ends (the hold histogram,
    # recorded at the real release, includes that wait).
    extra = {"mutex.fence": fence, "mutex.shared": shared, "mutex.databases": list(databases)}
    report.span(TRANSACTION_SPAN_NAME, 0.0, extra)


@_receiver(signals.lock_lost)
def _on_lost(report: _Report, **kwargs: Any) -> None:
    report.tools.lost.add(1, report.attributes)


@_receiver(signals.lock_waiting)
def _on_waiting(report: _Report, waiting: bool, **kwargs: Any) -> None:
    report.tools.waiters.add(1 if waiting else -1, report.attributes)


connect = _RECEIVERS.connect
disconnect = _RECEIVERS.disconnect
connected = _RECEIVERS.connected


def update_receivers() -> bool:
    """Connect the receivers if an alias turns telemetry on and OpenTelemetry is installed.

    Otherwise disconnect them. Return whether they are connected. An alias
    with ``TELEMETRY`` on but no ``opentelemetry-api`` is reported by the
    system check ``django_redis_mutex.W002``.
    """
    if telemetry_aliases() and available():
        connect()
        return True
    disconnect()
    return False


@receiver(setting_changed)
def _update_on_caches_change(*, setting: str, **kwargs: Any) -> None:
    if setting == "CACHES":
        update_receivers()
