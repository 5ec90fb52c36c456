"""The OpenAI upper bound for tools, the response format, tool calls and tool results: proven against the
framing OpenAI has published.

The reference is OpenAI's own code: openai-harmony renders the ``namespace functions`` section of a developer
message (its tokens decoded back to text here, the vocabulary read from our pinned file, no network), and
tiktoken counts it. The response-format section follows harmony's ``docs/format.md``. Tool calls and results
are harmony's own messages, the whole conversation rendered by harmony and counted by its tokens (o200k_base)
or, for cl100k_base, by tiktoken's tokens of each text between harmony's specials. The cookbook's
``num_tokens_for_tools`` is the second reference, and the cookbook's own measurement of OpenAI's API (101
prompt tokens for its weather example on gpt-4o) the one figure that comes from OpenAI's servers.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import regex
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from openai_harmony import (
    Author,
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
from ladder.openai_framing import (
    CALL_SPECIALS,
    CHANNEL_SPECIAL,
    RESULT_SPECIALS,
    TEXT_CHANNEL,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    call_bound_text,
    call_text,
    result_bound_text,
    result_header_text,
    tool_text,
    trailing_run,
)
from ladder.templates import (
    TEMPLATE_BUCKET,
    TEMPLATE_OBJECT,
    Bound,
    Cut,
    FixedText,
    Piece,
    Special,
    TemplateError,
    Text,
    get_template,
)

from .conftest import TOKENIZER_DIR
from .strategies import components_json, json_schemas, parts, texts, tool_definitions
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


def hidden_sections(payload: dict[str, Any]) -> str:
    """The payload's tools and response-format sections as harmony writes them, joined (empty if none)."""
    sections = []
    if payload.get("tools"):
        sections.append(harmony_tools_section([tool["function"] for tool in payload["tools"]]))
    if "response_format" in payload:
        sections.append(response_format_section(payload["response_format"]["json_schema"]["schema"]))
    return "\n\n".join(sections)


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
    """``data`` with these tools and output schema, without tool turns (the conversations below have them) and
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
    section = hidden_sections(payload)
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


def openai4_allowances(pieces: tuple[Piece, ...]) -> int:
    """What openai/4 adds to the bound: the ``Bound`` of the instructions' end (a template text without a
    letter or a digit), and the ``<|channel|>`` and channel of an assistant's text beside its calls."""
    total = 0
    for before, piece in itertools.pairwise(pieces):
        if not isinstance(piece, Bound) or piece.bucket != TEMPLATE_BUCKET:
            continue
        if piece.text == TEXT_CHANNEL and before == Special(CHANNEL_SPECIAL):
            total += 1 + len(piece.text.encode())
        elif trailing_run(piece.text) == piece.text:
            total += len(piece.text.encode())
    return total


def definition_text(part: object) -> str:
    assert isinstance(part, TextPart)
    return part.text


def old_rule_total(comps: Components, total: int) -> int:
    """The previous rule's count of the same request: a tool's JSON definition alone, no namespace frame (and
    none of what openai/4 adds)."""
    pieces = get_template("openai").render(comps)
    definitions = {
        m.object_id: definition_text(m.segments[0].part) for m in messages(comps) if m.bucket == "tools"
    }
    extra = openai4_allowances(pieces)
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


# ------------------------------------------------------------------------------------ tool calls and results

# A function name each of whose characters is a token of its own (digits and punctuation do not merge). The
# rule before openai/3 paid its bytes once; harmony's framing names it in the call and again in the result.
DENSE_NAME = "1-" * 31 + "1"
WEATHER_ARGUMENTS = '{"location":"San Francisco, CA","unit":"celsius"}'
WEATHER_RESULT = '{"temperature":18,"unit":"celsius","conditions":"fog"}'

call_ids = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"), exclude_characters="<\uff5c"),
    min_size=1,
    max_size=12,
)
call_names = st.one_of(
    st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    st.lists(st.sampled_from(["1", "-", "_", "a", "Z", "9", "get_", "weather"]), min_size=1, max_size=40).map(
        lambda pieces: "".join(pieces)[:64]
    ),
)
call_arguments = st.one_of(
    texts,
    st.dictionaries(texts, st.one_of(st.integers(), texts), max_size=3).map(
        lambda value: json.dumps(value, ensure_ascii=False)
    ),
)


@st.composite
def tool_conversations(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request (tools and an output schema as generated) whose history has assistant turns making up
    to six calls, some answered by a tool or user turn, some not yet."""
    data = dict(draw(components_json(images=False)), compactions=[])
    used: set[str] = set()
    turns: list[dict[str, Any]] = []
    number = 0
    for _ in range(draw(st.integers(1, 3))):
        calls = []
        for _ in range(draw(st.integers(1, 6))):
            call_id = draw(call_ids.filter(lambda value: value not in used))
            used.add(call_id)
            calls.append({"id": call_id, "name": draw(call_names), "arguments": draw(call_arguments)})
        assistant = {"turn": number, "role": "assistant", "parts": draw(parts(min_size=0, images=False))}
        turns.append(dict(assistant, toolCalls=calls))
        number += 1
        answered = draw(st.permutations(calls))[: draw(st.integers(0, len(calls)))]
        if answered:
            results = [
                {"callId": call["id"], "parts": draw(parts(min_size=0, images=False))} for call in answered
            ]
            if draw(st.booleans()):
                turns.append({"turn": number, "role": "tool", "toolResults": results})
            else:
                turns.append({"turn": number, "role": "user", "toolResults": results, "text": draw(texts)})
            number += 1
        if draw(st.booleans()):
            role = draw(st.sampled_from(["user", "assistant"]))
            turns.append({"turn": number, "role": role, "parts": draw(parts(images=False))})
            number += 1
    data["recentTurns"] = turns
    return data


def harmony_call(name: str, arguments: str, content_type: str = "json") -> Message:
    """A tool call as openai-harmony builds it (``content_type``: ``json``, or ``<|constrain|>json`` as the
    model writes it)."""
    return (
        Message.from_role_and_content(Role.ASSISTANT, arguments)
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type(content_type)
    )


def harmony_result(name: str, text: str) -> Message:
    return (
        Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def framing(tokens: list[int]) -> tuple[list[str], list[str]]:
    """harmony's tokens as its specials and the texts between them (each run of ordinary tokens, decoded)."""
    encoding = harmony()
    specials: list[str] = []
    between: list[str] = []
    run: list[int] = []
    for token in tokens:
        if encoding.is_special_token(token):
            if run:
                between.append(encoding.decode_utf8(run))
                run = []
            specials.append(encoding.decode_utf8([token]))
        else:
            run.append(token)
    if run:
        between.append(encoding.decode_utf8(run))
    return specials, between


def harmony_count(tokens: list[int], encoding_name: str) -> int:
    """The tokens of harmony's rendering in ``encoding_name``: its specials, and tiktoken's tokens of each
    text between them."""
    specials, between = framing(tokens)
    reference = openai_reference(encoding_name)
    total = len(specials) + sum(len(reference.encode(text, disallowed_special=())) for text in between)
    if encoding_name == "o200k_base":
        # harmony's vocabulary is o200k_base with its specials: this is its own count.
        assert total == len(tokens)
    return total


def harmony_conversations(comps: Components, encoding_name: str) -> dict[str, int]:
    """The tokens of the request as openai-harmony renders it: each message, and each tool call and tool
    result a message of its own, an assistant's text beside its calls in the commentary channel, the reply
    primed; the tools and response-format sections in each place they may go (a developer message of their
    own, or after the first system message's instructions)."""
    payload: dict[str, Any] = get_template("openai").payload(comps)
    entries = payload["messages"]
    names = {
        call["id"]: call["function"]["name"] for entry in entries for call in entry.get("tool_calls") or ()
    }
    section = hidden_sections(payload)
    out = {}
    for placement in ("own message", "appended"):
        rendered = []
        if section and placement == "own message":
            rendered.append(Message.from_role_and_content(Role.DEVELOPER, section))
        pending = bool(section) and placement == "appended"
        for entry in entries:
            content = entry["content"]
            if entry["role"] == "tool":
                rendered.append(harmony_result(names[entry["tool_call_id"]], content))
                continue
            if pending and entry["role"] == "system":
                content += "\n\n" + section
                pending = False
            if content is not None:
                message = Message.from_role_and_content(Role(entry["role"]), content)
                # harmony's preamble: an assistant's text beside its calls, in the commentary channel.
                rendered.append(message.with_channel("commentary") if entry.get("tool_calls") else message)
            for call in entry.get("tool_calls") or ():
                rendered.append(harmony_call(call["function"]["name"], call["function"]["arguments"]))
        conversation = Conversation.from_messages(rendered)
        tokens = harmony().render_conversation_for_completion(conversation, Role.ASSISTANT)
        out[placement] = harmony_count(tokens, encoding_name)
    return out


def sent_count(comps: Components, encoding_name: str) -> int:
    """The published rule over the payload as sent, every value counted: the content, a result's
    ``tool_call_id``, a call's id, name and arguments."""
    reference = openai_reference(encoding_name)
    payload: dict[str, Any] = get_template("openai").payload(comps)
    entries: list[dict[str, Any]] = []
    for entry in payload["messages"]:
        values = {"role": entry["role"], "content": entry["content"] or ""}
        if "tool_call_id" in entry:
            values["tool_call_id"] = entry["tool_call_id"]
        for index, call in enumerate(entry.get("tool_calls") or ()):
            function = call["function"]
            values[f"call {index}"] = call["id"] + function["name"] + function["arguments"]
        entries.append(values)
    return num_tokens_from_messages(entries, reference)


def old_tool_turn_total(comps: Components, total: int) -> int:
    """The rule before openai/3 over the same request: a call's id + name + arguments and 8 specials, a
    result's ``tool_call_id`` and 8 specials (and none of what openai/4 adds)."""
    total -= openai4_allowances(get_template("openai").render(comps))
    listed = messages(comps)
    names = {call.id: call.name for message in listed for call in message.calls}
    for message in listed:
        for call in message.calls:
            total -= len(call_bound_text(call.id, call.name, call.arguments).encode()) + len(CALL_SPECIALS)
            total += len((call.id + call.name + call.arguments).encode()) + 8
        if message.tool_call_id is not None:
            header = result_bound_text(message.tool_call_id, names[message.tool_call_id])
            total -= len(header.encode()) + len(RESULT_SPECIALS)
            total += len(message.tool_call_id.encode()) + 8
    return total


def call_request(
    name: str = "get_current_weather",
    call_id: str = "call_1",
    arguments: str = WEATHER_ARGUMENTS,
    result: str = WEATHER_RESULT,
) -> dict[str, Any]:
    """The cookbook's question, the one call it leads to, and the call's result."""
    return dict(
        MINIMAL,
        recentTurns=[
            {"turn": 1, "role": "user", "text": "What's the weather like in San Francisco?"},
            {
                "turn": 2,
                "role": "assistant",
                "parts": [],
                "toolCalls": [{"id": call_id, "name": name, "arguments": arguments}],
            },
            {"turn": 3, "role": "tool", "toolResults": [{"callId": call_id, "text": result}]},
        ],
    )


# ----------------------------------------------------------------------------- tool calls and results: proofs


@settings(max_examples=150, deadline=None)
@given(name=call_names, arguments=call_arguments, text=texts)
def test_our_call_and_result_texts_are_harmonys(name: str, arguments: str, text: str) -> None:
    """The texts between harmony's specials are ours, byte for byte, and its specials are ours: for the call
    harmony renders, for the call with the model's ``<|constrain|>``, for the call as the model writes it
    (``docs/format.md``: the recipient in the channel), and for the result."""
    encoding = harmony()
    specials, between = framing(encoding.render(harmony_call(name, arguments)))
    assert specials == [token for token in CALL_SPECIALS if token != "<|constrain|>"]
    assert "".join(between) == call_text(name, arguments)
    specials, between = framing(encoding.render(harmony_call(name, arguments, "<|constrain|>json")))
    assert specials == list(CALL_SPECIALS)
    assert "".join(between) == call_text(name, arguments)
    written = (
        f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"
        "<|call|>"
    )
    tokens = encoding.encode(written, allowed_special="all")
    [parsed] = encoding.parse_messages_from_completion_tokens(tokens[1:], Role.ASSISTANT)
    assert parsed.recipient == f"functions.{name}" and parsed.content_type == "<|constrain|>json"
    specials, between = framing(tokens)
    assert specials == list(CALL_SPECIALS)
    assert len("".join(between).encode()) == len(call_text(name, arguments).encode())
    specials, between = framing(encoding.render(harmony_result(name, text)))
    assert specials == list(RESULT_SPECIALS)
    assert "".join(between) == result_header_text(name) + text


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=tool_conversations())
def test_the_bound_is_above_harmonys_rendering_of_tool_calls_and_results(
    encoding: str, data: dict[str, Any]
) -> None:
    """The whole request as openai-harmony renders it (tool calls and results its own messages, and any tools
    and response format in either place) costs no more than the bound, nor does the payload as sent."""
    comps = components(data)
    _, result = count("openai", openai_counter(encoding), comps)
    assert result.method == "UPPER_BOUND"
    rendered = harmony_conversations(comps, encoding)
    assert result.total >= max(rendered.values()), rendered
    assert result.total >= sent_count(comps, encoding)


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_the_weather_call_and_its_result_are_bounded_by_their_harmony_messages(encoding: str) -> None:
    """Each call and result piece is its harmony text, and the count is above harmony's."""
    comps = components(call_request())
    pieces, result = count("openai", openai_counter(encoding), comps)
    bounds = [piece.text for piece in pieces if isinstance(piece, Bound)]
    assert bounds == [
        call_text("get_current_weather", WEATHER_ARGUMENTS),
        WEATHER_RESULT,
        result_header_text("get_current_weather"),
    ]
    rendered = harmony_conversations(comps, encoding)
    assert rendered["own message"] == rendered["appended"]
    call = harmony_count(harmony().render(harmony_call("get_current_weather", WEATHER_ARGUMENTS)), encoding)
    answer = harmony_count(harmony().render(harmony_result("get_current_weather", WEATHER_RESULT)), encoding)
    # harmony's conversation, its call and result messages, and the bound (their texts' bytes).
    expected = {"o200k_base": (84, 27, 27, 260), "cl100k_base": (86, 27, 28, 261)}
    assert (rendered["own message"], call, answer, result.total) == expected[encoding]
    assert result.total >= rendered["own message"]


def test_a_long_id_is_its_own_bound() -> None:
    """What we send stays in the maximum: an id longer than the harmony texts it stands beside bounds them."""
    call_id = "c" * 60
    comps = components(call_request(name="f", call_id=call_id))
    pieces = get_template("openai").render(comps)
    bounds = [piece.text for piece in pieces if isinstance(piece, Bound)]
    assert bounds == [call_id + "f" + WEATHER_ARGUMENTS, WEATHER_RESULT, call_id]
    assert len(call_id.encode()) > len(result_header_text("f").encode())


def test_a_result_without_its_call_is_a_template_error() -> None:
    """The parser admits no such request; a stream that lost the call cannot name the result's function."""
    comps = components(call_request())
    orphaned = replace(comps, recent_turns=tuple(t for t in comps.recent_turns if not t.tool_calls))
    with pytest.raises(TemplateError, match="call_1"):
        get_template("openai").render(orphaned)


# ------------------------------------------------------------------ tool calls and results: negative controls


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_the_old_rule_undercounts_a_token_dense_name(encoding: str) -> None:
    """The rule before openai/3 paid a call's name once; harmony names the function in the call and in the
    result, a token a character here. The old rule is below harmony's rendering, the bound above it."""
    comps = components(call_request(name=DENSE_NAME, call_id="1", arguments="{}", result=""))
    _, result = count("openai", openai_counter(encoding), comps)
    rendered = max(harmony_conversations(comps, encoding).values())
    assert old_tool_turn_total(comps, result.total) < rendered <= result.total


def test_the_property_finds_where_the_old_tool_turn_rule_undercounts() -> None:
    """The generated conversations reach such inputs: Hypothesis finds one the old rule undercounts (seen: a
    call not answered yet, id and name ``0``, no arguments: harmony's 12 tokens of framing are above the old
    8 specials and 2 bytes)."""

    def undercounts(data: dict[str, Any]) -> bool:
        comps = components(data)
        _, result = count("openai", openai_counter("o200k_base"), comps)
        rendered = max(harmony_conversations(comps, "o200k_base").values())
        return old_tool_turn_total(comps, result.total) < rendered

    found = find(
        tool_conversations(),
        undercounts,
        settings=settings(max_examples=500, deadline=None, database=None),
    )
    assert any(turn.get("toolCalls") for turn in found["recentTurns"])


# ------------------------------------------------------------------ the instructions joined to the sections

# Runs that may end the instructions: whitespace, line breaks, punctuation, CJK punctuation and spaces, a
# combining mark (a letter's in o200k_base, neither letter nor digit for the allowance).
ENDINGS = [*" \n\r\t", "\r\n", *"\u3000!.?)/#'。、！…—\u0301"]
instruction_ends = st.one_of(
    st.lists(st.sampled_from(ENDINGS), max_size=12).map("".join),
    st.builds(lambda run, times: run * times, st.sampled_from(ENDINGS), st.integers(1, 200)),
)
instructions = st.builds(lambda text, end: text + end, texts, instruction_ends)
# The units of the exhaustive search below, and an input it finds in both vocabularies: the merge of its
# line breaks with the "\n\n" costs more than the "\n\n"'s 2 bytes.
UNITS = ["\u3000", "\r\n", "\t", "\r", "\n", " ", "!", "。"]
MERGING = "Hello\r\n\t\r\n"


@cache
def sections() -> tuple[str, ...]:
    """The texts that may follow the instructions' ``\\n\\n``: harmony's tools section of the cookbook tool,
    a response-format section, and both."""
    tools = harmony_tools_section([COOKBOOK_TOOL])
    schema = response_format_section({"type": "object", "properties": {"a": {"type": "string"}}})
    return tools, schema, tools + "\n\n" + schema


@cache
def pre_tokenizer(encoding: str) -> Any:
    return regex.compile(openai_reference(encoding)._pat_str)


def pre_tokens(encoding: str, text: str) -> list[str]:
    """tiktoken's pre-tokens of ``text``: its vocabulary's regex (``openai_public.py``), as tiktoken's
    ``_educational.py`` applies it with the same ``regex`` module."""
    return list(pre_tokenizer(encoding).findall(text))


def join_excess(encoding: str, text: str, section: str) -> int:
    """How many tokens more ``text`` joined to ``section`` by ``\\n\\n`` costs than ``text``'s own count, the
    line break's 2 bytes and the section's own count: what the allowance must cover."""
    reference = openai_reference(encoding)

    def tokens(value: str) -> int:
        return len(reference.encode(value, disallowed_special=()))

    return tokens(text + "\n\n" + section) - tokens(text) - 2 - tokens(section)


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(max_examples=300, deadline=None)
@given(text=instructions)
def test_only_the_instructions_end_merges_with_the_section(encoding: str, text: str) -> None:
    """Step 3's lemma on tiktoken's own regexes: the instructions' pre-tokens up to the one holding their last
    letter or digit are unchanged by the join (a), the ones after lie in the run ``trailing_run`` returns, and
    the section's pre-tokens start after the ``\\n\\n``, the same as alone (b)."""
    section = sections()[0]
    alone = pre_tokens(encoding, text)
    joined = pre_tokens(encoding, text + "\n\n" + section)
    run_start = len(text) - len(trailing_run(text))
    starts = [sum(map(len, alone[:index])) for index in range(len(alone))]
    kept = sum(1 for start in starts if start < run_start)
    assert joined[:kept] == alone[:kept]
    merged_from = sum(map(len, alone[:kept]))
    assert merged_from >= run_start
    ends = [
        merged_from + sum(map(len, joined[kept : kept + index])) for index in range(len(joined) - kept + 1)
    ]
    after = ends.index(len(text) + 2)
    assert joined[kept + after :] == pre_tokens(encoding, section)


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_the_join_does_merge(encoding: str) -> None:
    """The lemma is not vacuous: a run of punctuation and one of spaces take the ``\\n\\n`` into their
    pre-token."""
    assert pre_tokens(encoding, "Stop!!\n\n# Tools")[:3] == ["Stop", "!!\n\n", "#"]
    assert pre_tokens(encoding, "Stop   \n\n# Tools")[:3] == ["Stop", "   \n\n", "#"]


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(max_examples=200, deadline=None)
@given(text=instructions, section=st.sampled_from([0, 1, 2]))
def test_the_instructions_end_covers_the_join(encoding: str, text: str, section: int) -> None:
    """The join costs at most the bytes of the instructions' end more than the line break's bytes and each
    side's own count: the ``Bound`` of ``trailing_run`` covers it."""
    assert join_excess(encoding, text, sections()[section]) <= len(trailing_run(text).encode())


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_without_the_instructions_end_the_join_is_undercounted(encoding: str) -> None:
    """Negative control, by an exhaustive search: of the instructions ``Hello`` and up to four ``UNITS``
    (4,680 of them), some cost more joined to each section than the line break's bytes and each side's own
    count (``MERGING`` among them); the allowance is above every one."""
    for section in sections():
        excess = {}
        for size in range(1, 5):
            for units in itertools.product(UNITS, repeat=size):
                text = "Hello" + "".join(units)
                excess[text] = join_excess(encoding, text, section)
        assert excess[MERGING] > 0
        assert all(value <= len(trailing_run(text).encode()) for text, value in excess.items())


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=components_json(images=False), rule=instructions, schema=st.one_of(st.none(), json_schemas))
def test_the_bound_is_above_the_join_after_instructions_ending_in_a_run(
    encoding: str, data: dict[str, Any], rule: str, schema: dict[str, Any] | None
) -> None:
    """The request's first system message is instructions ending in a generated run: the first system message
    holds its end as a ``Bound`` after its text, and the bound is above the published framing with the
    sections after it (and in a message of their own)."""
    comps = request(dict(data, immutableRules=[rule]), [COOKBOOK_TOOL], schema)
    pieces, result = count("openai", openai_counter(encoding), comps)
    run = trailing_run(rule)
    first = next(
        (
            index
            for index, piece in enumerate(pieces)
            if isinstance(piece, Text) and piece.bucket == "immutableRules"
        ),
        None,
    )
    if run:
        assert first is not None and pieces[first + 2] == Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, run)
    assert result.total >= max(published_framings(comps, encoding).values())


def test_the_instructions_end_is_bounded_only_where_a_section_may_follow() -> None:
    """Without tools or a response format nothing follows the instructions: no allowance, and the count stays
    exact."""
    data = dict(MINIMAL, immutableRules=["Answer briefly!!  "])
    plain = get_template("openai").render(components(data))
    assert not any(isinstance(piece, Bound) for piece in plain)
    _, result = count("openai", openai_counter("o200k_base"), components(data))
    assert result.method == "EXACT"
    joined = get_template("openai").render(request(data, [COOKBOOK_TOOL], None))
    assert joined.count(Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "!!  ")) == 1


# ------------------------------------------------------------------------- an assistant's text beside calls

# harmony's channels (its docs/format.md).
CHANNELS = ("analysis", "commentary", "final")


def cost(pieces: list[Piece], encoding: str) -> int:
    """The bound's count of these pieces: a special 1, a text its tokens, a bound its bytes."""
    reference = openai_reference(encoding)
    total = 0
    for piece in pieces:
        if isinstance(piece, Special):
            total += 1
        elif isinstance(piece, Text):
            total += len(reference.encode(piece.text, disallowed_special=()))
        elif isinstance(piece, Bound):
            total += len(piece.text.encode())
    return total


def assistant_pieces(
    pieces: tuple[Piece, ...], calls: list[dict[str, str]]
) -> tuple[list[Piece], list[list[Piece]]]:
    """The assistant message's pieces: its own (framing, content, channel) and each call's (its ``Bound``,
    the cut after it and its specials)."""
    start = next(
        index
        for index, piece in enumerate(pieces)
        if piece == Special("<|im_start|>")
        and pieces[index + 1] == FixedText(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "assistant")
    )
    end = pieces.index(Special("<|im_end|>"), start)
    own = list(pieces[start : end + 1])
    per_call = []
    for call in calls:
        text = call_bound_text(call["id"], call["name"], call["arguments"])
        index = next(i for i, piece in enumerate(own) if isinstance(piece, Bound) and piece.text == text)
        per_call.append(own[index : index + 2 + len(CALL_SPECIALS)])
        del own[index : index + 2 + len(CALL_SPECIALS)]
    return own, per_call


calls_beside_text = st.lists(
    st.fixed_dictionaries({"name": call_names, "arguments": call_arguments}), min_size=1, max_size=3
).map(lambda calls: [dict(call, id=f"call_{index}") for index, call in enumerate(calls)])


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@settings(max_examples=100, deadline=None)
@given(text=texts, calls=calls_beside_text)
def test_an_assistants_text_beside_its_calls_is_bounded_by_its_own_message(
    encoding: str, text: str, calls: list[dict[str, str]]
) -> None:
    """Each harmony message of an assistant turn with text and calls is bounded by its own pieces: the text's
    message, in any of harmony's channels, by the message's framing, content, ``<|channel|>`` and
    ``TEXT_CHANNEL``; each call's message by its ``Bound`` and specials. Negative control, on every example:
    without the channel's two pieces the text's message is above its pieces."""
    data = dict(
        MINIMAL,
        recentTurns=[
            {"turn": 1, "role": "user", "text": "What's the weather?"},
            {"turn": 2, "role": "assistant", "parts": [{"type": "text", "text": text}], "toolCalls": calls},
        ],
    )
    pieces = get_template("openai").render(components(data))
    own, per_call = assistant_pieces(pieces, calls)
    channel = [Special(CHANNEL_SPECIAL), Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, TEXT_CHANNEL)]
    assert own[-4:] == [*channel, Cut(), Special("<|im_end|>")]
    encoding_ = harmony()
    for name in CHANNELS:
        tokens = encoding_.render(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(name))
        specials, between = framing(tokens)
        assert specials == ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]
        assert "".join(between) == "assistant" + name + text
        assert harmony_count(tokens, encoding) <= cost(own, encoding)
    without = [piece for piece in own if piece not in channel]
    commentary = encoding_.render(
        Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
    )
    assert cost(without, encoding) < harmony_count(commentary, encoding)
    for call, pieces_of_call in zip(calls, per_call, strict=True):
        message = harmony_call(call["name"], call["arguments"], "<|constrain|>json")
        assert harmony_count(encoding_.render(message), encoding) <= cost(pieces_of_call, encoding)


def test_the_channel_bound_is_harmonys_longest_channel() -> None:
    """``TEXT_CHANNEL``'s bytes bound whichever channel harmony puts the text in."""
    assert max(CHANNELS, key=lambda name: len(name.encode())) == TEXT_CHANNEL


def test_calls_without_text_bring_no_channel() -> None:
    """An assistant turn of calls alone has no text message in harmony: no channel allowance."""
    pieces = get_template("openai").render(components(call_request()))
    assert Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, TEXT_CHANNEL) not in pieces
