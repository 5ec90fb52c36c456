"""Chat templates: the messages of ``ladder.messages`` → the token stream a model family sees.

Counting is exact because of one design rule, checked on every render: no two non-special pieces are
adjacent, and the stream begins and ends with a special token. Every special token of a family is a single
added token of its tokenizer, and these tokenizers split their input on added tokens before normalising and
pre-tokenising (the tests prove it against both files), so the stream's token count is ``number of specials
+ Σ count(text piece) + Σ image cost`` with nothing merging across a boundary. A template's ``revision``
goes into every count cache key: changing a template's text means a new revision.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from ladder.components import Components, ImagePart, ToolCall
from ladder.messages import Message, RenderMemo, Segment, TemplateError, build_payload, messages

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


def _piece(message: Message, segment: Segment) -> Piece | None:
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
    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
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

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
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
        message: Message, segments: tuple[Segment, ...], opening: str, closing: str | None
    ) -> Iterator[Piece]:
        """Wrap each segment in its own ``opening … closing`` block; an empty message still gets one block."""
        for segment in segments or (None,):
            yield Special(opening)
            piece = None if segment is None else _piece(message, segment)
            if piece is not None:
                yield piece
            if closing is not None:
                yield Special(closing)

    def _assistant(self, message: Message) -> Iterator[Piece]:
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

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
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
