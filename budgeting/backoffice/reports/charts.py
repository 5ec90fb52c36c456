"""The admin's charts (requests per rung over time, input deviation, the RECONCILING backlog by age) as data
for Chart.js: each ``Chart`` becomes a JSON spec that ``static/tokenbudget/charts.js`` draws with the library
vendored under ``static/tokenbudget/vendor/`` (no external service; works offline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
class Series:
    label: str
    color: str
    values: list[int]


@dataclass(frozen=True)
class Chart:
    """A bar chart (stacked when it has several series). With ``time_unit`` ("hour" or "day") the labels are
    ISO instants on a time axis; otherwise they are categories. ``note`` is the context a reader needs."""

    element_id: str
    title: str
    labels: list[str]
    series: list[Series]
    x_label: str
    y_label: str
    time_unit: str | None = None
    note: str = ""
    empty_text: str = "No data in this period."

    @property
    def empty(self) -> bool:
        return not any(any(s.values) for s in self.series)

    def spec(self) -> dict[str, Any]:
        """What charts.js reads (through ``json_script``)."""
        return {
            "title": self.title,
            "labels": self.labels,
            "series": [{"label": s.label, "color": s.color, "values": s.values} for s in self.series],
            "xLabel": self.x_label,
            "yLabel": self.y_label,
            "timeUnit": self.time_unit,
        }


def rung_chart(unit: str, rows: list[dict[str, Any]]) -> Chart:
    """Requests per rung over the buckets that have requests (``selectors.requests_over_time``)."""
    instants = sorted({row["at"] for row in rows})
    index = {at: i for i, at in enumerate(instants)}
    present = {row["rung"] for row in rows}
    rungs = [r for r in RUNGS if r in present] + sorted(present - set(RUNGS))
    series = []
    for rung in rungs:
        values = [0] * len(instants)
        for row in rows:
            if row["rung"] == rung:
                values[index[row["at"]]] += row["requests"]
        series.append(Series(rung, RUNG_COLORS.get(rung, OTHER_COLOR), values))
    return Chart(
        "tb-chart-rungs",
        "Requests per rung",
        instants,
        series,
        x_label=f"{unit} (UTC)",
        y_label="requests",
        time_unit=unit,
        note="Every decision, shadow included; the axis spans the requests of the period, "
        f"one bar per {unit}.",
    )


def deviation_chart(histogram: list[dict[str, Any]]) -> Chart:
    labels = []
    for bucket in histogram:
        if bucket["from"] is None:
            labels.append(f"< {bucket['to']:g} %")
        elif bucket["to"] is None:
            labels.append(f"≥ {bucket['from']:g} %")
        else:
            labels.append(f"{bucket['from']:g} to {bucket['to']:g} %")
    return Chart(
        "tb-chart-deviation",
        "Input deviation (provider-reported vs our count)",
        labels,
        [Series("reservations", "#1565c0", [b["count"] for b in histogram])],
        x_label="(provider-reported − our count) / our count",
        y_label="reservations",
        note="A provider's count is only as good as the provider: the demo's provider simulator estimates "
        "prompt tokens as UTF-8 bytes / 4 (+4 per message) instead of using the model's tokenizer, so with "
        "simulated traffic this spread is mostly the simulator's estimate, not an error of our count. With a "
        "real provider it shows how far our count is from what it bills.",
        empty_text="No provider-reported input in this period.",
    )


def backlog_chart(backlog: dict[str, Any]) -> Chart:
    return Chart(
        "tb-chart-backlog",
        "Reconciling backlog by age",
        [b["label"] for b in backlog["byAge"]],
        [Series("reservations", "#ef6c00", [b["count"] for b in backlog["byAge"]])],
        x_label="age since dispatch",
        y_label="reservations",
        empty_text="Nothing is reconciling.",
    )
