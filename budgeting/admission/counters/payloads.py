"""The ladder's final payload (OpenAI-style chat: ``messages``, ``tools``, ``response_format``) as each
counting API's request.

Images are never sent: the payload carries only their sizes (``{"type": "image", "width", "height"}``), so
their tokens come from the model revision's image formula (``image_tokens``) and are added to the API's count
of the rest. Each payload message keeps its own content block, so the API counts the same text in the same
order the model will receive it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ladder.counting import ImageFormula, image_tokens


def _messages(payload: Mapping[str, object]) -> list[Mapping[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise ValueError("the payload has no messages")
    return [message for message in messages if isinstance(message, Mapping)]


def _parts(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [part for part in content if isinstance(part, Mapping)]
    return []


def _text(message: Mapping[str, Any]) -> str:
    return "".join(str(part.get("text", "")) for part in _parts(message) if part.get("type") == "text")


def image_tokens_of(payload: Mapping[str, object], formula: ImageFormula) -> int:
    """The tokens of the payload's images by the model revision's formula (they are not sent to the API)."""
    return sum(
        image_tokens(int(part["width"]), int(part["height"]), formula)
        for message in _messages(payload)
        for part in _parts(message)
        if part.get("type") == "image"
    )


def _functions(payload: Mapping[str, object]) -> Iterator[Mapping[str, Any]]:
    tools = payload.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            yield function


def _arguments(raw: object) -> object:
    """A tool call's arguments as an object (they are JSON text in the chat payload)."""
    if not isinstance(raw, str):
        return raw or {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}


def _leading_system(messages: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[Mapping[str, Any]]]:
    """The system texts before the first other message, and the messages after them."""
    index = 0
    while index < len(messages) and messages[index].get("role") == "system":
        index += 1
    return [_text(message) for message in messages[:index]], list(messages[index:])


# ------------------------------------------------------------------------------------------------ Anthropic


def anthropic_request(payload: Mapping[str, object]) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens`` arguments: ``system`` blocks, ``messages`` and ``tools``.

    Consecutive messages of one role are merged into one message of several blocks (the Messages API
    alternates roles); a system message after the conversation started becomes a user text block; a tool
    result is a user ``tool_result`` block, a tool call an assistant ``tool_use`` block.
    """
    system, rest = _leading_system(_messages(payload))
    out: list[dict[str, Any]] = []
    for message in rest:
        role = message.get("role")
        blocks: list[dict[str, Any]] = []
        if role == "tool":
            blocks.append(
                {
                    "type": "tool_result",
                    "tool_use_id": str(message.get("tool_call_id")),
                    "content": _text(message),
                }
            )
            role = "user"
        else:
            text = _text(message)
            if text:
                blocks.append({"type": "text", "text": text})
            for call in message.get("tool_calls") or ():
                function = call.get("function", {})
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": str(call.get("id")),
                        "name": str(function.get("name")),
                        "input": _arguments(function.get("arguments")),
                    }
                )
            role = "assistant" if role == "assistant" else "user"
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    request: dict[str, Any] = {"messages": out}
    if system:
        request["system"] = [{"type": "text", "text": text} for text in system]
    tools = [
        {
            "name": str(function.get("name")),
            "description": str(function.get("description") or ""),
            "input_schema": function.get("parameters") or {"type": "object"},
        }
        for function in _functions(payload)
    ]
    if tools:
        request["tools"] = tools
    return request


# ---------------------------------------------------------------------------------------------------- Gemini


def gemini_request(payload: Mapping[str, object], model: str) -> dict[str, Any]:
    """The ``models.countTokens`` body: a ``generateContentRequest`` with ``systemInstruction``,
    ``contents`` (roles ``user`` and ``model``) and ``tools`` (function declarations)."""
    system, rest = _leading_system(_messages(payload))
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for message in rest:
        role = message.get("role")
        parts: list[dict[str, Any]] = []
        if role == "tool":
            call_id = str(message.get("tool_call_id"))
            parts.append(
                {
                    "functionResponse": {
                        "name": names.get(call_id, call_id),
                        "response": {"output": _text(message)},
                    }
                }
            )
            gemini_role = "user"
        else:
            text = _text(message)
            if text:
                parts.append({"text": text})
            for call in message.get("tool_calls") or ():
                function = call.get("function", {})
                names[str(call.get("id"))] = str(function.get("name"))
                parts.append(
                    {
                        "functionCall": {
                            "name": str(function.get("name")),
                            "args": _arguments(function.get("arguments")),
                        }
                    }
                )
            gemini_role = "model" if role == "assistant" else "user"
        if not parts:
            continue
        if contents and contents[-1]["role"] == gemini_role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": gemini_role, "parts": parts})
    request: dict[str, Any] = {"model": f"models/{model}", "contents": contents}
    if system:
        request["systemInstruction"] = {"parts": [{"text": text} for text in system]}
    declarations = [
        {
            "name": str(function.get("name")),
            "description": str(function.get("description") or ""),
            "parameters": function.get("parameters") or {"type": "object"},
        }
        for function in _functions(payload)
    ]
    if declarations:
        request["tools"] = [{"functionDeclarations": declarations}]
    return {"generateContentRequest": request}


# ---------------------------------------------------------------------------------------------------- OpenAI


def openai_request(payload: Mapping[str, object]) -> dict[str, Any]:
    """``POST /v1/responses/input_tokens`` arguments: ``input`` items, ``tools`` and ``text.format``.

    Every message is an input message of its role (system messages as ``system``); a tool call is a
    ``function_call`` item and its result a ``function_call_output`` item.
    """
    items: list[dict[str, Any]] = []
    for message in _messages(payload):
        role = message.get("role")
        if role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": str(message.get("tool_call_id")),
                    "output": _text(message),
                }
            )
            continue
        text = _text(message)
        if text:
            items.append({"type": "message", "role": str(role), "content": text})
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            items.append(
                {
                    "type": "function_call",
                    "call_id": str(call.get("id")),
                    "name": str(function.get("name")),
                    "arguments": str(function.get("arguments") or "{}"),
                }
            )
    request: dict[str, Any] = {"input": items}
    tools = [
        {
            "type": "function",
            "name": str(function.get("name")),
            "description": str(function.get("description") or ""),
            "parameters": function.get("parameters") or {"type": "object"},
            "strict": False,
        }
        for function in _functions(payload)
    ]
    if tools:
        request["tools"] = tools
    response_format = payload.get("response_format")
    if isinstance(response_format, Mapping) and isinstance(response_format.get("json_schema"), Mapping):
        schema = response_format["json_schema"]
        request["text"] = {
            "format": {
                "type": "json_schema",
                "name": str(schema.get("name", "output")),
                "schema": schema.get("schema", {}),
                "strict": bool(schema.get("strict", False)),
            }
        }
    return request
