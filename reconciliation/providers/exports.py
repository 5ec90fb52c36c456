"""Billing exports, per request or per time bucket, as CSV or JSON Lines (the simulator's and any provider
export with these columns), and the one entry point that reads every billing format the platform imports.

Per-request records name calls and settle them; bucket records and provider usage reports (``usage``) are
totals, compared with what we captured.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal, get_args

from reconciliation.providers.base import is_count
from reconciliation.providers.records import (
    BillingExportError,
    BillingExportScan,
    BillingRecord,
    BucketBillingRecord,
    ExportProblem,
    RequestBillingRecord,
    drop_duplicates,
)
from reconciliation.providers.usage import UsageFormat, scan_usage_report

BillingExportFormat = Literal[
    "csv", "jsonl", "openai-usage", "openai-costs", "anthropic-usage", "anthropic-costs"
]
EXPORT_FORMATS: Final = get_args(BillingExportFormat)
EXPORT_FORMAT_CHOICES: Final = (
    ("csv", "CSV (per request or per bucket)"),
    ("jsonl", "JSON lines (per request or per bucket)"),
    ("openai-usage", "OpenAI usage API: completions buckets (JSON)"),
    ("openai-costs", "OpenAI costs API pages (JSON)"),
    ("anthropic-usage", "Anthropic usage report: messages (JSON)"),
    ("anthropic-costs", "Anthropic cost report (JSON)"),
)

# Column sets of the billing export. Extra columns are ignored (providers add columns over time and a new
# column must not stop reconciliation); missing or malformed required columns are errors.
REQUEST_REQUIRED_FIELDS: Final = ("request_id", "model", "input_tokens", "output_tokens", "start_time")
REQUEST_FIELDS: Final = (
    "request_id",
    "model",
    "api_key_id",
    "project_id",
    "input_tokens",
    "output_tokens",
    "start_time",
    "cost",
    "currency",
)
BUCKET_REQUIRED_FIELDS: Final = ("bucket_start", "bucket_end", "model", "input_tokens", "output_tokens")
BUCKET_FIELDS: Final = (
    "bucket_start",
    "bucket_end",
    "api_key_id",
    "project_id",
    "model",
    "input_tokens",
    "output_tokens",
    "num_model_requests",
)

_DIGITS = re.compile(r"[0-9]+")


def parse_billing_export(text: str, fmt: BillingExportFormat) -> list[BillingRecord]:
    """Parse a whole billing export strictly.

    Raises ``BillingExportError`` listing every problem if any line's usage was dropped (a bad line or a
    conflicting duplicate): a partial import could later be read as "this request was not billed", so the
    import is all or nothing. Exact copies of a line lose nothing and are counted once.
    Raises ``ValueError`` for an unknown ``fmt``.
    """
    scan = scan_billing_export(text, fmt)
    if any(not problem.counted for problem in scan.problems):
        raise BillingExportError(scan.problems)
    return list(scan.records)


def scan_billing_export(text: str, fmt: BillingExportFormat) -> BillingExportScan:
    """Parse an export, collecting problems instead of raising.

    A CSV or JSONL record is per-request if it has ``request_id`` and per-bucket if it has ``bucket_start``;
    provider usage reports are read by ``usage.scan_usage_report``. Duplicates (same request id; same bucket)
    are reported on every occurrence after the first. When every copy carries the same values the record is
    kept once (the problems are ``counted``: flagged, not counted twice); when copies disagree every copy is
    dropped as a conflict, because the export does not say which one is right.

    Raises ``ValueError`` for an unknown ``fmt``.
    """
    if fmt in ("openai-usage", "openai-costs", "anthropic-usage", "anthropic-costs"):
        usage_format: UsageFormat = fmt
        return scan_usage_report(text, usage_format)
    if fmt == "csv":
        rows = _csv_rows(text)
    elif fmt == "jsonl":
        rows = _jsonl_rows(text)
    else:
        raise ValueError(f"unknown billing export format {fmt!r}")
    problems: list[ExportProblem] = []
    parsed: list[BillingRecord] = []
    for line, row in rows:
        if isinstance(row, str):
            problems.append(ExportProblem(line, row))
            continue
        record = _record_from_row(line, row, problems, textual=fmt == "csv")
        if record is not None:
            parsed.append(record)
    records = drop_duplicates(parsed, problems)
    return BillingExportScan(
        records=tuple(records),
        problems=tuple(sorted(problems, key=lambda p: p.line)),
    )


Row = Mapping[str, Any]


def _csv_rows(text: str) -> list[tuple[int, Row | str]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, Row | str]] = []
    try:
        header = next(reader)
    except StopIteration:
        return rows
    except csv.Error as exc:
        return [(1, f"unreadable header: {exc}")]
    if len(set(header)) != len(header):
        return [(1, "header repeats a column name")]
    while True:
        start_line = reader.line_num + 1
        try:
            values = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            rows.append((start_line, f"unreadable CSV: {exc}"))
            continue
        if not values:
            rows.append((start_line, "blank line"))
        elif len(values) != len(header):
            rows.append((start_line, f"{len(values)} columns, header has {len(header)}"))
        else:
            rows.append((start_line, dict(zip(header, values, strict=True))))
    return rows


def _jsonl_rows(text: str) -> list[tuple[int, Row | str]]:
    rows: list[tuple[int, Row | str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            rows.append((number, "blank line"))
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            rows.append((number, f"not JSON: {exc.msg}"))
            continue
        if not isinstance(value, dict):
            rows.append((number, "not a JSON object"))
            continue
        rows.append((number, value))
    return rows


def _record_from_row(
    line: int, row: Row, problems: list[ExportProblem], *, textual: bool
) -> BillingRecord | None:
    if "request_id" in row and "bucket_start" in row:
        problems.append(ExportProblem(line, "row has both request_id and bucket_start"))
        return None
    required = REQUEST_REQUIRED_FIELDS if "request_id" in row else BUCKET_REQUIRED_FIELDS
    if "request_id" not in row and "bucket_start" not in row:
        problems.append(ExportProblem(line, "row has neither request_id nor bucket_start"))
        return None
    missing = [name for name in required if name not in row]
    if missing:
        problems.append(ExportProblem(line, f"missing field(s): {', '.join(missing)}"))
        return None
    errors: list[str] = []
    input_tokens = _count(row, "input_tokens", errors, textual)
    output_tokens = _count(row, "output_tokens", errors, textual)
    model = _text(row, "model", errors)
    api_key_id = _optional_text(row, "api_key_id", errors)
    project_id = _optional_text(row, "project_id", errors)
    if "request_id" in row:
        request_id = _text(row, "request_id", errors)
        start_time = _timestamp(row, "start_time", errors)
        cost, currency = _cost(row, errors)
        if errors or input_tokens is None or output_tokens is None or start_time is None:
            problems.append(ExportProblem(line, "; ".join(errors)))
            return None
        return RequestBillingRecord(
            request_id=request_id,
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            start_time=start_time,
            api_key_id=api_key_id,
            project_id=project_id,
            cost=cost,
            currency=currency,
            line=line,
        )
    bucket_start = _timestamp(row, "bucket_start", errors)
    bucket_end = _timestamp(row, "bucket_end", errors)
    num_requests = (
        _count(row, "num_model_requests", errors, textual) if _present(row, "num_model_requests") else None
    )
    if bucket_start is not None and bucket_end is not None and bucket_end <= bucket_start:
        errors.append("bucket_end is not after bucket_start")
    if errors or input_tokens is None or output_tokens is None or bucket_start is None or bucket_end is None:
        problems.append(ExportProblem(line, "; ".join(errors)))
        return None
    return BucketBillingRecord(
        bucket_start=bucket_start,
        bucket_end=bucket_end,
        model=model,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        api_key_id=api_key_id,
        project_id=project_id,
        num_model_requests=num_requests,
        line=line,
    )


def _cost(row: Row, errors: list[str]) -> tuple[Decimal | None, str | None]:
    """The optional billed cost of a request and its currency: a decimal amount (text, or a JSON number read
    through its text) of 0 or more and a three-letter code; both or neither."""
    if not _present(row, "cost") and not _present(row, "currency"):
        return None, None
    value, currency = row.get("cost"), row.get("currency")
    if not isinstance(currency, str) or not re.fullmatch(r"[A-Za-z]{3}", currency):
        errors.append(f"currency is not a three-letter code: {currency!r}")
        return None, None
    try:
        amount = None if isinstance(value, bool) else Decimal(str(value))
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or amount < 0:
        errors.append(f"cost is not an amount of 0 or more: {value!r}")
        return None, None
    return amount, currency.upper()


def _present(row: Row, name: str) -> bool:
    return name in row and row[name] not in (None, "")


def _count(row: Row, name: str, errors: list[str], textual: bool) -> int | None:
    value = row[name]
    # CSV carries digits, JSONL carries JSON integers; "12.0", "-1", "1e3", 12.5, true and (in JSONL) "12"
    # are all rejected rather than coerced, because a coerced token count is a guess about money.
    if textual and isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    if not textual and is_count(value):
        return value
    errors.append(f"{name} is not a non-negative integer: {value!r}")
    return None


def _text(row: Row, name: str, errors: list[str]) -> str:
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{name} is empty or not a string")
        return ""
    return value


def _optional_text(row: Row, name: str, errors: list[str]) -> str | None:
    if not _present(row, name):
        return None
    value = row[name]
    if not isinstance(value, str):
        errors.append(f"{name} is not a string")
        return None
    return value


def _timestamp(row: Row, name: str, errors: list[str]) -> datetime | None:
    value = row[name]
    if not isinstance(value, str):
        errors.append(f"{name} is not an ISO-8601 string")
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        errors.append(f"{name} is not ISO-8601: {value!r}")
        return None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        # A naive timestamp would be read in the server's zone and land in the wrong bucket or period.
        errors.append(f"{name} has no UTC offset: {value!r}")
        return None
    return parsed.astimezone(UTC)
