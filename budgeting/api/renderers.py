"""The API's JSON, encoded once, in one C pass.

DRF's ``JSONRenderer`` encodes with ``json.dumps``; an admission's answer carries the admitted payload (about
the size of the request), so the encoder is on the hot path. orjson writes the same JSON for what this API
answers (UTF-8 kept as is, no whitespace, U+2028/U+2029 escaped; a float's exponent is spelt 1e-7, not
1e-07); datetimes, decimals and anything else orjson does not know natively go through DRF's own encoder, so
they are written exactly as before (``…Z`` for UTC).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.encoders import JSONEncoder

_DRF = JSONEncoder()
_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
# U+2028 and U+2029 in UTF-8. Both start with the byte 0xE2, which a memchr finds (or not) far faster than two
# bytes.replace scans of the answer (measured: bench/README.md).
_SEPARATORS = re.compile(b"\xe2\x80[\xa8\xa9]")
_ESCAPED = {b"\xe2\x80\xa8": b"\\u2028", b"\xe2\x80\xa9": b"\\u2029"}


class FastJSONRenderer(JSONRenderer):
    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        if data is None:
            return b""
        try:
            encoded = orjson.dumps(data, default=_DRF.default, option=_OPTIONS)
        except orjson.JSONEncodeError:
            # What orjson refuses and json writes (an integer beyond 64 bits): DRF's renderer, as before.
            return super().render(data, accepted_media_type, renderer_context)
        # As DRF does: U+2028 and U+2029 escaped, for clients that read JSON as JavaScript.
        if b"\xe2" not in encoded:
            return encoded
        return _SEPARATORS.sub(lambda match: _ESCAPED[match.group()], encoded)
