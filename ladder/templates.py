"""Chat templates: components → the provider payload and the token stream the model sees.

Both outputs come from one list of messages, so the payload sent and the stream counted cannot drift apart.

Counting is exact because of one design rule, checked on every render: no two non-special pieces are
adjacent, and the stream begins and ends with a special token. Every special token of a family is a single
added token of its tokenizer, and these tokenizers split their input on added tokens before normalising and
pre-tokenising (the tests prove it against both files), so the stream's token count is ``number of specials
+ Σ count(text piece) + Σ image cost`` with nothing merging across a boundary. A template's ``revision``
goes into every count cache key: changing a template's text means a new revision.

Payload images are placeholders ``{"type": "image", "ref": …, "width", "height"}``: the request carries only
the size of an image, the gateway attaches its bytes under ``ref``.
"""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypeVar

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

TEMPLATE_BUCKET = "template"
TEMPLATE_OBJECT = "template"


@dataclass(frozen=True, slots=True)
class Special:
    """A special (added) token; it counts exactly one token."""

    token: str


@dataclass(frozen=True, slots=True)
class Text:
    """Text counted by the tokenizer, attributed to ``bucket`` and ``object_id``."""

    bucket: str
    object_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Image:
    """An image, counted by the model revision's image formula and never tokenised."""

    bucket: str
    object_id: str
    width: int
    height: int


Piece: TypeAlias = Special | Text | Image


class TemplateError(Exception):
    """An unknown template family, a stream that breaks the boundary rule, or inconsistent ladder state."""


def object_id(bucket: str, key: str | int | None = None) -> str:
    """Return the object id used in counts and manifests: ``bucket`` or ``bucket:key``."""
    return bucket if key is None else f"{bucket}:{key}"


# ------------------------------------------------------------------------------------------------ messages

MessageRole = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class _Segment:
    part: Part
    image_ref: str | None


@dataclass(frozen=True, slots=True)
class _Message:
    role: MessageRole
    bucket: str
    object_id: str
    segments: tuple[_Segment, ...]
    calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    # Tool definitions and the output schema travel as request fields, not messages, but the model sees them.
    in_payload: bool = True


def _segments(ref_prefix: str, parts: Parts) -> tuple[_Segment, ...]:
    out: list[_Segment] = []
    images = 0
    for part in parts:
        ref = None
        if isinstance(part, ImagePart):
            ref = f"{ref_prefix}#image{images}"
            images += 1
        out.append(_Segment(part, ref))
    return tuple(out)


def _message(role: MessageRole, bucket: str, oid: str, parts: Parts, *, in_payload: bool = True) -> _Message:
    return _Message(role, bucket, oid, _segments(oid, parts), in_payload=in_payload)


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


def _turn_messages(turn: Turn) -> Iterator[_Message]:
    oid = object_id("recentTurns", turn.turn)
    for result in turn.tool_results:
        segments = _segments(f"{oid}/{result.call_id}", result.parts)
        yield _Message("tool", "recentTurns", oid, segments, tool_call_id=result.call_id)
    if turn.role == "assistant":
        yield _Message("assistant", "recentTurns", oid, _segments(oid, turn.parts), calls=turn.tool_calls)
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
        self._entries: dict[int, tuple[object, tuple[_Message, ...]]] = {}

    def get(self, item: _Item, build: Callable[[_Item], Iterable[_Message]]) -> tuple[_Message, ...]:
        """Return ``build(item)`` as a tuple, built on the first request for this object."""
        entry = self._entries.get(id(item))
        if entry is not None and entry[0] is item:
            return entry[1]
        built = tuple(build(item))
        self._entries[id(item)] = (item, built)
        return built


def _each(
    memo: RenderMemo | None, item: _Item, build: Callable[[_Item], Iterable[_Message]]
) -> Iterable[_Message]:
    return build(item) if memo is None else memo.get(item, build)


def _tool_messages(tool: Tool) -> tuple[_Message]:
    definition = (TextPart(_tool_definition_text(tool)),)
    return (_message("system", "tools", object_id("tools", tool.name), definition, in_payload=False),)


def _state_messages(state: TrustedStateItem) -> tuple[_Message]:
    parts = _labelled(f"[state id={state.id} provenance={state.provenance}]", (TextPart(state.text),))
    return (_message("system", "trustedState", object_id("trustedState", state.id), parts),)


def _evidence_messages(item: EvidenceItem) -> tuple[_Message]:
    parts = _labelled(f"[evidence id={item.id} source={item.source_id}]", item.parts)
    return (_message("system", "evidence", object_id("evidence", item.id), parts),)


def _compaction_messages(compaction: Compaction) -> tuple[_Message]:
    first, last = compaction.replaces_turns[0], compaction.replaces_turns[-1]
    parts = _labelled(f"[summary of turns {first}-{last}]", compaction.parts)
    return (_message("system", "recentTurns", object_id("compactions", compaction.id), parts),)


def _history(components: Components, memo: RenderMemo | None = None) -> Iterator[_Message]:
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


def messages(components: Components, memo: RenderMemo | None = None) -> tuple[_Message, ...]:
    """Lay the components out as messages, in the order the model reads them (``memo``: see RenderMemo).

    Raises TemplateError for an inconsistent history (a compaction applied over turns still present).
    """
    out: list[_Message] = []
    for index, rule in enumerate(components.immutable_rules):
        out.append(_message("system", "immutableRules", object_id("immutableRules", index), rule))
    scope = (TextPart("Authorization scope: " + components.authorization_scope.canonical_json),)
    out.append(_message("system", "authorizationScope", "authorizationScope", scope))
    for index, safety in enumerate(components.output_safety):
        out.append(_message("system", "outputSafety", object_id("outputSafety", index), safety))
    if components.output_schema_json is not None:
        schema = (TextPart("Output JSON schema: " + components.output_schema_json),)
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


def _content_json(segment: _Segment) -> dict[str, object]:
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


# -------------------------------------------------------------------------------------------------- stream


def _piece(message: _Message, segment: _Segment) -> Piece | None:
    part = segment.part
    if isinstance(part, ImagePart):
        return Image(message.bucket, message.object_id, part.width, part.height)
    # An empty text costs nothing; leaving it out keeps zero-width pieces out of the stream.
    return Text(message.bucket, message.object_id, part.text) if part.text else None


def check_boundaries(pieces: Sequence[Piece]) -> None:
    """Check the counting rule: the stream starts and ends with a special, and no two non-specials touch.

    Raises TemplateError when the rule is broken (a template bug: counts would no longer add up).
    """
    if not pieces or not isinstance(pieces[0], Special) or not isinstance(pieces[-1], Special):
        raise TemplateError("a stream must start and end with a special token")
    for left, right in itertools.pairwise(pieces):
        if not isinstance(left, Special) and not isinstance(right, Special):
            raise TemplateError(f"adjacent non-special pieces: {left!r} / {right!r}")


def stream_text(pieces: Sequence[Piece]) -> str:
    """Concatenate the stream as the tokenizer would see it (images, which are not text, are left out)."""
    return "".join(
        piece.token if isinstance(piece, Special) else piece.text
        for piece in pieces
        if not isinstance(piece, Image)
    )


class ChatTemplate(ABC):
    """A chat-template family. ``render`` returns the stream, ``payload`` the provider request body."""

    family: str
    revision: str
    specials: frozenset[str]

    def render(self, components: Components, memo: RenderMemo | None = None) -> tuple[Piece, ...]:
        """Return the token stream the model sees for ``components`` (``memo``: see RenderMemo).

        Raises TemplateError if the stream would break the boundary rule or the ladder state is inconsistent.
        """
        pieces = tuple(self._stream(messages(components, memo)))
        check_boundaries(pieces)
        return pieces

    def payload(self, components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
        """Return the provider payload (the same for every family: OpenAI-style chat completions)."""
        return build_payload(components, memo)

    @abstractmethod
    def _stream(self, message_list: tuple[_Message, ...]) -> Iterator[Piece]:
        """Yield the family's pieces for the messages."""


def _call_text(call: ToolCall) -> str:
    return f"{call.name}\n```json\n{call.arguments}\n```"


# The DeepSeek tokens are spelled with FULLWIDTH VERTICAL LINE (U+FF5C), exactly as in the tokenizer file.
class DeepSeekTemplate(ChatTemplate):
    """DeepSeek-V3 tokens. Every part of a message gets its own role block so that texts never touch."""

    family = "deepseek"
    revision = "deepseek/1"
    BOS = "<｜begin▁of▁sentence｜>"
    EOS = "<｜end▁of▁sentence｜>"
    USER = "<｜User｜>"
    ASSISTANT = "<｜Assistant｜>"
    BEGIN_SYS = "<｜begin▁sys｜>"
    END_SYS = "<｜end▁sys｜>"
    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    SEP = "<｜tool▁sep｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
    OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
    OUTPUT_END = "<｜tool▁output▁end｜>"
    OUTPUTS_END = "<｜tool▁outputs▁end｜>"
    specials = frozenset(
        {
            BOS,
            EOS,
            USER,
            ASSISTANT,
            BEGIN_SYS,
            END_SYS,
            CALLS_BEGIN,
            CALL_BEGIN,
            SEP,
            CALL_END,
            CALLS_END,
            OUTPUTS_BEGIN,
            OUTPUT_BEGIN,
            OUTPUT_END,
            OUTPUTS_END,
        }
    )

    def _stream(self, message_list: tuple[_Message, ...]) -> Iterator[Piece]:
        yield Special(self.BOS)
        in_outputs = False
        for message in message_list:
            if in_outputs and message.role != "tool":
                yield Special(self.OUTPUTS_END)
                in_outputs = False
            if message.role == "tool":
                if not in_outputs:
                    yield Special(self.OUTPUTS_BEGIN)
                    in_outputs = True
                yield from self._wrapped(message, message.segments, self.OUTPUT_BEGIN, self.OUTPUT_END)
            elif message.role == "system":
                yield from self._wrapped(message, message.segments, self.BEGIN_SYS, self.END_SYS)
            elif message.role == "user":
                yield from self._wrapped(message, message.segments, self.USER, None)
            else:
                yield from self._assistant(message)
        if in_outputs:
            yield Special(self.OUTPUTS_END)
        yield Special(self.ASSISTANT)

    @staticmethod
    def _wrapped(
        message: _Message, segments: tuple[_Segment, ...], opening: str, closing: str | None
    ) -> Iterator[Piece]:
        """Wrap each segment in its own ``opening … closing`` block; an empty message still gets one block."""
        for segment in segments or (None,):
            yield Special(opening)
            piece = None if segment is None else _piece(message, segment)
            if piece is not None:
                yield piece
            if closing is not None:
                yield Special(closing)

    def _assistant(self, message: _Message) -> Iterator[Piece]:
        if not message.calls:
            yield from self._wrapped(message, message.segments, self.ASSISTANT, self.EOS)
            return
        if len(message.segments) > 1:
            yield from self._wrapped(message, message.segments[:-1], self.ASSISTANT, self.EOS)
        yield Special(self.ASSISTANT)
        if message.segments:
            piece = _piece(message, message.segments[-1])
            if piece is not None:
                yield piece
        yield Special(self.CALLS_BEGIN)
        for call in message.calls:
            yield Special(self.CALL_BEGIN)
            yield Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "function")
            yield Special(self.SEP)
            yield Text(message.bucket, message.object_id, _call_text(call))
            yield Special(self.CALL_END)
        yield Special(self.CALLS_END)
        yield Special(self.EOS)


class MetaTemplate(ChatTemplate):
    """Tokens of the legacy Anthropic tokenizer: ``<META_START>role<META_END>`` parts joined by ``<META>``."""

    family = "meta"
    revision = "meta/1"
    SOS = "<SOS>"
    EOT = "<EOT>"
    META = "<META>"
    META_START = "<META_START>"
    META_END = "<META_END>"
    specials = frozenset({SOS, EOT, META, META_START, META_END})

    def _header(self, role: str) -> Iterator[Piece]:
        yield Special(self.META_START)
        yield Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, role)
        yield Special(self.META_END)

    def _stream(self, message_list: tuple[_Message, ...]) -> Iterator[Piece]:
        yield Special(self.SOS)
        for message in message_list:
            yield from self._header(message.role)
            items: list[Piece | None] = []
            if message.tool_call_id is not None:
                label = f"[result of tool call {message.tool_call_id}]"
                items.append(Text(message.bucket, message.object_id, label))
            items.extend(_piece(message, segment) for segment in message.segments)
            for call in message.calls:
                items.append(
                    Text(message.bucket, message.object_id, f"[tool call {call.id}] {_call_text(call)}")
                )
            for index, piece in enumerate(items):
                if index:
                    yield Special(self.META)
                if piece is not None:
                    yield piece
            yield Special(self.EOT)
        yield from self._header("assistant")


_TEMPLATES: dict[str, ChatTemplate] = {
    DeepSeekTemplate.family: DeepSeekTemplate(),
    MetaTemplate.family: MetaTemplate(),
}
TEMPLATE_FAMILIES: tuple[str, ...] = tuple(sorted(_TEMPLATES))


def get_template(family: str) -> ChatTemplate:
    """Return the template of ``family``. Raises TemplateError for an unknown family."""
    try:
        return _TEMPLATES[family]
    except KeyError:
        raise TemplateError(f"unknown chat-template family {family!r}") from None
