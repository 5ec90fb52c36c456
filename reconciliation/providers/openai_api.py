"""OpenAI, through the official ``openai`` SDK: outcome lookups of stored calls and the organization's usage.

Lookups: a Responses API id (``resp_…``) with ``GET /v1/responses/{id}``; anything else as a stored chat
completion with ``GET /v1/chat/completions/{id}`` (only completions created with ``store: true`` are kept,
for 30 days). A found call is evidence of what was billed. "Not found" is never proof: an unstored
completion, an expired one and one that was never processed all look the same — the adapter cannot vouch,
and the reservation waits for the usage import or a person.

Billing: the Usage API's completions buckets (by model, project and API key, hourly) and the Costs API
(daily), fetched with the organization admin key as pages of the documented shapes (``usage``).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

import openai
from openai import OpenAI

from reconciliation.providers.base import (
    Capabilities,
    LookupResult,
    LookupStatus,
    is_count,
    normalise_endpoint,
)

RETENTION: Final = timedelta(days=30)
_USAGE_GROUPS: Final[list[Any]] = ["model", "project_id", "api_key_id"]
_MAX_PAGES: Final = 100


class OpenAIAdapter:
    """``ProviderAdapter`` for OpenAI (and for the simulator answering in OpenAI's shapes)."""

    name = "openai"
    capabilities = Capabilities(lookup=True, vouches_not_found=False, retention=RETENTION, billing="bucket")

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
        # The SDK insists on a key at construction; a pool without one answers every lookup UNKNOWN (401).
        self._client = OpenAI(
            api_key=api_key or "missing",
            admin_api_key=admin_key,
            base_url=self.endpoint,
            timeout=timeout,
            max_retries=1,
            http_client=http_client,
        )

    def knows(self, provider_request_id: str) -> bool:
        return provider_request_id.startswith(("chatcmpl-", "resp_"))

    def lookup(self, provider_request_id: str) -> LookupResult:
        try:
            if provider_request_id.startswith("resp_"):
                return _from_response(
                    provider_request_id, self._client.responses.retrieve(provider_request_id)
                )
            completion = self._client.chat.completions.retrieve(provider_request_id)
        except openai.NotFoundError:
            return LookupResult(status=LookupStatus.NOT_FOUND, detail="not found (or not stored)")
        except openai.OpenAIError as exc:
            return LookupResult.unknown(f"lookup failed: {type(exc).__name__}: {exc}")
        return _from_chat_completion(provider_request_id, completion)

    def usage_pages(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """Every page of completions usage in ``[start, end)``, hourly, by model, project and API key.

        Raises ``openai.OpenAIError`` when the API cannot be read (the import is then retried later).
        """
        usage = self._client.admin.organization.usage
        return _all_pages(
            lambda page: usage.completions(
                start_time=int(start.timestamp()),
                end_time=int(end.timestamp()),
                bucket_width="1h",
                group_by=_USAGE_GROUPS,
                limit=168,
                **({"page": page} if page else {}),
            )
        )

    def cost_pages(self, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """Every page of daily costs in ``[start, end)`` by line item and project.

        Raises ``openai.OpenAIError`` when the API cannot be read.
        """
        usage = self._client.admin.organization.usage
        return _all_pages(
            lambda page: usage.costs(
                start_time=int(start.timestamp()),
                end_time=int(end.timestamp()),
                bucket_width="1d",
                group_by=["line_item", "project_id"],
                limit=180,
                **({"page": page} if page else {}),
            )
        )


def _all_pages(fetch: Any) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = fetch(cursor)
        pages.append(page.to_dict())
        cursor = page.next_page
        if not page.has_more or not cursor:
            break
    return pages


def _from_chat_completion(provider_request_id: str, completion: Any) -> LookupResult:
    if getattr(completion, "id", None) != provider_request_id:
        return LookupResult.unknown(f"lookup answered for id {getattr(completion, 'id', None)!r}")
    usage = getattr(completion, "usage", None)
    prompt = getattr(usage, "prompt_tokens", None)
    produced = getattr(usage, "completion_tokens", None)
    if not is_count(prompt) or not is_count(produced):
        return LookupResult.unknown("stored completion without usage")
    return LookupResult(LookupStatus.COMPLETED, prompt, produced, detail="stored chat completion")


def _from_response(provider_request_id: str, response: Any) -> LookupResult:
    if getattr(response, "id", None) != provider_request_id:
        return LookupResult.unknown(f"lookup answered for id {getattr(response, 'id', None)!r}")
    status = getattr(response, "status", None)
    if status in ("queued", "in_progress"):
        return LookupResult(LookupStatus.RUNNING, detail=f"response {status}")
    usage = getattr(response, "usage", None)
    consumed = getattr(usage, "input_tokens", None)
    produced = getattr(usage, "output_tokens", None)
    # An incomplete response (cut at max_output_tokens) is billed for what it produced, as its usage says.
    if status in ("completed", "incomplete") and is_count(consumed) and is_count(produced):
        return LookupResult(LookupStatus.COMPLETED, consumed, produced, detail=f"response {status}")
    # failed and cancelled responses are not documented as unbilled: they prove nothing.
    return LookupResult.unknown(f"response {status} without usage")
