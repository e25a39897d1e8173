"""The contention chart: the hottest lock classes over time, laid out for an inline SVG.

Drawn on the server from :class:`~django_redis_mutex.stats.StatsReport`, so the
admin page and the demo need no JavaScript chart library and nothing from a
CDN. This module only computes coordinates; the template
``django_redis_mutex/contention_chart.html`` draws them (and escapes the
class names, which may come from request data). :func:`figures_row` formats
one class's figures for the tables beside it: the admin page's, the debug
toolbar panel's and ``manage.py locks --stats``.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from django.utils import timezone as django_timezone
from django.utils.translation import gettext as _

from .display import short_duration, terminal_safe
from .stats import WINDOW, ClassStats, StatsReport

__all__ = ["Chart", "Series", "contention_chart", "figures_row"]

# Colours that stay apart for most colour-blind readers (Okabe and Ito's).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
# Room around the plot for the axis labels, in SVG units.
_LEFT, _RIGHT, _TOP, _BOTTOM = 44, 12, 12, 28
# Tops of the y axis: 1, 2, 5, 10, 20, 50... far past what a minute can hold.
_ROUND_STEPS: list[int] = [base * 10**power for power in range(12) for base in (1, 2, 5)]


@dataclass(frozen=True)
class Series:
    """One lock class's line: its points, its colour, and what it adds up to."""

    lock_class: str
    color: str
    points: str  # "x,y x,y ...", for <polyline points>
    total: int
    peak: int


@dataclass(frozen=True)
class Chart:
    """Everything the template draws: size, plot box, axes and one series per hot class."""

    width: int
    height: int
    series: tuple[Series, ...]
    y_ticks: tuple[tuple[float, int], ...]  # (y, count)
    x_ticks: tuple[tuple[float, str], ...]  # (x, "HH:MM")
    title: str
    # The plot box: what the axis labels leave of the picture.
    left: int = _LEFT
    top: int = _TOP

    @property
    def right(self) -> int:
        return self.width - _RIGHT

    @property
    def bottom(self) -> int:
        return self.height - _BOTTOM


def _clock(window: int) -> str:
    moment = datetime.fromtimestamp(window, tz=timezone.utc)
    return django_timezone.localtime(moment).strftime("%H:%M")


def contention_chart(
    report: StatsReport, count: int = 5, width: int = 720, height: int = 260
) -> Chart:
    """Return the chart of the ``count`` hottest classes of ``report``.

    Each line is a class's contention per minute: the acquisitions that found
    the lock held, whether they then waited or gave up.
    """
    windows = report.windows
    hottest = [c for c in report.classes if c.contention][:count]
    peak = max((max(c.per_window, default=0) for c in hottest), default=0)
    # A round top for the y axis: 1, 2, 5, 10, 20, 50...
    top_value = next(v for v in _ROUND_STEPS if v >= peak)
    right_edge, bottom_edge = width - _RIGHT, height - _BOTTOM
    plot_width, plot_height = right_edge - _LEFT, bottom_edge - _TOP
    steps = max(len(windows) - 1, 1)

    def x(position: int) -> float:
        return round(_LEFT + plot_width * position / steps, 1)

    def y(value: int) -> float:
        return round(bottom_edge - plot_height * value / top_value, 1)

    series = tuple(
        Series(
            lock_class=terminal_safe(figures.label),
            color=PALETTE[index % len(PALETTE)],
            points=" ".join(f"{x(i)},{y(v)}" for i, v in enumerate(figures.per_window)),
            total=figures.contention,
            peak=max(figures.per_window, default=0),
        )
        for index, figures in enumerate(hottest)
    )
    y_ticks = tuple((y(v), v) for v in sorted({0, top_value // 2, top_value}))
    # About six time labels, on whole windows.
    every = max(1, len(windows) // 6)
    x_ticks = tuple((x(i), _clock(w)) for i, w in enumerate(windows) if i % every == 0)
    title = _(
        "Acquisitions that found the lock held, per minute: the hottest lock "
        "classes of the last %(minutes)d minutes"
    ) % {"minutes": len(windows) * WINDOW // 60}
    return Chart(width, height, series, y_ticks, x_ticks, title)


def figures_row(figures: ClassStats) -> dict[str, Any]:
    """Return one lock class's contention figures as the tables show them, in column order.

    The class name is escaped (it may come from request data) and the
    durations are text; the counts stay ints, for a template to format as it
    formats every number. ``waited_share`` goes in brackets after ``waited``.
    """
    return {
        "lock_class": terminal_safe(figures.label),
        "acquired": figures.acquired,
        "waited": figures.waited,
        "waited_share": f"{figures.waited_share:.0%}",
        "contended": figures.contended,
        "wait_p50": short_duration(figures.wait_p50),
        "wait_p99": short_duration(figures.wait_p99),
        "hold_p50": short_duration(figures.hold_p50),
        "hold_p99": short_duration(figures.hold_p99),
        "lost": figures.lost,
        "deadlocks": figures.deadlocks,
    }
