"""The adapters a pool can name, the provider each belongs to, and building one from a pool's settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import anthropic
import openai

from reconciliation.providers.anthropic_api import AnthropicBatchesAdapter, AnthropicMessagesAdapter
from reconciliation.providers.base import ProviderAdapter
from reconciliation.providers.openai_api import OpenAIAdapter
from reconciliation.providers.simulator import SimulatorLookup
from reconciliation.providers.usage import UsageFormat

# Adapter name -> the provider it speaks to. ``budgeting.catalog.models`` offers exactly these to a pool.
PROVIDER_OF: Final[Mapping[str, str]] = {
    "simulator": "simulator",
    "openai": "openai",
    "anthropic-batches": "anthropic",
    "anthropic-messages": "anthropic",
}


# What fetching a usage report may raise: the provider or the network failing (retried on the next beat).
FETCH_ERRORS: Final = (openai.OpenAIError, anthropic.AnthropicError, OSError)


@dataclass(frozen=True)
class PoolProvider:
    """A pool's provider settings, with its keys read from the environment variables the pool names."""

    adapter: str
    base_url: str
    api_key: str | None = None
    admin_key: str | None = None


@dataclass(frozen=True)
class UsageFeed:
    """One report to import: its format and the pages to fetch it with."""

    fmt: UsageFormat
    label: str


def build(config: PoolProvider, *, http_client: Any = None) -> ProviderAdapter | None:
    """The adapter a pool names, or None without an endpoint. Raises ``ValueError`` for an unknown name."""
    if not config.base_url:
        return None
    if config.adapter == "simulator":
        return SimulatorLookup(config.base_url, timeout=5.0, api_key=config.api_key)
    keys: dict[str, Any] = {
        "api_key": config.api_key,
        "admin_key": config.admin_key,
        "http_client": http_client,
    }
    if config.adapter == "openai":
        return OpenAIAdapter(config.base_url, **keys)
    if config.adapter == "anthropic-batches":
        return AnthropicBatchesAdapter(config.base_url, **keys)
    if config.adapter == "anthropic-messages":
        return AnthropicMessagesAdapter(config.base_url, **keys)
    raise ValueError(f"unknown provider adapter {config.adapter!r}")


def usage_feeds(adapter: ProviderAdapter) -> list[tuple[UsageFeed, Any]]:
    """What the usage import fetches through ``adapter``: (feed, page fetcher) pairs (needs an admin key)."""
    if isinstance(adapter, OpenAIAdapter) and adapter.has_admin_key:
        return [
            (UsageFeed("openai-usage", "usage"), adapter.usage_pages),
            (UsageFeed("openai-costs", "costs"), adapter.cost_pages),
        ]
    if isinstance(adapter, AnthropicBatchesAdapter | AnthropicMessagesAdapter) and adapter.has_admin_key:
        return [
            (UsageFeed("anthropic-usage", "usage report"), adapter.usage_pages),
            (UsageFeed("anthropic-costs", "cost report"), adapter.cost_pages),
        ]
    return []
