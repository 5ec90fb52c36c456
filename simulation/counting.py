"""The simulator's counting APIs: what each counts in a request body, in each provider's documented shape.

- Anthropic ``POST /v1/messages/count_tokens`` (``x-api-key``): ``{"model", "messages", "system"?,
  "tools"?}`` → ``{"input_tokens": n}``.
- OpenAI ``POST /v1/responses/input_tokens`` (Bearer): ``{"model", "input", "instructions"?, "tools"?}`` →
  ``{"object": "response.input_tokens", "input_tokens": n}``.
- Gemini ``POST /v1beta/models/{model}:countTokens`` (``x-goog-api-key``): ``{"contents"}`` or
  ``{"generateContentRequest": {"contents", "systemInstruction"?, "tools"?}}`` → ``{"totalTokens": n,
  "promptTokensDetails": [{"modality": "TEXT", "tokenCount": n}]}``.

Each text block (a system block, a message's text, a tool call's arguments, a tool result) counts as one
message of the simulator's prompt counter — the rule its chat completions bill prompts by — so a simulated
call's billed prompt equals its count when the gateway sends what was counted. Tool definitions are not
counted, as chat completions do not count them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class Invalid(ValueError):
    """The request body is not the API's documented shape."""


def _text_of(content: object) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise Invalid("content must be a string or a list of blocks")
    texts: list[str] = []
    for block in content:
        if not isinstance(block, Mapping):
            raise Invalid("a content block must be an object")
        texts.extend(_block_text(block))
    return texts


def _block_text(block: Mapping[str, Any]) -> list[str]:
    kind = block.get("type")
    if kind in ("text", "input_text", "output_text"):
        return [str(block.get("text", ""))]
    if kind == "tool_use":
        return [json.dumps(block.get("input", {}), sort_keys=True)]
    if kind == "tool_result":
        content = block.get("content", "")
        return _text_of(content) if content else [""]
    raise Invalid(f"unsupported content block type {kind!r}")


def anthropic_texts(body: Mapping[str, Any]) -> list[str]:
    """The text blocks of a ``count_tokens`` body. Raises Invalid."""
    if not isinstance(body.get("model"), str) or not isinstance(body.get("messages"), list):
        raise Invalid("model and messages are required")
    system = body.get("system")
    texts: list[str] = [] if system is None else _text_of(system)
    for message in body["messages"]:
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise Invalid("each message needs the role user or assistant")
        texts.extend(_text_of(message.get("content")))
    return texts


def openai_texts(body: Mapping[str, Any]) -> list[str]:
    """The text blocks of a ``responses/input_tokens`` body. Raises Invalid."""
    items = body.get("input")
    texts: list[str] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        texts.append(instructions)
    if isinstance(items, str):
        return [*texts, items]
    if not isinstance(items, list):
        raise Invalid("input must be a string or a list of items")
    for item in items:
        if not isinstance(item, Mapping):
            raise Invalid("an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            texts.extend(_text_of(item.get("content")))
        elif kind == "function_call":
            texts.append(str(item.get("arguments", "")))
        elif kind == "function_call_output":
            texts.append(str(item.get("output", "")))
        else:
            raise Invalid(f"unsupported input item type {kind!r}")
    return texts


def _gemini_parts(content: object) -> list[str]:
    if not isinstance(content, Mapping) or not isinstance(content.get("parts"), list):
        raise Invalid("a content needs parts")
    texts: list[str] = []
    for part in content["parts"]:
        if not isinstance(part, Mapping):
            raise Invalid("a part must be an object")
        if "text" in part:
            texts.append(str(part["text"]))
        elif "functionCall" in part:
            texts.append(json.dumps(part["functionCall"].get("args", {}), sort_keys=True))
        elif "functionResponse" in part:
            texts.append(str(part["functionResponse"].get("response", {}).get("output", "")))
        else:
            raise Invalid("unsupported part")
    return texts


def gemini_texts(body: Mapping[str, Any]) -> list[str]:
    """The text parts of a ``countTokens`` body. Raises Invalid."""
    request = body.get("generateContentRequest", body)
    if not isinstance(request, Mapping) or not isinstance(request.get("contents"), list):
        raise Invalid("contents (or generateContentRequest.contents) is required")
    system = request.get("systemInstruction")
    texts = [] if system is None else _gemini_parts(system)
    for content in request["contents"]:
        texts.extend(_gemini_parts(content))
    return texts
