r"""Where DeepSeek-V3's pre-tokenizer must split a text: the seams at which two texts count apart exactly.

DeepSeek-V3's tokenizer (``deepseek_v3.json``) cuts text into pieces with three regex passes before its
byte-level BPE, and BPE merges never cross a piece:

1. ``\p{N}{1,3}``: runs of numbers are pieces of their own;
2. ``[一-龥぀-ゟ゠-ヿ]+``: runs of CJK ideographs, hiragana and katakana are pieces of their own;
3. ``[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
   ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+``.

No pattern looks behind, so once a piece ends where one text ends the next text is cut exactly as it is on its
own: the two count apart, ``count(x + y) == count(x) + count(y)``. Looking only at the last character ``a`` of
``x`` and the first ``b`` of ``y``, a piece must end between them when

- exactly one of ``a``, ``b`` is a number (pass 1);
- exactly one of them is in the CJK ranges of pass 2;
- ``a`` is a letter or a mark and ``b`` is punctuation, a symbol, a separator or a control (pass 3: the
  first two alternatives end with a run of letters and marks, and no other holds one); or
- ``a`` is CR or LF and ``b`` is a letter, mark, number, punctuation or symbol (pass 3: a piece that ends
  with a line break continues only over whitespace, and only the whitespace alternatives take a line break).

A character is in a class only where Python's Unicode database and its 3.2 version agree on its category
(unassigned characters are in none), so a tokenizer built on an older or newer Unicode version classifies it
the same. ``tests/ladder/test_deepseek_golden.py`` checks the rule against the tokenizer's own pre-tokenizer,
exhaustively on pairs of characters and by a Hypothesis property on generated texts.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache


def _cjk(char: str) -> bool:
    """In pass 2's ranges: U+4E00-U+9FA5, and U+3040-U+309F with U+30A0-U+30FF (one range together)."""
    point = ord(char)
    return 0x4E00 <= point <= 0x9FA5 or 0x3040 <= point <= 0x30FF


@lru_cache(maxsize=4096)
def _kind(char: str) -> str:
    """The major category (``L``, ``M``, ``N``, ``P``, ``S``, ``Z``, ``C``) stable across Unicode versions,
    or ``?`` for a character whose category changed or that is unassigned."""
    current = unicodedata.category(char)
    if current == "Cn" or unicodedata.ucd_3_2_0.category(char)[0] != current[0]:
        return "?"
    return current[0]


@lru_cache(maxsize=65536)
def splits_between(a: str, b: str) -> bool:
    """Whether DeepSeek-V3's pre-tokenizer ends a piece between the characters ``a`` and ``b`` of a text."""
    kind_a, kind_b = _kind(a), _kind(b)
    if "?" not in (kind_a, kind_b) and (kind_a == "N") != (kind_b == "N"):
        return True
    if _cjk(a) != _cjk(b):
        return True
    if kind_a in ("L", "M") and kind_b in ("P", "S", "Z", "C"):
        return True
    return a in "\r\n" and kind_b in ("L", "M", "N", "P", "S")


# DeepSeek-V3's pre-tokenizer as its tokenizer file states it: the three passes above, then the byte-level
# mapping. Provisioning frames a tokenizer with the deepseek template only if its file states exactly this
# and normalises nothing (``is_deepseek_v3``): the seams are proven for it alone.
DEEPSEEK_V3_PRE_TOKENIZER: dict[str, object] = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {
            "type": "Split",
            "pattern": {"Regex": "[一-龥\u3040-ゟ゠-ヿ]+"},
            "behavior": "Isolated",
            "invert": False,
        },
        {
            "type": "Split",
            "pattern": {
                "Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
            },
            "behavior": "Isolated",
            "invert": False,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
_NO_NORMALIZER: tuple[object, ...] = (None, {"type": "Sequence", "normalizers": []})


def is_deepseek_v3(tokenizer_json: object) -> bool:
    """Whether a ``tokenizers`` JSON document pre-tokenizes as DeepSeek-V3's and normalises nothing."""
    return (
        isinstance(tokenizer_json, dict)
        and tokenizer_json.get("pre_tokenizer") == DEEPSEEK_V3_PRE_TOKENIZER
        and tokenizer_json.get("normalizer") in _NO_NORMALIZER
    )
