"""Templates: stream counts add up exactly against the real tokenizers; the payload matches the stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from tokenizers import Tokenizer

from ladder.components import Limits, TextPart
from ladder.counting import ImageFormula, MemoryCountCache, TokenizerCounter, count_stream, image_tokens
from ladder.messages import TemplateError
from ladder.parser import parse_components
from ladder.templates import (
    TEMPLATE_FAMILIES,
    Bound,
    Image,
    Piece,
    Special,
    Text,
    check_boundaries,
    get_template,
    stream_text,
)

from .conftest import DEEPSEEK_FILE, LEGACY_FILE, deepseek_counter, legacy_counter, raw_tokenizer
from .fixtures import FIXTURES, fixture
from .strategies import components_json

FAMILIES = {"deepseek": DEEPSEEK_FILE, "meta": LEGACY_FILE}
ORACLES: dict[str, Tokenizer] = {}


def oracle(family: str) -> Tokenizer:
    if family not in ORACLES:
        ORACLES[family] = raw_tokenizer(FAMILIES[family])
    return ORACLES[family]


def counter(family: str) -> TokenizerCounter:
    return deepseek_counter() if family == "deepseek" else legacy_counter()


def whole_stream_count(family: str, pieces: Sequence[Piece], formula: ImageFormula) -> int:
    """The oracle: the stream encoded at once, special tokens recognised (each stretch between two images on
    its own: an image is no text, and the texts beside it are counted apart), plus the image formula and the
    UTF-8 bytes of each bound (a part the template does not show, never encoded with the rest)."""
    stretches: list[list[Piece]] = [[]]
    for piece in pieces:
        if isinstance(piece, Image):
            stretches.append([])
        elif not isinstance(piece, Bound):
            stretches[-1].append(piece)
    text_tokens = sum(
        len(oracle(family).encode(stream_text(stretch), add_special_tokens=False)) for stretch in stretches
    )
    images = sum(image_tokens(p.width, p.height, formula) for p in pieces if isinstance(p, Image))
    bounds = sum(len(p.text.encode("utf-8")) for p in pieces if isinstance(p, Bound))
    return text_tokens + images + bounds


def test_families_are_registered() -> None:
    # The families framed by the vendors' own code are proven against it in test_families.py.
    assert set(TEMPLATE_FAMILIES) == set(FAMILIES) | {"openai", "llama3", "mistral"}
    with pytest.raises(TemplateError):
        get_template("chatml")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_special_is_one_added_token(family: str) -> None:
    template = get_template(family)
    tokenizer = oracle(family)
    for token in template.specials:
        assert tokenizer.token_to_id(token) is not None, token
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generated_text_cannot_spell_an_added_token(family: str) -> None:
    """The oracle assumption of the property tests: every added token contains "<" or U+FF5C."""
    for token in oracle(family).get_added_tokens_decoder().values():
        assert "<" in token.content or "\uff5c" in token.content, token.content


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_counts_are_exact(family: str, name: str) -> None:
    components = parse_components(fixture(name), limits=Limits())
    template = get_template(family)
    pieces = template.render(components)
    count = count_stream(
        pieces,
        counter(family),
        MemoryCountCache(),
        template_revision=template.revision,
        image_formula="tiles512",
    )
    assert count.total == whole_stream_count(family, pieces, "tiles512")
    assert sum(count.per_bucket.values()) == count.total == sum(count.per_object.values())
    assert count.specials == sum(isinstance(piece, Special) for piece in pieces)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=components_json())
def test_segment_counts_add_up_to_the_whole_stream(data: dict[str, Any]) -> None:
    components = parse_components(data, limits=Limits())
    for family in FAMILIES:
        template = get_template(family)
        pieces = template.render(components)
        check_boundaries(pieces)
        for formula in ("tiles512", "pixels750"):
            count = count_stream(
                pieces,
                counter(family),
                MemoryCountCache(),
                template_revision=template.revision,
                image_formula=formula,
            )
            assert count.total == whole_stream_count(family, pieces, formula)


def test_boundary_rule_is_enforced() -> None:
    with pytest.raises(TemplateError):
        check_boundaries(
            [Special("<SOS>"), Text("question", "question", "a"), Text("question", "question", "b")]
        )
    with pytest.raises(TemplateError):
        check_boundaries([Special("<SOS>"), Text("question", "question", "a"), Image("question", "q", 1, 1)])
    with pytest.raises(TemplateError):
        check_boundaries([Special("<SOS>"), Text("question", "question", "a")])
    check_boundaries([Special("<SOS>"), Text("question", "question", "a"), Special("<EOT>")])


def test_the_kinds_of_the_stream_checked_last_are_reused_only_for_that_very_tuple() -> None:
    good = (Special("<SOS>"), Text("question", "question", "a"), Special("<EOT>"))
    kinds = check_boundaries(good)
    broken = (Special("<SOS>"), Text("question", "question", "a"), Text("question", "question", "b"))
    for _ in range(2):
        with pytest.raises(TemplateError):
            check_boundaries(broken)  # a stream that breaks the rule is never taken for checked
    assert check_boundaries(good) == kinds == check_boundaries(tuple(list(good)))
    image = (Special("<SOS>"), Image("question", "q", 1, 1), Special("<EOT>"))
    assert check_boundaries(image) != kinds
    # A list can change after its check: it is read again every time.
    pieces: list[Piece] = list(good)
    check_boundaries(pieces)
    pieces[-1] = Text("question", "question", "b")
    with pytest.raises(TemplateError):
        check_boundaries(pieces)


def test_content_spelling_a_special_token_is_that_token_as_a_server_reads_it() -> None:
    assert legacy_counter().count_many(["<EOT>"]) == [1]
    assert deepseek_counter().count_many(["<\uff5cend\u2581of\u2581sentence\uff5c>", "a<think>b"]) == [1, 3]


def test_payload_matches_the_stream() -> None:
    components = parse_components(fixture("everything"), limits=Limits())
    template = get_template("deepseek")
    payload: dict[str, Any] = template.payload(components)
    messages = payload["messages"]
    assert isinstance(messages, list)
    # Tool definitions and the schema are request fields, not messages; the stream still carries them.
    assert [tool["function"]["name"] for tool in payload["tools"]] == [tool.name for tool in components.tools]
    assert payload["response_format"]["json_schema"]["strict"] is True
    stream = stream_text(template.render(components))
    assert '"name":"tool_1"' in stream
    assert all("Output JSON schema" not in str(message) for message in messages)
    assert messages[-1]["role"] == "user"
    tool_messages = [message for message in messages if message["role"] == "tool"]
    assert tool_messages and all(message["tool_call_id"].startswith("call-") for message in tool_messages)
    # Every text of the payload appears verbatim in the stream: a text-only message's content is one string.
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            assert content in stream
            continue
        assert content is None or any(part["type"] == "image" for part in content)
        for part in content or []:
            if part["type"] == "text":
                assert part["text"] in stream
            else:
                assert part["ref"].endswith(("#image0", "#image1"))


def test_compactions_render_in_place_of_their_turns() -> None:
    components = parse_components(fixture("near_window"), limits=Limits())
    compaction = components.compactions[0]
    kept = tuple(turn for turn in components.recent_turns if turn.turn not in compaction.replaces_turns)
    applied = replace(components, recent_turns=kept)
    for family in FAMILIES:
        template = get_template(family)
        # Offered compactions (their turns all present) are not rendered.
        assert "[summary of turns" not in stream_text(template.render(components))
        stream = stream_text(template.render(applied))
        assert stream.count("[summary of turns") == 1
        first_kept = applied.recent_turns[0].parts[0]
        assert isinstance(first_kept, TextPart)
        assert stream.index("[summary of turns 1-8]") < stream.index(first_kept.text)
        partly = replace(components, recent_turns=components.recent_turns[1:])
        with pytest.raises(TemplateError):
            template.render(partly)


@pytest.mark.parametrize(
    ("width", "height", "formula", "tokens"),
    [
        (512, 512, "tiles512", 255),
        (513, 512, "tiles512", 425),
        (4000, 3000, "tiles512", 85 + 170 * 2 * 2),  # scaled to 2048 x 1536, then 1024 x 768
        (2048, 4096, "tiles512", 1105),  # OpenAI's own example: 768 x 1536, 6 tiles
        (1920, 1080, "tiles512", 85 + 170 * 3 * 2),  # 1366 x 768 (rounded up)
        (700, 5000, "tiles512", 85 + 170 * 1 * 4),  # 287 x 2048: the short side is under 768 already
        (1, 1, "tiles512", 255),
        (750, 1, "pixels750", 1),
        (751, 1, "pixels750", 2),
        (4000, 3000, "pixels750", 4195),  # ceil(2048 * 1536 / 750)
        (10_000, 3, "pixels750", 3),  # scaled to 2048 x 1 (rounded up): never under-counted
    ],
)
def test_image_formulas(width: int, height: int, formula: str, tokens: int) -> None:
    assert image_tokens(width, height, formula) == tokens  # type: ignore[arg-type]
