"""Chat templates: the messages of ``ladder.messages`` → the token stream a model family sees.

Counting is exact because of one design rule, checked on every render: no two non-special pieces are
adjacent, and the stream begins and ends with a special token. Every special token of a family is a single
added token of its tokenizer, and these tokenizers split their input on added tokens before normalising and
pre-tokenising (the tests prove it against both files), so the stream's token count is ``number of specials
+ Σ count(text piece) + Σ image cost`` with nothing merging across a boundary. A template's ``revision``
goes into every count cache key: changing a template's text means a new revision.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ladder.components import Components, ImagePart, TextPart, ToolCall
from ladder.messages import (
    OUTPUT_SCHEMA_LABEL,
    Message,
    RenderMemo,
    Segment,
    TemplateError,
    build_payload,
    messages,
)
from ladder.openai_framing import (
    CALL_SPECIALS,
    CHANNEL_SPECIAL,
    RESULT_SPECIALS,
    TEXT_CHANNEL,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    call_bound_text,
    result_bound_text,
    schema_bound_text,
    tool_bound_text,
    trailing_run,
)
from ladder.seams import splits_between

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
class FixedText(Text):
    """Text of the template's own, from a fixed handful (a role's name, a header's ``\\n\\n``), attributed to
    the template and separated like any text: its count depends on the tokenizer alone, so it is counted once
    per counter (``ladder.counting``), never looked up per request. Never a request's text, whose values are
    unbounded."""


@dataclass(frozen=True, slots=True)
class Image:
    """An image, counted by the model revision's image formula and never tokenised."""

    bucket: str
    object_id: str
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class Cut:
    """No token: a place where the vendor's own code encodes the text on each side separately.

    Meta's ChatFormat encodes a header's ``\n\n`` and each content part on its own, and OpenAI's published
    framing counts each value of a message on its own, so texts on either side of a cut never merge: their
    counts add exactly, as across a special token. In DeepSeek's stream, where the template makes texts
    touch, a cut is a place where DeepSeek-V3's pre-tokenizer must split the text (``ladder.seams``).
    """


@dataclass(frozen=True, slots=True)
class Bound:
    """Text whose framing the vendor does not publish, counted by a proven upper bound, never exactly.

    A stream holding one is counted ``UPPER_BOUND``: its text costs its UTF-8 bytes (every token of a
    byte-level BPE covers at least one byte), and the template adds its allowance for the hidden framing as
    specials.
    """

    bucket: str
    object_id: str
    text: str


Piece: TypeAlias = Special | Cut | Text | Bound | Image


def _piece(message: Message, segment: Segment) -> Piece | None:
    part = segment.part
    if isinstance(part, ImagePart):
        return Image(message.bucket, message.object_id, part.width, part.height)
    # An empty text costs nothing; leaving it out keeps zero-width pieces out of the stream.
    return Text(message.bucket, message.object_id, part.text) if part.text else None


# The piece classes are final (slotted dataclasses nothing subclasses but ``FixedText``, a kind of its own):
# an exact type is enough. Each kind is one byte, so a stream of a thousand pieces is read by C loops (map,
# translate, find, count, compress) instead of a Python loop per piece: a warm count does little else.
SPECIAL, CUT, TEXT, BOUND, IMAGE, FIXED = range(6)
KINDS = bytes([SPECIAL, CUT, TEXT, BOUND, IMAGE, FIXED])
_KINDS: dict[type, int] = {
    Special: SPECIAL, Cut: CUT, Text: TEXT, Bound: BOUND, Image: IMAGE, FixedText: FIXED,
}  # fmt: skip
# Kinds to 1 for the pieces that cost tokens (texts, bounds, images), to 0 for the separators (specials and
# cuts): the boundary rule is then "starts and ends with 0, and no 1 beside a 1".
COSTING = bytes.maketrans(KINDS, bytes([0, 0, 1, 1, 1, 1]))


# The last stream (a tuple: it and its frozen pieces cannot change) found to follow the rule, and its kinds.
# ``ChatTemplate.render`` checks every stream it returns and ``count_stream`` checks the stream it is given,
# nearly always that one: the second check is then an identity test. The stream is held, not its id, so no
# other tuple can come to have that id.
_last_checked: tuple[tuple[Piece, ...], bytes] = ((), b"")


def check_boundaries(pieces: Sequence[Piece]) -> bytes:
    """Check the counting rule: the stream starts and ends with a special or a cut, and no two other pieces
    touch (a special or a cut separates them). Returns the kind of each piece (``SPECIAL`` … ``FIXED``, one
    byte each), for a caller that reads the stream next.

    Raises TemplateError when the rule is broken (a template bug: counts would no longer add up).
    """
    global _last_checked
    checked, known_kinds = _last_checked
    if pieces is checked and known_kinds:
        return known_kinds
    kinds = bytes(map(_KINDS.__getitem__, map(type, pieces)))
    joins = kinds.translate(COSTING)
    if not joins or joins[0] or joins[-1]:
        raise TemplateError("a stream must start and end with a special token or a cut")
    index = joins.find(b"\x01\x01")
    if index >= 0:
        raise TemplateError(f"adjacent non-special pieces: {pieces[index]!r} / {pieces[index + 1]!r}")
    if type(pieces) is tuple:
        _last_checked = (pieces, kinds)
    return kinds


def stream_text(pieces: Sequence[Piece]) -> str:
    """Concatenate the stream as the tokenizer would see it (images, which are not text, are left out).

    Only meaningful for a stream without cuts: across a cut the vendor encodes each side on its own.
    """
    return "".join(
        piece.token if isinstance(piece, Special) else piece.text
        for piece in pieces
        if isinstance(piece, Special | Text | Bound)
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
    """DeepSeek-V3, framed as DeepSeek's published chat template frames the payload it is sent.

    The template (``chat_template`` of deepseek-ai/DeepSeek-V3, kept verbatim in
    ``simulation/deepseek_chat_template.py``) renders the beginning of sentence, then every system
    message's content, wherever it is in the chat, joined by ``\\n\\n``; then each other message in order:

    - a user's as ``<｜User｜>`` + content;
    - an assistant's as ``<｜Assistant｜>`` + content + ``<｜end▁of▁sentence｜>``, or right after tool
      results as ``<｜tool▁outputs▁end｜>`` + content + ``<｜end▁of▁sentence｜>``;
    - a tool result as ``<｜tool▁output▁begin｜>`` + content + ``<｜tool▁output▁end｜>``, the first of the
      whole chat after ``<｜tool▁outputs▁begin｜>``, every later one after ``\\n``;
    - the tool calls of an assistant whose content is null, each as ``<｜tool▁call▁begin｜>function``
      ``<｜tool▁sep｜>`` + name + ``\\n```json\\n`` + arguments + ``\\n```<｜tool▁call▁end｜>``: the first
      call of the whole chat after ``<｜Assistant｜><｜tool▁calls▁begin｜>``, every later one after ``\\n``
      and followed by ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`` (so a lone first call is never closed);

    and ``<｜tool▁outputs▁end｜>`` when results end the chat, else ``<｜Assistant｜>`` to prompt the reply.
    The golden tests compare token ids with that very template rendered as Hugging Face's
    ``apply_chat_template`` renders it.

    The payload sends each text-only message's content as one string, and null for an assistant turn that
    only calls tools. Texts that touch in the rendered text (system contents around ``\\n\\n``, a user's
    content before a later result's or call's ``\\n``) are cut only where DeepSeek-V3's pre-tokenizer must
    split them (``ladder.seams``); around a seam where it may merge, the text from the last such split before
    the seam to the first after it is one piece, attributed to the object with most characters in it. The
    cuts are proven for DeepSeek-V3's pre-tokenizer only, so this template frames the ``byte-level-bpe``
    family alone.

    What the payload sends and the template does not show is a ``Bound`` (its UTF-8 bytes, and no
    allowance: a JSON text's bytes exceed its tokens several times over, and the drift status watches the
    framing DeepSeek does not publish), so such a request is counted ``UPPER_BOUND``: tool definitions and
    the output schema (request fields the template never renders), and the tool calls of an assistant turn
    that also has text (the template renders only the text). A message holding an image keeps its parts as
    a list, and each image costs the revision's image formula. The template renders no image, so texts that
    touch across one are exact only across a seam the pre-tokenizer must split (they count the same touching
    or apart); the piece around any other is a ``Bound``, and the request ``UPPER_BOUND`` (``_split_run``).
    """

    family = "deepseek"
    revision = "deepseek/4"
    BOS = "<｜begin▁of▁sentence｜>"
    EOS = "<｜end▁of▁sentence｜>"
    USER = "<｜User｜>"
    ASSISTANT = "<｜Assistant｜>"
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
    SYSTEM_JOIN = "\n\n"
    NEXT = "\n"

    def payload(self, components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
        """The chat-completions payload: each text-only message's content as one string, and null for an
        assistant turn that only calls tools."""
        payload = build_payload(components, memo)
        sent = [message for message in messages(components, memo) if message.in_payload]
        entries = payload["messages"]
        assert isinstance(entries, list) and len(entries) == len(sent)
        for entry, message in zip(entries, sent, strict=True):
            text = _content_text(message)
            if text is not None:
                entry["content"] = None if message.calls and not text else text
        return payload

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
        items: list[Piece] = [Special(self.BOS)]
        system = [message for message in message_list if message.role == "system" and message.in_payload]
        for index, message in enumerate(system):
            if index:
                items.append(Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, self.SYSTEM_JOIN))
            items.extend(self._content(message))
        for message in message_list:
            if not message.in_payload:
                items.extend(
                    Bound(message.bucket, message.object_id, segment.part.text)
                    for segment in message.segments
                    if isinstance(segment.part, TextPart)
                )
        first_call = True
        first_output = True
        after_outputs = False
        for message in message_list:
            if message.role == "system":
                continue
            if message.role == "user":
                after_outputs = False
                items.append(Special(self.USER))
                items.extend(self._content(message))
            elif message.role == "tool":
                after_outputs = True
                if first_output:
                    items.append(Special(self.OUTPUTS_BEGIN))
                    first_output = False
                else:
                    items.append(Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, self.NEXT))
                items.append(Special(self.OUTPUT_BEGIN))
                items.extend(self._content(message))
                items.append(Special(self.OUTPUT_END))
            elif message.calls and _content_text(message) == "":
                after_outputs = False
                for call in message.calls:
                    if first_call:
                        items.extend((Special(self.ASSISTANT), Special(self.CALLS_BEGIN)))
                    else:
                        items.append(Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, self.NEXT))
                    items.append(Special(self.CALL_BEGIN))
                    items.append(Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "function"))
                    items.append(Special(self.SEP))
                    items.append(Text(message.bucket, message.object_id, _call_text(call)))
                    items.append(Special(self.CALL_END))
                    if not first_call:
                        items.extend((Special(self.CALLS_END), Special(self.EOS)))
                    first_call = False
            else:
                items.append(Special(self.OUTPUTS_END if after_outputs else self.ASSISTANT))
                after_outputs = False
                items.extend(self._content(message))
                items.extend(
                    Bound(message.bucket, message.object_id, _call_text(call)) for call in message.calls
                )
                items.append(Special(self.EOS))
        items.append(Special(self.OUTPUTS_END if after_outputs else self.ASSISTANT))
        return _with_seams(items)

    @staticmethod
    def _content(message: Message) -> list[Piece]:
        """The message's content: its text as one piece, or (holding an image) each part."""
        text = _content_text(message)
        if text is not None:
            return [Text(message.bucket, message.object_id, text)] if text else []
        return [piece for segment in message.segments if (piece := _piece(message, segment)) is not None]


def _with_seams(items: Sequence[Piece]) -> Iterator[Piece]:
    """The stream of ``items``, in which texts may touch: each run of touching texts (and the images among
    them, which the template does not render) cut where DeepSeek-V3's pre-tokenizer must split it, and a cut
    on each side of a bound."""
    run: list[Text | Image] = []
    last: Piece | None = None
    for item in items:
        if isinstance(item, Text | Image):
            run.append(item)
            continue
        for piece in _split_run(run):
            last = piece
            yield piece
        run.clear()
        if isinstance(item, Special):
            last = item
            yield item
            continue
        if last is not None and not isinstance(last, Special | Cut):
            yield Cut()
        yield item
        last = Cut()
        yield last
    yield from _split_run(run)


# Finds every added token of DeepSeek-V3's tokenizer, and more (``test_deepseek_golden`` checks it on each
# added token of the pinned file): a run of touching texts in which it finds nothing holds no added token, so
# only the pre-tokenizer decides where the run's text splits.
_ADDED_TOKEN_LIKE = re.compile(
    r"<\uff5c[^\uff5c]*\uff5c>|<\|[^|]*\|>|</?think>|</?dsml:|\uff5cDSML\uff5c|<\uff5c/table>\uff5c"
)


def _split_run(run: Sequence[Text | Image]) -> Iterator[Piece]:
    """Texts that touch, as pieces cut at seams DeepSeek-V3's pre-tokenizer must split (``ladder.seams``).

    A seam it must split is a cut. Around one where it may merge, the cuts are the last split inside the text
    before it and the first inside the text after it (none if there is none), and what lies between is one
    piece, attributed to the object (not the template) with most characters in it.

    An image among the texts stands at a seam of its own, and comes after the piece that holds that seam.
    The template renders no image, so whether the texts on either side of one reach the model touching (the
    image left out) or apart (something in its place) is not published: across a seam the pre-tokenizer
    must split, both readings count the same and the pieces stay exact; around one where it may merge, the
    piece holding the seam is a ``Bound`` (its UTF-8 bytes cover its tokens in either reading), and the
    stream is counted ``UPPER_BOUND``. So is every piece of a run that may hold an added token
    (``_ADDED_TOKEN_LIKE``): the tokenizer matches those before it pre-tokenises.
    """
    texts: list[Text] = []
    images: list[tuple[int, Image]] = []  # (the number of texts before it, the image)
    for item in run:
        if isinstance(item, Image):
            images.append((len(texts), item))
        elif item.text:
            texts.append(item)
    if not images and len(texts) <= 1:
        yield from texts
        return
    joined = "".join(text.text for text in texts)
    if _ADDED_TOKEN_LIKE.search(joined):
        # The tokenizer matches its added tokens before it pre-tokenises, so a seam's cut could fall inside
        # one, or one could straddle two texts: every piece of the run is bounded by its bytes.
        for number, item in enumerate(item for item in run if isinstance(item, Image) or item.text):
            if number:
                yield Cut()
            yield item if isinstance(item, Image) else Bound(item.bucket, item.object_id, item.text)
        return
    starts = [0]
    for text in texts:
        starts.append(starts[-1] + len(text.text))
    cuts: list[int] = []
    for index in range(1, len(texts)):
        seam = starts[index]
        if splits_between(joined[seam - 1], joined[seam]):
            cuts.append(seam)
            continue
        left = next(
            (p for p in range(seam - 1, starts[index - 1], -1) if splits_between(joined[p - 1], joined[p])),
            None,
        )
        right = next(
            (q for q in range(seam + 1, starts[index + 1]) if splits_between(joined[q - 1], joined[q])),
            None,
        )
        cuts.extend(position for position in (left, right) if position is not None)
    bounds = [0, *sorted(set(cuts)), len(joined)] if joined else [0]
    # Each image at the offset of the seam it stands in: after the piece that holds the offset, or first.
    offsets = [(starts[count], image) for count, image in images]
    atoms: list[Piece] = [image for offset, image in offsets if offset == 0]
    owner = 0
    for begin, end in itertools.pairwise(bounds):
        while starts[owner + 1] <= begin:
            owner += 1
        best, most = owner, -1
        candidate = owner
        while candidate < len(texts) and starts[candidate] < end:
            share = min(end, starts[candidate + 1]) - max(begin, starts[candidate])
            weight = share if texts[candidate].bucket != TEMPLATE_BUCKET else 0
            if weight > most:
                best, most = candidate, weight
            candidate += 1
        inside = [image for offset, image in offsets if begin < offset <= end]
        text = texts[best]
        if any(begin < offset < end for offset, _ in offsets):
            atoms.append(Bound(text.bucket, text.object_id, joined[begin:end]))
        elif begin == starts[best] and end == starts[best + 1]:
            atoms.append(text)
        else:
            atoms.append(Text(text.bucket, text.object_id, joined[begin:end]))
        atoms.extend(inside)
    for number, atom in enumerate(atoms):
        if number:
            yield Cut()
        yield atom


class MetaTemplate(ChatTemplate):
    """Tokens of the legacy Anthropic tokenizer: ``<META_START>role<META_END>`` parts joined by ``<META>``."""

    family = "meta"
    revision = "meta/2"
    SOS = "<SOS>"
    EOT = "<EOT>"
    META = "<META>"
    META_START = "<META_START>"
    META_END = "<META_END>"
    specials = frozenset({SOS, EOT, META, META_START, META_END})

    def _header(self, role: str) -> Iterator[Piece]:
        yield Special(self.META_START)
        yield FixedText(TEMPLATE_BUCKET, TEMPLATE_OBJECT, role)
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


def _content_text(message: Message) -> str | None:
    """The message's content as the one string the OpenAI payload sends, or None when it holds an image."""
    if any(isinstance(segment.part, ImagePart) for segment in message.segments):
        return None
    return "".join(segment.part.text for segment in message.segments if isinstance(segment.part, TextPart))


class OpenAITemplate(ChatTemplate):
    """OpenAI chat models (``o200k_base``/``cl100k_base``), framed as OpenAI publishes it.

    OpenAI's published rule (the cookbook's ``num_tokens_from_messages``): each message costs 3 tokens plus
    the tokens of each of its values, the role included (1 more for a name, which this platform never
    sends), and 3 more prime the reply. The three framing tokens of a message are specials here, so the
    role's and the content's tokens are counted on their own as the rule counts them. A text-only message is
    sent with its content as one string, and counted as that string.

    OpenAI does not publish how it frames tool definitions, the response format, tool calls or tool results.
    Those are ``Bound`` pieces, so a request holding any of them is never counted ``EXACT``. Where its pool
    has OpenAI's counting API (``ModelSpec.bound_counter``), the payload the ladder ends on is counted by it
    (``PROVIDER_COUNT``, OpenAI's own count of that payload). Without one it is ``UPPER_BOUND``: each tool and
    the output schema is a message of its own here (3 framing specials and its role) holding its text as a
    ``Bound``, and ``TOOL_ALLOWANCE`` specials more, and the first system message's instructions have a
    ``Bound`` of their end after them (3 below); each tool call and tool result is a ``Bound`` and the
    specials of its message in harmony's framing, and an assistant's text beside its calls has the special
    and the channel of its own message (5 and 6 below).

    Why that never undercounts tools and the response format, as OpenAI renders them in the one framing it
    has published (``ladder.openai_framing``: the ``namespace functions`` section and the response-format
    section of the system or developer message):

    1. Every token of o200k_base and cl100k_base is at least one byte (the tests check the whole vocabulary),
       and tiktoken's tokens of a text concatenate to its bytes, so no text has more tokens than UTF-8 bytes.
    2. A tool's ``Bound`` is the longer in bytes of its JSON definition and its part of the namespace section
       (``tool_bound_text``); the request's first tool adds ``TOOLS_OPEN`` + ``TOOLS_CLOSE``, the text the
       section opens and closes with; the output schema's is the longer of its system text and its
       response-format section (``schema_bound_text``). The sections are the concatenation of the namespace
       and response-format texts, none longer in bytes than its ``Bound``, so by 1 their tokens are at most
       the sum of the ``Bound`` bytes, whatever merges inside them.
    3. The section travels in a developer message of its own (3 framing tokens and its role: 4, below the 12
       specials an item brings here), or after the first system message's instructions ``T``, joined by
       ``\\n\\n``. For that placement the first system message holds, after ``T``, a ``Bound`` of
       ``trailing_run(T)``: ``R``, the end of ``T`` after its last letter or digit (Unicode L and N). tiktoken
       cuts a text into pre-tokens left to right with its vocabulary's regex (tiktoken's ``openai_public.py``:
       o200k_base's and cl100k_base's) and encodes each on its own; a match depends only on the characters
       the regex reads from where it starts, forward (neither regex looks behind).

       a. A match that starts at or before ``T``'s last letter or digit is the same in ``T`` and in ``T``
          followed by ``\\n\\n``. In a pre-token only letters, marks, digits (three at most) and a
          contraction (``'s``, ``'ll`` …: letters after the apostrophe) follow a letter or a digit, and each
          rejects a line break as it rejects the end of the text; the alternatives of whitespace and
          punctuation (``\\s*[\\r\\n]+``, ``\\s+(?!\\S)``, ``\\s++$``, `` ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*`` …)
          take no letter or digit, so they stop before it. So ``T``'s pre-tokens up to the one holding its
          last letter or digit are unchanged, and only those after it, all inside ``R``, can take the
          ``\\n\\n`` in (a run of spaces, line breaks, punctuation, CJK punctuation or ideographic spaces).
       b. Inside a pre-token a line break is followed only by whitespace or ``/``, and every section opens
          with ``#``: the section's pre-tokens start after the ``\\n\\n``, the same as alone.

       So the joined text costs the tokens of ``T``'s unchanged pre-tokens (at most ``T``'s count), at most
       ``R``'s bytes and the 2 of ``\\n\\n`` for the pre-tokens after them (by 1), and the section's own
       tokens: ``T``'s ``Text``, the ``Bound`` of ``R`` and the sections' ``Bound`` pieces (which open with
       that ``\\n\\n``) cover it. ``R`` is empty for instructions ending in a letter or a digit and short for
       most others, so the instructions stay counted exactly, not by their bytes. The tests check a and b on
       tiktoken's own regexes, and find instructions whose join costs more than the ``\\n\\n``'s bytes.
    4. The cookbook's ``num_tokens_for_tools`` (its constants for gpt-4o: 7 a function, 3 the properties, 3
       a property, -3 an enum, 3 an item, 12 at the end) counts the name and description, each top-level
       property's name, type and description, and the enum items, all texts the JSON definition holds, plus
       constants below the JSON's own punctuation around them; it is below the bound too (tested).

    Why it never undercounts tool calls and tool results, which harmony renders as messages of their own
    (``<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>`` and
    ``<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{result}<|end|>``):

    5. A call's ``Bound`` is the longer in bytes of its id + name + arguments and the texts of its call
       message between the specials (``call_bound_text``), and ``CALL_SPECIALS`` (5: ``<|constrain|>``
       included, which the model writes before ``json``) follow it, inside the assistant message that sends
       it. A result's text parts are ``Bound`` pieces, then the longer of its ``tool_call_id`` and its
       message's header texts (``result_bound_text``; the name is that of the call it answers, found in the
       request: the parser admits no result without its call, and no compaction splits them), then
       ``RESULT_SPECIALS`` (4), inside a message of its own (3 framing specials and the role ``tool``). An
       assistant message with content beside its calls is also rendered as a message of its own in harmony,
       ``<|start|>assistant<|channel|>commentary<|message|>{text}<|end|>``: the published rule's 3 tokens,
       its role and content, and ``<|channel|>`` and the channel more, so that message here has
       ``CHANNEL_SPECIAL`` and a ``Bound`` of ``TEXT_CHANNEL``, the longest of harmony's channels in bytes
       (``commentary``; ``analysis`` and ``final`` are shorter), whichever the text is rendered in.
    6. A special is never inside a pre-token: harmony (and tiktoken with specials) cuts the text at each
       special and encodes every text between two of them on its own. So a call message costs its specials
       plus the tokens of its texts, at most their bytes by 1, whichever way harmony cuts the same
       characters (the recipient in the header or in the channel, ``json`` after ``<|constrain|>`` or not);
       so does a result message, and the published rule's count of a tool message as sent (3 framing tokens,
       its role, content and ``tool_call_id``). The other messages render in harmony as
       ``<|start|>{role}<|message|>{content}<|end|>``, the published rule's 3 tokens and its values, and
       harmony primes the reply with 2 tokens, below the rule's 3.

    What we send stays in each maximum so that an item is never bounded below the JSON text of it: OpenAI's
    serving framing is still unpublished, and the drift status compares the bound with what it reports.
    """

    family = "openai"
    revision = "openai/4"
    START = "<|im_start|>"
    SEP = "<|im_sep|>"
    END = "<|im_end|>"
    PRIME = "<|reply|>"
    ALLOWANCE = "<|framing|>"
    TOOL_ALLOWANCE = 8
    specials = frozenset(
        {START, SEP, END, PRIME, ALLOWANCE, CHANNEL_SPECIAL, *CALL_SPECIALS, *RESULT_SPECIALS}
    )

    def payload(self, components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
        """The chat-completions payload, with each text-only message's content sent as one string."""
        payload = build_payload(components, memo)
        sent = [message for message in messages(components, memo) if message.in_payload]
        entries = payload["messages"]
        assert isinstance(entries, list) and len(entries) == len(sent)
        for entry, message in zip(entries, sent, strict=True):
            text = _content_text(message)
            if text is not None and entry["content"] is not None:
                entry["content"] = text
        return payload

    def _allowance(self) -> Iterator[Piece]:
        for _ in range(self.TOOL_ALLOWANCE):
            yield Special(self.ALLOWANCE)

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
        names = {call.id: call.name for message in message_list for call in message.calls}
        # The hidden sections may follow the first system message's instructions (step 3).
        joined = any(not message.in_payload for message in message_list)
        tools_opened = False
        for message in message_list:
            yield Special(self.START)
            yield FixedText(TEMPLATE_BUCKET, TEMPLATE_OBJECT, message.role)
            yield Special(self.SEP)
            text = _content_text(message)
            if not message.in_payload or message.role == "tool":
                for segment in message.segments:
                    yield from self._bounded(message, segment)
                if not message.in_payload and message.bucket == "tools" and not tools_opened:
                    tools_opened = True
                    yield Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, TOOLS_OPEN + TOOLS_CLOSE)
                    yield Cut()
                if message.tool_call_id is not None:
                    yield from self._result_framing(message, message.tool_call_id, names)
            elif text is not None:
                if text:
                    yield Text(message.bucket, message.object_id, text)
                    yield Cut()
            else:
                for segment in message.segments:
                    piece = _piece(message, segment)
                    if piece is not None:
                        yield piece
                        yield Cut()
            if joined and message.in_payload and message.role == "system":
                joined = False
                yield from self._instructions_end(message)
            if message.calls and message.segments:
                yield Special(CHANNEL_SPECIAL)
                yield Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, TEXT_CHANNEL)
                yield Cut()
            for call in message.calls:
                yield Bound(
                    message.bucket, message.object_id, call_bound_text(call.id, call.name, call.arguments)
                )
                yield Cut()
                yield from map(Special, CALL_SPECIALS)
            if not message.in_payload:
                yield from self._allowance()
            yield Special(self.END)
        yield Special(self.PRIME)
        yield Special(self.PRIME)
        yield Special(self.PRIME)

    @staticmethod
    def _instructions_end(message: Message) -> Iterator[Piece]:
        """The allowance for the instructions' last pre-tokens merging with the ``\\n\\n`` that joins the
        hidden sections to them (step 3): a ``Bound`` of the end of their last text after its last letter or
        digit, none when the message ends with an image (no text there to merge)."""
        text = _content_text(message)
        if text is None:
            # With an image each part is a piece of its own: the join follows the last one counted.
            counted = [
                segment.part
                for segment in message.segments
                if isinstance(segment.part, ImagePart) or segment.part.text
            ]
            text = counted[-1].text if isinstance(counted[-1], TextPart) else ""
        run = trailing_run(text)
        if run:
            yield Bound(TEMPLATE_BUCKET, TEMPLATE_OBJECT, run)
            yield Cut()

    @staticmethod
    def _result_framing(message: Message, call_id: str, names: dict[str, str]) -> Iterator[Piece]:
        """A result's framing in harmony, bounded: its header names the function of the call it answers."""
        name = names.get(call_id)
        if name is None:
            raise TemplateError(f"the tool result for {call_id!r} has no tool call in the request")
        yield Bound(message.bucket, message.object_id, result_bound_text(call_id, name))
        yield Cut()
        yield from map(Special, RESULT_SPECIALS)

    @staticmethod
    def _bounded(message: Message, segment: Segment) -> Iterator[Piece]:
        part = segment.part
        if isinstance(part, ImagePart):
            yield Image(message.bucket, message.object_id, part.width, part.height)
        elif part.text:
            text = part.text
            if not message.in_payload and message.bucket == "tools":
                text = tool_bound_text(text)
            elif not message.in_payload and message.bucket == "outputSchema":
                text = schema_bound_text(text, text.removeprefix(OUTPUT_SCHEMA_LABEL))
            yield Bound(message.bucket, message.object_id, text)
        yield Cut()


class Llama3Template(ChatTemplate):
    """Llama 3.x instruct, framed as Meta's ``llama_models.llama3.chat_format.ChatFormat`` frames a dialog.

    ``<|begin_of_text|>``, then per message ``<|start_header_id|>role<|end_header_id|>`` and ``\n\n`` (a tool
    result's role is ``ipython``), each content part encoded on its own (an image is one ``<|image|>``
    token, as ChatFormat emits it; the vision encoder takes the pixels), each tool call as ChatFormat's JSON
    tool-call text, ``<|eot_id|>``; and the assistant's header to prime the reply. Tool definitions are
    system messages (the platform's rendering, as for every family).
    """

    family = "llama3"
    revision = "llama3/1"
    BOS = "<|begin_of_text|>"
    START_HEADER = "<|start_header_id|>"
    END_HEADER = "<|end_header_id|>"
    EOT = "<|eot_id|>"
    PYTHON_TAG = "<|python_tag|>"
    IMAGE = "<|image|>"
    specials = frozenset({BOS, START_HEADER, END_HEADER, EOT, PYTHON_TAG, IMAGE})
    # Meta's built-in tools, which ChatFormat encodes in their own syntax rather than as JSON.
    QUERY_TOOLS = ("brave_search", "wolfram_alpha", "photogen")
    CODE_TOOL = "code_interpreter"

    def _header(self, role: str) -> Iterator[Piece]:
        yield Special(self.START_HEADER)
        yield FixedText(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "ipython" if role == "tool" else role)
        yield Special(self.END_HEADER)
        yield FixedText(TEMPLATE_BUCKET, TEMPLATE_OBJECT, "\n\n")
        yield Cut()

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
        yield Special(self.BOS)
        for message in message_list:
            yield from self._header(message.role)
            if message.calls and message.calls[0].name == self.CODE_TOOL:
                yield Special(self.PYTHON_TAG)
            for segment in message.segments:
                part = segment.part
                if isinstance(part, ImagePart):
                    yield Special(self.IMAGE)
                elif part.text:
                    yield Text(message.bucket, message.object_id, part.text)
                    yield Cut()
            for call in message.calls:
                text = self.call_text(call)
                if text is None:
                    # Meta's code cannot frame it: bounded by the bytes of its JSON tool-prompt format.
                    yield Bound(message.bucket, message.object_id, self.json_call_text(call))
                else:
                    yield Text(message.bucket, message.object_id, text)
                yield Cut()
            yield Special(self.EOT)
        yield from self._header("assistant")

    @classmethod
    def call_text(cls, call: ToolCall) -> str | None:
        """Return the text ChatFormat encodes for a tool call (its JSON tool-prompt format; a built-in tool's
        own syntax), or None for a call Meta's code does not frame as text: arguments nested deeper than
        Meta's ``ToolCall`` holds (a value is a primitive, a list of primitives or an object of them), a
        built-in call without the argument its syntax needs, code that is not a string, or a value holding a
        lone surrogate (escaped in the arguments' JSON), which no encoder takes.

        Arguments that parse as a JSON object are the call's parameters; any other text is passed as the
        string it is.
        """
        arguments = cls._arguments(call)
        if isinstance(arguments, dict) and not _meta_typed(arguments):
            return None
        if call.name not in cls.QUERY_TOOLS and call.name != cls.CODE_TOOL:
            return json.dumps({"type": "function", "name": call.name, "parameters": arguments})
        key = "code" if call.name == cls.CODE_TOOL else "query"
        if not isinstance(arguments, dict) or key not in arguments:
            return None
        value = arguments[key]
        if call.name == cls.CODE_TOOL and not isinstance(value, str):
            return None
        text = value if call.name == cls.CODE_TOOL else f'{call.name}.call(query="{value}")'
        return None if _LONE_SURROGATE.search(text) else text

    @classmethod
    def json_call_text(cls, call: ToolCall) -> str:
        """The call in the JSON tool-prompt format, non-ASCII escaped: never fewer bytes than its text."""
        return json.dumps({"type": "function", "name": call.name, "parameters": cls._arguments(call)})

    @staticmethod
    def _arguments(call: ToolCall) -> object:
        try:
            parsed = json.loads(call.arguments)
        except ValueError:
            parsed = None
        return parsed if isinstance(parsed, dict) else call.arguments


def _meta_typed(arguments: dict[str, object]) -> bool:
    """Whether Meta's ``ToolCall`` holds these arguments (its ``RecursiveType``, one level deep)."""
    for value in arguments.values():
        if isinstance(value, list):
            if not all(isinstance(item, _PRIMITIVES) for item in value):
                return False
        elif isinstance(value, dict):
            if not all(isinstance(item, _PRIMITIVES) for item in value.values()):
                return False
        elif not isinstance(value, _PRIMITIVES):
            return False
    return True


_PRIMITIVES = (str, int, float, bool, type(None))
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_VALID_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def mistral_call_id(call_id: str) -> str:
    """Return ``call_id`` if Mistral accepts it, else nine letters and digits derived from it."""
    if _VALID_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        out.append(_ALPHABET[digit])
    return "".join(out)


def _with_mistral_ids(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        entry = dict(entry)
        if "tool_call_id" in entry:
            entry["tool_call_id"] = mistral_call_id(str(entry["tool_call_id"]))
        if entry.get("tool_calls"):
            entry["tool_calls"] = [dict(call, id=mistral_call_id(call["id"])) for call in entry["tool_calls"]]
        out.append(entry)
    return out


def _request_json(message_list: tuple[Message, ...]) -> str:
    """The request as a Mistral endpoint reads it (images left out), as compact JSON."""
    entries: list[dict[str, Any]] = []
    tools: list[Any] = []
    for message in message_list:
        if not message.in_payload:
            if message.bucket == "tools":
                tools.extend(json.loads(segment.part.text) for segment in _texts(message))
            continue
        content: list[dict[str, str]] | None = [
            {"type": "text", "text": segment.part.text} for segment in _texts(message)
        ]
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        if message.calls:
            # As build_payload: no content only when the message has no part at all (images included).
            entry["content"] = content if message.segments else None
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.calls
            ]
        entries.append(entry)
    request: dict[str, Any] = {"messages": _with_mistral_ids(entries)}
    if tools:
        request["tools"] = tools
    # Key order kept: Mistral re-serialises tool schemas in the order the payload gives them.
    return json.dumps(request, ensure_ascii=False, separators=(",", ":"))


def _texts(message: Message) -> Iterator[Any]:
    return (segment for segment in message.segments if isinstance(segment.part, TextPart))


class MistralTemplate(ChatTemplate):
    """The request JSON (counted by ``MistralCounter``), then each image and the output schema."""

    family = "mistral"
    revision = "mistral/1"
    specials = frozenset()

    def payload(self, components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
        """The chat-completions payload, with tool-call ids as Mistral accepts them."""
        payload = build_payload(components, memo)
        entries = payload["messages"]
        assert isinstance(entries, list)
        payload["messages"] = _with_mistral_ids(entries)
        return payload

    def _stream(self, message_list: tuple[Message, ...]) -> Iterator[Piece]:
        yield Cut()
        yield Text(TEMPLATE_BUCKET, TEMPLATE_OBJECT, _request_json(message_list))
        yield Cut()
        for message in message_list:
            for segment in message.segments:
                part = segment.part
                if isinstance(part, ImagePart):
                    yield Image(message.bucket, message.object_id, part.width, part.height)
                    yield Cut()
                elif message.bucket == "outputSchema":
                    yield Bound(message.bucket, message.object_id, part.text)
                    yield Cut()


_TEMPLATES: dict[str, ChatTemplate] = {
    DeepSeekTemplate.family: DeepSeekTemplate(),
    MetaTemplate.family: MetaTemplate(),
    OpenAITemplate.family: OpenAITemplate(),
    Llama3Template.family: Llama3Template(),
    MistralTemplate.family: MistralTemplate(),
}
TEMPLATE_FAMILIES: tuple[str, ...] = tuple(sorted(_TEMPLATES))


def get_template(family: str) -> ChatTemplate:
    """Return the template of ``family``. Raises TemplateError for an unknown family."""
    try:
        return _TEMPLATES[family]
    except KeyError:
        raise TemplateError(f"unknown chat-template family {family!r}") from None
