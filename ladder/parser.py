"""The strict parser of an admission request's camelCase ``components`` object (SPEC §3).

It is deliberately unforgiving: anything it does not understand is a ``ComponentError`` naming the exact path,
so that a malformed request is answered 400 and never reaches rendering or counting. The primitives it reads
values with are ``ladder.strict_json``'s; this module is the grammar of each bucket and the rules that tie
objects together (turn order, tool call ids, compaction runs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ladder.components import (
    DUPLICATE,
    INVALID_VALUE,
    MISSING_FIELD,
    ORPHAN_TOOL_RESULT,
    ROLES,
    UNKNOWN_REFERENCE,
    WRONG_TYPE,
    AuthorizationScope,
    Compaction,
    ComponentError,
    Components,
    EvidenceItem,
    ImagePart,
    Limits,
    Part,
    Parts,
    TextPart,
    Tool,
    ToolCall,
    ToolResult,
    TrustedStateItem,
    Turn,
    canonical_json,
)
from ladder.strict_json import StrictReader, member_path, unique

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _ComponentReader(StrictReader):
    """The grammar of the components object, bucket by bucket."""

    def tool_name(self, value: object, path: str) -> str:
        text = self.string(value, path, max_chars=64, non_empty=True)
        if not _TOOL_NAME.fullmatch(text):
            raise ComponentError(path, "tool names match [A-Za-z0-9_-]{1,64}", INVALID_VALUE)
        return text

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
        unique(names, path, "permission")
        return frozenset(names)

    # ---- buckets

    def scope(self, value: object, path: str) -> AuthorizationScope:
        data = self.obj(value, path, required=("permissions",), extra=True)
        permissions = self.permissions(data["permissions"], f"{path}.permissions")
        for key, item in data.items():
            if key != "permissions":
                self.string(key, member_path(path, key))
                self.json_value(item, member_path(path, key), depth=1)
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
    parser = _ComponentReader(limits)
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
    unique([item.id for item in trusted], f"{root}.trustedState", "id")
    evidence = parser.items(obj.get("evidence", []), f"{root}.evidence", limits.max_evidence, parser.evidence)
    unique([item.id for item in evidence], f"{root}.evidence", "id")
    turns = parser.items(obj.get("recentTurns", []), f"{root}.recentTurns", limits.max_turns, parser.turn)
    _check_turns(turns, f"{root}.recentTurns")
    compactions = parser.items(
        obj.get("compactions", []), f"{root}.compactions", limits.max_compactions, parser.compaction
    )
    unique([item.id for item in compactions], f"{root}.compactions", "id")
    _check_compactions(compactions, turns, f"{root}.compactions")
    tools = parser.items(obj.get("tools", []), f"{root}.tools", limits.max_tools, parser.tool)
    unique([tool.name for tool in tools], f"{root}.tools", "tool name")
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
