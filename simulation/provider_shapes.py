"""The simulator's billing ledger in real providers' shapes, so the platform's real adapters run against it.

- OpenAI: a stored chat completion (``GET /v1/chat/completions/{id}``), the organization Usage API's
  completions buckets (``GET /v1/organization/usage/completions``) and the Costs API
  (``GET /v1/organization/costs``, priced at ``PRICES``);
- Anthropic: the Usage & Cost Admin API's message usage report
  (``GET /v1/organizations/usage_report/messages``) and its cost report
  (``GET /v1/organizations/cost_report``, priced at ``PRICES``, amounts in cents as decimal strings).

Buckets cover billed requests by start time; grouping follows ``group_by`` (fields not grouped by are null and
added up). Pages hold ``limit`` buckets, the cursor being the next bucket's index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from simulation.billing import BillingEntry
from simulation.completions import usage_object

WIDTHS: Final = {"1m": timedelta(minutes=1), "1h": timedelta(hours=1), "1d": timedelta(days=1)}
PRICES: Final = {"input": Decimal("0.000001"), "output": Decimal("0.000004")}
"""US dollars per token: what the simulated Costs API and cost report charge."""
_ANTHROPIC_TOKEN_TYPES: Final = {"input": "uncached_input_tokens", "output": "output_tokens"}
_CENTS: Final = 100
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


class QueryError(ValueError):
    """A report query the provider would refuse (its ``invalid_request_error``)."""


def stored_completion(row: BillingEntry) -> dict[str, Any]:
    """The chat completion object a provider that stored ``row`` answers its retrieval with."""
    return {
        "id": row.request_id,
        "object": "chat.completion",
        "created": int(row.started_at.timestamp()),
        "model": row.model,
        "choices": [],
        "usage": usage_object(row.prompt_tokens, row.completion_tokens),
    }


def openai_usage(entries: Sequence[BillingEntry], query: Mapping[str, list[str]]) -> dict[str, Any]:
    """A page of completions usage buckets."""
    width, start, end = _window(query, "start_time", "end_time", _unix)
    groups = _groups(query, {"model", "project_id", "api_key_id"})

    def result(rows: list[BillingEntry], dims: Mapping[str, str | None]) -> list[dict[str, Any]]:
        return [
            {
                "object": "organization.usage.completions.result",
                "input_tokens": sum(r.prompt_tokens for r in rows),
                "input_cached_tokens": 0,
                "output_tokens": sum(r.completion_tokens for r in rows),
                "num_model_requests": len(rows),
                "project_id": dims.get("project_id"),
                "api_key_id": dims.get("api_key_id"),
                "model": dims.get("model"),
                "user_id": None,
                "batch": None,
            }
        ]

    return _page(entries, query, width, start, end, groups, result, openai=True)


def openai_costs(entries: Sequence[BillingEntry], query: Mapping[str, list[str]]) -> dict[str, Any]:
    """A page of daily cost buckets, one result per line item (model and direction) when grouped by it."""
    width, start, end = _window(query, "start_time", "end_time", _unix)
    if width != WIDTHS["1d"]:
        raise QueryError("bucket_width must be 1d")
    groups = _groups(query, {"line_item", "project_id", "api_key_id"})

    def results(rows: list[BillingEntry], dims: Mapping[str, str | None]) -> list[dict[str, Any]]:
        lines: dict[str | None, Decimal] = {}
        for row in rows:
            for direction, tokens in (("input", row.prompt_tokens), ("output", row.completion_tokens)):
                item = f"{row.model}, {direction}" if "line_item" in groups else None
                lines[item] = lines.get(item, Decimal(0)) + tokens * PRICES[direction]
        return [
            {
                "object": "organization.costs.result",
                "amount": {"value": float(amount), "currency": "usd"},
                "line_item": item,
                "project_id": dims.get("project_id"),
                "api_key_id": dims.get("api_key_id"),
            }
            for item, amount in sorted(lines.items(), key=lambda pair: pair[0] or "")
        ]

    return _page(entries, query, width, start, end, groups - {"line_item"}, results, openai=True)


def anthropic_usage(entries: Sequence[BillingEntry], query: Mapping[str, list[str]]) -> dict[str, Any]:
    """A page of the message usage report."""
    width, start, end = _window(query, "starting_at", "ending_at", _rfc3339)
    groups = _groups(query, {"model", "workspace_id", "api_key_id"})

    def result(rows: list[BillingEntry], dims: Mapping[str, str | None]) -> list[dict[str, Any]]:
        return [
            {
                "uncached_input_tokens": sum(r.prompt_tokens for r in rows),
                "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
                "cache_read_input_tokens": 0,
                "output_tokens": sum(r.completion_tokens for r in rows),
                "server_tool_use": {"web_search_requests": 0},
                "api_key_id": dims.get("api_key_id"),
                "workspace_id": dims.get("workspace_id"),
                "model": dims.get("model"),
                "service_tier": "standard",
                "context_window": "0-200k",
            }
        ]

    return _page(entries, query, width, start, end, groups, result, openai=False)


def anthropic_costs(entries: Sequence[BillingEntry], query: Mapping[str, list[str]]) -> dict[str, Any]:
    """A page of the daily cost report: grouped by description, one result per model and token type, else
    one total; amounts in cents (the currency's lowest units) as decimal strings."""
    width, start, end = _window(query, "starting_at", "ending_at", _rfc3339)
    if width != WIDTHS["1d"]:
        raise QueryError("bucket_width must be 1d")
    groups = _groups(query, {"workspace_id", "description"})
    described = "description" in groups

    def results(rows: list[BillingEntry], dims: Mapping[str, str | None]) -> list[dict[str, Any]]:
        lines: dict[tuple[str, str] | None, Decimal] = {}
        for row in rows:
            for direction, tokens in (("input", row.prompt_tokens), ("output", row.completion_tokens)):
                item = (row.model, direction) if described else None
                lines[item] = lines.get(item, Decimal(0)) + tokens * PRICES[direction] * _CENTS
        return [
            {
                "amount": f"{amount:f}",
                "currency": "USD",
                "description": None if item is None else f"{item[0]} Usage - {item[1].title()} Tokens",
                "model": None if item is None else item[0],
                "cost_type": "tokens" if described else None,
                "token_type": None if item is None else _ANTHROPIC_TOKEN_TYPES[item[1]],
                "service_tier": "standard" if described else None,
                "context_window": "0-200k" if described else None,
                "workspace_id": dims.get("workspace_id"),
            }
            for item, amount in sorted(lines.items(), key=lambda pair: pair[0] or ("", ""))
        ]

    return _page(entries, query, width, start, end, groups - {"description"}, results, openai=False)


def _one(query: Mapping[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _unix(value: str) -> datetime:
    if not value.isdigit():
        raise QueryError(f"not Unix seconds: {value!r}")
    return datetime.fromtimestamp(int(value), tz=UTC)


def _rfc3339(value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise QueryError(f"not RFC 3339: {value!r}") from None
    if moment.tzinfo is None:
        raise QueryError(f"no UTC offset: {value!r}")
    return moment.astimezone(UTC)


def _window(
    query: Mapping[str, list[str]], start_name: str, end_name: str, parse: Callable[[str], datetime]
) -> tuple[timedelta, datetime, datetime]:
    width = WIDTHS.get(_one(query, "bucket_width") or "1d")
    if width is None:
        raise QueryError("bucket_width must be 1m, 1h or 1d")
    raw_start = _one(query, start_name)
    if raw_start is None:
        raise QueryError(f"{start_name} is required")
    raw_end = _one(query, end_name)
    start = parse(raw_start)
    end = parse(raw_end) if raw_end is not None else start + 7 * width
    return width, start, end


def _groups(query: Mapping[str, list[str]], allowed: set[str]) -> set[str]:
    groups = set(query.get("group_by", []) + query.get("group_by[]", []))
    if not groups <= allowed:
        raise QueryError(f"cannot group by {sorted(groups - allowed)}")
    return groups


def _page(
    entries: Sequence[BillingEntry],
    query: Mapping[str, list[str]],
    width: timedelta,
    start: datetime,
    end: datetime,
    groups: set[str],
    results: Callable[[list[BillingEntry], Mapping[str, str | None]], list[dict[str, Any]]],
    *,
    openai: bool,
) -> dict[str, Any]:
    first = _EPOCH + ((start - _EPOCH) // width) * width
    starts = []
    moment = first
    while moment < end:
        starts.append(moment)
        moment += width
    limit = int(_one(query, "limit") or "7")
    offset = int((_one(query, "page") or "page_0").removeprefix("page_") or 0)
    shown = starts[offset : offset + limit]
    buckets = [_bucket(entries, moment, moment + width, groups, results, openai=openai) for moment in shown]
    more = offset + limit < len(starts)
    page: dict[str, Any] = {
        "data": buckets,
        "has_more": more,
        "next_page": f"page_{offset + limit}" if more else None,
    }
    return {"object": "page", **page} if openai else page


def _bucket(
    entries: Sequence[BillingEntry],
    start: datetime,
    end: datetime,
    groups: set[str],
    results: Callable[[list[BillingEntry], Mapping[str, str | None]], list[dict[str, Any]]],
    *,
    openai: bool,
) -> dict[str, Any]:
    grouped: dict[tuple[tuple[str, str | None], ...], list[BillingEntry]] = {}
    for row in entries:
        if row.billed and start <= row.started_at < end:
            dims = {
                "model": row.model,
                "project_id": row.project_id,
                "workspace_id": row.project_id,
                "api_key_id": row.api_key_id,
            }
            key = tuple(sorted((name, dims[name] if name in groups else None) for name in dims))
            grouped.setdefault(key, []).append(row)
    found = [item for key, rows in sorted(grouped.items(), key=repr) for item in results(rows, dict(key))]
    if openai:
        return {
            "object": "bucket",
            "start_time": int(start.timestamp()),
            "end_time": int(end.timestamp()),
            "results": found,
        }
    return {"starting_at": _seconds(start), "ending_at": _seconds(end), "results": found}


def _seconds(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
