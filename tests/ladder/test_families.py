"""Golden token ids: our rendering and counting of each local family against the vendor's own code.

The references are the vendors' code, run here as test dependencies: ``tiktoken.get_encoding`` (OpenAI's own
definition of o200k_base and cl100k_base, read from tiktoken's cache folder, so no network) with OpenAI's
published chat framing (the cookbook's ``num_tokens_from_messages``); Meta's ``llama_models.llama3``
Tokenizer and ChatFormat. Ids are compared, not only counts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pydantic
import pytest
import tiktoken
from hypothesis import HealthCheck, given, reject, settings
from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem
from llama_models.datatypes import ToolCall as MetaToolCall
from llama_models.llama3.chat_format import ChatFormat
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from PIL import Image as PILImage
from tiktoken_ext.openai_public import ENCODING_CONSTRUCTORS

from ladder.components import Components, ImagePart, Limits
from ladder.counting import Count, MemoryCountCache, count_stream
from ladder.encoders import TiktokenCounter
from ladder.families import load_counter
from ladder.messages import messages
from ladder.parser import parse_components
from ladder.templates import Bound, Image, Piece, Special, Text, get_template

from .conftest import TOKENIZER_DIR
from .fixtures import FIXTURES, fixture, many_turns, plain, without_images
from .strategies import components_json

OPENAI_FILES = {"o200k_base": "o200k_base.tiktoken", "cl100k_base": "cl100k_base.tiktoken"}
# tiktoken names a cached file by the sha1 of the URL it comes from (tiktoken_ext/openai_public.py).
OPENAI_URLS = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
}
LLAMA3_FILE = TOKENIZER_DIR / "llama3.tokenizer.model"


def components(data: dict[str, Any]) -> Components:
    return parse_components(data, limits=Limits())


def count(family: str, counter: TiktokenCounter, comps: Components) -> tuple[tuple[Piece, ...], Count]:
    template = get_template(family)
    pieces = template.render(comps)
    result = count_stream(
        pieces, counter, MemoryCountCache(), template_revision=template.revision, image_formula="tiles512"
    )
    assert sum(result.per_bucket.values()) == result.total == sum(result.per_object.values())
    return pieces, result


def text_ids(pieces: tuple[Piece, ...], counter: TiktokenCounter) -> list[int]:
    return [token for piece in pieces if isinstance(piece, Text) for token in counter.encode(piece.text)]


def visible(data: dict[str, Any]) -> dict[str, Any]:
    """The fixture without what OpenAI's published rule does not frame: tools, the output schema, tool
    turns and images."""
    data = dict(data)
    data.pop("tools", None)
    data.pop("outputSchema", None)
    data.pop("compactions", None)
    turns = []
    for turn in data.get("recentTurns", []):
        if turn.get("toolCalls") or turn.get("toolResults"):
            continue
        turns.append(turn)
    data["recentTurns"] = turns
    # Images are counted by the revision's image formula, which OpenAI's published rule does not cover.
    return without_images(data)


GOLDEN: dict[str, Any] = {"plain": plain, "many_turns": many_turns} | {
    name: (lambda name=name: fixture(name)) for name in sorted(FIXTURES)
}


# ------------------------------------------------------------------------------------------------- OpenAI


@cache
def openai_reference(name: str) -> tiktoken.Encoding:
    """tiktoken's own encoding, read from a cache folder holding our pinned file under tiktoken's name."""
    folder = Path(tempfile.mkdtemp(prefix="tiktoken-cache-"))
    shutil.copy(
        TOKENIZER_DIR / OPENAI_FILES[name], folder / hashlib.sha1(OPENAI_URLS[name].encode()).hexdigest()
    )
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)
    try:
        # OpenAI's own constructor of the encoding; built here rather than by tiktoken.get_encoding, whose
        # registry other code may share.
        return tiktoken.Encoding(**ENCODING_CONSTRUCTORS[name]())
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
        shutil.rmtree(folder)


def num_tokens_from_messages(entries: list[dict[str, Any]], encoding: tiktoken.Encoding) -> int:
    """OpenAI's published rule (openai-cookbook, "How to count tokens with tiktoken"), verbatim but for
    ``disallowed_special=()``: content that spells a special token is text to the API."""
    tokens_per_message, tokens_per_name = 3, 1
    total = 0
    for message in entries:
        total += tokens_per_message
        for key, value in message.items():
            total += len(encoding.encode(value, disallowed_special=()))
            if key == "name":
                total += tokens_per_name
    return total + 3


def openai_counter(name: str) -> TiktokenCounter:
    counter = load_counter(name, TOKENIZER_DIR / OPENAI_FILES[name])
    assert isinstance(counter, TiktokenCounter)
    return counter


def check_openai_exact(name: str, comps: Components, reference: tiktoken.Encoding) -> None:
    counter = openai_counter(name)
    pieces, result = count("openai", counter, comps)
    assert result.method == "EXACT"
    payload: dict[str, Any] = get_template("openai").payload(comps)
    entries = payload["messages"]
    assert all(isinstance(entry["content"], str) for entry in entries)
    assert result.total == num_tokens_from_messages(entries, reference)
    expected = [
        token
        for entry in entries
        for value in (entry["role"], entry["content"])
        for token in reference.encode(value, disallowed_special=())
    ]
    assert text_ids(pieces, counter) == expected


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
@pytest.mark.parametrize("name", sorted(set(GOLDEN) - {"images"}))
def test_openai_ids_and_counts_equal_tiktoken_and_the_published_framing(encoding: str, name: str) -> None:
    check_openai_exact(encoding, components(visible(GOLDEN[name]())), openai_reference(encoding))


@pytest.mark.parametrize("encoding", sorted(OPENAI_FILES))
def test_openai_vocabulary_equals_tiktoken_on_every_special_spelling(encoding: str) -> None:
    counter = openai_counter(encoding)
    reference = openai_reference(encoding)
    assert counter.encoding._mergeable_ranks == reference._mergeable_ranks
    for text in ["<|endoftext|>", "<|endofprompt|>", "a" * 30_000, " \n\t" * 500, "😀" * 50, "ｈｅｌｌｏ ①"]:
        assert counter.encode(text) == reference.encode(text, disallowed_special=()), text[:20]


@pytest.mark.parametrize("name", ["code", "huge_tools", "near_window", "everything"])
def test_openai_with_tools_is_an_upper_bound_over_every_token_it_sends(name: str) -> None:
    """Tools, the response format, tool calls and results: OpenAI does not publish their framing. The count
    says UPPER_BOUND, and is above the published framing of the messages plus the tokens of every hidden
    JSON text."""
    comps = components(GOLDEN[name]())
    counter = openai_counter("o200k_base")
    pieces, result = count("openai", counter, comps)
    assert result.method == "UPPER_BOUND"
    reference = openai_reference("o200k_base")
    hidden = [piece.text for piece in pieces if isinstance(piece, Bound)]
    assert hidden
    payload: dict[str, Any] = get_template("openai").payload(comps)
    shown = [entry for entry in payload["messages"] if isinstance(entry["content"], str)]
    floor = num_tokens_from_messages(
        [{"role": entry["role"], "content": entry["content"]} for entry in shown], reference
    ) + sum(len(reference.encode(text, disallowed_special=())) for text in hidden)
    assert result.total >= floor


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=components_json(images=False))
def test_openai_generated_conversations(data: dict[str, Any]) -> None:
    reference = openai_reference("o200k_base")
    comps = components(data)
    pieces, result = count("openai", openai_counter("o200k_base"), comps)
    if any(isinstance(piece, Bound) for piece in pieces):
        assert result.method == "UPPER_BOUND"
        check_openai_exact("o200k_base", components(visible(data)), reference)
    else:
        check_openai_exact("o200k_base", comps, reference)


# ------------------------------------------------------------------------------------------------- Llama 3


@cache
def meta_format() -> ChatFormat:
    return ChatFormat(MetaTokenizer(LLAMA3_FILE))


@cache
def png() -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (2, 2)).save(buffer, format="PNG")
    return buffer.getvalue()


def meta_messages(comps: Components) -> list[RawMessage]:
    """Our messages as Meta's RawMessage: content parts in order, tool calls with their parsed arguments."""
    out = []
    for message in messages(comps):
        content: list[RawTextItem | RawMediaItem] = [
            RawMediaItem(data=png())
            if isinstance(segment.part, ImagePart)
            else RawTextItem(text=segment.part.text)
            for segment in message.segments
        ]
        calls = []
        for call in message.calls:
            try:
                parsed = json.loads(call.arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else call.arguments
            try:
                calls.append(MetaToolCall(call_id=call.id, tool_name=call.name, arguments=arguments))
            except pydantic.ValidationError:
                # Meta's ToolCall holds arguments at most one object deep: a generated call nested deeper has
                # no reference framing to compare with (a fixture never is, so there this fails the test).
                reject()
        out.append(RawMessage(role=message.role, content=content, tool_calls=calls))
    return out


def check_llama3(comps: Components) -> None:
    # First: a generated call Meta's ToolCall cannot hold is rejected before ours is asked (it is an upper
    # bound, tested on its own below).
    expected = meta_format().encode_dialog_prompt(meta_messages(comps)).tokens
    counter = load_counter("llama3", LLAMA3_FILE)
    assert isinstance(counter, TiktokenCounter)
    pieces, result = count("llama3", counter, comps)
    assert result.method == "EXACT"
    ours: list[int] = []
    for piece in pieces:
        if isinstance(piece, Special):
            token = counter.special_id(piece.token)
            assert token is not None, piece.token
            # ChatFormat hands the image token on as 128256, the vision model's own id for it.
            ours.append(128256 if piece.token == "<|image|>" else token)
        elif isinstance(piece, Text):
            ours.extend(counter.encode(piece.text))
        assert not isinstance(piece, Image | Bound)
    assert ours == expected
    assert result.total == len(expected)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_llama3_ids_equal_metas_chat_format(name: str) -> None:
    check_llama3(components(GOLDEN[name]()))


def test_llama3_built_in_tool_calls_are_framed_as_meta_frames_them() -> None:
    data = plain()
    data["recentTurns"] = [
        {"turn": 1, "role": "user", "text": "Search and compute."},
        {
            "turn": 2,
            "role": "assistant",
            "text": "",
            "toolCalls": [
                {"id": "c1", "name": "brave_search", "arguments": json.dumps({"query": "liability cap"})},
                {"id": "c2", "name": "lookup", "arguments": "not json"},
            ],
        },
        {"turn": 3, "role": "tool", "toolResults": [{"callId": "c1", "text": "1,000 EUR"}]},
        {"turn": 4, "role": "tool", "toolResults": [{"callId": "c2", "text": "none"}]},
        {
            "turn": 5,
            "role": "assistant",
            "text": "",
            "toolCalls": [{"id": "c3", "name": "code_interpreter", "arguments": json.dumps({"code": "1+1"})}],
        },
        {"turn": 6, "role": "tool", "toolResults": [{"callId": "c3", "text": "2"}]},
    ]
    check_llama3(components(data))


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("code_interpreter", {"code": 5}),
        ("code_interpreter", {"code": None}),
        ("code_interpreter", {"code": ["a=1", "b=2"]}),
        ("code_interpreter", {"code": {"x": 1}}),
        ("code_interpreter", {"code": "x\ud800y"}),
        ("brave_search", {"q": 5}),
        ("brave_search", {"query": "\udfff"}),
        ("wolfram_alpha", "hello"),
        ("lookup", {"filter": {"range": {"from": 1, "to": 9}}}),
        ("lookup", {"rows": [[1, 2], [3]]}),
        ("lookup", {"rows": [{"id": 1}]}),
        ("brave_search", {"query": "cap", "options": {"region": ["eu"]}}),
    ],
)
def test_llama3_built_in_calls_metas_code_does_not_frame_as_text_are_an_upper_bound(
    name: str, arguments: object
) -> None:
    """Not a string of code, no query, a lone surrogate escaped in the arguments, or arguments nested deeper
    than Meta's ``ToolCall`` holds: Meta's code frames no text (or fails, or refuses the call), so the call
    is bounded by its JSON's bytes, never an exact count or an error."""
    data = plain()
    data["recentTurns"] = [
        {"turn": 1, "role": "user", "text": "Go."},
        {
            "turn": 2,
            "role": "assistant",
            "text": "",
            "toolCalls": [{"id": "c1", "name": name, "arguments": json.dumps(arguments)}],
        },
        {"turn": 3, "role": "tool", "toolResults": [{"callId": "c1", "text": "done"}]},
    ]
    comps = components(data)
    counter = load_counter("llama3", LLAMA3_FILE)
    assert isinstance(counter, TiktokenCounter)
    _, result = count("llama3", counter, comps)
    assert result.method == "UPPER_BOUND"
    if name == "lookup" or (isinstance(arguments, dict) and "options" in arguments):
        with pytest.raises(pydantic.ValidationError):
            MetaToolCall(call_id="c1", tool_name=name, arguments=arguments)  # Meta's type refuses them
    if name == "code_interpreter" and isinstance(arguments, dict) and not isinstance(arguments["code"], str):
        # Meta's code frames these, encoding no text (or each item of a list) as the code: the bound is above.
        expected = meta_format().encode_dialog_prompt(meta_messages(comps)).tokens
        assert result.total >= len(expected)


def test_llama3_long_runs_are_cut_where_metas_tokenizer_cuts_them() -> None:
    counter = load_counter("llama3", LLAMA3_FILE)
    assert isinstance(counter, TiktokenCounter)
    meta = meta_format().tokenizer
    for text in ["a" * 60_003, " " * 26_000 + "x", ("word " * 90_000) + "z" * 30_000]:
        assert counter.encode(text) == meta.encode(text, bos=False, eos=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=components_json())
def test_llama3_generated_conversations(data: dict[str, Any]) -> None:
    check_llama3(components(data))
