"""The report's bar charts as geometry (requests per rung, input deviation, the RECONCILING backlog by age),
drawn as inline SVG by ``templates/admin/budgeting/_bar_chart.html``: no script, no external service."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from budgeting.backoffice.reports.query import ReportQuery
from ladder.policy import RUNGS

RUNG_COLORS = {
    "FULL": "#2e7d32",
    "DEDUP_EVIDENCE": "#1565c0",
    "COMPACT_HISTORY": "#6a1b9a",
    "NARROW_WORKFLOW": "#ef6c00",
    "TRIM_EVIDENCE": "#c62828",
    "SMALLER_MODEL": "#00838f",
    "QUEUE_OR_REJECT": "#616161",
}
OTHER_COLOR = "#9e9e9e"


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str


@dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True)
class Chart:
    """Geometry of a bar chart; ``templates/admin/budgeting/_bar_chart.html`` draws it."""

    title: str
    width: int
    height: int
    left: int
    top: int
    right: int
    bottom: int
    bars: list[Bar]
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    legend: list[tuple[str, str]]
    x_label: str
    y_label: str

    @property
    def empty(self) -> bool:
        return not self.bars


def _nice_step(maximum: float, ticks: int = 4) -> float:
    raw = maximum / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def bar_chart(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, str, Sequence[int]]],
    *,
    x_label: str,
    y_label: str,
    width: int = 760,
    height: int = 240,
    max_x_labels: int = 12,
) -> Chart:
    """Stacked bars: one bar per category, one segment per series (name, color, values per category)."""
    left, right, top, bottom = 56, 12, 12, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    totals = [sum(values[i] for _, _, values in series) for i in range(len(categories))]
    peak = max(totals, default=0)
    bars: list[Bar] = []
    y_ticks: list[Tick] = []
    if peak:
        step = max(_nice_step(peak), 1.0)  # counts: no half-request gridlines
        top_value = math.ceil(peak / step) * step
        scale = plot_h / top_value
        y_ticks = [
            Tick(top + plot_h - v * scale, f"{v:g}")
            for v in (step * i for i in range(int(top_value / step) + 1))
        ]
        slot = plot_w / max(len(categories), 1)
        bar_w = max(slot * 0.7, 1.0)
        for i, category in enumerate(categories):
            base = float(top + plot_h)
            for name, color, values in series:
                if values[i]:
                    h = values[i] * scale
                    base -= h
                    bars.append(
                        Bar(
                            left + i * slot + (slot - bar_w) / 2,
                            base,
                            bar_w,
                            h,
                            color,
                            f"{category} · {name}: {values[i]}",
                        )
                    )
    every = max(1, math.ceil(len(categories) / max_x_labels))
    slot = plot_w / max(len(categories), 1)
    x_ticks = [Tick(left + i * slot + slot / 2, c) for i, c in enumerate(categories) if i % every == 0]
    legend = [(name, color) for name, color, values in series if any(values)] if len(series) > 1 else []
    return Chart(
        title, width, height, left, top, right, bottom, bars, x_ticks, y_ticks, legend, x_label, y_label
    )


def rung_chart(query: ReportQuery, per_rung: list[dict[str, Any]]) -> Chart:
    days = [d.isoformat() for d in query.days]
    index = {day: i for i, day in enumerate(days)}
    rungs = [r for r in RUNGS if any(row["rung"] == r for row in per_rung)]
    rungs += sorted({row["rung"] for row in per_rung} - set(rungs))
    series = []
    for rung in rungs:
        values = [0] * len(days)
        for row in per_rung:
            if row["rung"] == rung and row["day"] in index:
                values[index[row["day"]]] += row["requests"]
        series.append((rung, RUNG_COLORS.get(rung, OTHER_COLOR), values))
    labels = [d[5:] for d in days]
    return bar_chart("Requests per rung", labels, series, x_label="day (UTC)", y_label="requests")


def _counts_chart(title: str, labels: list[str], values: list[int], color: str, x_label: str) -> Chart:
    """A narrow chart of one series of reservation counts, every bar labelled."""
    return bar_chart(
        title,
        labels,
        [("reservations", color, values)],
        x_label=x_label,
        y_label="reservations",
        width=460,
        max_x_labels=len(labels),
    )


def deviation_chart(histogram: list[dict[str, Any]]) -> Chart:
    labels = []
    for bucket in histogram:
        if bucket["from"] is None:
            labels.append(f"<{bucket['to']:g}")
        elif bucket["to"] is None:
            labels.append(f"≥{bucket['from']:g}")
        else:
            labels.append(f"{bucket['from']:g}")
    return _counts_chart(
        "Input deviation (provider-reported vs our count)",
        labels,
        [b["count"] for b in histogram],
        "#1565c0",
        "deviation, % (each bar from its label to the next)",
    )


def backlog_chart(backlog: dict[str, Any]) -> Chart:
    return _counts_chart(
        "Reconciling backlog by age",
        [b["label"] for b in backlog["byAge"]],
        [b["count"] for b in backlog["byAge"]],
        "#ef6c00",
        "age since dispatch",
    )
