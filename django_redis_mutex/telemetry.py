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
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import Signal, receiver

from . import signals
from .conf import get_settings, parse_settings

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter
    from opentelemetry.trace import Tracer

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

_UID = "django_redis_mutex.telemetry"


@dataclass(frozen=True)
class _Instruments:
    tracer: Tracer
    wait: Histogram
    hold: Histogram
    contended: Counter
    lost: Counter
    waiters: UpDownCounter


@cache
def _instruments() -> _Instruments | None:
    """Return the tracer and instruments, or None when opentelemetry-api is not installed."""
    try:
        from opentelemetry import metrics, trace
    except ImportError:
        return None
    from . import __version__

    meter = metrics.get_meter("django_redis_mutex", __version__)
    return _Instruments(
        tracer=trace.get_tracer("django_redis_mutex", __version__),
        wait=meter.create_histogram(
            "mutex.wait.duration",
            unit="s",
            description="Time an acquisition took, waiting included, by outcome.",
            explicit_bucket_boundaries_advisory=BUCKETS,
        ),
        hold=meter.create_histogram(
            "mutex.hold.duration",
            unit="s",
            description="Time a lock was held, from acquisition to release.",
            explicit_bucket_boundaries_advisory=BUCKETS,
        ),
        contended=meter.create_counter(
            "mutex.contended",
            unit="{acquisition}",
            description="Acquisitions that gave up because the lock stayed held.",
        ),
        lost=meter.create_counter(
            "mutex.lost",
            unit="{hold}",
            description="Holds lost before release: expired, reset or taken.",
        ),
        waiters=meter.create_up_down_counter(
            "mutex.waiters",
            unit="{waiter}",
            description="Acquisitions of this process waiting for a held lock right now.",
        ),
    )


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


def _span(
    instruments: _Instruments,
    attributes: dict[str, str],
    outcome: str,
    wait: float,
    extra: dict[str, Any],
    error: BaseException | None = None,
) -> None:
    end = time.time_ns()
    span = instruments.tracer.start_span(
        SPAN_NAME,
        start_time=end - max(int(wait * 1e9), 0),
        attributes={**attributes, "mutex.outcome": outcome, "mutex.wait": wait, **extra},
    )
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=end)
    instruments.wait.record(wait, {**attributes, "mutex.outcome": outcome})


def _receiver(record: Callable[..., None]) -> Callable[..., None]:
    """Make ``record(instruments, attributes, **kwargs)`` a receiver that never raises.

    A broken exporter or span processor must cost the lock nothing: an error
    of a ``lock_acquired`` receiver would make the acquisition give its lock
    back. It is logged instead, with its traceback the first time.
    """

    @wraps(record)
    def receive(sender: str, name: str, **kwargs: Any) -> None:
        attributes = _attributes(sender, name)
        instruments = _instruments()
        if attributes is None or instruments is None:
            return
        try:
            record(instruments, attributes, **kwargs)
        except Exception as exc:
            failure = (record.__name__, type(exc).__qualname__)
            if failure not in _logged_failures:
                _logged_failures.add(failure)
                logger.warning("Lock telemetry failed in %s", record.__name__, exc_info=exc)
            else:
                logger.debug("Lock telemetry failed in %s: %r", record.__name__, exc)

    return receive


# (receiver, error type) already logged with a traceback: later ones go to DEBUG,
# so a broken exporter does not log once per lock.
_logged_failures: set[tuple[str, str]] = set()


@_receiver
def _on_acquired(
    instruments: _Instruments,
    attributes: dict[str, str],
    fence: int,
    wait: float,
    shared: bool = False,
    **kwargs: Any,
) -> None:
    _span(instruments, attributes, "acquired", wait, {"mutex.fence": fence, "mutex.shared": shared})


@_receiver
def _on_contended(
    instruments: _Instruments,
    attributes: dict[str, str],
    wait: float,
    retry_after: int,
    shared: bool = False,
    **kwargs: Any,
) -> None:
    extra = {"mutex.retry_after": retry_after, "mutex.shared": shared}
    _span(instruments, attributes, "contended", wait, extra)
    instruments.contended.add(1, attributes)


@_receiver
def _on_unavailable(
    instruments: _Instruments,
    attributes: dict[str, str],
    wait: float,
    error: BaseException,
    **kwargs: Any,
) -> None:
    _span(instruments, attributes, "unavailable", wait, {}, error)


@_receiver
def _on_released(
    instruments: _Instruments, attributes: dict[str, str], held: float, **kwargs: Any
) -> None:
    instruments.hold.record(held, attributes)


@_receiver
def _on_held_for_transaction(
    instruments: _Instruments,
    attributes: dict[str, str],
    fence: int,
    databases: tuple[str, ...],
    shared: bool = False,
    **kwargs: Any,
) -> None:
    # A span of its own, at the moment the block ended: the lock is kept from
    # here until the transaction on ``databases`` ends (the hold histogram,
    # recorded at the real release, includes that wait).
    now = time.time_ns()
    span = instruments.tracer.start_span(
        TRANSACTION_SPAN_NAME,
        start_time=now,
        attributes={
            **attributes,
            "mutex.fence": fence,
            "mutex.shared": shared,
            "mutex.databases": list(databases),
        },
    )
    span.end(end_time=now)


@_receiver
def _on_lost(instruments: _Instruments, attributes: dict[str, str], **kwargs: Any) -> None:
    instruments.lost.add(1, attributes)


@_receiver
def _on_waiting(
    instruments: _Instruments, attributes: dict[str, str], waiting: bool, **kwargs: Any
) -> None:
    instruments.waiters.add(1 if waiting else -1, attributes)


_RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_contended, _on_contended),
    (signals.lock_unavailable, _on_unavailable),
    (signals.lock_released, _on_released),
    (signals.lock_held_for_transaction, _on_held_for_transaction),
    (signals.lock_lost, _on_lost),
    (signals.lock_waiting, _on_waiting),
)


def connect() -> None:
    """Connect the telemetry receivers to the lock signals (idempotent)."""
    for signal, function in _RECEIVERS:
        signal.connect(function, dispatch_uid=_UID)


def disconnect() -> None:
    """Disconnect the telemetry receivers (idempotent)."""
    for signal, _function in _RECEIVERS:
        signal.disconnect(dispatch_uid=_UID)


def connected() -> bool:
    """Return True if the telemetry receivers are connected."""
    return any(key[0] == _UID for key, *_rest in signals.lock_acquired.receivers)


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
