"""Bucket-level usage and cost reports of real providers, as their APIs return them and as finance saves them.

Formats (a document is one page object, a JSON array of pages, or JSON Lines of pages, so the pages an API
fetch collects and a file saved from the API read the same):

- ``openai-usage``: OpenAI's organization Usage API, completions (``GET /v1/organization/usage/completions``,
  grouped by model and optionally project and API key): ``{"object": "page", "data": [{"object": "bucket",
  "start_time", "end_time", "results": [{"input_tokens", "input_cached_tokens", "output_tokens",
  "num_model_requests", "model", "project_id", "api_key_id", ...}]}], "has_more", "next_page"}``;
- ``openai-costs``: OpenAI's Costs API (``GET /v1/organization/costs``): the same pages, each result
  ``{"amount": {"value", "currency"}, "line_item", "project_id", ...}``;
- ``anthropic-usage``: Anthropic's Usage & Cost Admin API message usage report
  (``GET /v1/organizations/usage_report/messages``): ``{"data": [{"starting_at", "ending_at", "results":
  [{"uncached_input_tokens", "cache_creation": {"ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"},
  "cache_read_input_tokens", "output_tokens", "model", "workspace_id", "api_key_id", ...}]}], ...}``;
- ``anthropic-costs``: the same API's cost report (``GET /v1/organizations/cost_report``, daily, grouped by
  workspace and description): ``{"data": [{"starting_at", "ending_at", "results": [{"amount", "currency",
  "description", "model", "cost_type", "token_type", "service_tier", "context_window", "workspace_id"}]}],
  "has_more", "next_page"}``, where ``amount`` is a decimal string in the currency's LOWEST units
  ("123.45" in USD is $1.2345) and the fields but ``amount`` and ``currency`` are null unless grouped by
  description. A cost of a model is the line item ``"<model>, <token type>"``, as OpenAI's line items name
  theirs.

A result row is identified by its bucket and every grouping field it carries (model, project or workspace,
API key, service tier, ...). The same row twice is counted once; the same row with other amounts is a
conflict and dropped. Rows that differ only in a grouping we do not compare by (service tier, batch, context
window) are added up into one bucket record per (API key, project or workspace, model, bucket).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal

from reconciliation.providers.base import is_count
from reconciliation.providers.records import (
    BillingExportScan,
    BillingRecord,
    BucketBillingRecord,
    CostRecord,
    ExportProblem,
    ProblemKind,
)

UsageFormat = Literal["openai-usage", "openai-costs", "anthropic-usage", "anthropic-costs"]
USAGE_FORMATS: Final[tuple[UsageFormat, ...]] = (
    "openai-usage",
    "openai-costs",
    "anthropic-usage",
    "anthropic-costs",
)
# Anthropic's cost amounts are in a currency's lowest units; how many of those make one unit, for the
# currencies its report is documented in (only US dollars: "Currently always USD").
_LOWEST_UNIT_PLACES: Final = {"USD": 2}

Row = Mapping[str, Any]
_TOKEN_FIELDS: Final = frozenset(
    {
        "input_tokens", "output_tokens", "input_cached_tokens", "num_model_requests", "uncached_input_tokens",
        "cache_read_input_tokens", "cache_creation", "server_tool_use", "amount", "quantity",
        "input_audio_tokens", "output_audio_tokens", "input_cache_write_tokens",
    }
)  # fmt: skip


def scan_usage_report(text: str, fmt: UsageFormat) -> BillingExportScan:
    """Parse a usage or cost report, collecting problems instead of raising. Raises ``ValueError`` for an
    unknown ``fmt``."""
    if fmt not in USAGE_FORMATS:
        raise ValueError(f"unknown usage report format {fmt!r}")
    problems: list[ExportProblem] = []
    rows: dict[tuple[Any, ...], tuple[int, Any]] = {}
    conflicted: set[tuple[Any, ...]] = set()
    ordinal = 0
    for page_number, page in _pages(text, problems):
        for bucket in _buckets(page, page_number, problems):
            start, end, results = bucket
            for result in results:
                ordinal += 1
                parsed = _parse_result(result, fmt, start, end, ordinal, problems)
                if parsed is None:
                    continue
                identity = (start, end, _dimensions(result))
                earlier = rows.get(identity)
                if earlier is None:
                    rows[identity] = (ordinal, parsed)
                elif earlier[1] == parsed:
                    problems.append(
                        ExportProblem(
                            ordinal,
                            f"exact duplicate of row {earlier[0]}; counted once",
                            ProblemKind.DUPLICATE,
                        )
                    )
                else:
                    conflicted.add(identity)
                    problems.append(
                        ExportProblem(
                            ordinal,
                            f"row {earlier[0]} again with other amounts; every copy dropped",
                            ProblemKind.CONFLICT,
                        )
                    )
    kept = [row for identity, row in rows.items() if identity not in conflicted]
    records = _add_up(kept)
    return BillingExportScan(records=tuple(records), problems=tuple(sorted(problems, key=lambda p: p.line)))


def _pages(text: str, problems: list[ExportProblem]) -> Iterator[tuple[int, Row]]:
    stripped = text.strip()
    if not stripped:
        return
    try:
        documents: list[Any] = [json.loads(stripped)]
    except json.JSONDecodeError:
        documents = []
        for number, raw in enumerate(stripped.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                documents.append(json.loads(raw))
            except json.JSONDecodeError as exc:
                problems.append(ExportProblem(number, f"not JSON: {exc.msg}"))
    pages: list[Any] = []
    for document in documents:
        pages.extend(document if isinstance(document, list) else [document])
    for number, page in enumerate(pages, start=1):
        if isinstance(page, dict) and isinstance(page.get("data"), list):
            yield number, page
        else:
            problems.append(ExportProblem(number, "not a report page (an object with a data list)"))


def _buckets(
    page: Row, page_number: int, problems: list[ExportProblem]
) -> Iterator[tuple[datetime, datetime, list[Any]]]:
    for bucket in page["data"]:
        if not isinstance(bucket, dict) or not isinstance(bucket.get("results"), list):
            problems.append(ExportProblem(page_number, "a bucket without a results list"))
            continue
        start = _moment(bucket.get("start_time", bucket.get("starting_at")))
        end = _moment(bucket.get("end_time", bucket.get("ending_at")))
        if start is None or end is None or end <= start:
            problems.append(ExportProblem(page_number, "a bucket without a valid start and end"))
            continue
        yield start, end, bucket["results"]


def _moment(value: object) -> datetime | None:
    """Unix seconds (OpenAI) or an RFC 3339 string with an offset (Anthropic)."""
    if is_count(value):
        return datetime.fromtimestamp(value, tz=UTC)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        if parsed.tzinfo is not None:
            return parsed.astimezone(UTC)
    return None


def _dimensions(result: Row) -> tuple[tuple[str, Any], ...]:
    return tuple(
        sorted(
            (name, value)
            for name, value in result.items()
            if name not in _TOKEN_FIELDS
            and name != "object"
            and (value is None or isinstance(value, str | bool))
        )
    )


def _parse_result(
    result: object,
    fmt: UsageFormat,
    start: datetime,
    end: datetime,
    ordinal: int,
    problems: list[ExportProblem],
) -> BillingRecord | None:
    if not isinstance(result, dict):
        problems.append(ExportProblem(ordinal, "a result that is not an object"))
        return None
    parser = _PARSERS[fmt]
    try:
        return parser(result, start, end, ordinal)
    except _BadRow as exc:
        problems.append(ExportProblem(ordinal, str(exc)))
        return None


class _BadRow(ValueError):
    pass


def _count(row: Row, name: str, *, optional: bool = False) -> int:
    value = row.get(name)
    if value is None and optional:
        return 0
    if not is_count(value):
        raise _BadRow(f"{name} is not a non-negative integer: {value!r}")
    return value


def _text(row: Row, name: str, *, required: bool = False) -> str | None:
    value = row.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise _BadRow(
            f"{name} is missing (group the report by {name})" if value is None else f"{name} is not text"
        )
    return value


def _openai_usage(row: Row, start: datetime, end: datetime, ordinal: int) -> BucketBillingRecord:
    return BucketBillingRecord(
        bucket_start=start,
        bucket_end=end,
        model=_text(row, "model", required=True) or "",
        input_tokens=_count(row, "input_tokens"),
        output_tokens=_count(row, "output_tokens"),
        api_key_id=_text(row, "api_key_id"),
        project_id=_text(row, "project_id"),
        num_model_requests=_count(row, "num_model_requests", optional=True),
        cached_input_tokens=_count(row, "input_cached_tokens", optional=True),
        line=ordinal,
    )


def _anthropic_usage(row: Row, start: datetime, end: datetime, ordinal: int) -> BucketBillingRecord:
    creation = row.get("cache_creation") or {}
    if not isinstance(creation, dict):
        raise _BadRow("cache_creation is not an object")
    created = _count(creation, "ephemeral_5m_input_tokens", optional=True) + _count(
        creation, "ephemeral_1h_input_tokens", optional=True
    )
    read = _count(row, "cache_read_input_tokens", optional=True)
    return BucketBillingRecord(
        bucket_start=start,
        bucket_end=end,
        model=_text(row, "model", required=True) or "",
        input_tokens=_count(row, "uncached_input_tokens") + created + read,
        output_tokens=_count(row, "output_tokens"),
        api_key_id=_text(row, "api_key_id"),
        project_id=_text(row, "workspace_id"),
        cached_input_tokens=read,
        cache_creation_tokens=created,
        line=ordinal,
    )


def model_of_line_item(line_item: str | None) -> str | None:
    """The model a cost line item names (``"gpt-4o-2024-08-06, input"``), or None."""
    if not line_item or "," not in line_item:
        return None
    model = line_item.rsplit(",", 1)[0].strip()
    return model or None


def _openai_costs(row: Row, start: datetime, end: datetime, ordinal: int) -> CostRecord:
    amount = row.get("amount")
    if not isinstance(amount, dict):
        raise _BadRow("amount is not an object")
    value, currency = amount.get("value"), amount.get("currency")
    if isinstance(value, bool) or not isinstance(value, int | float | str) or not isinstance(currency, str):
        raise _BadRow(f"amount is not a value and a currency: {amount!r}")
    try:
        # Through str: a float's binary expansion is not the amount the provider meant.
        decimal = Decimal(str(value))
    except InvalidOperation:
        raise _BadRow(f"amount value is not a number: {value!r}") from None
    if not decimal.is_finite():
        raise _BadRow(f"amount value is not a number: {value!r}")
    line_item = _text(row, "line_item")
    return CostRecord(
        bucket_start=start,
        bucket_end=end,
        amount=decimal,
        currency=currency.lower(),
        line_item=line_item,
        project_id=_text(row, "project_id"),
        api_key_id=_text(row, "api_key_id"),
        model=model_of_line_item(line_item),
        line=ordinal,
    )


def _anthropic_costs(row: Row, start: datetime, end: datetime, ordinal: int) -> CostRecord:
    amount, currency = row.get("amount"), row.get("currency")
    if not isinstance(currency, str) or not currency:
        raise _BadRow(f"currency is not a currency code: {currency!r}")
    places = _LOWEST_UNIT_PLACES.get(currency.upper())
    if places is None:
        raise _BadRow(f"amount in {currency}: the report's lowest units are documented for USD only")
    if not isinstance(amount, str):
        # Documented as a decimal string; a JSON number would already be a float's binary expansion.
        raise _BadRow(f"amount is not a decimal string: {amount!r}")
    try:
        lowest = Decimal(amount)
    except InvalidOperation:
        raise _BadRow(f"amount is not a number: {amount!r}") from None
    if not lowest.is_finite():
        raise _BadRow(f"amount is not a number: {amount!r}")
    model = _text(row, "model")
    kind = _text(row, "token_type") or _text(row, "cost_type")
    # A model's cost is named as OpenAI names its line items; any other cost (web search, code execution,
    # an ungrouped total) by its description, commas taken out so that no model is read from it.
    description = (_text(row, "description") or kind or "").replace(",", ";")
    return CostRecord(
        bucket_start=start,
        bucket_end=end,
        amount=lowest.scaleb(-places),
        currency=currency.upper(),
        line_item=f"{model}, {kind or 'tokens'}" if model else description or None,
        project_id=_text(row, "workspace_id"),
        model=model,
        line=ordinal,
    )


_PARSERS: Final[Mapping[str, Callable[[Row, datetime, datetime, int], BillingRecord]]] = {
    "openai-usage": _openai_usage,
    "openai-costs": _openai_costs,
    "anthropic-usage": _anthropic_usage,
    "anthropic-costs": _anthropic_costs,
}


def _add_up(rows: list[tuple[int, Any]]) -> list[BillingRecord]:
    totals: dict[object, BillingRecord] = {}
    for _, record in rows:
        earlier = totals.get(record.key)
        totals[record.key] = record if earlier is None else _plus(earlier, record)
    return list(totals.values())


def _plus(a: BillingRecord, b: BillingRecord) -> BillingRecord:
    if isinstance(a, CostRecord) and isinstance(b, CostRecord):
        return CostRecord(**{**a.__dict__, "amount": a.amount + b.amount})
    assert isinstance(a, BucketBillingRecord) and isinstance(b, BucketBillingRecord)

    def total(x: int | None, y: int | None) -> int | None:
        return None if x is None and y is None else (x or 0) + (y or 0)

    return BucketBillingRecord(
        **{
            **a.__dict__,
            "input_tokens": a.input_tokens + b.input_tokens,
            "output_tokens": a.output_tokens + b.output_tokens,
            "num_model_requests": total(a.num_model_requests, b.num_model_requests),
            "cached_input_tokens": total(a.cached_input_tokens, b.cached_input_tokens),
            "cache_creation_tokens": total(a.cache_creation_tokens, b.cache_creation_tokens),
        }
    )
