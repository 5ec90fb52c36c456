"""Hypothesis strategies: random valid components JSON, from text that cannot spell a special token."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .fixtures import CJK, CODE, EMOJI, KANA, NFKC, WORDS

# Every added token of both tokenizers contains "<" or U+FF5C; without them no content can spell one.
SAFE_CHARACTERS = st.characters(codec="utf-8", exclude_characters="\x00<\uff5c")
# Fragments chosen to stress boundaries: whitespace runs, digits, combining marks (U+0338 composes with ">"
# under NFKC), CJK, emoji sequences, NFKC-expanding characters, code.
FRAGMENTS = [
    *WORDS,
    *NFKC,
    *EMOJI,
    *CODE,
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "123",
    "4567",
    "\u0301",
    "\u0338",
    ">",
    "=",
    "|",
    "'s",
    "ﬁ",
    CJK[:12],
    CJK[40:47],
    KANA[:9],
]

texts = st.one_of(
    st.text(SAFE_CHARACTERS, max_size=24),
    st.lists(st.sampled_from(FRAGMENTS), max_size=10).map("".join),
)


@st.composite
def parts(draw: st.DrawFn, *, min_size: int = 1, images: bool = True) -> list[dict[str, Any]]:
    text_part = texts.map(lambda text: {"type": "text", "text": text})
    image_part = st.builds(
        lambda width, height: {"type": "image", "width": width, "height": height},
        st.integers(1, 5000),
        st.integers(1, 5000),
    )
    part = st.one_of(text_part, text_part, text_part, image_part) if images else text_part
    return draw(st.lists(part, min_size=min_size, max_size=3))


@st.composite
def components_json(draw: st.DrawFn, *, images: bool = True, request_id: str = "req-1") -> dict[str, Any]:
    """A valid components object with every bucket, duplicates, permissions, tool calls and compactions."""
    permissions = ["a", "b", "c"]
    rule = st.one_of(texts, parts(images=images))
    data: dict[str, Any] = {
        "immutableRules": draw(st.lists(rule, max_size=2)),
        "authorizationScope": {
            "permissions": draw(st.lists(st.sampled_from(permissions), unique=True)),
            "note": draw(texts),
        },
        "outputSafety": draw(st.lists(texts, max_size=2)),
        "question": {"parts": draw(parts(images=images))},
        "trustedState": [
            {"id": f"state-{index}", "text": text, "provenance": "db"}
            for index, text in enumerate(draw(st.lists(texts, max_size=2)))
        ],
    }

    evidence: list[dict[str, Any]] = []
    for index in range(draw(st.integers(0, 6))):
        item = {
            "id": f"ev-{index}",
            "sourceId": f"doc-{index}",
            "parts": draw(parts(images=images)),
            "score": draw(st.one_of(st.sampled_from([0.1, 0.5, 0.9]), st.floats(0, 1))),
            "permissions": draw(st.lists(st.sampled_from([*permissions, "z"]), unique=True, max_size=2)),
            "minimumRetention": draw(st.booleans()),
        }
        duplicate = draw(st.booleans())
        if evidence and duplicate:
            # A copy of an earlier item: same content, and often the same permissions too.
            source: dict[str, Any] = draw(st.sampled_from(evidence))
            item["parts"] = source["parts"]
            if draw(st.booleans()):
                item["permissions"] = source["permissions"]
        evidence.append(item)
    data["evidence"] = evidence

    turns: list[dict[str, Any]] = []
    number = draw(st.integers(0, 3))
    call_index = 0
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            calls = []
            for _ in range(draw(st.integers(1, 2))):
                calls.append({"id": f"call-{call_index}", "name": "search", "arguments": draw(texts)})
                call_index += 1
            turns.append(
                {"turn": number, "role": "assistant", "parts": draw(parts(min_size=0)), "toolCalls": calls}
            )
            number += draw(st.integers(1, 2))
            results = [{"callId": call["id"], "parts": draw(parts(min_size=0))} for call in calls]
            if draw(st.booleans()):
                turns.append({"turn": number, "role": "tool", "toolResults": results})
            else:
                turns.append({"turn": number, "role": "user", "toolResults": results, "text": draw(texts)})
        else:
            role = draw(st.sampled_from(["user", "assistant"]))
            turns.append({"turn": number, "role": role, "parts": draw(parts(images=images))})
        number += draw(st.integers(1, 2))
    data["recentTurns"] = turns

    compactions: list[dict[str, Any]] = []
    if turns:
        for index in range(draw(st.integers(0, 3))):
            start = draw(st.integers(0, len(turns) - 1))
            end = draw(st.integers(start, len(turns) - 1))
            compactions.append(
                {
                    "id": f"cmp-{index}",
                    "replacesTurns": [turn["turn"] for turn in turns[start : end + 1]],
                    "text": draw(st.text(SAFE_CHARACTERS, max_size=6)),
                    "gateId": draw(st.sampled_from(["gate-a", "gate-a", "gate-b"])),
                    "fidelityScore": draw(st.sampled_from([0.5, 0.95, 1.0])),
                    "requestId": draw(st.sampled_from([request_id, request_id, "req-other"])),
                }
            )
    data["compactions"] = compactions

    data["tools"] = [
        {
            "name": name,
            "description": draw(texts),
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "description": draw(texts)}},
            },
            "essential": draw(st.booleans()),
        }
        for name in draw(
            st.lists(st.sampled_from(["search", "fetch", "calc", "mail"]), unique=True, max_size=3)
        )
    ]
    if draw(st.booleans()):
        data["outputSchema"] = {"type": "object", "description": draw(texts)}
    return data


# ----------------------------------------------------------------------------------------- tool schemas

# Texts of many short lines: the shape where a rendering that comments each line costs more than JSON.
LINES = st.lists(
    st.sampled_from(["1", "42", "a", " x", "é", "中", '"', "//", " ", "\n", "\n", "\n\n", "\r\n", "\r"]),
    max_size=40,
).map("".join)
# And one short line many times over: long enough for the per-line cost to outgrow any fixed allowance.
REPEATED_LINES = st.builds(
    lambda line, times: line * times, st.sampled_from(["1\n", "\n7", "a\n", "\n"]), st.integers(0, 200)
)
schema_texts = st.one_of(texts, LINES, REPEATED_LINES)
keys = st.one_of(
    st.sampled_from(["q", "city", "unit", "n", "x_y", "long_property_name"]),
    st.text(SAFE_CHARACTERS, max_size=6),
)
defaults = st.one_of(
    schema_texts,
    st.integers(-(2**63), 2**63),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(0, 9), max_size=3),
)


def _annotated(schema: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """``schema`` with any of the annotations the TypeScript rendering writes as comments."""
    extras = st.fixed_dictionaries(
        {},
        optional={
            "description": schema_texts,
            "title": schema_texts,
            "examples": st.lists(schema_texts, max_size=6),
            "default": defaults,
            "nullable": st.booleans(),
        },
    )
    return st.builds(lambda base, more: {**base, **more}, schema, extras)


leaf_schemas = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda values: {"type": "string", "enum": values}, st.lists(schema_texts, max_size=8)),
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {}]),
    st.just({"type": ["string", "integer", "null"]}),
)


def _object_schema(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        properties = draw(st.dictionaries(keys, children, max_size=5))
        required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
        return {"type": "object", "properties": properties, "required": required}

    return build()


json_schemas = st.recursive(
    _annotated(leaf_schemas),
    lambda children: _annotated(
        st.one_of(
            _object_schema(children),
            st.builds(lambda items: {"type": "array", "items": items}, children),
            st.just({"type": "array"}),
            st.builds(lambda variants: {"oneOf": variants}, st.lists(children, max_size=3)),
        )
    ),
    max_leaves=12,
)
tool_definitions = st.builds(
    lambda name, description, parameters: {
        "name": name,
        "description": description,
        "parameters": parameters,
    },
    st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    schema_texts,
    st.one_of(_object_schema(json_schemas), json_schemas),
)
