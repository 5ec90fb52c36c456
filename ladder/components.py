"""The structured components of an admission request (SPEC §3): their frozen values, limits and digests.

``ladder.parser`` builds them from the request's camelCase JSON, within ``Limits``, or raises
``ComponentError``; everything else in the ladder reads them. A bucket's digest is the SHA-256 of the
canonical JSON of its request form, so it can be recomputed from the request alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

import orjson

BUCKETS: tuple[str, ...] = (
    "immutableRules",
    "authorizationScope",
    "outputSafety",
    "question",
    "trustedState",
    "evidence",
    "recentTurns",
    "tools",
    "outputSchema",
)
HARD_BUCKETS: tuple[str, ...] = (
    "immutableRules",
    "authorizationScope",
    "outputSafety",
    "question",
    "outputSchema",
)
# Digested alongside the buckets: the compaction artifacts (offered before the ladder, applied after it).
DIGESTED: tuple[str, ...] = (*BUCKETS, "compactions")

Role = Literal["user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)


def canonical_json(value: object) -> str:
    """Serialise ``value`` canonically: sorted keys, no whitespace, UTF-8 kept as is, NaN refused.

    Raises ValueError for NaN/infinity and TypeError for values JSON cannot represent.
    """
    fast = _orjson_canonical(value)
    if fast is not None:
        return fast.decode()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_digest(value: object) -> str:
    """``sha256_digest(canonical_json(value))``, without decoding and encoding the JSON in between."""
    fast = _orjson_canonical(value)
    if fast is not None:
        return "sha256:" + hashlib.sha256(fast).hexdigest()
    return sha256_digest(canonical_json(value))


def _orjson_canonical(value: object) -> bytes | None:
    """``canonical_json(value)`` as UTF-8, written by orjson (several times faster than the standard library
    on the texts of a large request), or None when it might differ: orjson writes the same bytes for strings,
    integers, booleans, null, lists and string-keyed objects, and for a float unless its shortest form has an
    exponent (``1e-07`` against ``1e-7``). One pass over the containers decides."""
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            if not all(type(key) is str for key in node):
                return None
            stack.extend(node.values())
        elif type(node) is list or type(node) is tuple:
            stack.extend(node)
        elif type(node) is float:
            if node != node or node in (_INF, -_INF) or "e" in repr(node):
                return None
        elif type(node) is int:
            if not -(2**63) <= node < 2**64:
                return None
        elif not (type(node) is str or type(node) is bool or node is None):
            return None
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return None  # a lone surrogate: the standard library's path raises or writes it as before


_INF = float("inf")


def sha256_digest(text: str) -> str:
    """Return ``'sha256:' + hex`` of the UTF-8 bytes of ``text``."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TextPart:
    """A text content part."""

    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image content part; only its size matters for counting (the bytes travel outside this service)."""

    width: int
    height: int


Part: TypeAlias = TextPart | ImagePart
Parts: TypeAlias = tuple[Part, ...]


@dataclass(frozen=True)
class AuthorizationScope:
    """What the caller may see and do: ``permissions`` filters evidence, the whole object is rendered."""

    permissions: frozenset[str]
    canonical_json: str


@dataclass(frozen=True)
class TrustedStateItem:
    """Server-side state with its provenance; no rung ever changes it."""

    id: str
    text: str
    provenance: str


@dataclass(frozen=True)
class EvidenceItem:
    """One retrieved evidence item."""

    id: str
    source_id: str
    parts: Parts
    score: float
    permissions: frozenset[str]
    minimum_retention: bool


@dataclass(frozen=True)
class ToolCall:
    """A tool call made by the assistant; ``arguments`` is the JSON string as the model produced it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolResult:
    """The result of the tool call ``call_id``."""

    call_id: str
    parts: Parts


@dataclass(frozen=True)
class Turn:
    """One turn of history. Tool calls live on assistant turns, tool results on tool or user turns."""

    turn: int
    role: Role
    parts: Parts
    tool_calls: tuple[ToolCall, ...]
    tool_results: tuple[ToolResult, ...]
    provenance: str | None


@dataclass(frozen=True)
class Tool:
    """A tool definition; ``parameters_json`` is the canonical JSON of its parameter schema."""

    name: str
    description: str
    parameters_json: str
    essential: bool


@dataclass(frozen=True)
class Compaction:
    """A caller-supplied summary that may replace whole turns once it has passed the fidelity gate."""

    id: str
    replaces_turns: tuple[int, ...]
    parts: Parts
    gate_id: str
    fidelity_score: float
    request_id: str


@dataclass(frozen=True)
class Components:
    """Everything the model will see, by bucket.

    ``compactions`` holds the artifacts offered by the caller in a parsed request; in a ladder state it holds
    the artifacts applied in place of their turns. ``ladder.templates`` renders a compaction only once its
    turns are gone.
    ``workflow_instruction`` is set only by the NARROW_WORKFLOW rung when it switches to the clarification
    workflow.
    """

    immutable_rules: tuple[Parts, ...]
    authorization_scope: AuthorizationScope
    output_safety: tuple[Parts, ...]
    question: Parts
    trusted_state: tuple[TrustedStateItem, ...]
    evidence: tuple[EvidenceItem, ...]
    recent_turns: tuple[Turn, ...]
    compactions: tuple[Compaction, ...]
    tools: tuple[Tool, ...]
    output_schema_json: str | None
    workflow_instruction: str | None = None


class ComponentError(ValueError):
    """A malformed components object. ``path`` points at the offending value, ``code`` is machine-readable."""

    def __init__(self, path: str, message: str, code: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
        self.code = code


# Error codes of ComponentError.
UNKNOWN_FIELD = "unknown_field"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
OUT_OF_RANGE = "out_of_range"
TOO_MANY = "too_many"
TOO_LONG = "too_long"
INVALID_STRING = "invalid_string"
INVALID_VALUE = "invalid_value"
DUPLICATE = "duplicate"
UNKNOWN_REFERENCE = "unknown_reference"
ORPHAN_TOOL_RESULT = "orphan_tool_result"


@dataclass(frozen=True)
class Limits:
    """Size limits of one components object; every limit is inclusive."""

    max_rules: int = 200
    max_safety: int = 200
    max_trusted_state: int = 500
    max_evidence: int = 2000
    max_turns: int = 1000
    max_compactions: int = 200
    max_tools: int = 256
    max_parts: int = 64
    max_tool_calls_per_turn: int = 128
    max_permissions: int = 512
    max_string_chars: int = 2_000_000
    max_total_chars: int = 16_000_000
    max_id_chars: int = 256
    max_json_depth: int = 64
    max_json_nodes: int = 100_000
    max_image_side: int = 32_768
    max_turn_number: int = 1_000_000_000
    max_abs_score: float = 1e9


# ---------------------------------------------------------------------------------------------------- digests
# The request form of each value: what its bucket's digest is taken of.


def parts_json(parts: Parts) -> list[dict[str, object]]:
    """Return the JSON form of content parts."""
    out: list[dict[str, object]] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        else:
            out.append({"type": "image", "width": part.width, "height": part.height})
    return out


def _trusted_json(item: TrustedStateItem) -> dict[str, object]:
    return {"id": item.id, "text": item.text, "provenance": item.provenance}


def _evidence_json(item: EvidenceItem) -> dict[str, object]:
    return {
        "id": item.id,
        "sourceId": item.source_id,
        "parts": parts_json(item.parts),
        "score": item.score,
        "permissions": sorted(item.permissions),
        "minimumRetention": item.minimum_retention,
    }


def _turn_json(turn: Turn) -> dict[str, object]:
    data: dict[str, object] = {
        "turn": turn.turn,
        "role": turn.role,
        "parts": parts_json(turn.parts),
        "toolCalls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in turn.tool_calls],
        "toolResults": [{"callId": r.call_id, "parts": parts_json(r.parts)} for r in turn.tool_results],
    }
    if turn.provenance is not None:
        data["provenance"] = turn.provenance
    return data


def _compaction_json(item: Compaction) -> dict[str, object]:
    return {
        "id": item.id,
        "replacesTurns": list(item.replaces_turns),
        "parts": parts_json(item.parts),
        "gateId": item.gate_id,
        "fidelityScore": item.fidelity_score,
        "requestId": item.request_id,
    }


def tool_json(tool: Tool) -> dict[str, object]:
    """Return the JSON form of a tool definition."""
    return {
        "name": tool.name,
        "description": tool.description,
        "parameters": json.loads(tool.parameters_json),
        "essential": tool.essential,
    }


def bucket_value(components: Components, bucket: str) -> object:
    """Return the JSON value of one bucket (or of ``compactions``), the input of its digest.

    Raises KeyError for an unknown bucket name.
    """
    if bucket == "immutableRules":
        return [parts_json(rule) for rule in components.immutable_rules]
    if bucket == "authorizationScope":
        return json.loads(components.authorization_scope.canonical_json)
    if bucket == "outputSafety":
        return [parts_json(item) for item in components.output_safety]
    if bucket == "question":
        return parts_json(components.question)
    if bucket == "trustedState":
        return [_trusted_json(item) for item in components.trusted_state]
    if bucket == "evidence":
        return [_evidence_json(item) for item in components.evidence]
    if bucket == "recentTurns":
        return [_turn_json(turn) for turn in components.recent_turns]
    if bucket == "compactions":
        return [_compaction_json(item) for item in components.compactions]
    if bucket == "tools":
        return {
            "tools": [tool_json(tool) for tool in components.tools],
            "workflowInstruction": components.workflow_instruction,
        }
    if bucket == "outputSchema":
        return None if components.output_schema_json is None else json.loads(components.output_schema_json)
    raise KeyError(bucket)


def bucket_digests(components: Components) -> dict[str, str]:
    """Return ``{bucket: 'sha256:…'}`` for every bucket and for ``compactions``."""
    return {name: canonical_digest(bucket_value(components, name)) for name in DIGESTED}
