"""Recorded provider answers, in the shapes OpenAI's and Anthropic's API references document, served to the
official SDKs through an ``httpx2.MockTransport``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import httpx2

Route = Callable[[httpx2.Request], httpx2.Response]

CHAT_COMPLETION = {
    "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
    "object": "chat.completion",
    "created": 1741570283,
    "model": "gpt-4o-2024-08-06",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The notice period is 30 days.", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 1117,
        "completion_tokens": 46,
        "total_tokens": 1163,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
    "service_tier": "default",
    "system_fingerprint": "fp_fc9f1d7035",
}

OPENAI_NOT_FOUND = {
    "error": {
        "message": "No chat completion found with id 'chatcmpl-missing'.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}


def response_object(status: str, usage: Mapping[str, int] | None) -> dict[str, Any]:
    """A Responses API object (``GET /v1/responses/{id}``)."""
    return {
        "id": "resp_67ccd3a9da748190baa7f1570fe91ac6",
        "object": "response",
        "created_at": 1741476777,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": "gpt-4o-2024-08-06",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["input"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["output"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["input"] + usage["output"],
        },
    }


USAGE_PAGE_1 = {
    "object": "page",
    "data": [
        {
            "object": "bucket",
            "start_time": 1730419200,
            "end_time": 1730422800,
            "results": [
                {
                    "object": "organization.usage.completions.result",
                    "input_tokens": 1000,
                    "output_tokens": 500,
                    "input_cached_tokens": 800,
                    "input_audio_tokens": 0,
                    "output_audio_tokens": 0,
                    "num_model_requests": 5,
                    "project_id": "proj_abc",
                    "user_id": None,
                    "api_key_id": "key_abc",
                    "model": "gpt-4o-mini-2024-07-18",
                    "batch": None,
                }
            ],
        }
    ],
    "has_more": True,
    "next_page": "page_AAAAAGdGxdEiJdKOAAAAAGcqsYA=",
}
USAGE_PAGE_2 = {
    "object": "page",
    "data": [
        {
            "object": "bucket",
            "start_time": 1730422800,
            "end_time": 1730426400,
            "results": [
                {
                    "object": "organization.usage.completions.result",
                    "input_tokens": 20,
                    "output_tokens": 10,
                    "input_cached_tokens": 0,
                    "num_model_requests": 1,
                    "project_id": "proj_abc",
                    "api_key_id": "key_abc",
                    "model": "gpt-4o-mini-2024-07-18",
                }
            ],
        }
    ],
    "has_more": False,
    "next_page": None,
}
COSTS_PAGE = {
    "object": "page",
    "data": [
        {
            "object": "bucket",
            "start_time": 1730419200,
            "end_time": 1730505600,
            "results": [
                {
                    "object": "organization.costs.result",
                    "amount": {"value": 0.06, "currency": "usd"},
                    "line_item": "gpt-4o-mini-2024-07-18, input",
                    "project_id": "proj_abc",
                },
                {
                    "object": "organization.costs.result",
                    "amount": {"value": 0.12, "currency": "usd"},
                    "line_item": "gpt-4o-mini-2024-07-18, output",
                    "project_id": "proj_abc",
                },
            ],
        }
    ],
    "has_more": False,
    "next_page": None,
}

BATCH_ID = "msgbatch_013Zva2CMHLNnXjNJJKqJ2EF"


def batch(status: str) -> dict[str, Any]:
    """A Message Batch (``GET /v1/messages/batches/{id}``)."""
    ended = status == "ended"
    return {
        "id": BATCH_ID,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": 0 if ended else 4,
            "succeeded": 1,
            "errored": 1,
            "canceled": 1,
            "expired": 1,
        },
        "ended_at": "2024-08-20T18:37:24.100435Z" if ended else None,
        "created_at": "2024-08-20T18:37:24.100435Z",
        "expires_at": "2024-08-21T18:37:24.100435Z",
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": f"https://api.anthropic.com/v1/messages/batches/{BATCH_ID}/results" if ended else None,
    }


BATCH_RESULTS = [
    {
        "custom_id": "req-ok",
        "result": {
            "type": "succeeded",
            "message": {
                "id": "msg_014VwiXbi91y3JMjcpyGBHX5",
                "type": "message",
                "role": "assistant",
                "model": "claude-sonnet-4-20250514",
                "content": [{"type": "text", "text": "Hello again! It's nice to see you."}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 11,
                    "cache_creation_input_tokens": 4,
                    "cache_read_input_tokens": 5,
                    "output_tokens": 36,
                },
            },
        },
    },
    {
        "custom_id": "req-err",
        "result": {
            "type": "errored",
            "error": {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "max_tokens: too large"},
            },
        },
    },
    {"custom_id": "req-cancel", "result": {"type": "canceled"}},
    {"custom_id": "req-expired", "result": {"type": "expired"}},
]

ANTHROPIC_USAGE_PAGE = {
    "data": [
        {
            "starting_at": "2025-08-01T00:00:00Z",
            "ending_at": "2025-08-01T01:00:00Z",
            "results": [
                {
                    "uncached_input_tokens": 1500,
                    "cache_creation": {"ephemeral_1h_input_tokens": 1000, "ephemeral_5m_input_tokens": 500},
                    "cache_read_input_tokens": 200,
                    "output_tokens": 500,
                    "server_tool_use": {"web_search_requests": 10},
                    "api_key_id": "apikey_01Rj2N8SVvo6BePZj99NhmiT",
                    "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    "model": "claude-sonnet-4-20250514",
                    "service_tier": "standard",
                    "context_window": "0-200k",
                },
                {
                    "uncached_input_tokens": 100,
                    "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
                    "cache_read_input_tokens": 0,
                    "output_tokens": 50,
                    "server_tool_use": {"web_search_requests": 0},
                    "api_key_id": "apikey_01Rj2N8SVvo6BePZj99NhmiT",
                    "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    "model": "claude-sonnet-4-20250514",
                    "service_tier": "batch",
                    "context_window": "0-200k",
                },
            ],
        }
    ],
    "has_more": False,
    "next_page": None,
}


# Anthropic's cost report (GET /v1/organizations/cost_report). The first page is the "Response 200" example of
# Anthropic's API reference, "Get Cost Report" (amounts are decimal strings in cents: "123.78912" is
# $1.2378912); the second, the next day's bucket, follows the same documented schema: one model's output
# tokens in two service tiers (one cost line, added up) and a web search cost, which names no model.
ANTHROPIC_COST_CURSOR = "2019-12-27T18:11:19.117Z"
ANTHROPIC_COST_PAGES = [
    {
        "data": [
            {
                "ending_at": "2025-08-02T00:00:00Z",
                "results": [
                    {
                        "amount": "123.78912",
                        "context_window": "0-200k",
                        "cost_type": "tokens",
                        "currency": "USD",
                        "description": "Claude Sonnet 4 Usage - Input Tokens",
                        "model": "claude-sonnet-4-20250514",
                        "service_tier": "standard",
                        "token_type": "uncached_input_tokens",
                        "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    }
                ],
                "starting_at": "2025-08-01T00:00:00Z",
            }
        ],
        "has_more": True,
        "next_page": ANTHROPIC_COST_CURSOR,
    },
    {
        "data": [
            {
                "ending_at": "2025-08-03T00:00:00Z",
                "results": [
                    {
                        "amount": "250",
                        "context_window": "0-200k",
                        "cost_type": "tokens",
                        "currency": "USD",
                        "description": "Claude Sonnet 4 Usage - Output Tokens",
                        "model": "claude-sonnet-4-20250514",
                        "service_tier": "standard",
                        "token_type": "output_tokens",
                        "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    },
                    {
                        "amount": "125.5",
                        "context_window": "0-200k",
                        "cost_type": "tokens",
                        "currency": "USD",
                        "description": "Claude Sonnet 4 Batch Usage - Output Tokens",
                        "model": "claude-sonnet-4-20250514",
                        "service_tier": "batch",
                        "token_type": "output_tokens",
                        "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    },
                    {
                        "amount": "1000",
                        "context_window": None,
                        "cost_type": "web_search",
                        "currency": "USD",
                        "description": "Web Search Usage",
                        "model": None,
                        "service_tier": None,
                        "token_type": None,
                        "workspace_id": "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
                    },
                ],
                "starting_at": "2025-08-02T00:00:00Z",
            }
        ],
        "has_more": False,
        "next_page": None,
    },
]


def mock_client(routes: Mapping[str, Route], seen: list[httpx2.Request] | None = None) -> httpx2.Client:
    """An HTTP client whose transport answers each path from ``routes`` (404 for any other)."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(request)
        route = routes.get(request.url.path)
        return route(request) if route else httpx2.Response(404, json=OPENAI_NOT_FOUND)

    return httpx2.Client(transport=httpx2.MockTransport(handle))


def answer(status: int, body: Any) -> Route:
    return lambda request: httpx2.Response(status, json=body)


def jsonl(rows: list[dict[str, Any]]) -> Route:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    return lambda request: httpx2.Response(
        200, content=text.encode(), headers={"content-type": "application/binary"}
    )
