"""Mistral: the count is Mistral's own rendering of the very payload we send, token for token.

The reference is ``mistral_common`` with the tokenizer files it ships in its own package (not our installed
copies), given the payload ``MistralTemplate.payload`` returns, without its image placeholders.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import mistral_common
import pytest
from hypothesis import HealthCheck, given, settings
from mistral_common.exceptions import MistralCommonException
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from ladder.components import Components, Limits
from ladder.counting import CountingUnavailable, MemoryCountCache, count_stream
from ladder.families import load_counter
from ladder.mistral import MistralCounter
from ladder.parser import parse_components
from ladder.templates import Bound, Image, Text, get_template, mistral_call_id

from .conftest import TOKENIZER_DIR
from .strategies import components_json
from .test_families import GOLDEN

FILES = {
    "tekken_240911.json": "mistral-tekken",
    "tekken_240718.json": "mistral-tekken",
    "mistral_instruct_tokenizer_240323.model.v3": "mistral-sentencepiece",
    "mistral_instruct_tokenizer_241114.model.v7": "mistral-sentencepiece",
}
VENDOR_DATA = Path(mistral_common.__file__).parent / "data"
# Mistral's v3 code refuses an assistant message with both text and tool calls (so would its API).
V3_REFUSES = {"code", "everything", "huge_tools", "near_window"}


@cache
def reference(file_name: str) -> MistralTokenizer:
    return MistralTokenizer.from_file(VENDOR_DATA / file_name)


@cache
def ours(file_name: str) -> MistralCounter:
    counter = load_counter(FILES[file_name], TOKENIZER_DIR / file_name)
    assert isinstance(counter, MistralCounter)
    return counter


def without_images(payload: dict[str, Any]) -> dict[str, Any]:
    entries = []
    for entry in payload["messages"]:
        entry = dict(entry)
        if isinstance(entry["content"], list):
            entry["content"] = [part for part in entry["content"] if part["type"] == "text"]
        entries.append(entry)
    return {"messages": entries, **({"tools": payload["tools"]} if "tools" in payload else {})}


def silent_calls(data: dict[str, Any]) -> dict[str, Any]:
    """The fixture with its tool-calling assistant turns carrying no text, as Mistral's v3 requires."""
    data = dict(data)
    data["recentTurns"] = [
        {
            key: value
            for key, value in turn.items()
            if not (key in ("text", "parts") and turn.get("toolCalls"))
        }
        for turn in data.get("recentTurns", [])
    ]
    return data


def check(file_name: str, comps: Components) -> None:
    template = get_template("mistral")
    pieces = template.render(comps)
    result = count_stream(
        pieces,
        ours(file_name),
        MemoryCountCache(),
        template_revision=template.revision,
        image_formula="tiles512",
    )
    (request,) = [piece.text for piece in pieces if isinstance(piece, Text)]
    payload = template.payload(comps)
    # What is counted is what is sent (but for the images, counted by the formula).
    assert json.loads(request) == json.loads(json.dumps(without_images(payload)))
    sent = without_images(payload)
    expected = (
        reference(file_name)
        .encode_chat_completion(
            ChatCompletionRequest.from_openai(messages=sent["messages"], tools=sent.get("tools"))
        )
        .tokens
    )
    assert ours(file_name).encode(request) == expected
    images = sum(1 for piece in pieces if isinstance(piece, Image))
    bounded = any(isinstance(piece, Bound) for piece in pieces)
    assert result.method == ("UPPER_BOUND" if bounded else "EXACT")
    if not images and not bounded:
        assert result.total == len(expected)
    assert sum(result.per_bucket.values()) == result.total


@pytest.mark.parametrize("file_name", sorted(FILES))
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_mistral_ids_equal_mistral_commons_own_rendering(file_name: str, name: str) -> None:
    data = GOLDEN[name]()
    if file_name.endswith(".v7"):
        check(file_name, parse_components(data, limits=Limits()))
        return
    if name in V3_REFUSES:
        with pytest.raises(CountingUnavailable, match="refuses"):
            check(file_name, parse_components(data, limits=Limits()))
    check(file_name, parse_components(silent_calls(data), limits=Limits()))


def test_tool_call_ids_become_ids_mistral_accepts_consistently() -> None:
    assert mistral_call_id("abcDEF123") == "abcDEF123"
    derived = mistral_call_id("call-1-0")
    assert derived == mistral_call_id("call-1-0") != mistral_call_id("call-1-1")
    assert len(derived) == 9 and derived.isalnum()
    payload: dict[str, Any] = get_template("mistral").payload(
        parse_components(GOLDEN["code"](), limits=Limits())
    )
    calls = {call["id"] for entry in payload["messages"] for call in entry.get("tool_calls") or []}
    results = {entry["tool_call_id"] for entry in payload["messages"] if entry["role"] == "tool"}
    assert calls == results and all(len(call) == 9 for call in calls)


def check_or_both_refuse(file_name: str, comps: Components) -> None:
    """Our count equals Mistral's rendering, or Mistral's code refuses the payload and so does our count."""
    sent = without_images(get_template("mistral").payload(comps))
    try:
        request = ChatCompletionRequest.from_openai(messages=sent["messages"], tools=sent.get("tools"))
        reference(file_name).encode_chat_completion(request)
    except (MistralCommonException, ValueError, AssertionError, RuntimeError):
        with pytest.raises(CountingUnavailable, match="refuses"):
            check(file_name, comps)
        return
    check(file_name, comps)


@pytest.mark.parametrize("file_name", sorted(FILES))
def test_a_lone_surrogate_escaped_in_arguments_is_refused_as_mistral_refuses_it(
    file_name: str,
) -> None:
    """sentencepiece raises a plain RuntimeError for it: refused (the policy's counting-unavailable rule),
    never an error of ours. Tekken encodes it."""
    data = silent_calls(GOLDEN["plain"]())
    data["recentTurns"] = [
        {"turn": 1, "role": "user", "text": "Go."},
        {
            "turn": 2,
            "role": "assistant",
            "text": "",
            "toolCalls": [{"id": "c1", "name": "lookup", "arguments": '{"q": "x\\ud800y"}'}],
        },
        {"turn": 3, "role": "tool", "toolResults": [{"callId": "c1", "text": "done"}]},
    ]
    check_or_both_refuse(file_name, parse_components(data, limits=Limits()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=components_json())
def test_mistral_generated_conversations(data: dict[str, Any]) -> None:
    check_or_both_refuse(
        "mistral_instruct_tokenizer_241114.model.v7", parse_components(data, limits=Limits())
    )
    check_or_both_refuse("tekken_240911.json", parse_components(silent_calls(data), limits=Limits()))
