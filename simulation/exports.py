"""Billing exports of the provider simulator: per-request rows or per-bucket aggregates, as CSV or JSON Lines.

The columns are the ones ``reconciliation.providers.exports`` parses, so the platform's own billing import
reads them.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal

from reconciliation.providers.exports import BUCKET_FIELDS, REQUEST_FIELDS
from simulation.billing import BillingEntry
from simulation.provider_shapes import PRICES

ExportFormat = Literal["csv", "jsonl"]
ExportGranularity = Literal["request", "bucket"]

EXPORT_FORMATS: Final[Mapping[str, ExportFormat]] = {"csv": "csv", "jsonl": "jsonl"}
EXPORT_GRANULARITIES: Final[Mapping[str, ExportGranularity]] = {"request": "request", "bucket": "bucket"}
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_BUCKET_WIDTH = re.compile(r"([1-9][0-9]*)([smhd])")
_BUCKET_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def render_export(
    entries: Sequence[BillingEntry],
    fmt: ExportFormat,
    granularity: ExportGranularity = "request",
    bucket: timedelta = timedelta(hours=1),
    start_time: datetime | None = None,
    end_time: datetime | None = None,
) -> str:
    """Render the billing export of the billed ``entries`` started in ``[start_time, end_time)``.

    Raises ``ValueError`` for an unknown format or granularity, or a non-positive bucket.
    """
    if fmt not in ("csv", "jsonl"):
        raise ValueError(f"unknown format {fmt!r}")
    if granularity not in ("request", "bucket"):
        raise ValueError(f"unknown granularity {granularity!r}")
    if bucket <= timedelta(0):
        raise ValueError("bucket must be positive")
    billed = [
        row
        for row in entries
        if row.billed
        and (start_time is None or row.started_at >= start_time)
        and (end_time is None or row.started_at < end_time)
    ]
    if granularity == "request":
        columns: tuple[str, ...] = REQUEST_FIELDS
        rows = [_request_row(row) for row in billed]
    else:
        columns = BUCKET_FIELDS
        rows = _bucket_rows(billed, bucket)
    if fmt == "jsonl":
        return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def parse_bucket_width(text: str) -> timedelta:
    """Parse ``30s``, ``5m``, ``1h`` or ``1d``. Raises ``ValueError`` otherwise."""
    match = _BUCKET_WIDTH.fullmatch(text)
    if match is None:
        raise ValueError(f"bucket must look like 30s, 5m, 1h or 1d, not {text!r}")
    return timedelta(seconds=int(match.group(1)) * _BUCKET_UNITS[match.group(2)])


def parse_query_time(value: str | None) -> datetime | None:
    """A ``start_time``/``end_time`` query value in UTC. Raises ``ValueError`` without an offset."""
    if value is None:
        return None
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError(f"{value!r} has no UTC offset")
    return parsed.astimezone(UTC)


def format_timestamp(moment: datetime) -> str:
    """ISO-8601 in UTC with a ``Z`` suffix."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _request_row(row: BillingEntry) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "model": row.model,
        "api_key_id": row.api_key_id,
        "project_id": row.project_id,
        "input_tokens": row.prompt_tokens,
        "output_tokens": row.completion_tokens,
        "start_time": format_timestamp(row.started_at),
        # What the simulated provider charged, at the prices its Costs API charges.
        "cost": str(row.prompt_tokens * PRICES["input"] + row.completion_tokens * PRICES["output"]),
        "currency": "USD",
    }


def _bucket_rows(rows: Sequence[BillingEntry], width: timedelta) -> list[dict[str, Any]]:
    totals: dict[tuple[datetime, str, str, str], list[int]] = {}
    for row in rows:
        start = _EPOCH + ((row.started_at - _EPOCH) // width) * width
        key = (start, row.api_key_id, row.project_id, row.model)
        total = totals.setdefault(key, [0, 0, 0])
        total[0] += row.prompt_tokens
        total[1] += row.completion_tokens
        total[2] += 1
    return [
        {
            "bucket_start": format_timestamp(start),
            "bucket_end": format_timestamp(start + width),
            "api_key_id": key_id,
            "project_id": project_id,
            "model": model,
            "input_tokens": prompt,
            "output_tokens": completion,
            "num_model_requests": count,
        }
        for (start, key_id, project_id, model), (prompt, completion, count) in sorted(totals.items())
    ]
