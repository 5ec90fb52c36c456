"""Token counting of a rendered stream: exact with the model's tokenizer, or a proven upper bound.

A stream's count is the number of its special tokens, plus the count of each text piece, plus the image cost
of each image (``ladder.templates`` guarantees these add up exactly). Text counts are cached per segment
under ``tc:{tokenizer digest}:{template revision}:{sha256 of the text}``, so a count made with another
tokenizer file or another template revision is never reused. In front of that shared cache, ``TextCounts``
keeps this process's counts under the same three parts, the text itself in place of its sha256: a warm count
then costs a dictionary lookup per segment, no key built and no round trip.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import unicodedata
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse, repeat
from operator import attrgetter, is_, is_not, not_
from pathlib import Path
from typing import Literal, Protocol, cast

from tokenizers import Tokenizer

from ladder.components import canonical_digest
from ladder.templates import (
    BOUND,
    FIXED,
    IMAGE,
    KINDS,
    SPECIAL,
    TEMPLATE_BUCKET,
    TEMPLATE_OBJECT,
    Bound,
    Image,
    Piece,
    Text,
    check_boundaries,
)

CountMethod = Literal["EXACT", "UPPER_BOUND", "PROVIDER_COUNT"]
"""``EXACT``: the model's own tokenizer, proven equal to the vendor's code. ``UPPER_BOUND``: an approved bound
that never undercounts. ``PROVIDER_COUNT``: the provider's counting API answered for the final payload (its
own count, which Anthropic documents as an estimate): never called exact."""
ImageFormula = Literal["tiles512", "pixels750"]
IMAGE_FORMULAS: tuple[ImageFormula, ...] = ("tiles512", "pixels750")
# Images are scaled down so that their long side is at most this many pixels before the formula applies.
IMAGE_MAX_SIDE = 2048
# ``tiles512`` then scales the short side down to this many pixels (OpenAI's rule for a high-detail image).
TILES_SHORT_SIDE = 768


class CountingUnavailable(Exception):
    """Counting cannot be done now: tokenizer file missing, unreadable or not the expected one; a timeout."""


class SegmentCounter(Protocol):
    """Counts text segments with one tokenizer (or one approved bound of it)."""

    @property
    def digest(self) -> str:
        """Identity of the counting function; part of every cache key."""
        ...

    @property
    def method(self) -> CountMethod:
        """``EXACT`` for a real tokenizer, ``UPPER_BOUND`` for a proven bound."""
        ...

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Return the token count of each text, in order. Raises CountingUnavailable."""
        ...


class CountCache(Protocol):
    """A cache of segment counts (Redis in production)."""

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        """Return the cached count of each key, or None where there is none."""
        ...

    def set_many(self, mapping: Mapping[str, int]) -> None:
        """Store counts."""
        ...


class MemoryCountCache:
    """A process-local ``CountCache`` (tests, benchmarks, and the short-lived upper-bound path)."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        """Return the cached count of each key, or None."""
        data = self.data
        return [data.get(key) for key in keys]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        """Store counts."""
        self.data.update(mapping)


class TextCounts:
    """This process's segment counts, keyed by (counter digest, template revision, the text itself).

    The same identity as a shared cache key (``cache_key``), so a count made with another tokenizer file (a
    new digest) or another template revision is never reused; only the text stands for its sha256. Each
    (digest, revision) has its own table, keyed by the text alone: finding a stream's segments is then one
    ``map`` of the table's ``get`` in C, the string's own hash (computed once per string object) and a
    comparison each, where a cache key costs its UTF-8 encoding, a sha256 and the shared cache's round trip.

    Bounded by the characters it holds (``max_chars``; 0 keeps nothing): the least recently used text of the
    least recently used table goes out first, so a table no count asks for any more (an old tokenizer or
    template revision) is emptied before the one in use loses a text. Safe to share between threads.
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        # Both levels least recently used first.
        self._tables: OrderedDict[tuple[str, str], OrderedDict[str, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(map(len, self._tables.values()))

    @property
    def chars(self) -> int:
        """The characters of the texts held."""
        return self._chars

    def get_many(self, counter_digest: str, template_revision: str, texts: Sequence[str]) -> list[int | None]:
        """Return the count of each text under this counter and template revision, or None where unknown.

        Each text found becomes the most recently used of its table, and its table of the tables.
        """
        identity = (counter_digest, template_revision)
        with self._lock:
            table = self._tables.get(identity)
            if table is None:
                return [None] * len(texts)
            self._tables.move_to_end(identity)
            found = list(map(table.get, texts))
            hits = texts if None not in found else compress(texts, map(is_not, found, repeat(None)))
            # Consumed in C, like the lookups: no Python step per text.
            deque(map(table.move_to_end, hits), maxlen=0)
        return found

    def set_many(self, counter_digest: str, template_revision: str, counts: Mapping[str, int]) -> None:
        """Keep the counts of these texts under this counter and template revision (a text longer than
        ``max_chars`` is not kept), each the most recently used of its table."""
        limit = self.max_chars
        if max(map(len, counts), default=0) > limit:
            counts = {text: value for text, value in counts.items() if len(text) <= limit}
        if not counts:
            return
        identity = (counter_digest, template_revision)
        tables = self._tables
        with self._lock:
            table = tables.get(identity)
            if table is None:
                table = tables[identity] = OrderedDict()
            else:
                tables.move_to_end(identity)
            held = list(filter(table.__contains__, counts))
            deque(map(table.move_to_end, held), maxlen=0)
            table.update(counts)
            self._chars += sum(map(len, counts)) - sum(map(len, held))
            while self._chars > limit:
                oldest_identity, oldest = next(iter(tables.items()))
                text, _ = oldest.popitem(last=False)
                self._chars -= len(text)
                if not oldest:
                    del tables[oldest_identity]

    def clear(self) -> None:
        """Forget every count."""
        with self._lock:
            self._tables.clear()
            self._chars = 0


# ------------------------------------------------------------------------------------------------ counters


def file_digest(data: bytes) -> str:
    """Return ``'sha256:' + hex`` of a tokenizer file's bytes (its ``tokenizerDigest``)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


_LOCK = threading.Lock()
# One Tokenizer per file content per process, and the digest of each file version seen (keyed by its stat).
_BY_DIGEST: dict[str, Tokenizer] = {}
_DIGEST_BY_STAT: dict[tuple[str, int, int, int, int, int], str] = {}


def _load(digest: str, data: bytes) -> Tokenizer:
    """Return the process's one Tokenizer for these bytes, building it on first use."""
    with _LOCK:
        loaded = _BY_DIGEST.get(digest)
    if loaded is not None:
        return loaded
    tokenizer = Tokenizer.from_buffer(data)
    with _LOCK:
        return _BY_DIGEST.setdefault(digest, tokenizer)


@dataclass(frozen=True, eq=False)
class TokenizerCounter:
    """Exact counts with a Hugging Face ``tokenizers`` tokenizer.

    Content that spells an added token (special or not) is counted as that token, as a server reads the
    prompt the published template renders (``tests/ladder/test_deepseek_golden.py``'s reference), and no
    special tokens are added around a segment: the template's specials are counted by the stream.
    """

    tokenizer: Tokenizer
    digest: str

    @property
    def method(self) -> CountMethod:
        """Always ``EXACT``."""
        return "EXACT"

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, expected_digest: str | None = None
    ) -> TokenizerCounter:
        """Load the tokenizer file at ``path``, at most once per process for each file content.

        The digest is computed from the very bytes that are loaded, so it always names what counts.
        Raises CountingUnavailable if the file is missing, unreadable, not a tokenizer, or (when
        ``expected_digest`` is given) not the expected file.
        """
        file = Path(path)
        try:
            # A rewritten or replaced file (or a symlink pointed elsewhere: stat follows it) has a new stat
            # key, so it is read and hashed again. No resolve(): it costs ten stats, on every admission.
            stat = file.stat()
            stat_key = (str(file), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
            with _LOCK:
                digest = _DIGEST_BY_STAT.get(stat_key, "")
                tokenizer = _BY_DIGEST.get(digest)
            if tokenizer is None:
                data = file.read_bytes()
                digest = file_digest(data)
                tokenizer = _load(digest, data)
                with _LOCK:
                    _DIGEST_BY_STAT[stat_key] = digest
        except OSError as exc:
            raise CountingUnavailable(f"tokenizer file {file} is unavailable: {exc}") from exc
        except Exception as exc:  # the Rust loader raises plain Exception for a malformed file
            raise CountingUnavailable(f"tokenizer file {file} cannot be loaded: {exc}") from exc
        if expected_digest is not None and digest != expected_digest:
            raise CountingUnavailable(
                f"tokenizer file {file} has digest {digest}, expected {expected_digest}"
            )
        return cls(tokenizer, digest)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` (special-token spellings in it are plain text)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def special_id(self, token: str) -> int | None:
        """Return the id of an added token of this tokenizer, or None."""
        return self.tokenizer.token_to_id(token)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Return the exact token count of each text (one batch call into the tokenizer)."""
        if not texts:
            return []
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [len(encoding) for encoding in encodings]


UpperBoundRule = Literal["UTF8_BYTES", "NFKC_UTF8_BYTES"]
UPPER_BOUND_RULES: tuple[UpperBoundRule, ...] = ("UTF8_BYTES", "NFKC_UTF8_BYTES")


@dataclass(frozen=True)
class UpperBoundCounter:
    """A proven upper bound for a byte-level BPE tokenizer: every token covers at least one byte of the
    (normalised) text, so a segment never has more tokens than the UTF-8 bytes of its NFKC form (``nfkc``,
    for a tokenizer with an NFKC normaliser, which can expand text) or of the text itself (no normaliser).
    """

    nfkc: bool
    tokenizer_digest: str

    @property
    def method(self) -> CountMethod:
        """Always ``UPPER_BOUND``."""
        return "UPPER_BOUND"

    @property
    def digest(self) -> str:
        """Cache identity, distinct from the exact counter of the same tokenizer."""
        rule = "nfkc-utf8" if self.nfkc else "utf8"
        return f"upper-bound:{rule}:{self.tokenizer_digest}"

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Return the bound of each text."""
        if self.nfkc:
            return [len(unicodedata.normalize("NFKC", text).encode("utf-8")) for text in texts]
        return [len(text.encode("utf-8")) for text in texts]


def upper_bound_rule(tokenizer_json: Mapping[str, object]) -> UpperBoundRule | None:
    """Return the upper-bound rule that is proven for a ``tokenizers`` JSON document, or None.

    Proven: a BPE model with a ByteLevel pre-tokenizer (every token covers at least one byte) and either no
    normaliser (``UTF8_BYTES``) or exactly NFKC (``NFKC_UTF8_BYTES``). Anything else has no approved bound.
    """
    model = tokenizer_json.get("model")
    if not isinstance(model, Mapping) or model.get("type") != "BPE":
        return None
    if not _has_byte_level(tokenizer_json.get("pre_tokenizer")):
        return None
    normalizer = tokenizer_json.get("normalizer")
    if normalizer is None or (
        isinstance(normalizer, Mapping)
        and normalizer.get("type") == "Sequence"
        and not normalizer.get("normalizers")
    ):
        return "UTF8_BYTES"
    if isinstance(normalizer, Mapping) and normalizer.get("type") == "NFKC":
        return "NFKC_UTF8_BYTES"
    return None


def _has_byte_level(pre_tokenizer: object) -> bool:
    if not isinstance(pre_tokenizer, Mapping):
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    children = pre_tokenizer.get("pretokenizers")
    return (
        pre_tokenizer.get("type") == "Sequence"
        and isinstance(children, list)
        and any(_has_byte_level(child) for child in children)
    )


# -------------------------------------------------------------------------------------------------- images


def image_tokens(width: int, height: int, formula: ImageFormula) -> int:
    """Return the token cost of an image after scaling its long side down to ``IMAGE_MAX_SIDE``.

    ``tiles512``: OpenAI's published rule for a high-detail image, 85 + 170 per 512-pixel tile once its short
    side is also scaled down to ``TILES_SHORT_SIDE``; ``pixels750``: one token per 750 pixels, rounded up.
    Scaled sides are rounded up, so the cost is never under-counted. Raises ValueError for an unknown formula
    or a non-positive side.
    """
    if width <= 0 or height <= 0:
        raise ValueError("image sides must be positive")
    long_side = max(width, height)
    if long_side > IMAGE_MAX_SIDE:
        width = -(-width * IMAGE_MAX_SIDE // long_side)
        height = -(-height * IMAGE_MAX_SIDE // long_side)
    if formula == "tiles512":
        short_side = min(width, height)
        if short_side > TILES_SHORT_SIDE:
            width = -(-width * TILES_SHORT_SIDE // short_side)
            height = -(-height * TILES_SHORT_SIDE // short_side)
        return 85 + 170 * math.ceil(width / 512) * math.ceil(height / 512)
    if formula == "pixels750":
        return -(-width * height // 750)
    raise ValueError(f"unknown image formula {formula!r}")


# -------------------------------------------------------------------------------------------------- stream


@dataclass(frozen=True)
class Count:
    """The count of one rendered stream; ``per_bucket`` and ``per_object`` both sum to ``total``."""

    total: int
    per_bucket: dict[str, int]
    per_object: dict[str, int]
    method: CountMethod
    specials: int


def apportion(parts: Mapping[str, int], total: int) -> dict[str, int]:
    """Share ``total`` between ``parts`` in proportion to them (largest remainder), so the shares sum to it.

    A provider's counting API answers one total; the buckets and objects keep the local counter's shares of
    it. Raises ValueError for a negative total or part.
    """
    if total < 0 or any(value < 0 for value in parts.values()):
        raise ValueError("counts cannot be negative")
    weight = sum(parts.values())
    if not parts:
        return {}
    if weight == 0:
        first = next(iter(parts))
        return {name: (total if name == first else 0) for name in parts}
    shares = {name: value * total // weight for name, value in parts.items()}
    left = total - sum(shares.values())
    by_remainder = sorted(parts, key=lambda name: (-(parts[name] * total % weight), name))
    for name in by_remainder[:left]:
        shares[name] += 1
    return shares


def with_total(count: Count, total: int, method: CountMethod) -> Count:
    """The count ``count`` re-apportioned to ``total`` (buckets and objects keep their shares)."""
    per_bucket = apportion(count.per_bucket, total)
    return Count(
        total,
        per_bucket,
        apportion(count.per_object, total),
        method,
        per_bucket.get(TEMPLATE_BUCKET, 0),
    )


_TEXT_OF = attrgetter("text")
# Kinds (ladder.templates.check_boundaries) to 1 for the texts of the request, which are looked up and counted
# per segment; for the template's fixed texts, counted once per counter; for the pieces that cost tokens, the
# fixed texts left out (they are added in one sum).
_TEXTS = bytes.maketrans(KINDS, bytes([0, 0, 1, 0, 0, 0]))
_FIXED_TEXTS = bytes.maketrans(KINDS, bytes([0, 0, 0, 0, 0, 1]))
_EACH_COSTING = bytes.maketrans(KINDS, bytes([0, 0, 1, 1, 1, 0]))
_FIXED_KIND = bytes([FIXED])

# Each counter's counts of the templates' fixed texts (a handful: the roles' names, a header's ``\n\n``), by
# the counter's digest.
_fixed_counts: dict[str, dict[str, int]] = {}
_fixed_lock = threading.Lock()


def _fixed_tokens(pieces: Sequence[Piece], kinds: bytes, counter: SegmentCounter) -> int:
    """The tokens of the stream's ``FixedText`` pieces, each text counted once per counter (see Cut: a text
    between separators is encoded on its own, so its count depends on the tokenizer alone)."""
    if _FIXED_KIND not in kinds:
        return 0
    texts = list(map(_TEXT_OF, compress(pieces, kinds.translate(_FIXED_TEXTS))))
    known = _fixed_counts.get(counter.digest, {})
    try:
        return sum(map(known.__getitem__, texts))
    except KeyError:
        pass
    new = [text for text in dict.fromkeys(texts) if text not in known]
    counted = _checked(counter.count_many(new), len(new))
    with _fixed_lock:
        table = _fixed_counts.setdefault(counter.digest, {})
        table.update(zip(new, counted, strict=True))
    return sum(map(table.__getitem__, texts))


def _checked(counted: list[int], expected: int) -> list[int]:
    """``counted``, a counter's answer for ``expected`` texts; raises ValueError if it is malformed."""
    if len(counted) != expected or not set(map(type, counted)) <= {int} or (counted and min(counted) < 0):
        raise ValueError("counter returned a malformed answer")
    return counted


def cache_keys(counter_digest: str, template_revision: str, texts: Sequence[str]) -> list[str]:
    """Return the cache key of each text segment, in order."""
    prefix = f"tc:{counter_digest}:{template_revision}:"
    sha256 = hashlib.sha256
    return [prefix + sha256(text.encode("utf-8")).hexdigest() for text in texts]


def cache_key(counter_digest: str, template_revision: str, text: str) -> str:
    """Return the cache key of one text segment."""
    return cache_keys(counter_digest, template_revision, (text,))[0]


def _take_found(into: dict[str, int], texts: list[str], found: list[int | None]) -> list[str]:
    """Put the counts found (``found[i]`` for ``texts[i]``, None where unknown) into ``into``; return the
    texts still unknown, in order."""
    unknown = found.count(None)
    if unknown == len(found):
        return texts
    if not unknown:
        into.update(zip(texts, cast("list[int]", found), strict=True))
        return []
    hits = list(map(is_not, found, repeat(None)))
    into.update(zip(compress(texts, hits), cast("Iterator[int]", compress(found, hits)), strict=True))
    return list(compress(texts, map(not_, hits)))


def count_stream(
    pieces: Sequence[Piece],
    counter: SegmentCounter,
    cache: CountCache,
    *,
    template_revision: str,
    image_formula: ImageFormula,
    memo: dict[str, int] | None = None,
    known: TextCounts | None = None,
) -> Count:
    """Count a rendered stream: known and cached segments are reused, the misses go to the counter at once.

    ``memo`` (text → count) is consulted first and filled: the recounts of one ladder walk then neither look
    a text up again nor ask the cache for it. It must only ever hold counts of this ``counter`` under this
    ``template_revision``. ``known`` (the process's ``TextCounts``) is consulted next, then ``cache`` (by
    ``cache_keys``) for what neither has; what the cache or the counter answered is added to ``known``.

    Raises CountingUnavailable when the counter fails, TemplateError when the stream breaks the boundary rule
    (its segment counts would not add up), and ValueError if the counter answers with the wrong shape.
    """
    kinds = check_boundaries(pieces)
    texts: dict[str, int] = {} if memo is None else memo
    # Here and below every step over the texts runs in C (map, compress, dict.fromkeys, zip into a dict),
    # never a Python step per text: a warm count does little else.
    text_pieces = cast("list[Text]", list(compress(pieces, kinds.translate(_TEXTS))))
    strings = list(map(_TEXT_OF, text_pieces))
    # The texts the memo does not have, repeats included, in stream order.
    pending = list(filterfalse(texts.__contains__, strings)) if texts else strings
    digest = counter.digest
    if pending and known is not None:
        found = known.get_many(digest, template_revision, pending)
        if pending is strings and IMAGE not in kinds and BOUND not in kinds and None not in found:
            # A worker's steady state: every text known and nothing else costing tokens, so ``found`` holds
            # the count of each costing piece, in order.
            if memo is not None:
                memo.update(zip(strings, cast("list[int]", found), strict=True))
            fixed = _fixed_tokens(pieces, kinds, counter)
            return _texts_count(text_pieces, cast("list[int]", found), kinds, fixed, counter.method)
        pending = _take_found(texts, pending, found)
    unique = list(dict.fromkeys(pending))
    if unique:
        keys = cache_keys(digest, template_revision, unique)
        cached = cache.get_many(keys)
        learned: dict[str, int] = {}
        missing = _take_found(learned, unique, cached)
        if missing:
            counted = _checked(counter.count_many(missing), len(missing))
            learned.update(zip(missing, counted, strict=True))
            misses = map(is_, cached, repeat(None)) if len(missing) < len(unique) else repeat(True)
            cache.set_many(dict(zip(compress(keys, misses), counted, strict=True)))
        texts.update(learned)
        if known is not None:
            known.set_many(digest, template_revision, learned)

    per_bucket: dict[str, int] = {}
    per_object: dict[str, int] = {}
    method = counter.method
    # Only the pieces that cost tokens: a cut costs none, and the specials and fixed texts are counted in one
    # go below.
    costing = cast("Iterator[Text | Bound | Image]", compress(pieces, kinds.translate(_EACH_COSTING)))
    for piece in costing:
        if type(piece) is Text:
            tokens = texts[piece.text]
        elif type(piece) is Image:
            tokens = image_tokens(piece.width, piece.height, image_formula)
        elif type(piece) is Bound:
            # Every token of a byte-level BPE covers at least one byte (see Bound).
            tokens = len(piece.text.encode("utf-8"))
            method = "UPPER_BOUND"
        per_bucket[piece.bucket] = per_bucket.get(piece.bucket, 0) + tokens
        per_object[piece.object_id] = per_object.get(piece.object_id, 0) + tokens
    return _with_template(per_bucket, per_object, kinds, _fixed_tokens(pieces, kinds, counter), method)


def _texts_count(
    text_pieces: list[Text], tokens: list[int], kinds: bytes, fixed: int, method: CountMethod
) -> Count:
    """The count of a stream whose costing pieces are ``text_pieces``, of ``tokens`` tokens each, and fixed
    texts of ``fixed`` tokens in all."""
    per_bucket: dict[str, int] = {}
    per_object: dict[str, int] = {}
    for piece, n in zip(text_pieces, tokens, strict=True):
        per_bucket[piece.bucket] = per_bucket.get(piece.bucket, 0) + n
        per_object[piece.object_id] = per_object.get(piece.object_id, 0) + n
    return _with_template(per_bucket, per_object, kinds, fixed, method)


def _with_template(
    per_bucket: dict[str, int], per_object: dict[str, int], kinds: bytes, fixed: int, method: CountMethod
) -> Count:
    """The count of a stream: its pieces' tokens by bucket and object, plus the template's: its specials and
    its fixed texts (``fixed`` tokens)."""
    specials = kinds.count(SPECIAL)
    template = specials + fixed
    per_bucket[TEMPLATE_BUCKET] = per_bucket.get(TEMPLATE_BUCKET, 0) + template
    per_object[TEMPLATE_OBJECT] = per_object.get(TEMPLATE_OBJECT, 0) + template
    return Count(sum(per_bucket.values()), per_bucket, per_object, method, specials)


def rendered_digest(payload: object) -> str:
    """Return ``'sha256:…'`` of the canonical JSON of a payload (sorted keys, no whitespace, UTF-8).

    Raises ValueError/TypeError for values JSON cannot represent.
    """
    return canonical_digest(payload)
