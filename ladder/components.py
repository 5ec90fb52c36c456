"""The structured components of an admission request (SPEC §3) and their strict parser.

The parser accepts the camelCase ``components`` object of the admission API and turns it into frozen values.
It is deliberately unforgiving: anything it does not understand is a ``ComponentError`` naming the exact path,
so that a malformed request is answered 400 and never reaches rendering or counting.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypeVar, cast

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
ROLES: tuple[Role, ...] = ("user", "assistant", "tool")

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def canonical_json(value: object) -> str:
    """Serialise ``value`` canonically: sorted keys, no whitespace, UTF-8 kept as is, NaN refused.

    Raises ValueError for NaN/infinity and TypeError for values JSON cannot represent.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


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

    @property
    def content_digest(self) -> str:
        """Digest of the content parts only (not id, source, score or permissions)."""
        return sha256_digest(canonical_json(parts_json(self.parts)))


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

    def to_json(self) -> dict[str, object]:
        """Return the camelCase JSON form; ``parse_components`` of it gives back an equal value.

        The ladder-only ``workflow_instruction`` is not part of the request format and is left out.
        """
        data: dict[str, object] = {
            "immutableRules": [parts_json(rule) for rule in self.immutable_rules],
            "authorizationScope": json.loads(self.authorization_scope.canonical_json),
            "outputSafety": [parts_json(item) for item in self.output_safety],
            "question": {"parts": parts_json(self.question)},
            "trustedState": [_trusted_json(item) for item in self.trusted_state],
            "evidence": [_evidence_json(item) for item in self.evidence],
            "recentTurns": [_turn_json(turn) for turn in self.recent_turns],
            "compactions": [_compaction_json(item) for item in self.compactions],
            "tools": [tool_json(tool) for tool in self.tools],
        }
        if self.output_schema_json is not None:
            data["outputSchema"] = json.loads(self.output_schema_json)
        return data


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
    return {name: sha256_digest(canonical_json(bucket_value(components, name))) for name in DIGESTED}


# --------------------------------------------------------------------------------------------------- parsing


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


_T = TypeVar("_T")


def _member(path: str, key: object) -> str:
    """Path of a member. A client-chosen key that is not a plain name is quoted with JSON escapes (ASCII
    only, shortened), so that an error path is always safe to echo back."""
    text = str(key)
    if _PLAIN_KEY.fullmatch(text):
        return f"{path}.{text}"
    return f"{path}[{json.dumps(text[:64])}]"


class _Parser:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total_chars = 0
        self.json_nodes = 0

    # ---- primitives

    def obj(
        self,
        value: object,
        path: str,
        *,
        required: Sequence[str],
        optional: Sequence[str] = (),
        extra: bool = False,
    ) -> dict[str, object]:
        if not isinstance(value, dict):
            raise ComponentError(path, "expected an object", WRONG_TYPE)
        data = cast(dict[object, object], value)
        if not extra:
            allowed = set(required) | set(optional)
            unknown = sorted(str(key) for key in data if key not in allowed)
            if unknown:
                raise ComponentError(_member(path, unknown[0]), "unknown field", UNKNOWN_FIELD)
        for key in required:
            if key not in data:
                raise ComponentError(f"{path}.{key}", "required field is missing", MISSING_FIELD)
        return cast(dict[str, object], data)

    def array(self, value: object, path: str, max_items: int) -> list[object]:
        if not isinstance(value, list):
            raise ComponentError(path, "expected an array", WRONG_TYPE)
        if len(value) > max_items:
            raise ComponentError(path, f"at most {max_items} elements are allowed", TOO_MANY)
        return cast(list[object], value)

    def string(
        self, value: object, path: str, *, max_chars: int | None = None, non_empty: bool = False
    ) -> str:
        if not isinstance(value, str):
            raise ComponentError(path, "expected a string", WRONG_TYPE)
        limit = self.limits.max_string_chars if max_chars is None else max_chars
        if len(value) > limit:
            raise ComponentError(path, f"longer than {limit} characters", TOO_LONG)
        if non_empty and not value:
            raise ComponentError(path, "must not be empty", INVALID_VALUE)
        if "\x00" in value:
            raise ComponentError(path, "NUL characters are not allowed", INVALID_STRING)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ComponentError(path, "lone surrogates are not allowed", INVALID_STRING) from None
        self.total_chars += len(value)
        if self.total_chars > self.limits.max_total_chars:
            raise ComponentError(
                path, f"components exceed {self.limits.max_total_chars} characters", TOO_LONG
            )
        return value

    def ident(self, value: object, path: str) -> str:
        text = self.string(value, path, max_chars=self.limits.max_id_chars, non_empty=True)
        if _CONTROL.search(text):
            raise ComponentError(path, "control characters are not allowed in identifiers", INVALID_STRING)
        return text

    def tool_name(self, value: object, path: str) -> str:
        text = self.string(value, path, max_chars=64, non_empty=True)
        if not _TOOL_NAME.fullmatch(text):
            raise ComponentError(path, "tool names match [A-Za-z0-9_-]{1,64}", INVALID_VALUE)
        return text

    def integer(self, value: object, path: str, *, low: int, high: int) -> int:
        # bool is a subclass of int in Python, but true/false is not a number in this API.
        if type(value) is not int:
            raise ComponentError(path, "expected an integer", WRONG_TYPE)
        if not low <= value <= high:
            raise ComponentError(path, f"must be between {low} and {high}", OUT_OF_RANGE)
        return value

    def number(self, value: object, path: str, *, low: float, high: float) -> float:
        if type(value) is not int and type(value) is not float:
            raise ComponentError(path, "expected a number", WRONG_TYPE)
        number = float(cast(float, value))
        if not math.isfinite(number) or not low <= number <= high:
            raise ComponentError(path, f"must be a finite number between {low} and {high}", OUT_OF_RANGE)
        return number

    def boolean(self, value: object, path: str) -> bool:
        if type(value) is not bool:
            raise ComponentError(path, "expected true or false", WRONG_TYPE)
        return value

    def json_value(self, value: object, path: str, depth: int = 0) -> None:
        """Check that ``value`` is plain, finite, well-formed JSON within the depth and node limits."""
        if depth > self.limits.max_json_depth:
            raise ComponentError(path, f"nested deeper than {self.limits.max_json_depth}", TOO_LONG)
        self.json_nodes += 1
        if self.json_nodes > self.limits.max_json_nodes:
            raise ComponentError(path, f"more than {self.limits.max_json_nodes} JSON values", TOO_MANY)
        if value is None or type(value) is bool:
            return
        if type(value) is int:
            if abs(value) > 2**63:
                raise ComponentError(path, "integer out of range", OUT_OF_RANGE)
            return
        if type(value) is float:
            if not math.isfinite(value):
                raise ComponentError(path, "must be finite", OUT_OF_RANGE)
            return
        if isinstance(value, str):
            self.string(value, path)
            return
        if isinstance(value, list):
            for index, item in enumerate(cast(list[object], value)):
                self.json_value(item, f"{path}[{index}]", depth + 1)
            return
        if isinstance(value, dict):
            for key, item in cast(dict[object, object], value).items():
                if not isinstance(key, str):
                    raise ComponentError(path, "object keys must be strings", WRONG_TYPE)
                self.string(key, _member(path, key))
                self.json_value(item, _member(path, key), depth + 1)
            return
        raise ComponentError(path, "not a JSON value", WRONG_TYPE)

    def json_object(self, value: object, path: str) -> str:
        if not isinstance(value, dict):
            raise ComponentError(path, "expected an object", WRONG_TYPE)
        self.json_value(value, path)
        return canonical_json(value)

    def items(
        self, value: object, path: str, max_items: int, parse: Callable[[object, str], _T]
    ) -> tuple[_T, ...]:
        return tuple(parse(item, f"{path}[{i}]") for i, item in enumerate(self.array(value, path, max_items)))

    # ---- content

    def part(self, value: object, path: str) -> Part:
        data = self.obj(value, path, required=("type",), optional=("text", "width", "height"))
        kind = data["type"]
        if kind == "text":
            self.obj(data, path, required=("type", "text"))
            return TextPart(self.string(data["text"], f"{path}.text"))
        if kind == "image":
            self.obj(data, path, required=("type", "width", "height"))
            side = self.limits.max_image_side
            return ImagePart(
                self.integer(data["width"], f"{path}.width", low=1, high=side),
                self.integer(data["height"], f"{path}.height", low=1, high=side),
            )
        if not isinstance(kind, str):
            raise ComponentError(f"{path}.type", "expected a string", WRONG_TYPE)
        raise ComponentError(f"{path}.type", "must be 'text' or 'image'", INVALID_VALUE)

    def parts(self, value: object, path: str, *, non_empty: bool = True) -> Parts:
        parts = self.items(value, path, self.limits.max_parts, self.part)
        if non_empty and not parts:
            raise ComponentError(path, "at least one part is required", INVALID_VALUE)
        return parts

    def content(
        self, data: Mapping[str, object], path: str, *, required: bool = True, non_empty: bool = True
    ) -> Parts:
        """Read the ``text`` or ``parts`` member of an object (exactly one of them)."""
        if "text" in data and "parts" in data:
            raise ComponentError(f"{path}.parts", "give either text or parts, not both", INVALID_VALUE)
        if "text" in data:
            return (TextPart(self.string(data["text"], f"{path}.text")),)
        if "parts" in data:
            return self.parts(data["parts"], f"{path}.parts", non_empty=non_empty)
        if required:
            raise ComponentError(f"{path}.text", "required field is missing (text or parts)", MISSING_FIELD)
        return ()

    def rule(self, value: object, path: str) -> Parts:
        if isinstance(value, str):
            return (TextPart(self.string(value, path)),)
        if isinstance(value, list):
            return self.parts(value, path)
        raise ComponentError(path, "expected a string or an array of parts", WRONG_TYPE)

    def permissions(self, value: object, path: str) -> frozenset[str]:
        names = self.items(value, path, self.limits.max_permissions, self.ident)
        _unique(names, path, "permission")
        return frozenset(names)

    # ---- buckets

    def scope(self, value: object, path: str) -> AuthorizationScope:
        data = self.obj(value, path, required=("permissions",), extra=True)
        permissions = self.permissions(data["permissions"], f"{path}.permissions")
        for key, item in data.items():
            if key != "permissions":
                self.string(key, _member(path, key))
                self.json_value(item, _member(path, key), depth=1)
        return AuthorizationScope(permissions, canonical_json(data))

    def question(self, value: object, path: str) -> Parts:
        data = self.obj(value, path, required=(), optional=("text", "parts"))
        return self.content(data, path)

    def trusted(self, value: object, path: str) -> TrustedStateItem:
        data = self.obj(value, path, required=("id", "text", "provenance"))
        return TrustedStateItem(
            self.ident(data["id"], f"{path}.id"),
            self.string(data["text"], f"{path}.text"),
            self.string(data["provenance"], f"{path}.provenance", max_chars=self.limits.max_id_chars),
        )

    def evidence(self, value: object, path: str) -> EvidenceItem:
        data = self.obj(
            value,
            path,
            required=("id", "sourceId", "score", "permissions"),
            optional=("text", "parts", "minimumRetention"),
        )
        bound = self.limits.max_abs_score
        return EvidenceItem(
            id=self.ident(data["id"], f"{path}.id"),
            source_id=self.ident(data["sourceId"], f"{path}.sourceId"),
            parts=self.content(data, path),
            score=self.number(data["score"], f"{path}.score", low=-bound, high=bound),
            permissions=self.permissions(data["permissions"], f"{path}.permissions"),
            minimum_retention=self.boolean(data.get("minimumRetention", False), f"{path}.minimumRetention"),
        )

    def tool_call(self, value: object, path: str) -> ToolCall:
        data = self.obj(value, path, required=("id", "name", "arguments"))
        return ToolCall(
            self.ident(data["id"], f"{path}.id"),
            self.tool_name(data["name"], f"{path}.name"),
            self.string(data["arguments"], f"{path}.arguments"),
        )

    def tool_result(self, value: object, path: str) -> ToolResult:
        data = self.obj(value, path, required=("callId",), optional=("text", "parts"))
        # A tool may legitimately return nothing.
        parts = self.content(data, path, non_empty=False)
        return ToolResult(self.ident(data["callId"], f"{path}.callId"), parts)

    def turn(self, value: object, path: str) -> Turn:
        data = self.obj(
            value,
            path,
            required=("turn", "role"),
            optional=("text", "parts", "toolCalls", "toolResults", "provenance"),
        )
        number = self.integer(data["turn"], f"{path}.turn", low=0, high=self.limits.max_turn_number)
        role = data["role"]
        if not isinstance(role, str):
            raise ComponentError(f"{path}.role", "expected a string", WRONG_TYPE)
        if role not in ROLES:
            raise ComponentError(f"{path}.role", "must be 'user', 'assistant' or 'tool'", INVALID_VALUE)
        parts = self.content(data, path, required=False, non_empty=False)
        calls = self.items(
            data.get("toolCalls", []),
            f"{path}.toolCalls",
            self.limits.max_tool_calls_per_turn,
            self.tool_call,
        )
        results = self.items(
            data.get("toolResults", []),
            f"{path}.toolResults",
            self.limits.max_tool_calls_per_turn,
            self.tool_result,
        )
        if calls and role != "assistant":
            raise ComponentError(f"{path}.toolCalls", "only assistant turns make tool calls", INVALID_VALUE)
        if results and role == "assistant":
            raise ComponentError(
                f"{path}.toolResults", "tool results belong to tool or user turns", INVALID_VALUE
            )
        if role == "tool" and parts:
            where = f"{path}.text" if "text" in data else f"{path}.parts"
            raise ComponentError(where, "a tool turn carries its content in toolResults", INVALID_VALUE)
        if not (parts or calls or results):
            raise ComponentError(path, "a turn needs content, tool calls or tool results", INVALID_VALUE)
        provenance = data.get("provenance")
        return Turn(
            turn=number,
            role=role,
            parts=parts,
            tool_calls=calls,
            tool_results=results,
            provenance=None
            if provenance is None
            else self.string(provenance, f"{path}.provenance", max_chars=self.limits.max_id_chars),
        )

    def compaction(self, value: object, path: str) -> Compaction:
        data = self.obj(
            value,
            path,
            required=("id", "replacesTurns", "gateId", "fidelityScore", "requestId"),
            optional=("text", "parts"),
        )
        turns_path = f"{path}.replacesTurns"
        high = self.limits.max_turn_number
        turns = self.items(
            data["replacesTurns"],
            turns_path,
            self.limits.max_turns,
            lambda item, item_path: self.integer(item, item_path, low=0, high=high),
        )
        if not turns:
            raise ComponentError(turns_path, "at least one turn is required", INVALID_VALUE)
        for index in range(1, len(turns)):
            if turns[index] <= turns[index - 1]:
                raise ComponentError(
                    f"{turns_path}[{index}]", "turns must be strictly increasing", INVALID_VALUE
                )
        return Compaction(
            id=self.ident(data["id"], f"{path}.id"),
            replaces_turns=turns,
            parts=self.content(data, path),
            gate_id=self.ident(data["gateId"], f"{path}.gateId"),
            fidelity_score=self.number(data["fidelityScore"], f"{path}.fidelityScore", low=0.0, high=1.0),
            request_id=self.ident(data["requestId"], f"{path}.requestId"),
        )

    def tool(self, value: object, path: str) -> Tool:
        data = self.obj(value, path, required=("name", "parameters"), optional=("description", "essential"))
        return Tool(
            name=self.tool_name(data["name"], f"{path}.name"),
            description=self.string(data.get("description", ""), f"{path}.description"),
            parameters_json=self.json_object(data["parameters"], f"{path}.parameters"),
            essential=self.boolean(data.get("essential", False), f"{path}.essential"),
        )


def _unique(values: Sequence[object], path: str, what: str) -> None:
    seen: set[object] = set()
    for index, value in enumerate(values):
        if value in seen:
            raise ComponentError(f"{path}[{index}]", f"duplicate {what} {value!r}", DUPLICATE)
        seen.add(value)


def _check_turns(turns: tuple[Turn, ...], path: str) -> None:
    """Turn numbers increase, call ids are unique, each result answers a call of this or an earlier turn."""
    calls: set[str] = set()
    answered: set[str] = set()
    previous: int | None = None
    for index, turn in enumerate(turns):
        here = f"{path}[{index}]"
        if previous is not None and turn.turn <= previous:
            code = DUPLICATE if turn.turn == previous else INVALID_VALUE
            raise ComponentError(f"{here}.turn", "turn numbers must be strictly increasing", code)
        previous = turn.turn
        for call_index, call in enumerate(turn.tool_calls):
            if call.id in calls:
                raise ComponentError(
                    f"{here}.toolCalls[{call_index}].id", f"duplicate call id {call.id!r}", DUPLICATE
                )
            calls.add(call.id)
        for result_index, result in enumerate(turn.tool_results):
            result_path = f"{here}.toolResults[{result_index}].callId"
            if result.call_id not in calls:
                raise ComponentError(
                    result_path,
                    f"no tool call {result.call_id!r} in this or an earlier turn",
                    ORPHAN_TOOL_RESULT,
                )
            if result.call_id in answered:
                raise ComponentError(result_path, f"call {result.call_id!r} already has a result", DUPLICATE)
            answered.add(result.call_id)


def _check_compactions(compactions: tuple[Compaction, ...], turns: tuple[Turn, ...], path: str) -> None:
    """Every compaction replaces a contiguous run of turns present in ``recentTurns``."""
    position = {turn.turn: index for index, turn in enumerate(turns)}
    for index, compaction in enumerate(compactions):
        turns_path = f"{path}[{index}].replacesTurns"
        for turn_index, number in enumerate(compaction.replaces_turns):
            if number not in position:
                raise ComponentError(
                    f"{turns_path}[{turn_index}]", f"no turn {number} in recentTurns", UNKNOWN_REFERENCE
                )
        first = position[compaction.replaces_turns[0]]
        last = position[compaction.replaces_turns[-1]]
        if last - first + 1 != len(compaction.replaces_turns):
            raise ComponentError(turns_path, "must be a contiguous run of recentTurns", INVALID_VALUE)


def parse_components(data: object, *, limits: Limits) -> Components:
    """Parse the camelCase ``components`` object of an admission request.

    Raises ComponentError (with a path such as ``components.evidence[3].score`` and a code) for unknown
    fields, wrong types (a boolean is not a number), out-of-range numbers, too many elements, NUL characters
    or lone surrogates in strings, duplicate ids, references to unknown turns and tool results without a call.
    """
    root = "components"
    parser = _Parser(limits)
    obj = parser.obj(
        data,
        root,
        required=("authorizationScope", "question"),
        optional=(
            "immutableRules",
            "outputSafety",
            "trustedState",
            "evidence",
            "recentTurns",
            "compactions",
            "tools",
            "outputSchema",
        ),
    )
    rules = parser.items(
        obj.get("immutableRules", []), f"{root}.immutableRules", limits.max_rules, parser.rule
    )
    scope = parser.scope(obj["authorizationScope"], f"{root}.authorizationScope")
    safety = parser.items(obj.get("outputSafety", []), f"{root}.outputSafety", limits.max_safety, parser.rule)
    question = parser.question(obj["question"], f"{root}.question")
    trusted = parser.items(
        obj.get("trustedState", []), f"{root}.trustedState", limits.max_trusted_state, parser.trusted
    )
    _unique([item.id for item in trusted], f"{root}.trustedState", "id")
    evidence = parser.items(obj.get("evidence", []), f"{root}.evidence", limits.max_evidence, parser.evidence)
    _unique([item.id for item in evidence], f"{root}.evidence", "id")
    turns = parser.items(obj.get("recentTurns", []), f"{root}.recentTurns", limits.max_turns, parser.turn)
    _check_turns(turns, f"{root}.recentTurns")
    compactions = parser.items(
        obj.get("compactions", []), f"{root}.compactions", limits.max_compactions, parser.compaction
    )
    _unique([item.id for item in compactions], f"{root}.compactions", "id")
    _check_compactions(compactions, turns, f"{root}.compactions")
    tools = parser.items(obj.get("tools", []), f"{root}.tools", limits.max_tools, parser.tool)
    _unique([tool.name for tool in tools], f"{root}.tools", "tool name")
    schema = obj.get("outputSchema")
    return Components(
        immutable_rules=rules,
        authorization_scope=scope,
        output_safety=safety,
        question=question,
        trusted_state=trusted,
        evidence=evidence,
        recent_turns=turns,
        compactions=compactions,
        tools=tools,
        output_schema_json=None if schema is None else parser.json_object(schema, f"{root}.outputSchema"),
    )
