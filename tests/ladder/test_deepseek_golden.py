"""Golden token ids: DeepSeek-V3 as our template renders it against DeepSeek's published chat template.

The reference renders the very payload we send with the verbatim template
(``simulation/deepseek_chat_template.py``) as Hugging Face transformers' ``apply_chat_template`` does (an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, ``bos_token``,
``add_generation_prompt=True``), then encodes the text with the ``tokenizers`` library and the pinned
``deepseek_v3.json``, special tokens recognised, as a server does. Our ids are the stream's: each special's
id, each text piece's encoding. What the template does not show (tool definitions, the output schema, the
calls of a turn that also has text) is a ``Bound`` of ours and nothing of the reference's: such a count is
``UPPER_BOUND`` and exceeds the reference by the bound's bytes.

The cuts between touching texts rest on ``ladder.seams``, checked here against the tokenizer's own
pre-tokenizer: exhaustively on pairs of characters in context, and by a Hypothesis property.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ladder.components import Components, Limits
from ladder.counting import MemoryCountCache, TokenizerCounter, count_stream, image_tokens
from ladder.parser import parse_components
from ladder.seams import splits_between
from ladder.templates import (
    _ADDED_TOKEN_LIKE,
    Bound,
    Cut,
    DeepSeekTemplate,
    Image,
    Piece,
    Special,
    Text,
    _split_run,
    get_template,
)
from simulation.deepseek_chat_template import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_SHA256,
    deepseek_v3_counter,
    published_template,
)

from .conftest import DEEPSEEK_FILE, deepseek_counter
from .fixtures import CJK, KANA, Gen, fixture, many_turns, plain, tool_history, without_images
from .strategies import SAFE_CHARACTERS, components_json, texts

TEMPLATE = get_template("deepseek")


# ----------------------------------------------------------------------------------------------- reference


@cache
def server_tokenizer() -> Tokenizer:
    """The pinned tokenizer as a server loads it: special-token spellings in the text are special tokens."""
    return Tokenizer.from_file(str(DEEPSEEK_FILE))


def reference_text(payload: dict[str, Any]) -> str:
    return published_template().render(
        messages=payload["messages"],
        tools=payload.get("tools"),
        add_generation_prompt=True,
        bos_token=DeepSeekTemplate.BOS,
        eos_token=DeepSeekTemplate.EOS,
    )


def reference_ids(payload: dict[str, Any]) -> list[int]:
    return list(server_tokenizer().encode(reference_text(payload), add_special_tokens=False).ids)


# -------------------------------------------------------------------------------------------------- ours


def our_ids(pieces: tuple[Piece, ...], counter: TokenizerCounter) -> list[int]:
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, Special):
            token = counter.special_id(piece.token)
            assert token is not None, piece.token
            ids.append(token)
        elif isinstance(piece, Text):
            ids.extend(counter.encode(piece.text))
        assert not isinstance(piece, Image)
    return ids


def check(comps: Components) -> tuple[tuple[Piece, ...], int]:
    """Compare our ids and count with the reference; return the stream and the bound's bytes."""
    counter = deepseek_counter()
    pieces = TEMPLATE.render(comps)
    count = count_stream(
        pieces, counter, MemoryCountCache(), template_revision=TEMPLATE.revision, image_formula="tiles512"
    )
    assert sum(count.per_bucket.values()) == count.total == sum(count.per_object.values())
    payload: dict[str, Any] = TEMPLATE.payload(comps)
    for entry in payload["messages"]:
        assert entry["content"] is None or isinstance(entry["content"], str), entry
    expected = reference_ids(payload)
    assert our_ids(pieces, counter) == expected
    bound = sum(len(piece.text.encode("utf-8")) for piece in pieces if isinstance(piece, Bound))
    hidden = any(isinstance(piece, Bound) for piece in pieces)
    assert count.method == ("UPPER_BOUND" if hidden else "EXACT")
    assert count.total == len(expected) + bound
    return pieces, bound


def components(data: dict[str, Any]) -> Components:
    return parse_components(data, limits=Limits())


# ---------------------------------------------------------------------------------------------- fixtures


def system_messages() -> dict[str, Any]:
    """Many system messages whose seams stress the pre-tokenizer: each ends and starts differently."""
    data = plain()
    data["immutableRules"] = [
        "Rule one ends with a word",
        "Rule two ends with a dot.",
        "",
        "  starts with spaces and ends with spaces  ",
        "\nstarts with a line break and ends with one\n",
        "ends with digits 2024",
        [{"type": "text", "text": "two parts: "}, {"type": "text", "text": "joined as one."}],
        "漢字で終わる規則" + CJK[:5],
        "ends with a tab\t",
        "」ends with a closing bracket」",
        "ends with a mark e\u0301",
    ]
    data["outputSafety"] = ["- a bullet", "…and an ellipsis…"]
    data["trustedState"] = [{"id": "s1", "text": KANA[:20], "provenance": "db"}]
    return data


def compacted() -> dict[str, Any]:
    """A compaction on offer for turns 11-20 of the many turns (``test_an_applied_compaction_is_hoisted``)."""
    data = many_turns()
    data["compactions"] = [
        {
            "id": "cmp-1",
            "replacesTurns": list(range(11, 21)),
            "text": "Earlier: the user asked about clauses 1-4.",
            "gateId": "gate-a",
            "fidelityScore": 0.95,
            "requestId": "req-1",
        }
    ]
    return data


def calls(count: int, *, text: str = "") -> dict[str, Any]:
    """A user asks, an assistant calls ``count`` tools (no text), each result comes back, it answers."""
    data = plain()
    ids = [f"call-{index}" for index in range(count)]
    data["recentTurns"] = [
        {"turn": 1, "role": "user", "text": "Look these up."},
        {
            "turn": 2,
            "role": "assistant",
            "text": text,
            "toolCalls": [
                {"id": call, "name": f"lookup_{call[-1]}", "arguments": json.dumps({"q": call})}
                for call in ids
            ],
        },
        {
            "turn": 3,
            "role": "tool",
            "toolResults": [{"callId": call, "text": f"result of {call}"} for call in ids],
        },
        {"turn": 4, "role": "assistant", "text": "Here is what I found."},
    ]
    return data


def results_in_two_groups() -> dict[str, Any]:
    """Two exchanges: the second group of results opens with a line break, after a user's text and later
    calls that open with one."""
    data = calls(2)
    data["recentTurns"] += [
        {"turn": 5, "role": "user", "text": "And the next two?"},
        {
            "turn": 6,
            "role": "assistant",
            "toolCalls": [
                {"id": "call-a", "name": "lookup", "arguments": "{}"},
                {"id": "call-b", "name": "lookup", "arguments": '{"q": "b"}'},
            ],
        },
        {"turn": 7, "role": "tool", "toolResults": [{"callId": "call-a", "text": "a."}]},
        {"turn": 8, "role": "tool", "toolResults": [{"callId": "call-b", "text": "b"}]},
        {"turn": 9, "role": "assistant", "text": "Both done."},
    ]
    return data


def results_after_user() -> dict[str, Any]:
    """A result that a user's turn carries after the user's own text, answering an earlier call: it opens
    with a line break right after that text, and the question follows it unclosed."""
    data = calls(2)
    turns = data["recentTurns"]
    turns[2]["toolResults"] = turns[2]["toolResults"][:1]
    turns += [
        {"turn": 5, "role": "user", "text": "Here is another result:"},
        {"turn": 6, "role": "user", "toolResults": [{"callId": "call-1", "text": "late result"}]},
    ]
    return data


def code() -> dict[str, Any]:
    data = without_images(fixture("code"))
    data.pop("tools")
    gen = Gen(11)
    data["recentTurns"] = [
        {**turn, "text": ""} if turn.get("toolCalls") else turn for turn in tool_history(gen, 3, size=20)
    ]
    return data


def near_window() -> dict[str, Any]:
    data = without_images(fixture("near_window"))
    data.pop("tools")
    data["recentTurns"] = [
        {**turn, "text": ""} if turn.get("toolCalls") else turn for turn in data["recentTurns"]
    ]
    return data


EXACT_FIXTURES: dict[str, Any] = {
    "plain": plain,
    "cjk": lambda: fixture("cjk"),
    "emoji_nfkc": lambda: fixture("emoji_nfkc"),
    "duplicates": lambda: fixture("duplicates"),
    "code": code,
    "many_turns": many_turns,
    "near_window": near_window,
    "system_messages": system_messages,
    "one_call": lambda: calls(1),
    "two_calls": lambda: calls(2),
    "three_calls": lambda: calls(3),
    "results_in_two_groups": results_in_two_groups,
    "results_after_user": results_after_user,
}
BOUND_FIXTURES: dict[str, Any] = {
    "code_with_tools": lambda: without_images(fixture("code")),
    "huge_tools": lambda: fixture("huge_tools"),
    "near_window_with_tools": lambda: without_images(fixture("near_window")),
    "everything": lambda: without_images(fixture("everything")),
    "calls_with_text": lambda: calls(2, text="Let me check."),
}


def test_the_fixture_is_the_published_template() -> None:
    assert hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest() == CHAT_TEMPLATE_SHA256
    assert "is_first_sp=true" in CHAT_TEMPLATE and "'\n<｜tool▁output▁begin｜>'" in CHAT_TEMPLATE


@pytest.mark.parametrize("name", sorted(EXACT_FIXTURES))
def test_ids_equal_the_published_template(name: str) -> None:
    pieces, bound = check(components(EXACT_FIXTURES[name]()))
    assert bound == 0
    assert all(not isinstance(piece, Bound) for piece in pieces)


@pytest.mark.parametrize("name", sorted(EXACT_FIXTURES))
def test_the_demo_providers_prompt_count_is_our_exact_count(name: str) -> None:
    """The provider simulator of ``./platform run`` reports a DeepSeek-V3 call's prompt tokens as DeepSeek
    does: for every payload we count EXACT, its count is ours."""
    comps = components(EXACT_FIXTURES[name]())
    count = count_stream(
        TEMPLATE.render(comps),
        deepseek_counter(),
        MemoryCountCache(),
        template_revision=TEMPLATE.revision,
        image_formula="tiles512",
    )
    payload: dict[str, Any] = TEMPLATE.payload(comps)
    assert deepseek_v3_counter(DEEPSEEK_FILE)(payload["messages"]) == count.total


@pytest.mark.parametrize("name", sorted(BOUND_FIXTURES))
def test_what_the_template_does_not_show_is_an_upper_bound(name: str) -> None:
    _, bound = check(components(BOUND_FIXTURES[name]()))
    assert bound > 0


def test_the_fixtures_cover_the_templates_quirks() -> None:
    """Each quirk of the published template that the fixtures are meant to reach is in its rendering."""
    tokens = DeepSeekTemplate

    def rendered(data: dict[str, Any]) -> str:
        return reference_text(TEMPLATE.payload(components(data)))

    one, two, three = rendered(calls(1)), rendered(calls(2)), rendered(calls(3))
    # A lone first call is never closed; each later one closes the calls and the sentence.
    assert tokens.CALLS_END not in one
    assert two.count(tokens.CALLS_END) == 1 and three.count(tokens.CALLS_END) == 2
    assert three.count("\n" + tokens.CALL_BEGIN) == 2
    # Results in a row are joined by a line break; the assistant's answer closes them without its token.
    assert three.count(tokens.OUTPUT_END + "\n" + tokens.OUTPUT_BEGIN) == 2
    assert tokens.OUTPUTS_END + "Here is what I found." + tokens.EOS in three
    groups = rendered(results_in_two_groups())
    assert groups.count(tokens.OUTPUTS_BEGIN) == 1
    assert "And the next two?\n" + tokens.CALL_BEGIN in groups
    late = rendered(results_after_user())
    assert "Here is another result:\n" + tokens.OUTPUT_BEGIN in late
    assert "late result" + tokens.OUTPUT_END + tokens.USER in late
    # Every system message is hoisted after the beginning of sentence, joined by two line breaks.
    system = rendered(system_messages())
    head = system[len(tokens.BOS) : system.index(tokens.USER)]
    assert "Rule one ends with a word\n\nRule two ends with a dot.\n\n\n\n  starts" in head
    assert "two parts: joined as one." in head
    # The calls of a turn that also has text are not rendered at all.
    assert tokens.CALL_BEGIN not in rendered(calls(2, text="Let me check."))


def test_an_applied_compaction_is_hoisted() -> None:
    offered = components(compacted())
    applied = replace(
        offered, recent_turns=tuple(turn for turn in offered.recent_turns if not 11 <= turn.turn <= 20)
    )
    check(applied)
    text = reference_text(TEMPLATE.payload(applied))
    assert text.index("[summary of turns 11-20]") < text.index(DeepSeekTemplate.USER)


def test_the_payload_sends_text_as_one_string_and_null_beside_calls_alone() -> None:
    payload: dict[str, Any] = TEMPLATE.payload(components(calls(2)))
    entries = payload["messages"]
    assert [entry["role"] for entry in entries] == [
        "system",
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert entries[4]["content"] is None and len(entries[4]["tool_calls"]) == 2
    assert entries[3]["content"] == "Look these up."
    with_text: dict[str, Any] = TEMPLATE.payload(components(calls(2, text="Let me check.")))
    assert with_text["messages"][4]["content"] == "Let me check."


def test_touching_system_texts_keep_their_objects() -> None:
    """Around a seam the pre-tokenizer may merge, only the few characters near it share a piece."""
    pieces = TEMPLATE.render(components(system_messages()))
    texts = [piece for piece in pieces if isinstance(piece, Text)]
    assert any(piece.text == "Rule one ends with a word" for piece in texts)
    assert any(piece.text.startswith("Rule two ends with a dot") for piece in texts)
    # Rule 1's dot, the empty rule 2 between two separators, and rule 3's leading spaces and first word
    # may merge: one piece, the object with most characters in it.
    seam = next(piece for piece in texts if piece.text.startswith(".\n\n"))
    assert (seam.text, seam.object_id) == (".\n\n\n\n  starts", "immutableRules:3")
    counted = count_stream(
        pieces,
        deepseek_counter(),
        MemoryCountCache(),
        template_revision=TEMPLATE.revision,
        image_formula="tiles512",
    )
    assert counted.per_object["immutableRules:0"] == len(
        deepseek_counter().encode("Rule one ends with a word")
    )
    assert counted.per_bucket["evidence"] > 0 and counted.per_bucket["trustedState"] > 0


def test_images_are_counted_by_the_formula_beside_their_texts() -> None:
    pieces = TEMPLATE.render(components(fixture("images")))
    assert sum(isinstance(piece, Image) for piece in pieces) == 3
    for left, right in itertools.pairwise(pieces):
        if isinstance(left, Image) or isinstance(right, Image):
            assert isinstance(left, Special | Cut) or isinstance(right, Special | Cut)


@pytest.mark.parametrize(("text", "method"), [("", "UPPER_BOUND"), ("x", "EXACT")])
def test_texts_beside_an_image_are_exact_only_across_a_seam_that_must_split(text: str, method: str) -> None:
    """The template renders no image: whether the texts on either side of one reach the model touching (it
    left out) or apart is not published, so the count is exact only where both readings agree. Here the
    image ends the second rule: after "\n\n" + "x" the "\n\n" that follows must split, after "\n\n"
    alone it may merge (CI's find: 272 counted EXACT, 271 in the touching reading)."""
    parts = [{"type": "text", "text": text}] if text else []
    data = {
        "immutableRules": ["", [*parts, {"type": "image", "width": 1, "height": 1}]],
        "authorizationScope": {"permissions": [], "note": ""},
        "question": {"parts": [{"type": "text", "text": ""}]},
    }
    pieces = TEMPLATE.render(components(data))
    count = count_stream(
        pieces,
        deepseek_counter(),
        MemoryCountCache(),
        template_revision=TEMPLATE.revision,
        image_formula="tiles512",
    )

    def tokens(stretch: str) -> int:
        return len(server_tokenizer().encode(stretch, add_special_tokens=False))

    ds = DeepSeekTemplate
    before = ds.BOS + "\n\n" + text
    after = '\n\nAuthorization scope: {"note":"","permissions":[]}' + ds.USER + ds.ASSISTANT
    image = image_tokens(1, 1, "tiles512")
    touching, apart = tokens(before + after) + image, tokens(before) + image + tokens(after)
    assert count.method == method
    if method == "EXACT":
        assert count.total == touching == apart
    else:
        assert (touching, apart) == (271, 272) and count.total >= apart


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=components_json(images=False))
def test_generated_conversations(data: dict[str, Any]) -> None:
    comps = components(data)
    payload: dict[str, Any] = TEMPLATE.payload(comps)
    if any(isinstance(message.get("content"), list) for message in payload["messages"]):
        reject()  # a tool turn's generated parts may still hold an image, which the template cannot render
    check(comps)


# ------------------------------------------------------------------------------------------ added tokens

# Content that spells an added token: special ones (the beginning and end of a sentence), others the template
# uses (a role, a call's separator), others it does not (reasoning, DSML), one inside words.
SPELLED = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜tool▁sep｜>",
    "<think>x</think>",
    "<|EOT|>",
    "｜DSML｜",
    "a<｜Assistant｜>b",
]


def count_and_reference(data: dict[str, Any]) -> tuple[tuple[Piece, ...], Any, list[int]]:
    comps = components(data)
    pieces = TEMPLATE.render(comps)
    count = count_stream(
        pieces, deepseek_counter(), MemoryCountCache(), template_revision=TEMPLATE.revision,
        image_formula="tiles512",
    )  # fmt: skip
    return pieces, count, reference_ids(TEMPLATE.payload(comps))


def test_every_added_token_is_found_by_the_run_check() -> None:
    """A run of touching texts in which ``_ADDED_TOKEN_LIKE`` finds nothing holds none of the file's added
    tokens, special or not."""
    tokens = [token.content for token in server_tokenizer().get_added_tokens_decoder().values()]
    assert len(tokens) > 1000
    assert [token for token in tokens if not _ADDED_TOKEN_LIKE.fullmatch(token)] == []


@pytest.mark.parametrize("spelled", SPELLED)
def test_a_text_spelling_an_added_token_counts_it_as_the_server_does(spelled: str) -> None:
    """Between the template's specials (the question, the turns) such a text is exact: the tokenizer reads
    the spelling as the token, as the server reading the rendered prompt does."""
    data = plain()
    data["question"] = {"text": f"Why {spelled} here?"}
    data["recentTurns"] = [
        {"turn": 1, "role": "user", "text": spelled},
        {"turn": 2, "role": "assistant", "text": f"{spelled} again"},
    ]
    _, bound = check(components(data))
    assert bound == 0


@pytest.mark.parametrize(
    "rules", [[f"never say {s}"] for s in SPELLED] + [["it ends <｜Us", "er｜> it starts"]]
)
def test_system_texts_holding_an_added_token_are_an_upper_bound(rules: list[str]) -> None:
    """The system messages' texts touch, and the tokenizer matches an added token before it pre-tokenises:
    a seam's cut could fall inside one (``<｜Us`` + ``er｜>``), so the run is bounded by its bytes."""
    data = system_messages()
    data["immutableRules"] = [*data["immutableRules"], *rules]
    pieces, count, expected = count_and_reference(data)
    assert count.method == "UPPER_BOUND"
    assert any(isinstance(piece, Bound) for piece in pieces)
    assert count.total >= len(expected)


spelling_texts = st.lists(
    st.one_of(texts, st.sampled_from([*SPELLED, "<", "｜", ">", "<｜"])), max_size=6
).map("".join)


@settings(max_examples=80, deadline=None)
@given(rules=st.lists(spelling_texts, min_size=1, max_size=4), question=spelling_texts, turn=spelling_texts)
def test_generated_texts_spelling_added_tokens(rules: list[str], question: str, turn: str) -> None:
    """Exact means the server's ids; otherwise the count is at least what the server counts."""
    data = plain()
    data["immutableRules"] = rules
    data["question"] = {"text": question or "?"}
    data["recentTurns"] = [{"turn": 1, "role": "user", "text": turn or "hi"}]
    pieces, count, expected = count_and_reference(data)
    if count.method == "EXACT":
        assert our_ids(pieces, deepseek_counter()) == expected
        assert count.total == len(expected)
    else:
        assert count.total >= len(expected)


# ------------------------------------------------------------------------------------------------- seams

# Letters (Latin, accented, CJK in and out of the pre-tokenizer's ranges, kana, Hangul), marks, numbers of
# every kind, punctuation and symbols (ASCII and not, CJK ones inside the ranges), whitespace of every kind,
# controls and format characters, a private-use and an unassigned character.
ALPHABET = [
    *"aZéßΩжא漢あアー가𠀀",
    "\u0301",
    "\u3099",
    *"09٣²①",
    *".,'\"-_(}。、「」・…",
    *"$+<=>^`|~©€😀",
    *" \t\n\r\x0b\x0c\x85\xa0\u2028\u3000",
    *"\x01\x1c\u200b\u200d\ue000\U000e0001\U0010fffd",
]
CONTEXTS = ["", "x", " ", ".", "1", "\n", "漢", "é\u0301", "  ", "-a"]


def pre_tokens(text: str) -> list[str]:
    pre_tokenizer = server_tokenizer().pre_tokenizer
    assert pre_tokenizer is not None
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def splits_apart(left: str, right: str) -> bool:
    return pre_tokens(left + right) == pre_tokens(left) + pre_tokens(right)


def test_the_seam_rule_holds_for_every_pair_of_characters_in_context() -> None:
    splitting = 0
    for a, b in itertools.product(ALPHABET, repeat=2):
        if not splits_between(a, b):
            continue
        splitting += 1
        for before, after in itertools.product(CONTEXTS, repeat=2):
            assert splits_apart(before + a, b + after), (before + a, b + after)
    # The rule is not vacuous: it splits most seams between a letter, a number or a line break and the rest.
    assert splitting > len(ALPHABET) ** 2 // 4


def test_the_seams_the_rule_refuses_do_merge_somewhere() -> None:
    """The rule is not needlessly strict where it matters: the seams it refuses for DeepSeek's separators
    do merge."""
    assert not splits_apart("a dot.", "\n\n")
    assert not splits_apart("spaces  ", "\n\n")
    assert not splits_apart("\n\n", " \nx")
    assert not splits_apart("\n\n", "\nx")
    assert not splits_between(".", "\n") and not splits_between("\n", "\n") and not splits_between("\n", " ")


@settings(max_examples=300, deadline=None)
@given(left=texts, right=texts, extra=st.text(SAFE_CHARACTERS, max_size=3))
def test_the_seam_rule_holds_on_generated_texts(left: str, right: str, extra: str) -> None:
    left += extra
    if left and right and splits_between(left[-1], right[0]):
        assert splits_apart(left, right)
        counter = deepseek_counter()
        assert counter.count_many([left + right]) == [sum(counter.count_many([left, right]))]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.one_of(texts, st.sampled_from(["\n\n", "\n", ".", " ", "1", "a"])), max_size=8))
def test_a_run_of_touching_texts_counts_as_the_whole(parts: list[str]) -> None:
    """Our cuts of any run of touching texts add up to the tokenizer's count of the run as one text."""
    counter = deepseek_counter()
    run = [Text("evidence", f"evidence:{index}", text) for index, text in enumerate(parts)]
    pieces = list(_split_run(run))
    joined = "".join(parts)
    assert "".join(piece.text for piece in pieces if isinstance(piece, Text)) == joined
    counts = counter.count_many([piece.text for piece in pieces if isinstance(piece, Text)])
    assert sum(counts) == (counter.count_many([joined])[0] if joined else 0)
