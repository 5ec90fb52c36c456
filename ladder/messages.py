"""Components → messages: what the model reads, in order, and the provider payload built from them.

Every chat template renders the same list of messages and the payload is built from it too, so the payload
sent and the stream counted cannot drift apart. Each message is attributed to a bucket and an object id,
the keys of the per-bucket and per-object counts.

Payload images are placeholders ``{"type": "image", "ref": …, "width", "height"}``: the request carries only
the size of an image, the gateway attaches its bytes under ``ref``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from ladder.components import (
    Compaction,
    Components,
    EvidenceItem,
    ImagePart,
    Part,
    Parts,
    TextPart,
    Tool,
    ToolCall,
    TrustedStateItem,
    Turn,
    canonical_json,
)

# The output schema is a system message to the families whose templates show it; OpenAI receives it as the
# request's response format instead (``ladder.openai_framing``).
OUTPUT_SCHEMA_LABEL = "Output JSON schema: "


class TemplateError(Exception):
    """An unknown template family, a stream that breaks the boundary rule, or inconsistent ladder state."""


def object_id(bucket: str, key: str | int | None = None) -> str:
    """Return the object id used in counts and manifests: ``bucket`` or ``bucket:key``."""
    return bucket if key is None else f"{bucket}:{key}"


# ------------------------------------------------------------------------------------------------ messages

MessageRole = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One content part of a message; an image carries the ``ref`` the gateway attaches its bytes under."""

    part: Part
    image_ref: str | None


@dataclass(frozen=True, slots=True)
class Message:
    """One message as the model reads it, attributed to a bucket and an object for the counts."""

    role: MessageRole
    bucket: str
    object_id: str
    segments: tuple[Segment, ...]
    calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    # Tool definitions and the output schema travel as request fields, not messages, but the model sees them.
    in_payload: bool = True


def _segments(ref_prefix: str, parts: Parts) -> tuple[Segment, ...]:
    out: list[Segment] = []
    images = 0
    for part in parts:
        ref = None
        if isinstance(part, ImagePart):
            ref = f"{ref_prefix}#image{images}"
            images += 1
        out.append(Segment(part, ref))
    return tuple(out)


def _message(role: MessageRole, bucket: str, oid: str, parts: Parts, *, in_payload: bool = True) -> Message:
    return Message(role, bucket, oid, _segments(oid, parts), in_payload=in_payload)


def _labelled(label: str, parts: Parts) -> Parts:
    """Put ``label`` in front of the first text part, or as its own part when the item opens with an image."""
    if parts and isinstance(parts[0], TextPart):
        return (TextPart(f"{label}\n{parts[0].text}"), *parts[1:])
    return (TextPart(label), *parts)


def _tool_definition_text(tool: Tool) -> str:
    return (
        '{"type":"function","function":{"name":'
        + canonical_json(tool.name)
        + ',"description":'
        + canonical_json(tool.description)
        + ',"parameters":'
        + tool.parameters_json
        + "}}"
    )


def _turn_messages(turn: Turn) -> Iterator[Message]:
    oid = object_id("recentTurns", turn.turn)
    for result in turn.tool_results:
        segments = _segments(f"{oid}/{result.call_id}", result.parts)
        yield Message("tool", "recentTurns", oid, segments, tool_call_id=result.call_id)
    if turn.role == "assistant":
        yield Message("assistant", "recentTurns", oid, _segments(oid, turn.parts), calls=turn.tool_calls)
    elif turn.role == "user" and turn.parts:
        yield _message("user", "recentTurns", oid, turn.parts)


_Item = TypeVar("_Item")


class RenderMemo:
    """The messages already laid out for component objects, reused by the re-renders of one ladder walk.

    Rungs build new ``Components`` but share the item objects (an evidence item, a turn, a tool), so the
    messages of an item, and the very text strings the count memo looks up, are made once per decision.
    Entries are keyed by object identity and hold the object, so an id can never be reused while cached.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[object, tuple[Message, ...]]] = {}

    def get(self, item: _Item, build: Callable[[_Item], Iterable[Message]]) -> tuple[Message, ...]:
        """Return ``build(item)`` as a tuple, built on the first request for this object."""
        entry = self._entries.get(id(item))
        if entry is not None and entry[0] is item:
            return entry[1]
        built = tuple(build(item))
        self._entries[id(item)] = (item, built)
        return built


def _each(
    memo: RenderMemo | None, item: _Item, build: Callable[[_Item], Iterable[Message]]
) -> Iterable[Message]:
    return build(item) if memo is None else memo.get(item, build)


def _tool_messages(tool: Tool) -> tuple[Message]:
    definition = (TextPart(_tool_definition_text(tool)),)
    return (_message("system", "tools", object_id("tools", tool.name), definition, in_payload=False),)


def _state_messages(state: TrustedStateItem) -> tuple[Message]:
    parts = _labelled(f"[state id={state.id} provenance={state.provenance}]", (TextPart(state.text),))
    return (_message("system", "trustedState", object_id("trustedState", state.id), parts),)


def _evidence_messages(item: EvidenceItem) -> tuple[Message]:
    parts = _labelled(f"[evidence id={item.id} source={item.source_id}]", item.parts)
    return (_message("system", "evidence", object_id("evidence", item.id), parts),)


def _compaction_messages(compaction: Compaction) -> tuple[Message]:
    first, last = compaction.replaces_turns[0], compaction.replaces_turns[-1]
    parts = _labelled(f"[summary of turns {first}-{last}]", compaction.parts)
    return (_message("system", "recentTurns", object_id("compactions", compaction.id), parts),)


def _history(components: Components, memo: RenderMemo | None = None) -> Iterator[Message]:
    """Turns in order, with each applied compaction in place of the turns it replaced.

    A compaction whose turns are all still present is only on offer and is not rendered; one whose turns are
    partly present, or that overlaps another applied one, is an inconsistent state (TemplateError).
    """
    present = {turn.turn for turn in components.recent_turns}
    covered: set[int] = set()
    applied: list[Compaction] = []
    for compaction in components.compactions:
        replaced = set(compaction.replaces_turns)
        if replaced <= present:
            continue
        if replaced & (present | covered):
            raise TemplateError(f"compaction {compaction.id!r} overlaps turns that are present or compacted")
        covered |= replaced
        applied.append(compaction)
    # A compaction takes the place of the first turn it replaces.
    entries: list[tuple[int, Turn | Compaction]] = [(turn.turn, turn) for turn in components.recent_turns]
    entries.extend((compaction.replaces_turns[0], compaction) for compaction in applied)
    for _, entry in sorted(entries, key=lambda item: item[0]):
        if isinstance(entry, Turn):
            yield from _each(memo, entry, _turn_messages)
        else:
            yield from _each(memo, entry, _compaction_messages)


def messages(components: Components, memo: RenderMemo | None = None) -> tuple[Message, ...]:
    """Lay the components out as messages, in the order the model reads them (``memo``: see RenderMemo).

    Raises TemplateError for an inconsistent history (a compaction applied over turns still present).
    """
    out: list[Message] = []
    for index, rule in enumerate(components.immutable_rules):
        out.append(_message("system", "immutableRules", object_id("immutableRules", index), rule))
    scope = (TextPart("Authorization scope: " + components.authorization_scope.canonical_json),)
    out.append(_message("system", "authorizationScope", "authorizationScope", scope))
    for index, safety in enumerate(components.output_safety):
        out.append(_message("system", "outputSafety", object_id("outputSafety", index), safety))
    if components.output_schema_json is not None:
        schema = (TextPart(OUTPUT_SCHEMA_LABEL + components.output_schema_json),)
        out.append(_message("system", "outputSchema", "outputSchema", schema, in_payload=False))
    for tool in components.tools:
        out.extend(_each(memo, tool, _tool_messages))
    if components.workflow_instruction is not None:
        instruction = (TextPart(components.workflow_instruction),)
        out.append(_message("system", "tools", object_id("tools", "workflowInstruction"), instruction))
    for state in components.trusted_state:
        out.extend(_each(memo, state, _state_messages))
    for item in components.evidence:
        out.extend(_each(memo, item, _evidence_messages))
    out.extend(_history(components, memo))
    out.append(_message("user", "question", "question", components.question))
    return tuple(out)


# ------------------------------------------------------------------------------------------------- payload


def _content_json(segment: Segment) -> dict[str, object]:
    part = segment.part
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    return {"type": "image", "ref": segment.image_ref, "width": part.width, "height": part.height}


def build_payload(components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
    """Return the OpenAI-style provider payload: ``messages``, plus ``tools`` and ``response_format`` if any.

    The gateway adds the model id and ``max_tokens``; ``ladder.decide`` does so in the admitted payload.
    Raises TemplateError like ``messages``.
    """
    out_messages: list[dict[str, object]] = []
    for message in messages(components, memo):
        if not message.in_payload:
            continue
        content = [_content_json(segment) for segment in message.segments]
        entry: dict[str, object] = {"role": message.role, "content": content}
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        if message.calls:
            entry["content"] = content or None
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.calls
            ]
        out_messages.append(entry)
    payload: dict[str, object] = {"messages": out_messages}
    if components.tools:
        payload["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": json.loads(tool.parameters_json),
                },
            }
            for tool in components.tools
        ]
    if components.output_schema_json is not None:
        schema = json.loads(components.output_schema_json)
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "strict": True, "schema": schema},
        }
    return payload
