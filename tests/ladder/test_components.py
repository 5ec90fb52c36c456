"""The strict components parser: fixtures parse and round-trip; every kind of bad input names its path."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladder.components import (
    ComponentError,
    ImagePart,
    Limits,
    TextPart,
    bucket_digests,
    canonical_digest,
    canonical_json,
    parts_json,
    sha256_digest,
)
from ladder.parser import parse_components
from ladder.wire import components_json

from .fixtures import FIXTURES, fixture

LIMITS = Limits()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_parses_and_round_trips(name: str) -> None:
    components = parse_components(fixture(name), limits=LIMITS)
    again = parse_components(components_json(components), limits=LIMITS)
    assert again == components
    assert bucket_digests(again) == bucket_digests(components)


def _valid() -> dict[str, Any]:
    return {
        "immutableRules": ["rule"],
        "authorizationScope": {"permissions": ["legal"]},
        "outputSafety": ["safe"],
        "question": {"text": "q"},
        "trustedState": [{"id": "s1", "text": "t", "provenance": "db"}],
        "evidence": [
            {"id": "e1", "sourceId": "d1", "text": "x", "score": 0.5, "permissions": ["legal"]},
            {
                "id": "e2",
                "sourceId": "d2",
                "parts": [{"type": "text", "text": "y"}],
                "score": 1,
                "permissions": [],
            },
        ],
        "recentTurns": [
            {"turn": 1, "role": "user", "text": "hi"},
            {
                "turn": 2,
                "role": "assistant",
                "toolCalls": [{"id": "c1", "name": "search", "arguments": "{}"}],
            },
            {"turn": 3, "role": "tool", "toolResults": [{"callId": "c1", "text": "r"}]},
            {"turn": 4, "role": "assistant", "text": "done"},
        ],
        "compactions": [
            {
                "id": "k1",
                "replacesTurns": [1, 2, 3],
                "text": "s",
                "gateId": "g",
                "fidelityScore": 0.9,
                "requestId": "r",
            }
        ],
        "tools": [
            {"name": "search", "description": "d", "parameters": {"type": "object"}, "essential": True}
        ],
        "outputSchema": {"type": "object"},
    }


def test_valid_document_parses() -> None:
    components = parse_components(_valid(), limits=LIMITS)
    assert components.authorization_scope.permissions == frozenset({"legal"})
    assert components.evidence[1].score == 1.0
    assert components.recent_turns[2].tool_results[0].call_id == "c1"


Mutation = Callable[[dict[str, Any]], object]


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> object:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return data

    return mutate


def _delete(path: tuple[Any, ...]) -> Mutation:
    def mutate(data: dict[str, Any]) -> object:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return data

    return mutate


def _append(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> object:
        target: Any = data
        for key in path:
            target = target[key]
        target.append(value)
        return data

    return mutate


def _late_call(data: dict[str, Any]) -> object:
    """A result that answers a call made only in a later turn."""
    late = {"turn": 5, "role": "assistant", "toolCalls": [{"id": "late", "name": "x", "arguments": ""}]}
    data["recentTurns"].append(late)
    data["recentTurns"][2]["toolResults"][0]["callId"] = "late"
    return data


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


CASES: list[tuple[str, Mutation, str | None, str]] = [
    ("not an object", lambda data: [data], "components", "wrong_type"),
    ("unknown top-level field", _set(("foo",), 1), "components.foo", "unknown_field"),
    ("unknown odd field", _set(("a b\ud800",), 1), 'components["a b\\ud800"]', "unknown_field"),
    (
        "unknown evidence field",
        _set(("evidence", 0, "rank"), 1),
        "components.evidence[0].rank",
        "unknown_field",
    ),
    ("missing question", _delete(("question",)), "components.question", "missing_field"),
    ("missing score", _delete(("evidence", 1, "score")), "components.evidence[1].score", "missing_field"),
    (
        "bool is not a number",
        _set(("evidence", 0, "score"), True),
        "components.evidence[0].score",
        "wrong_type",
    ),
    ("string score", _set(("evidence", 0, "score"), "0.5"), "components.evidence[0].score", "wrong_type"),
    (
        "NaN score",
        _set(("evidence", 0, "score"), float("nan")),
        "components.evidence[0].score",
        "out_of_range",
    ),
    ("absurd score", _set(("evidence", 0, "score"), 1e300), "components.evidence[0].score", "out_of_range"),
    ("int where str", _set(("evidence", 0, "sourceId"), 5), "components.evidence[0].sourceId", "wrong_type"),
    (
        "str where bool",
        _set(("evidence", 0, "minimumRetention"), "yes"),
        "components.evidence[0].minimumRetention",
        "wrong_type",
    ),
    ("negative turn", _set(("recentTurns", 0, "turn"), -1), "components.recentTurns[0].turn", "out_of_range"),
    ("bool turn", _set(("recentTurns", 0, "turn"), True), "components.recentTurns[0].turn", "wrong_type"),
    ("float turn", _set(("recentTurns", 0, "turn"), 1.0), "components.recentTurns[0].turn", "wrong_type"),
    ("duplicate turn", _set(("recentTurns", 1, "turn"), 1), "components.recentTurns[1].turn", "duplicate"),
    (
        "decreasing turn",
        _set(("recentTurns", 3, "turn"), 0),
        "components.recentTurns[3].turn",
        "invalid_value",
    ),
    (
        "unknown role",
        _set(("recentTurns", 0, "role"), "system"),
        "components.recentTurns[0].role",
        "invalid_value",
    ),
    ("int text", _set(("question", "text"), 7), "components.question.text", "wrong_type"),
    (
        "text and parts",
        _set(("question", "parts"), [{"type": "text", "text": "a"}]),
        "components.question.parts",
        "invalid_value",
    ),
    ("empty parts", _set(("question",), {"parts": []}), "components.question.parts", "invalid_value"),
    (
        "unknown part type",
        _set(("question",), {"parts": [{"type": "audio"}]}),
        "components.question.parts[0].type",
        "invalid_value",
    ),
    (
        "zero-width image",
        _set(("question",), {"parts": [{"type": "image", "width": 0, "height": 5}]}),
        "components.question.parts[0].width",
        "out_of_range",
    ),
    (
        "huge image",
        _set(("question",), {"parts": [{"type": "image", "width": 5, "height": 10**7}]}),
        "components.question.parts[0].height",
        "out_of_range",
    ),
    (
        "fractional image",
        _set(("question",), {"parts": [{"type": "image", "width": 5.5, "height": 5}]}),
        "components.question.parts[0].width",
        "wrong_type",
    ),
    (
        "text field on an image",
        _set(("question",), {"parts": [{"type": "image", "width": 5, "height": 5, "text": "x"}]}),
        "components.question.parts[0].text",
        "unknown_field",
    ),
    (
        "lone surrogate",
        _set(("question", "text"), "bad \ud800 text"),
        "components.question.text",
        "invalid_string",
    ),
    (
        "NUL character",
        _set(("immutableRules", 0), "a\x00b"),
        "components.immutableRules[0]",
        "invalid_string",
    ),
    (
        "surrogate in schema key",
        _set(("outputSchema",), {"\udfff": 1}),
        r'components.outputSchema["\udfff"]',
        "invalid_string",
    ),
    ("duplicate evidence id", _set(("evidence", 1, "id"), "e1"), "components.evidence[1]", "duplicate"),
    ("empty id", _set(("evidence", 0, "id"), ""), "components.evidence[0].id", "invalid_value"),
    (
        "duplicate permission",
        _set(("evidence", 0, "permissions"), ["a", "a"]),
        "components.evidence[0].permissions[1]",
        "duplicate",
    ),
    (
        "int permission",
        _set(("authorizationScope", "permissions"), [1]),
        "components.authorizationScope.permissions[0]",
        "wrong_type",
    ),
    (
        "scope without permissions",
        _set(("authorizationScope",), {"tenant": "x"}),
        "components.authorizationScope.permissions",
        "missing_field",
    ),
    (
        "orphan tool result",
        _set(("recentTurns", 2, "toolResults", 0, "callId"), "nope"),
        "components.recentTurns[2].toolResults[0].callId",
        "orphan_tool_result",
    ),
    (
        "result before its call",
        lambda data: _late_call(data),
        "components.recentTurns[2].toolResults[0].callId",
        "orphan_tool_result",
    ),
    (
        "duplicate call id",
        _set(
            ("recentTurns", 3),
            {"turn": 4, "role": "assistant", "toolCalls": [{"id": "c1", "name": "x", "arguments": "{}"}]},
        ),
        "components.recentTurns[3].toolCalls[0].id",
        "duplicate",
    ),
    (
        "tool call on a user turn",
        _set(("recentTurns", 0, "toolCalls"), [{"id": "u", "name": "x", "arguments": ""}]),
        "components.recentTurns[0].toolCalls",
        "invalid_value",
    ),
    (
        "text on a tool turn",
        _set(("recentTurns", 2, "text"), "x"),
        "components.recentTurns[2].text",
        "invalid_value",
    ),
    (
        "empty turn",
        _set(("recentTurns", 3), {"turn": 4, "role": "assistant"}),
        "components.recentTurns[3]",
        "invalid_value",
    ),
    (
        "fidelity above 1",
        _set(("compactions", 0, "fidelityScore"), 1.5),
        "components.compactions[0].fidelityScore",
        "out_of_range",
    ),
    (
        "compaction of an unknown turn",
        _set(("compactions", 0, "replacesTurns"), [1, 99]),
        "components.compactions[0].replacesTurns[1]",
        "unknown_reference",
    ),
    (
        "non-contiguous compaction",
        _set(("compactions", 0, "replacesTurns"), [1, 3]),
        "components.compactions[0].replacesTurns",
        "invalid_value",
    ),
    (
        "unsorted compaction",
        _set(("compactions", 0, "replacesTurns"), [2, 1]),
        "components.compactions[0].replacesTurns[1]",
        "invalid_value",
    ),
    (
        "duplicate tool",
        _append(("tools",), {"name": "search", "parameters": {}}),
        "components.tools[1]",
        "duplicate",
    ),
    ("bad tool name", _set(("tools", 0, "name"), "web search"), "components.tools[0].name", "invalid_value"),
    (
        "schema not an object",
        _set(("tools", 0, "parameters"), []),
        "components.tools[0].parameters",
        "wrong_type",
    ),
    ("output schema list", _set(("outputSchema",), [1]), "components.outputSchema", "wrong_type"),
    ("schema too deep", _set(("outputSchema",), _deep(80)), None, "too_long"),
    (
        "infinite in schema",
        _set(("outputSchema",), {"max": float("inf")}),
        "components.outputSchema.max",
        "out_of_range",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "path", "code"), CASES, ids=[case[0] for case in CASES])
def test_rejects_bad_input_with_its_path(case: str, mutate: Mutation, path: str | None, code: str) -> None:
    data = mutate(copy.deepcopy(_valid()))
    with pytest.raises(ComponentError) as caught:
        parse_components(data, limits=LIMITS)
    if path is not None:
        assert caught.value.path == path
    assert caught.value.code == code
    caught.value.path.encode("ascii")  # always safe to echo in a problem+json body


LIMIT_CASES: list[tuple[Limits, Mutation, str | None, str]] = [
    (Limits(max_evidence=1), lambda data: data, "components.evidence", "too_many"),
    (Limits(max_turns=3), lambda data: data, "components.recentTurns", "too_many"),
    (Limits(max_permissions=0), lambda data: data, "components.authorizationScope.permissions", "too_many"),
    (
        Limits(max_string_chars=5),
        _set(("question", "text"), "sixsix"),
        "components.question.text",
        "too_long",
    ),
    (Limits(max_total_chars=30), lambda data: data, None, "too_long"),
    (
        Limits(max_parts=1),
        _set(("question",), {"parts": [{"type": "text", "text": "a"}] * 2}),
        "components.question.parts",
        "too_many",
    ),
    (
        Limits(max_image_side=100),
        _set(("question",), {"parts": [{"type": "image", "width": 101, "height": 1}]}),
        "components.question.parts[0].width",
        "out_of_range",
    ),
]


@pytest.mark.parametrize(("limits", "mutate", "path", "code"), LIMIT_CASES)
def test_limits(limits: Limits, mutate: Mutation, path: str | None, code: str) -> None:
    with pytest.raises(ComponentError) as caught:
        parse_components(mutate(_valid()), limits=limits)
    if path is not None:
        assert caught.value.path == path
    assert caught.value.code == code


PARTS = st.lists(
    st.one_of(
        st.builds(TextPart, st.text()),
        st.builds(ImagePart, st.integers(1, 32_768), st.integers(1, 32_768)),
    ),
    max_size=4,
)


@given(PARTS)
def test_the_digest_of_content_parts_is_the_canonical_json_digest(parts: list[Any]) -> None:
    """orjson writes content parts byte for byte as canonical_json does (any text, control characters,
    U+2028, astral planes), so stored bucket digests keep their values; a lone surrogate is refused alike."""
    parts_tuple = tuple(parts)
    try:
        expected = sha256_digest(canonical_json(parts_json(parts_tuple)))
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            canonical_digest(parts_json(parts_tuple))
        return
    assert canonical_digest(parts_json(parts_tuple)) == expected


@given(PARTS, PARTS, st.booleans())
def test_content_parts_are_equal_exactly_when_their_json_is(a: list[Any], b: list[Any], same: bool) -> None:
    """DEDUP_EVIDENCE compares items' parts as values: the same copies as comparing their JSON."""
    first, second = tuple(a), tuple(a) if same else tuple(b)
    as_json = _standard_library(parts_json(first)) == _standard_library(parts_json(second))
    assert (first == second) is as_json
    if as_json:
        assert hash(first) == hash(second)


def _standard_library(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


JSON_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.sampled_from([1e-7, 1e16, 1e15, 0.0001, -0.0, 123.456, 5e-324])
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=6), children, max_size=4)
        | st.dictionaries(st.integers(-3, 3), children, max_size=2)
    ),
    max_leaves=25,
)


@given(JSON_LIKE)
def test_canonical_json_is_the_standard_librarys_output_whichever_writer_runs(value: Any) -> None:
    """orjson writes it when it provably gives the same bytes; otherwise the standard library does. Either
    way the result (or the error: NaN, infinity) is the standard library's, so stored digests keep their
    values."""
    try:
        expected = _standard_library(value)
    except ValueError as error:
        with pytest.raises(type(error)):
            canonical_json(value)
        return
    assert canonical_json(value) == expected
    try:
        digest = sha256_digest(expected)
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            canonical_digest(value)
        return
    assert canonical_digest(value) == digest
