"""The OpenAI upper bound for tools and the response format: proven against the framing OpenAI has published.

The reference is OpenAI's own code: openai-harmony renders the ``namespace functions`` section of a developer
message (its tokens decoded back to text here, the vocabulary read from our pinned file, no network), and
tiktoken counts it. The response-format section follows harmony's ``docs/format.md``. The cookbook's
``num_tokens_for_tools`` is the second reference, and the cookbook's own measurement of OpenAI's API (101
prompt tokens for its weather example on gpt-4o) the one figure that comes from OpenAI's servers.
"""

from __future__ import annotations

import json
import os
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from openai_harmony import (
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    Role,
    ToolDescription,
    load_harmony_encoding,
)

from ladder.components import Components, TextPart
from ladder.encoders import parse_tiktoken_bpe
from ladder.messages import messages
from ladder.openai_framing import TOOLS_CLOSE, TOOLS_OPEN, tool_text
from ladder.templates import Bound, get_template

from .conftest import TOKENIZER_DIR
from .strategies import components_json, json_schemas, tool_definitions
from .test_families import (
    OPENAI_FILES,
    components,
    count,
    num_tokens_from_messages,
    openai_counter,
    openai_reference,
)

COOKBOOK_TOOL = {
    "name": "get_current_weather",
    "description": "Get the current weather in a given location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "unit": {
                "type": "string",
                "description": "The unit of temperature to return",
                "enum": ["celsius", "fahrenheit"],
            },
        },
        "required": ["location"],
    },
}
COOKBOOK_MESSAGES = [
    {
        "role": "system",
        "content": "You are a helpful assistant that can answer to questions about the weather.",
    },
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]
MINIMAL: dict[str, Any] = {
    "authorizationScope": {"permissions": []},
    "question": {"parts": [{"type": "text", "text": "hi"}]},
    "recentTurns": [],
}
# What OpenAI's API answered for COOKBOOK_MESSAGES with COOKBOOK_TOOL on gpt-4o (the cookbook's output).
COOKBOOK_API_PROMPT_TOKENS = 101


@cache
def harmony() -> HarmonyEncoding:
    saved = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    # harmony reads o200k_base.tiktoken from this folder instead of downloading it.
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(TOKENIZER_DIR)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = saved


def harmony_tools_section(tools: list[dict[str, Any]]) -> str:
    """The developer message's content as openai-harmony renders these tools (and nothing else)."""
    content = DeveloperContent.new().with_function_tools(
        [ToolDescription.new(tool["name"], tool["description"], tool["parameters"]) for tool in tools]
    )
    encoding = harmony()
    rendered = encoding.decode_utf8(
        encoding.render_conversation(
            Conversation.from_messages([Message.from_role_and_content(Role.DEVELOPER, content)])
        )
    )
    opening, closing = "<|start|>developer<|message|>", "<|end|>"
    assert rendered.startswith(opening) and rendered.endswith(closing)
    return rendered[len(opening) : -len(closing)]


def has_float(value: object) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(has_float(item) for item in value.values())
    return isinstance(value, list) and any(has_float(item) for item in value)


def response_format_section(schema: dict[str, Any]) -> str:
    """harmony's docs/format.md: ``# Response Formats``, ``## {name}``, then the JSON schema."""
    return "# Response Formats\n\n## output\n\n" + json.dumps(
        schema, ensure_ascii=False, separators=(",", ":")
    )


def num_tokens_for_tools(
    functions: list[dict[str, Any]], entries: list[dict[str, Any]], encoding: Any
) -> int:
    """The cookbook's ``num_tokens_for_tools`` with its gpt-4o constants (``disallowed_special=()`` added)."""
    func_init, prop_init, prop_key, enum_init, enum_item, func_end = 7, 3, 3, -3, 3, 12

    def tokens(text: str) -> int:
        return len(encoding.encode(text, disallowed_special=()))

    total = 0
    for function in functions:
        total += func_init
        description = function["description"].removesuffix(".")
        total += tokens(function["name"] + ":" + description)
        properties = function["parameters"]["properties"]
        if properties:
            total += prop_init
            for key, value in properties.items():
                total += prop_key
                if "enum" in value:
                    total += enum_init
                    for item in value["enum"]:
                        total += enum_item + tokens(item)
                total += tokens(f"{key}:{value['type']}:{value['description'].removesuffix('.')}")
    if functions:
        total += func_end
    return total + num_tokens_from_messages(entries, encoding)


def cookbook_shaped(function: dict[str, Any]) -> bool:
    """Whether the cookbook's formula is defined for the function (it reads these keys unguarded)."""
    properties = function["parameters"].get("properties")
    return isinstance(properties, dict) and all(
        isinstance(value, dict)
        and isinstance(value.get("type"), str)
        and isinstance(value.get("description"), str)
        and all(isinstance(item, str) for item in value.get("enum", []))
        for value in properties.values()
    )


def request(data: dict[str, Any], tools: list[dict[str, Any]], schema: dict[str, Any] | None) -> Components:
    """``data`` with these tools and output schema, and without what no published framing covers: tool turns,
    compactions."""
    data = dict(data, tools=tools, compactions=[])
    turns = data["recentTurns"]
    data["recentTurns"] = [
        turn for turn in turns if not turn.get("toolCalls") and not turn.get("toolResults")
    ]
    if schema is None:
        data.pop("outputSchema", None)
    else:
        data["outputSchema"] = schema
    return components(data)


def published_framings(comps: Components, encoding_name: str) -> dict[str, int]:
    """The tokens of the request in the published framing, the hidden sections in each place they may go: a
    developer message of their own, or after the first system message's instructions."""
    reference = openai_reference(encoding_name)
    payload: dict[str, Any] = get_template("openai").payload(comps)
    shown = payload["messages"]
    sections = []
    if payload.get("tools"):
        sections.append(harmony_tools_section([tool["function"] for tool in payload["tools"]]))
    if "response_format" in payload:
        sections.append(response_format_section(payload["response_format"]["json_schema"]["schema"]))
    section = "\n\n".join(sections)
    own = (
        num_tokens_from_messages(shown, reference)
        + 3
        + len(reference.encode("developer"))
        + len(reference.encode(section, disallowed_special=()))
    )
    first = next(index for index, entry in enumerate(shown) if entry["role"] == "system")
    appended = [dict(entry) for entry in shown]
    appended[first]["content"] += "\n\n" + section
    return {"own message": own, "appended": num_tokens_from_messages(appended, reference)}


def definition_text(part: object) -> str:
    assert isinstance(part, TextPart)
    return part.text


def old_rule_total(comps: Components, total: int) -> int:
    """The previous rule's count of the same request: a tool's JSON definition alone, no namespace frame."""
    pieces = get_template("openai").render(comps)
    definitions = {
        m.object_id: definition_text(m.segments[0].part) for m in messages(comps) if m.bucket == "tools"
    }
    extra = 0
    for piece in pieces:
        if isinstance(piece, Bound) and piece.bucket == "tools" and piece.object_id in definitions:
            extra += len(piece.text.encode()) - len(definitions[piece.object_id].encode())
        elif isinstance(piece, Bound) and piece.text == TOOLS_OPEN + TOOLS_CLOSE:
            extra += len(piece.text.encode())
    return total - extra


# ----------------------------------------------------------------------------------------------- proofs


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_every_token_of_the_vocabulary_is_at_least_one_byte(encoding: str) -> None:
    """The lemma under every byte bound here: a text never has more tokens than UTF-8 bytes."""
    ranks = parse_tiktoken_bpe((TOKENIZER_DIR / OPENAI_FILES[encoding]).read_bytes())
    assert len(ranks) > 100_000 if encoding == "o200k_base" else len(ranks) > 99_000
    assert min(len(token) for token in ranks) == 1
    # The 256 single bytes are all there, so any byte string has a tokenization (BPE starts from them).
    assert {bytes([value]) for value in range(256)} <= ranks.keys()
    reference = openai_reference(encoding)
    for text in ["a\n1\n1\n1", '    // - "a"\n' * 3, "é中😀", ""]:
        tokens = reference.encode(text, disallowed_special=())
        assert b"".join(reference.decode_single_token_bytes(t) for t in tokens) == text.encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=st.lists(tool_definitions, max_size=3, unique_by=lambda tool: tool["name"]))
def test_our_namespace_rendering_is_openai_harmonys(tools: list[dict[str, Any]]) -> None:
    """Our text of the tools section is, byte for byte, what OpenAI's renderer writes; where a float default
    is written, no shorter (ours takes the longest digits serde_json may write)."""
    if not tools:
        return
    ours = (
        TOOLS_OPEN.removeprefix("\n\n")
        + "".join(tool_text(tool["name"], tool["description"], tool["parameters"]) for tool in tools)
        + TOOLS_CLOSE
    )
    theirs = harmony_tools_section(tools)
    if has_float(tools):
        assert len(ours.encode()) >= len(theirs.encode())
    else:
        assert ours == theirs


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    data=components_json(images=False),
    tools=st.lists(tool_definitions, min_size=1, max_size=3, unique_by=lambda tool: tool["name"]),
    schema=st.one_of(st.none(), json_schemas),
)
def test_the_bound_is_above_the_published_framing_and_the_cookbook(
    encoding: str, data: dict[str, Any], tools: list[dict[str, Any]], schema: dict[str, Any] | None
) -> None:
    comps = request(data, tools, schema)
    _, result = count("openai", openai_counter(encoding), comps)
    assert result.method == "UPPER_BOUND"
    framings = published_framings(comps, encoding)
    assert result.total >= max(framings.values()), framings
    payload: dict[str, Any] = get_template("openai").payload(comps)
    functions = [tool["function"] for tool in payload["tools"]]
    if all(cookbook_shaped(function) for function in functions):
        reference = openai_reference(encoding)
        assert result.total >= num_tokens_for_tools(functions, payload["messages"], reference)


def test_the_bound_is_above_what_openai_counted_for_the_cookbook_example() -> None:
    """The cookbook's weather tool: OpenAI's API counted 101 prompt tokens, 68 of them over the messages'
    published count; the tool costs the bound more than that, and more than the cookbook's formula."""
    reference = openai_reference("o200k_base")
    tools_part = COOKBOOK_API_PROMPT_TOKENS - num_tokens_from_messages(COOKBOOK_MESSAGES, reference)
    assert tools_part == 68
    assert num_tokens_for_tools([COOKBOOK_TOOL], COOKBOOK_MESSAGES, reference) == COOKBOOK_API_PROMPT_TOKENS
    # harmony's rendering of the same tool is within a token of what the API counted.
    assert abs(len(reference.encode(harmony_tools_section([COOKBOOK_TOOL]))) - tools_part) <= 1
    data = dict(MINIMAL, question={"parts": [{"type": "text", "text": COOKBOOK_MESSAGES[1]["content"]}]})
    counter = openai_counter("o200k_base")
    _, without = count("openai", counter, components(data))
    _, with_tool = count("openai", counter, components(dict(data, tools=[COOKBOOK_TOOL])))
    assert with_tool.method == "UPPER_BOUND"
    assert with_tool.total - without.total >= tools_part


# ----------------------------------------------------------------------------------------- negative controls

MANY_LINES = {"name": "lines", "description": "1\n" * 150, "parameters": {"type": "object", "properties": {}}}
MANY_EXAMPLES = {
    "name": "examples",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {"inner": {"type": "string", "examples": ["a"] * 150}},
            }
        },
    },
}


@pytest.mark.parametrize("tool", [MANY_LINES, MANY_EXAMPLES], ids=["description lines", "nested examples"])
def test_the_json_definition_alone_undercounts_the_namespace(tool: dict[str, Any]) -> None:
    """What the bound was before: the JSON's bytes and 8 tokens an item. A description of many short lines,
    or many examples of a nested property, render to more tokens than that; the bound now is above them."""
    reference = openai_reference("o200k_base")
    comps = request(MINIMAL, [tool], None)
    _, result = count("openai", openai_counter("o200k_base"), comps)
    framings = published_framings(comps, "o200k_base")
    assert old_rule_total(comps, result.total) < min(framings.values())
    assert result.total >= max(framings.values())
    definition = next(definition_text(m.segments[0].part) for m in messages(comps) if m.bucket == "tools")
    # Not even the JSON's own tokens are above the rendering: a JSON text is no stand-in for it.
    rendered = harmony_tools_section([tool])
    assert len(reference.encode(definition)) < len(reference.encode(rendered))


def test_the_property_finds_where_the_old_rule_undercounts() -> None:
    """The generated tools reach the inputs above: Hypothesis finds a request the old rule undercounts."""

    def undercounts(tools: list[dict[str, Any]]) -> bool:
        comps = request(MINIMAL, tools, None)
        _, result = count("openai", openai_counter("o200k_base"), comps)
        return old_rule_total(comps, result.total) < max(published_framings(comps, "o200k_base").values())

    found = find(
        st.lists(tool_definitions, min_size=1, max_size=3, unique_by=lambda tool: tool["name"]),
        undercounts,
        settings=settings(max_examples=500, deadline=None, database=None),
    )
    assert found
