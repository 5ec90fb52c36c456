"""Generated fixtures for the ladder tests: components JSON, policies and model specs.

Every generator is deterministic (seeded), so a failing fixture can be regenerated exactly. Text never
contains ``<`` or U+FF5C (FULLWIDTH VERTICAL LINE): every added token of both tokenizers contains one of them,
so generated content cannot spell a special token and the whole-stream oracle stays comparable.
"""

# The fixtures are made of look-alike characters on purpose (fullwidth, ligatures, black-letter).

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

from ladder.policy import TaskPolicy, parse_policy

# CJK unified ideographs (every 7th of the range DeepSeek pre-tokenizes as CJK), hiragana and katakana.
CJK = "".join(map(chr, range(0x4E00, 0x9FA6, 7)))
KANA = "".join(map(chr, [*range(0x3041, 0x3097), *range(0x30A1, 0x30FB)]))
EMOJI = ["😀", "😃", "🧑‍💻", "👍🏽", "🇯🇵", "❤️‍🔥", "🎉", "🚀", "👨‍👩‍👧‍👦", "🤖", "✅", "🔥", "🫠"]
# Text that NFKC changes, sometimes by a lot (ligatures, fullwidth, circled digits, squared words, Arabic).
NFKC = [
    "ﬁ",
    "ﬂ",
    "ｈｅｌｌｏ",
    "①",
    "②",
    "⑳",
    "㍻",
    "ℌ",
    "¼",
    "x²",
    "ǆ",
    "㎞",
    "ﷺ",
    "ﾊﾟ",
    "Ⅻ",
    "㈱",
    "＠",
    "ｶﾞ",
]
WORDS = [
    "the",
    "contract",
    "clause",
    "liability",
    "indemnity",
    "party",
    "shall",
    "notwithstanding",
    "herein",
    "termination",
    "breach",
    "notice",
    "payment",
    "invoice",
    "warranty",
    "audit",
    "schedule",
    "governing",
    "law",
    "jurisdiction",
    "confidential",
    "disclosure",
]
CODE = [
    "def total(items):\n    return sum(item.price * item.qty for item in items)\n",
    "for (let i = 0; i != n; i++) {\n  acc += xs[i] ** 2;\n}\n",
    "SELECT id, amount FROM invoices WHERE tenant_id = $1 AND status = 'OPEN';\n",
    '{"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}\n',
    '\tif err != nil {\n\t\treturn fmt.Errorf("load: %w", err)\n\t}\n',
    '#include "stdio.h"\nint main(void) { return 0; }\n',
    "    \r\n\r\n   trailing spaces   \n",
]


class Gen:
    """A seeded generator of component pieces."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def prose(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def cjk(self, chars: int) -> str:
        return "".join(self.rng.choice(CJK + KANA) for _ in range(chars))

    def emoji(self, count: int) -> str:
        return " ".join(self.rng.choice(EMOJI) + self.rng.choice(WORDS) for _ in range(count))

    def nfkc(self, count: int) -> str:
        return " ".join(self.rng.choice(NFKC) + self.rng.choice(WORDS) for _ in range(count))

    def code(self, blocks: int) -> str:
        return "".join(self.rng.choice(CODE) for _ in range(blocks))

    def mixed(self, size: int) -> str:
        kind = self.rng.randrange(5)
        if kind == 0:
            return self.prose(size)
        if kind == 1:
            return self.cjk(size)
        if kind == 2:
            return self.emoji(max(1, size // 3))
        if kind == 3:
            return self.nfkc(max(1, size // 3))
        return self.code(max(1, size // 15))


def huge_tool_schema(properties: int, depth: int) -> dict[str, Any]:
    """A JSON schema with ``properties`` fields per level, nested ``depth`` levels deep."""
    schema: dict[str, Any] = {"type": "string", "description": "leaf value, ISO-8601 when it is a date"}
    for level in range(depth):
        schema = {
            "type": "object",
            "description": f"level {level}",
            "properties": {
                f"field_{level}_{index}": (
                    schema
                    if index == 0
                    else {"type": "integer", "minimum": 0, "description": f"count {index}"}
                )
                for index in range(properties)
            },
            "required": [f"field_{level}_0"],
        }
    return schema


def base_components(gen: Gen, *, request_id: str = "req-1") -> dict[str, Any]:
    """Hard buckets and trusted state only: the part of every fixture no rung may change."""
    return {
        "immutableRules": [
            "You review contracts for the legal team. Cite evidence ids.",
            [{"type": "text", "text": "Never reveal another tenant's data. " + gen.prose(20)}],
        ],
        "authorizationScope": {
            "permissions": ["legal", "finance", "eu"],
            "tenant": "t-19",
            "roles": ["reviewer"],
        },
        "outputSafety": ["No legal advice outside the contract.", "Redact personal data."],
        "question": {"text": "Which clauses limit liability? " + gen.nfkc(2)},
        "trustedState": [
            {"id": "state-1", "text": "Contract 88 is in negotiation.", "provenance": "crm:contracts/88"},
            {"id": "state-2", "text": gen.cjk(30), "provenance": "erp:orders"},
        ],
    }


def evidence_item(
    gen: Gen,
    index: int,
    *,
    text: str | None = None,
    score: float | None = None,
    permissions: list[str] | None = None,
    minimum: bool = False,
    size: int = 40,
) -> dict[str, Any]:
    return {
        "id": f"ev-{index}",
        "sourceId": f"doc-{index % 7}",
        "text": text if text is not None else gen.mixed(size),
        "score": score if score is not None else round(gen.rng.random(), 3),
        "permissions": permissions if permissions is not None else ["legal"],
        "minimumRetention": minimum,
    }


def tool_history(gen: Gen, exchanges: int, *, start: int = 1, size: int = 30) -> list[dict[str, Any]]:
    """User → assistant (tool call) → tool result → assistant answer, ``exchanges`` times."""
    turns: list[dict[str, Any]] = []
    number = start
    for exchange in range(exchanges):
        call_id = f"call-{start}-{exchange}"
        turns.append({"turn": number, "role": "user", "text": gen.mixed(size)})
        turns.append(
            {
                "turn": number + 1,
                "role": "assistant",
                "text": "Looking it up.",
                "toolCalls": [
                    {"id": call_id, "name": "search", "arguments": json.dumps({"q": gen.prose(3)})}
                ],
            }
        )
        turns.append(
            {
                "turn": number + 2,
                "role": "tool",
                "toolResults": [{"callId": call_id, "text": gen.mixed(size)}],
            }
        )
        turns.append({"turn": number + 3, "role": "assistant", "text": gen.mixed(size)})
        number += 4
    return turns


def tools(
    count: int, *, essential: tuple[str, ...] = ("search",), huge: bool = False
) -> list[dict[str, Any]]:
    names = ["search", *(f"tool_{index}" for index in range(1, count))]
    return [
        {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": huge_tool_schema(12, 4) if huge and name != "search" else {"type": "object"},
            "essential": name in essential,
        }
        for name in names[:count]
    ]


def compaction(
    cid: str,
    turns: list[int],
    *,
    text: str,
    gate: str = "gate-a",
    score: float = 0.95,
    request_id: str = "req-1",
) -> dict[str, Any]:
    return {
        "id": cid,
        "replacesTurns": turns,
        "text": text,
        "gateId": gate,
        "fidelityScore": score,
        "requestId": request_id,
    }


# ------------------------------------------------------------------------------------------ named fixtures


def fx_cjk() -> dict[str, Any]:
    gen = Gen(1)
    data = base_components(gen)
    data["question"] = {"text": "合同第十二条的责任上限是多少？" + gen.cjk(20)}
    data["evidence"] = [evidence_item(gen, i, text=gen.cjk(200), minimum=i == 0) for i in range(12)]
    return data


def fx_code() -> dict[str, Any]:
    gen = Gen(2)
    data = base_components(gen)
    data["evidence"] = [evidence_item(gen, i, text=gen.code(6)) for i in range(10)]
    data["recentTurns"] = tool_history(gen, 3)
    data["tools"] = tools(3)
    return data


def fx_emoji_nfkc() -> dict[str, Any]:
    gen = Gen(3)
    data = base_components(gen)
    data["immutableRules"].append("Rules: ﬁle ｈｅｌｌｏ ① ㍻ ﷺ " + gen.nfkc(30))
    data["evidence"] = [
        evidence_item(gen, i, text=gen.emoji(30) if i % 2 else gen.nfkc(40), minimum=i == 1)
        for i in range(10)
    ]
    return data


def fx_huge_tools() -> dict[str, Any]:
    gen = Gen(4)
    data = base_components(gen)
    data["tools"] = tools(8, huge=True)
    data["recentTurns"] = tool_history(gen, 2)
    data["outputSchema"] = huge_tool_schema(6, 3)
    return data


def fx_images() -> dict[str, Any]:
    gen = Gen(5)
    data = base_components(gen)
    data["question"] = {
        "parts": [
            {"type": "text", "text": "What does this scan say?"},
            {"type": "image", "width": 4000, "height": 3000},
            {"type": "text", "text": "and this one"},
            {"type": "image", "width": 512, "height": 512},
        ]
    }
    data["evidence"] = [
        {
            "id": "ev-img",
            "sourceId": "scan-1",
            "parts": [
                {"type": "image", "width": 1024, "height": 2048},
                {"type": "text", "text": gen.prose(30)},
            ],
            "score": 0.9,
            "permissions": ["legal"],
        },
        *(evidence_item(gen, i) for i in range(1, 6)),
    ]
    return data


def fx_duplicates() -> dict[str, Any]:
    gen = Gen(6)
    data = base_components(gen)
    shared = gen.prose(80)
    data["evidence"] = [
        evidence_item(gen, 0, text=shared, score=0.9, permissions=["legal"]),
        evidence_item(gen, 1, text=shared, score=0.5, permissions=["legal"]),  # a copy: removable
        evidence_item(
            gen, 2, text=shared, score=0.7, permissions=["legal", "finance"]
        ),  # other permissions: kept
        evidence_item(gen, 3, text=shared, score=0.9, permissions=["legal"]),  # tie, later: removable
        evidence_item(gen, 4, text=shared, score=0.1, permissions=["legal"], minimum=True),  # marked: kept
        evidence_item(gen, 5, text=gen.prose(80), score=0.4),
        evidence_item(gen, 6, text=shared, score=0.99, permissions=["hr"]),  # not permitted
    ]
    return data


def fx_near_window() -> dict[str, Any]:
    gen = Gen(7)
    data = base_components(gen)
    data["evidence"] = [evidence_item(gen, i, size=60, minimum=i < 2) for i in range(20)]
    data["recentTurns"] = tool_history(gen, 10, size=40)
    data["tools"] = tools(5, huge=True)
    data["compactions"] = [
        compaction("cmp-ok", [1, 2, 3, 4, 5, 6, 7, 8], text="Earlier: user asked about clauses 1-4."),
        compaction("cmp-low", [9, 10, 11, 12], text="low fidelity", score=0.2),
        compaction("cmp-gate", [13, 14, 15, 16], text="unapproved gate", gate="gate-x"),
        compaction("cmp-other", [17, 18, 19, 20], text="another request", request_id="req-other"),
        compaction("cmp-split", [21, 22], text="splits a call from its result"),
        compaction("cmp-ok2", [21, 22, 23, 24], text="Then the user asked about clause 6."),
    ]
    return data


def fx_everything() -> dict[str, Any]:
    gen = Gen(8)
    data = fx_near_window()
    data["evidence"].extend(fx_duplicates()["evidence"][i] | {"id": f"dup-{i}"} for i in range(7))
    data["evidence"].append(fx_images()["evidence"][0])
    data["outputSchema"] = {"type": "object", "properties": {"answer": {"type": "string"}}}
    data["recentTurns"].append({"turn": 100, "role": "user", "text": gen.emoji(10)})
    return data


FIXTURES: dict[str, Callable[[], dict[str, Any]]] = {
    "cjk": fx_cjk,
    "code": fx_code,
    "emoji_nfkc": fx_emoji_nfkc,
    "huge_tools": fx_huge_tools,
    "images": fx_images,
    "duplicates": fx_duplicates,
    "near_window": fx_near_window,
    "everything": fx_everything,
}


def plain() -> dict[str, Any]:
    """A short request: one rule, one evidence item, a question (the golden tests' first fixture)."""
    return {
        "immutableRules": ["You are a careful assistant."],
        "authorizationScope": {"permissions": ["legal"]},
        "outputSafety": [],
        "question": {"text": "Summarise the clause in one sentence."},
        "evidence": [
            {
                "id": "ev-1",
                "sourceId": "doc",
                "text": "The supplier's liability is capped at 1,000 EUR.",
                "score": 0.9,
                "permissions": ["legal"],
            }
        ],
    }


def many_turns() -> dict[str, Any]:
    """``plain`` with 80 turns of mixed English and CJK."""
    data = plain()
    data["recentTurns"] = [
        {
            "turn": index,
            "role": "user" if index % 2 else "assistant",
            "text": f"Turn {index}: 第{index}条 ok?",
        }
        for index in range(1, 81)
    ]
    return data


def without_images(data: dict[str, Any]) -> dict[str, Any]:
    """The fixture without its evidence items that hold an image."""
    data = dict(data)
    data["evidence"] = [
        item
        for item in data.get("evidence", [])
        if not any(part.get("type") == "image" for part in item.get("parts", []))
    ]
    return data


def fixture(name: str) -> dict[str, Any]:
    """A fresh copy of a named fixture's components JSON."""
    return copy.deepcopy(FIXTURES[name]())


# ------------------------------------------------------------------------------------------------- policy

ALL_RUNGS = [
    "FULL",
    "DEDUP_EVIDENCE",
    "COMPACT_HISTORY",
    "NARROW_WORKFLOW",
    "TRIM_EVIDENCE",
    "SMALLER_MODEL",
    "QUEUE_OR_REJECT",
]


def task_doc(**overrides: Any) -> dict[str, Any]:
    """A coherent task-class document using every rung; ``overrides`` replace top-level fields."""
    doc: dict[str, Any] = {
        "inputCap": 1_000_000,
        "outputCap": 4000,
        "ladder": list(ALL_RUNGS),
        "minimumEvidence": {"minItems": 2, "requireMarked": False},
        "compaction": {"fidelityThreshold": 0.9, "approvedGates": ["gate-a"]},
        "essentialTools": ["search"],
        "clarificationWorkflow": {"tools": ["search"], "instruction": "Ask one clarifying question."},
        "countingUnavailable": "REJECT",
        "queue": {"allowed": True, "deadlineSeconds": 60},
        "rampPercent": 100,
        "fallbackModels": ["legacy@1", "us@1", "notools@1", "lowtier@1"],
    }
    doc.update(overrides)
    if "SMALLER_MODEL" not in doc["ladder"]:
        doc["fallbackModels"] = []
    if "NARROW_WORKFLOW" not in doc["ladder"]:
        doc["clarificationWorkflow"] = None
    return doc


def policy_doc(**task_overrides: Any) -> dict[str, Any]:
    return {
        "revision": 1,
        "globalMaxInputTokens": 2_000_000,
        "taskClasses": {"contract-review": task_doc(**task_overrides)},
    }


def task_policy(**overrides: Any) -> TaskPolicy:
    return parse_policy(policy_doc(**overrides)).task_classes["contract-review"]
