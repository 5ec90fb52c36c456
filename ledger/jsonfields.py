"""JSON columns written in one C pass.

Django encodes a ``JSONField`` value with ``json.dumps(value, cls=encoder)`` before psycopg sends it. With
``FastJSONEncoder`` as the encoder that call runs orjson: an admission's manifest and stored answer (each
about the size of the request, ~185 KB for a 20k-token request) are encoded several times faster. Types
orjson does not know go through Django's own encoder, so what can be stored is what ``DjangoJSONEncoder``
can store.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder


class FastJSONEncoder(DjangoJSONEncoder):
    def encode(self, o: Any) -> str:
        try:
            return orjson.dumps(o, default=self.default, option=orjson.OPT_NON_STR_KEYS).decode()
        except orjson.JSONEncodeError:
            # What orjson refuses and json writes (an integer beyond 64 bits): Django's encoder, as before.
            return super().encode(o)
