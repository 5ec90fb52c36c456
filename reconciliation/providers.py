"""Provider adapters the reconciler uses: request lookups and billing-export parsing.

Django-free on purpose: the reconciler's Celery tasks call these adapters, and the adapters are tested against
the provider simulator without a database.

The one rule every adapter here obeys: an answer that is not positive, well-formed evidence is ``UNKNOWN``.
A network error, a timeout, a 5xx, a 404 from a wrong route or a malformed body never becomes
``NOT_PROCESSED`` — that status releases a reservation in full, so it needs the provider to say so.
"""

from __future__ import annotations

import csv
import io
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from http.client import HTTPException
from typing import Any, Final, Literal, Protocol, TypeGuard, runtime_checkable

BillingExportFormat = Literal["csv", "jsonl"]

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


class LookupStatus(StrEnum):
    """What a provider lookup established about one provider request."""

    COMPLETED = "COMPLETED"
    NOT_PROCESSED = "NOT_PROCESSED"
    RUNNING = "RUNNING"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class LookupResult:
    """The outcome of looking up one provider request.

    ``input_tokens``/``output_tokens`` are the billed usage and are only non-zero for ``COMPLETED``.
    ``authoritative`` says the provider's answer may settle the reservation (post billed usage, or release in
    full for ``NOT_PROCESSED``); it is never true for ``RUNNING`` or ``UNKNOWN``.

    Raises ``ValueError`` on an inconsistent combination, so a buggy adapter cannot fabricate evidence.
    """

    status: LookupStatus
    input_tokens: int = 0
    output_tokens: int = 0
    authoritative: bool = False
    detail: str = ""

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError("token counts cannot be negative")
        if self.status is not LookupStatus.COMPLETED and (self.input_tokens or self.output_tokens):
            raise ValueError(f"{self.status} carries no usage")
        if self.authoritative and self.status in (LookupStatus.RUNNING, LookupStatus.UNKNOWN):
            raise ValueError(f"{self.status} cannot be authoritative")

    @classmethod
    def unknown(cls, detail: str) -> LookupResult:
        """An answer that proves nothing; the reservation stays held."""
        return cls(status=LookupStatus.UNKNOWN, detail=detail)


@runtime_checkable
class ProviderLookup(Protocol):
    """Looks up one provider request by the stable id the gateway sent with it."""

    def lookup(self, provider_request_id: str) -> LookupResult:
        """Return what the provider knows; never raises for provider-side trouble (that is ``UNKNOWN``)."""
        ...


class SimulatorLookup:
    """``ProviderLookup`` over the simulator's ``GET /v1/requests/{id}`` (see ``reconciliation.simulator``).

    Mapping: ``completed`` → COMPLETED (authoritative, billed usage); ``not_found`` → NOT_PROCESSED
    (authoritative: the simulator's lookup is strongly consistent, and only an id it never processed is not
    found); ``running`` → RUNNING; anything else — ``unknown``, any non-200 status, connection errors,
    timeouts, a body that is not the expected JSON or names another id — → UNKNOWN.

    An adapter for a real provider whose lookup is eventually consistent must not copy the ``not_found``
    rule: it should answer NOT_PROCESSED with ``authoritative=False`` until the provider's documented
    visibility delay has passed.
    """

    def __init__(self, base_url: str, timeout: float = 5.0, *, api_key: str | None = None) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._api_key = api_key

    def lookup(self, provider_request_id: str) -> LookupResult:
        """Look up ``provider_request_id``; every failure to get a well-formed answer is UNKNOWN."""
        url = f"{self._base_url}/v1/requests/{urllib.parse.quote(provider_request_id, safe='')}"
        request = urllib.request.Request(url, method="GET", headers={"Accept": "application/json"})
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                status = response.status
                raw = response.read()
        except urllib.error.HTTPError as exc:
            return LookupResult.unknown(f"lookup answered HTTP {exc.code}")
        except (urllib.error.URLError, OSError, HTTPException) as exc:
            # URLError wraps refused/reset connections; socket timeouts and resets while reading the body
            # surface as OSError or HTTPException. None of them says anything about the request.
            return LookupResult.unknown(f"lookup failed: {type(exc).__name__}: {exc}")
        if status != 200:
            return LookupResult.unknown(f"lookup answered HTTP {status}")
        return _interpret_lookup(provider_request_id, raw)


def _interpret_lookup(provider_request_id: str, raw: bytes) -> LookupResult:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return LookupResult.unknown("lookup body is not JSON")
    if not isinstance(body, dict):
        return LookupResult.unknown("lookup body is not an object")
    if body.get("id") != provider_request_id:
        # A proxy or cache answering for another id must not settle this one.
        return LookupResult.unknown(f"lookup answered for id {body.get('id')!r}")
    status = body.get("status")
    if status == "completed":
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return LookupResult.unknown("completed lookup without usage")
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not _is_count(prompt) or not _is_count(completion):
            return LookupResult.unknown("completed lookup with malformed usage")
        return LookupResult(
            status=LookupStatus.COMPLETED,
            input_tokens=prompt,
            output_tokens=completion,
            authoritative=True,
            detail=str(body.get("billing_status", "")),
        )
    if status == "not_found":
        return LookupResult(status=LookupStatus.NOT_PROCESSED, authoritative=True, detail="not_found")
    if status == "running":
        return LookupResult(status=LookupStatus.RUNNING, detail="running")
    return LookupResult.unknown(f"lookup status {status!r}")


def _is_count(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True must not pass as one token.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class RequestBillingRecord:
    """One billed provider request from a per-request export. ``line`` is where it was read (1-based)."""

    request_id: str
    model: str
    input_tokens: int
    output_tokens: int
    start_time: datetime
    api_key_id: str | None = None
    project_id: str | None = None
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class BucketBillingRecord:
    """Billed totals of one (api key, project, model, time bucket) from a bucketed export."""

    bucket_start: datetime
    bucket_end: datetime
    model: str
    input_tokens: int
    output_tokens: int
    api_key_id: str | None = None
    project_id: str | None = None
    num_model_requests: int | None = None
    line: int = field(default=0, compare=False)

    @property
    def key(self) -> tuple[str | None, str | None, str, datetime, datetime]:
        """The identity of a bucket row: two rows with the same key are duplicates."""
        return (self.api_key_id, self.project_id, self.model, self.bucket_start, self.bucket_end)


BillingRecord = RequestBillingRecord | BucketBillingRecord


@dataclass(frozen=True)
class ExportProblem:
    """A bad or duplicate line of a billing export.

    ``counted`` is true only for an exact copy of an earlier line: its record is kept once, so the line is
    flagged but no billed usage is lost. Every other problem means the line's usage is not in the records.
    """

    line: int
    reason: str
    counted: bool = False


@dataclass(frozen=True)
class BillingExportScan:
    """Every well-formed, unique record of an export, and every problem found, in line order."""

    records: tuple[BillingRecord, ...]
    problems: tuple[ExportProblem, ...]


class BillingExportError(ValueError):
    """A billing export had bad or duplicate lines; ``problems`` lists all of them, not just the first."""

    def __init__(self, problems: tuple[ExportProblem, ...]) -> None:
        self.problems = problems
        shown = "; ".join(f"line {p.line}: {p.reason}" for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(f"{len(problems)} bad line(s) in billing export: {shown}{more}")


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

    A record is per-request if it has ``request_id`` and per-bucket if it has ``bucket_start``. Duplicates
    (same request id; same bucket key) are reported on every occurrence after the first. When every copy
    carries the same values the record is kept once (the problems are ``counted``: flagged, not counted
    twice); when copies disagree every copy is dropped, because the export does not say which one is right.

    Raises ``ValueError`` for an unknown ``fmt``.
    """
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
    records = _drop_duplicates(parsed, problems)
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


def _present(row: Row, name: str) -> bool:
    return name in row and row[name] not in (None, "")


def _count(row: Row, name: str, errors: list[str], textual: bool) -> int | None:
    value = row[name]
    # CSV carries digits, JSONL carries JSON integers; "12.0", "-1", "1e3", 12.5, true and (in JSONL) "12"
    # are all rejected rather than coerced, because a coerced token count is a guess about money.
    if textual and isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    if not textual and _is_count(value):
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


def _drop_duplicates(parsed: list[BillingRecord], problems: list[ExportProblem]) -> list[BillingRecord]:
    copies: dict[object, list[BillingRecord]] = {}
    for record in parsed:
        copies.setdefault(_identity(record), []).append(record)
    kept: list[BillingRecord] = []
    for record in parsed:
        group = copies[_identity(record)]
        first = group[0]
        # Record equality ignores the line number: identical values are one billed request written twice.
        identical = all(copy == first for copy in group)
        if record is first:
            if identical:
                kept.append(record)
            continue
        if identical:
            problems.append(
                ExportProblem(record.line, f"exact duplicate of line {first.line}; counted once", True)
            )
        else:
            problems.append(
                ExportProblem(record.line, f"conflicting duplicate of line {first.line}; every copy dropped")
            )
    return kept


def _identity(record: BillingRecord) -> object:
    if isinstance(record, RequestBillingRecord):
        return ("request", record.request_id)
    return ("bucket", record.key)


__all__ = [
    "BUCKET_FIELDS",
    "REQUEST_FIELDS",
    "BillingExportError",
    "BillingExportFormat",
    "BillingExportScan",
    "BillingRecord",
    "BucketBillingRecord",
    "ExportProblem",
    "LookupResult",
    "LookupStatus",
    "ProviderLookup",
    "RequestBillingRecord",
    "SimulatorLookup",
    "parse_billing_export",
    "scan_billing_export",
]
