"""OpenTelemetry spans and metrics, recorded by the SDK's in-memory exporters against real Redis.

Telemetry is turned on per test with ``override_settings``; everywhere else in
the suite the lock signals keep no telemetry receiver. The tests that show
OpenTelemetry costs nothing when off, or when missing, run in a fresh
interpreter, since this one has it imported.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.test import override_settings
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from django_redis_mutex import LockBackendUnavailable, LockLost, Mutex, mutex, reset, signals
from django_redis_mutex import telemetry as mutex_telemetry
from django_redis_mutex.checks import check_mutex_settings
from django_redis_mutex.conf import parse_settings
from django_redis_mutex.testing import free_port

from .helpers import ROOT, caches_with, wait_until

LOCK_SIGNALS = (
    signals.lock_acquired,
    signals.lock_released,
    signals.lock_contended,
    signals.lock_lost,
    signals.lock_waiting,
    signals.lock_unavailable,
    signals.lock_held_for_transaction,
)

# (metric name, attributes) -> (count or value, sum): what the SDK has aggregated so far.
Totals = dict[tuple[str, frozenset[tuple[str, Any]]], tuple[float, float]]


class BrokenProcessor(SpanProcessor):
    """A span processor that fails on every span while ``broken`` is set."""

    broken = False

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.broken:
            raise RuntimeError("span processor is broken")


@dataclass
class Recorded:
    """What the in-memory exporters saw: finished spans, and cumulative metric totals."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer: trace.Tracer
    broken: BrokenProcessor

    def acquisitions(self, outcome: str | None = None) -> list[ReadableSpan]:
        return [
            span
            for span in self.spans.get_finished_spans()
            if span.name == mutex_telemetry.SPAN_NAME
            and (outcome is None or span.attributes["mutex.outcome"] == outcome)  # type: ignore[index]
        ]

    def totals(self) -> Totals:
        found: Totals = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                if scope.scope.name != "django_redis_mutex":
                    continue
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        key = (metric.name, frozenset((point.attributes or {}).items()))
                        if hasattr(point, "count"):
                            found[key] = (point.count, point.sum)
                        else:
                            found[key] = (point.value, point.value)
        return found

    def waiters(self, alias: str = "default") -> float:
        key = ("mutex.waiters", frozenset({("mutex.alias", alias)}))
        return self.totals().get(key, (0, 0))[0]


def added(before: Totals, after: Totals, metric: str, **attributes: Any) -> tuple[float, float]:
    """Return (count, sum) added to ``metric`` with exactly ``attributes`` between two totals."""
    key = (metric, frozenset(attributes.items()))
    old, new = before.get(key, (0, 0)), after.get(key, (0, 0))
    return new[0] - old[0], new[1] - old[1]


@cache
def _providers() -> Recorded:
    # The global providers can be set once per process; the instruments of
    # django_redis_mutex.telemetry follow them whenever they are set.
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    broken = BrokenProcessor()
    tracer_provider.add_span_processor(broken)
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    assert trace.get_tracer_provider() is tracer_provider, "another tracer provider was set"
    return Recorded(spans, reader, tracer_provider.get_tracer("tests"), broken)


@pytest.fixture
def telemetry() -> Iterator[Recorded]:
    """Turn telemetry on for the default alias and record what it sends."""
    recorded = _providers()
    with override_settings(CACHES=caches_with(TELEMETRY=True)):
        recorded.spans.clear()
        yield recorded


def hold_in_thread(name: str, **options: Any) -> Mutex:
    """Take ``name`` from another thread (another owner) and return its handle."""
    lock = Mutex(name, **options)
    taker = threading.Thread(target=lock.acquire, kwargs={"blocking": False})
    taker.start()
    taker.join()
    assert lock.owned()
    return lock


def span_seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def test_contended_acquisition_records_a_span_with_its_outcome_and_wait(
    telemetry: Recorded,
) -> None:
    before = telemetry.totals()
    holder = hold_in_thread("inventory", ttl=9)
    try:
        assert not Mutex("inventory", timeout=0.2).acquire()
    finally:
        holder.release()
    [span] = telemetry.acquisitions("contended")
    attributes = dict(span.attributes or {})
    wait = attributes.pop("mutex.wait")
    assert attributes == {
        "mutex.alias": "default",
        "mutex.outcome": "contended",
        "mutex.retry_after": 9,
        "mutex.shared": False,
    }
    assert 0.2 <= wait < 3
    # Sent after the fact, the span is stretched back over the whole wait.
    assert span_seconds(span) == pytest.approx(wait, abs=1e-6)
    assert span.status.status_code is StatusCode.UNSET
    after = telemetry.totals()
    assert added(before, after, "mutex.contended", **{"mutex.alias": "default"})[0] == 1
    count, total = added(
        before,
        after,
        "mutex.wait.duration",
        **{"mutex.alias": "default", "mutex.outcome": "contended"},
    )
    assert count == 1
    assert total == pytest.approx(wait)


def test_a_waiter_is_counted_while_it_waits_and_its_span_has_fence_and_wait(
    telemetry: Recorded,
) -> None:
    holder = Mutex("inventory")
    assert holder.acquire()
    waiter = Mutex("inventory")
    started = time.monotonic()
    thread = threading.Thread(target=waiter.acquire)
    thread.start()
    wait_until(lambda: telemetry.waiters() == 1, what="the waiters gauge to count the waiter")
    holder.release()
    thread.join(5)
    elapsed = time.monotonic() - started
    assert waiter.owned()
    fence = waiter.fence
    waiter.release()
    assert telemetry.waiters() == 0
    [span] = [
        span
        for span in telemetry.acquisitions("acquired")
        if (span.attributes or {})["mutex.fence"] == fence
    ]
    assert 0 < (span.attributes or {})["mutex.wait"] <= elapsed  # type: ignore[operator]


def test_every_cycle_counts_in_the_wait_and_hold_histograms(telemetry: Recorded) -> None:
    before = telemetry.totals()
    started = time.monotonic()
    for _ in range(3):
        with mutex("inventory"):
            pass
    elapsed = time.monotonic() - started
    after = telemetry.totals()
    alias = {"mutex.alias": "default"}
    waits, _ = added(before, after, "mutex.wait.duration", **alias, **{"mutex.outcome": "acquired"})
    holds, held = added(before, after, "mutex.hold.duration", **alias)
    assert (waits, holds) == (3, 3)
    assert 0 < held <= elapsed
    assert added(before, after, "mutex.contended", **alias) == (0, 0)
    assert len(telemetry.acquisitions("acquired")) == 3


def test_a_reset_lock_counts_as_lost(telemetry: Recorded) -> None:
    before = telemetry.totals()
    with pytest.raises(LockLost), mutex("inventory", watchdog=False):
        assert reset("inventory")
    after = telemetry.totals()
    assert added(before, after, "mutex.lost", **{"mutex.alias": "default"})[0] == 1
    # A hold that ended lost was never released: no hold time is recorded for it.
    assert added(before, after, "mutex.hold.duration", **{"mutex.alias": "default"})[0] == 0


def test_unreachable_redis_records_an_unavailable_span(telemetry: Recorded) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["down"] = {
        **caches["default"],
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
        "MUTEX": {**caches["default"]["MUTEX"], "TELEMETRY": True},
    }
    before = telemetry.totals()
    with override_settings(CACHES=caches), pytest.raises(LockBackendUnavailable):
        Mutex("inventory", using="down").acquire()
    [span] = telemetry.acquisitions("unavailable")
    assert (span.attributes or {})["mutex.alias"] == "down"
    assert span.status.status_code is StatusCode.ERROR
    assert [event.name for event in span.events] == ["exception"]
    after = telemetry.totals()
    attributes = {"mutex.alias": "down", "mutex.outcome": "unavailable"}
    assert added(before, after, "mutex.wait.duration", **attributes)[0] == 1


def test_lock_names_are_attributes_only_when_asked_for(telemetry: Recorded) -> None:
    with mutex("inventory"):
        pass
    [anonymous] = telemetry.acquisitions()
    assert "mutex.name" not in (anonymous.attributes or {})
    before = telemetry.totals()
    with (
        override_settings(CACHES=caches_with(TELEMETRY=True, TELEMETRY_NAMES=True)),
        mutex("inventory"),
    ):
        pass
    named = telemetry.acquisitions()[-1]
    assert (named.attributes or {})["mutex.name"] == "inventory"
    after = telemetry.totals()
    attributes = {"mutex.alias": "default", "mutex.name": "inventory"}
    assert added(before, after, "mutex.hold.duration", **attributes)[0] == 1


def test_the_span_is_a_child_of_the_current_span(telemetry: Recorded) -> None:
    with telemetry.tracer.start_as_current_span("GET /orders/7/") as request_span, mutex("order:7"):
        pass
    [span] = telemetry.acquisitions()
    assert span.parent is not None
    assert span.parent.span_id == request_span.get_span_context().span_id


def test_an_async_acquisition_records_its_span(telemetry: Recorded) -> None:
    async def take() -> int | None:
        async with mutex("inventory") as lock:
            return lock.fence

    fence = asyncio.run(take())
    [span] = telemetry.acquisitions("acquired")
    assert (span.attributes or {})["mutex.fence"] == fence
    assert (span.attributes or {})["mutex.shared"] is False


def test_a_shared_acquisition_says_so_on_its_span(telemetry: Recorded) -> None:
    with mutex("inventory", shared=True) as lock:
        fence = lock.fence
    [span] = telemetry.acquisitions("acquired")
    assert (span.attributes or {})["mutex.fence"] == fence
    assert (span.attributes or {})["mutex.shared"] is True


def test_a_failing_span_processor_costs_the_lock_nothing(
    telemetry: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="django_redis_mutex")
    telemetry.broken.broken = True
    try:
        with mutex("inventory") as lock:
            assert lock.owned()
        with mutex("inventory") as lock:
            assert lock.owned()
    finally:
        telemetry.broken.broken = False
    assert not Mutex("inventory").locked()
    # Only telemetry's own lines: a background give-back left by an earlier
    # test may log on the same logger meanwhile.
    ours = [
        record
        for record in caplog.records
        if record.name == "django_redis_mutex" and "telemetry" in record.getMessage()
    ]
    # Logged with its traceback once, not once per lock.
    assert [(record.levelname, record.getMessage()) for record in ours] == [
        ("WARNING", "Lock telemetry failed in _on_acquired"),
        (
            "DEBUG",
            "Lock telemetry failed in _on_acquired: RuntimeError('span processor is broken')",
        ),
    ]


def test_an_alias_without_telemetry_records_nothing(telemetry: Recorded) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["quiet"] = {
        **caches["default"],
        "MUTEX": {"PREFIX": caches["default"]["MUTEX"]["PREFIX"] + "q"},
    }
    before = telemetry.totals()
    with override_settings(CACHES=caches), mutex("inventory", using="quiet"):
        pass
    assert telemetry.acquisitions() == []
    assert telemetry.totals() == before


def our_receivers() -> list[str]:
    """Return the signals that have a telemetry receiver connected."""
    names = {id(signal): name for name, signal in vars(signals).items() if signal in LOCK_SIGNALS}
    return [
        names[id(signal)]
        for signal in LOCK_SIGNALS
        if any(
            str(key[0]).startswith("django_redis_mutex.telemetry") for key, *_ in signal.receivers
        )
    ]


def test_receivers_are_connected_only_while_an_alias_turns_telemetry_on() -> None:
    assert our_receivers() == []
    assert not mutex_telemetry.connected()
    with override_settings(CACHES=caches_with(TELEMETRY=True)):
        assert sorted(our_receivers()) == sorted(
            name for name, value in vars(signals).items() if value in LOCK_SIGNALS
        )
    assert our_receivers() == []


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"TELEMETRY": "yes"}, "TELEMETRY"),
        ({"TELEMETRY": True, "TELEMETRY_NAMES": 1}, "TELEMETRY_NAMES"),
        ({"TELEMETRY_NAMES": True}, "TELEMETRY_NAMES"),
    ],
)
def test_a_bad_telemetry_setting_is_an_error_naming_the_key(
    block: dict[str, Any], key: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"\['MUTEX'\]\['{key}'\]"):
        parse_settings("default", block)
    with override_settings(CACHES=caches_with(**block)):
        [error] = check_mutex_settings()
    assert error.id == "django_redis_mutex.E002"
    assert f"['{key}']" in error.msg


def test_telemetry_on_with_opentelemetry_installed_passes_the_checks() -> None:
    with override_settings(CACHES=caches_with(TELEMETRY=True, TELEMETRY_NAMES=True)):
        assert check_mutex_settings() == []


# Run in a fresh interpreter with the suite's settings. Every import of
# opentelemetry is noted with the module that asked for it (redis-py asks on
# its own when the package is installed); HIDE_OPENTELEMETRY makes each such
# import fail, as if the package were not installed.
FRESH_PROCESS = """
import copy, json, os, sys

importers = set()

class NoteOpenTelemetryImports:
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] != "opentelemetry":
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        importers.add(frame.f_globals.get("__name__") if frame is not None else "?")
        if os.environ.get("HIDE_OPENTELEMETRY"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoteOpenTelemetryImports())

import django
from django.conf import settings
from tests import settings as suite

caches = copy.deepcopy(suite.CACHES)
caches["default"]["MUTEX"]["TELEMETRY"] = bool(os.environ.get("TELEMETRY"))
settings.configure(**{**{name: getattr(suite, name) for name in dir(suite) if name.isupper()},
                      "CACHES": caches})
django.setup()

from django.core.checks import run_checks
from django_redis_mutex import mutex, signals

with mutex("inventory") as lock:
    fence = lock.fence
lock_signals = [value for name, value in vars(signals).items() if name.startswith("lock_")]
print(json.dumps({
    "fence": fence,
    "ours": sorted(name for name in importers if name.startswith("django_redis_mutex")),
    "receivers": sum(len(signal.receivers) for signal in lock_signals),
    "checks": [message.id for message in run_checks(tags=["caches"])],
}))
"""


def run_fresh(redis_url: str, prefix: str, **env: str) -> dict[str, Any]:
    environment = {
        **os.environ,
        "DJANGO_REDIS_MUTEX_TEST_URL": redis_url,
        "DJANGO_REDIS_MUTEX_TEST_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
        **env,
    }
    environment.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_with_telemetry_off_the_package_never_imports_opentelemetry(
    redis_url: str, mutex_prefix: str
) -> None:
    result = run_fresh(redis_url, mutex_prefix)
    assert result["fence"] > 0
    assert result["ours"] == []
    assert result["receivers"] == 0
    assert result["checks"] == []


def test_without_opentelemetry_a_lock_still_works_and_the_check_warns(
    redis_url: str, mutex_prefix: str
) -> None:
    result = run_fresh(redis_url, mutex_prefix, TELEMETRY="1", HIDE_OPENTELEMETRY="1")
    assert result["fence"] > 0
    assert result["ours"] == ["django_redis_mutex.telemetry"]  # tried once, found missing
    assert result["receivers"] == 0
    assert result["checks"] == ["django_redis_mutex.W002"]


def test_with_telemetry_on_in_a_fresh_process_the_receivers_are_connected(
    redis_url: str, mutex_prefix: str
) -> None:
    result = run_fresh(redis_url, mutex_prefix, TELEMETRY="1")
    assert result["fence"] > 0
    assert result["receivers"] == len(LOCK_SIGNALS)
    assert result["checks"] == []


@pytest.mark.django_db(transaction=True)
def test_a_lock_kept_for_its_transaction_sends_a_span_naming_the_databases(
    telemetry: Recorded,
) -> None:
    with transaction.atomic(), mutex("inventory") as lock:
        fence = lock.fence
    [span] = [
        span
        for span in telemetry.spans.get_finished_spans()
        if span.name == mutex_telemetry.TRANSACTION_SPAN_NAME
    ]
    assert span.attributes is not None
    assert span.attributes["mutex.databases"] == ("default",)
    assert span.attributes["mutex.fence"] == fence


def test_telemetry_agrees_with_the_contention_figures_everywhere_they_are_shown(
    django_user_model: Any,
) -> None:
    """One contended run: telemetry, ``locks --stats``, the admin page and the panel agree."""
    import html
    import io
    import re

    from django.core.management import call_command
    from django.test import Client

    from django_redis_mutex import stats

    from .test_stats import contend_in_threads

    recorded = _providers()
    alias = {"mutex.alias": "default"}
    with override_settings(CACHES=caches_with(TELEMETRY=True, STATS=True)):
        before = recorded.totals()
        contend_in_threads(1)
        contend_in_threads(2)
        after = recorded.totals()
        stats.flush()

        acquired = added(
            before, after, "mutex.wait.duration", **alias, **{"mutex.outcome": "acquired"}
        )[0]
        waited = added(before, after, "mutex.waited", **alias)[0]
        contended = added(before, after, "mutex.contended", **alias)[0]
        assert (acquired, waited, contended) == (4, 2, 2)

        out = io.StringIO()
        call_command("locks", "--stats", "--json", stdout=out)
        [figures] = [
            c for c in json.loads(out.getvalue())["classes"] if c["lock_class"] == "product:{pk}"
        ]
        assert (figures["acquired"], figures["waited"], figures["contended"]) == (4, 2, 2)

        admin = Client()
        admin.force_login(django_user_model.objects.create_superuser("root", password=None))
        page = admin.get("/admin/django_redis_mutex/lock/contention/")
        assert page.status_code == 200
        row = re.search(
            r'<tr data-lock-class="product:\{pk\}">(.*?)</tr>', page.content.decode(), re.S
        )
        assert row is not None
        cells = dict(re.findall(r'class="numeric field-([\w-]+)">(.*?)</td>', row.group(1)))
        assert (cells["acquired"], html.unescape(cells["waited"]), cells["contended"]) == (
            "4",
            "2 (50%)",
            "2",
        )

        panel = _contention_in_the_panel()
        assert panel["product:{pk}"][:3] == ["4", "2 (50%)", "2"]


def _contention_in_the_panel() -> dict[str, list[str]]:
    """Request a locked view with the toolbar on; return its panel's contention rows by class."""
    import html
    import re

    from django.test import Client

    with override_settings(
        INSTALLED_APPS=[*settings.INSTALLED_APPS, "debug_toolbar"],
        MIDDLEWARE=["debug_toolbar.middleware.DebugToolbarMiddleware", *settings.MIDDLEWARE],
        ROOT_URLCONF="tests.toolbar_urls",
        DEBUG_TOOLBAR_PANELS=["django_redis_mutex.panels.LocksPanel"],
        DEBUG_TOOLBAR_CONFIG={
            "SHOW_TOOLBAR_CALLBACK": "tests.test_debug_toolbar.show_toolbar",
            "IS_RUNNING_TESTS": False,
        },
    ):
        client = Client()
        response = client.get("/locked/elsewhere/")
        match = re.search(r'data-request-id="([0-9a-f]+)"', response.content.decode())
        assert match, "the toolbar was not inserted in the page"
        rendered = client.get(
            "/__debug__/render_panel/", {"request_id": match.group(1), "panel_id": "LocksPanel"}
        )
    content = rendered.json()["content"]
    [table] = re.findall(r'<table class="djdt-contention">(.*?)</table>', content, re.S)
    rows = {}
    for row in re.findall(r'<tr class="djdt-contention-class">(.*?)</tr>', table, re.S):
        cells = [
            html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        rows[cells[1]] = cells[2:]
    return rows
