"""Anthropic, through the official ``anthropic`` SDK: Message Batches results and the usage report.

- ``anthropic-batches``: a call is a request in a Message Batch, recorded as ``msgbatch_…/<custom_id>``. Its
  result (``GET /v1/messages/batches/{id}`` then the results file, kept 29 days) says ``succeeded`` with the
  billed usage, or ``errored``/``canceled``/``expired``, which Anthropic documents as never billed: that is
  proof of non-processing from the provider itself, not an inference from "not found".
- ``anthropic-messages``: plain Messages calls cannot be looked up at all. The adapter says so, and the
  reservation waits for the usage report or a person.

Both import the Usage & Cost Admin API's message usage report
(``GET /v1/organizations/usage_report/messages``, hourly, by model, workspace and API key) and its cost report
(``GET /v1/organizations/cost_report``, daily, by workspace and description: each model's cost per token
type) with the organization admin key. The SDK has no method of its own for those reports, so they go
through the SDK client's plain ``get`` (same auth, retries and base URL), page after page.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any, Final

import anthropic
from anthropic import Anthropic

from reconciliation.providers.base import (
    Capabilities,
    LookupResult,
    LookupStatus,
    is_count,
    normalise_endpoint,
)

RETENTION: Final = timedelta(days=29)
BATCH_REQUEST_ID: Final = re.compile(r"(msgbatch_[A-Za-z0-9_]+)/([A-Za-z0-9_-]{1,64})")
USAGE_REPORT_PATH: Final = "/v1/organizations/usage_report/messages"
COST_REPORT_PATH: Final = "/v1/organizations/cost_report"
# Documented as "you will not be billed for these requests".
_NEVER_BILLED: Final = frozenset({"errored", "canceled", "expired"})
_MAX_PAGES: Final = 100


class _AnthropicUsage:
    """The usage and cost reports, shared by both Anthropic adapters."""

    name: str

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        admin_key: str | None = None,
        timeout: float = 10.0,
        http_client: Any = None,
    ) -> None:
        self.endpoint = normalise_endpoint(base_url)
        self.has_admin_key = bool(admin_key)
        options: dict[str, Any] = {"base_url": self.endpoint, "timeout": timeout, "max_retries": 1}
        if http_client is not None:
            options["http_client"] = http_client
        self._client = Anthropic(api_key=api_key or "missing", **options)
        self._admin = Anthropic(api_key=admin_key or "missing", **options)

    def usage_pages(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """Every page of the hourly message usage report in ``[start, end)`` by model, workspace and key.

        Raises ``anthropic.AnthropicError`` when the report cannot be read.
        """
        return self._pages(
            USAGE_REPORT_PATH,
            {
                **_window(start, end),
                "bucket_width": "1h",
                "group_by": ["model", "workspace_id", "api_key_id"],
                "limit": 168,
            },
        )

    def cost_pages(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """Every page of the daily cost report in ``[start, end)`` by workspace and description (which names
        each cost's model and token type).

        Raises ``anthropic.AnthropicError`` when the report cannot be read.
        """
        return self._pages(
            COST_REPORT_PATH,
            {
                **_window(start, end),
                "bucket_width": "1d",
                "group_by": ["workspace_id", "description"],
                "limit": 31,
            },
        )

    def _pages(self, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        pages: list[dict[str, Any]] = []
        for _ in range(_MAX_PAGES):
            page = self._admin.get(path, cast_to=object, options={"params": params})
            if not isinstance(page, dict):
                raise anthropic.AnthropicError(f"{path} page is not an object")
            pages.append(page)
            if not page.get("has_more") or not page.get("next_page"):
                break
            params = {**params, "page": page["next_page"]}
        return pages


def _window(start: datetime, end: datetime) -> dict[str, str]:
    return {
        "starting_at": start.isoformat().replace("+00:00", "Z"),
        "ending_at": end.isoformat().replace("+00:00", "Z"),
    }


class AnthropicBatchesAdapter(_AnthropicUsage):
    """``ProviderAdapter`` for calls made as Message Batch requests."""

    name = "anthropic-batches"
    capabilities = Capabilities(lookup=True, vouches_not_found=False, retention=RETENTION, billing="bucket")

    def knows(self, provider_request_id: str) -> bool:
        return BATCH_REQUEST_ID.fullmatch(provider_request_id) is not None

    def lookup(self, provider_request_id: str) -> LookupResult:
        match = BATCH_REQUEST_ID.fullmatch(provider_request_id)
        if match is None:
            return LookupResult.unknown("not a batch request id (msgbatch_…/custom_id)")
        batch_id, custom_id = match.groups()
        batches = self._client.messages.batches
        try:
            batch = batches.retrieve(batch_id)
            if getattr(batch, "id", None) != batch_id:
                return LookupResult.unknown(f"lookup answered for batch {getattr(batch, 'id', None)!r}")
            if batch.processing_status != "ended":
                return LookupResult(LookupStatus.RUNNING, detail=f"batch {batch.processing_status}")
            for line in batches.results(batch_id):
                if line.custom_id == custom_id:
                    return _from_result(line.result)
        except anthropic.NotFoundError:
            return LookupResult(status=LookupStatus.NOT_FOUND, detail="batch not found")
        except anthropic.AnthropicError as exc:
            return LookupResult.unknown(f"lookup failed: {type(exc).__name__}: {exc}")
        return LookupResult(status=LookupStatus.NOT_FOUND, detail=f"no result for {custom_id} in the batch")


class AnthropicMessagesAdapter(_AnthropicUsage):
    """``ProviderAdapter`` for plain Messages calls: no lookup exists, so it proves nothing either way."""

    name = "anthropic-messages"
    capabilities = Capabilities(lookup=False, vouches_not_found=False, retention=None, billing="bucket")

    def knows(self, provider_request_id: str) -> bool:
        return False

    def lookup(self, provider_request_id: str) -> LookupResult:
        return LookupResult.unknown("Anthropic Messages calls cannot be looked up")


def _from_result(result: Any) -> LookupResult:
    kind = getattr(result, "type", None)
    if kind in _NEVER_BILLED:
        return LookupResult(LookupStatus.NOT_PROCESSED, detail=f"batch request {kind} (not billed)")
    if kind != "succeeded":
        return LookupResult.unknown(f"batch result {kind!r}")
    usage = getattr(getattr(result, "message", None), "usage", None)
    consumed = getattr(usage, "input_tokens", None)
    produced = getattr(usage, "output_tokens", None)
    # Cache fields are absent or null when no cache was used.
    cached = [
        getattr(usage, name, None) or 0 for name in ("cache_creation_input_tokens", "cache_read_input_tokens")
    ]
    if not is_count(consumed) or not is_count(produced) or not all(is_count(value) for value in cached):
        return LookupResult.unknown("succeeded batch request without usage")
    return LookupResult(
        LookupStatus.COMPLETED, consumed + sum(cached), produced, detail="batch request succeeded"
    )
