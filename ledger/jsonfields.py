"""JSON columns written in one C pass, and the large ones stored compressed.

Django encodes a ``JSONField`` value with ``json.dumps(value, cls=encoder)`` before psycopg sends it. With
``FastJSONEncoder`` as the encoder that call runs orjson. Types orjson does not know go through Django's own
encoder, so what can be stored is what ``DjangoJSONEncoder`` can store.

``PackedJSONField`` is for the documents an admission must keep whole and nobody queries into: the manifest's
request (for replay) and the reservation's stored answer (for idempotent retries), each about the size of the
request (~185 KB for a 20k-token request). As ``jsonb`` PostgreSQL parsed each into its binary form and then
compressed it on the admission's one transaction, several times slower than the same INSERT of bytes
compressed here with lz4 (measured: bench/README.md). The column is ``bytea``: JSON
text as UTF-8, lz4-framed above ``PACK_ABOVE_BYTES`` (a frame starts with a magic number no JSON text can
start with, so plain and framed values read alike). Reads give back what ``JSONField`` gives.
"""

from __future__ import annotations

import json
from typing import Any

import lz4.frame
import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.db import migrations, models
from django.db.backends.base.base import BaseDatabaseWrapper

PACK_ABOVE_BYTES = 1024
LZ4_FRAME_MAGIC = b"\x04\x22\x4d\x18"


class FastJSONEncoder(DjangoJSONEncoder):
    def encode(self, o: Any) -> str:
        return json_bytes(o).decode()


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON (UTF-8), as ``json.dumps(value, cls=DjangoJSONEncoder)`` would write it."""
    try:
        return orjson.dumps(value, default=DjangoJSONEncoder().default, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        # What orjson refuses and json writes (an integer beyond 64 bits): Django's encoder, as before.
        return json.dumps(value, cls=DjangoJSONEncoder, separators=(",", ":")).encode()


def pack(value: Any) -> bytes:
    data = json_bytes(value)
    return lz4.frame.compress(data) if len(data) > PACK_ABOVE_BYTES else data


def unpack(data: bytes | memoryview) -> Any:
    raw = bytes(data)
    if raw.startswith(LZ4_FRAME_MAGIC):
        raw = lz4.frame.decompress(raw)
    # json, not orjson: orjson reads an integer beyond 64 bits as a float, and such an integer can be stored.
    return json.loads(raw)


class PackedJSONField(models.JSONField):
    """A JSON document kept whole in a ``bytea`` column (see the module's docstring); no key lookups."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("encoder", FastJSONEncoder)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        kwargs.pop("encoder", None)
        return name, path, args, kwargs

    def db_type(self, connection: BaseDatabaseWrapper) -> str:
        return "bytea"

    def get_db_prep_value(self, value: Any, connection: BaseDatabaseWrapper, prepared: bool = False) -> Any:
        if not prepared:
            value = self.get_prep_value(value)
        return pack(value)

    def from_db_value(self, value: Any, expression: Any, connection: BaseDatabaseWrapper) -> Any:
        return None if value is None else unpack(value)

    def get_transform(self, name: str) -> Any:
        transform = models.Field.get_transform(self, name)
        if transform is None:
            raise NotImplementedError(f"{self.name} is stored packed: no key lookups ({name!r})")
        return transform


class PackColumn(migrations.RunPython):
    """A migration's change of a ``jsonb`` column to ``PackedJSONField``'s ``bytea``, and back.

    Forward, the rewrite keeps each existing document as its JSON text (PostgreSQL compresses the large ones
    as before); then storage becomes EXTERNAL, so new lz4 frames are not compressed again (pglz only spends
    time failing to shrink them; measured: bench/README.md). Backward, the frames are unpacked here and the
    column is ``jsonb`` again.
    """

    def __init__(self, table: str, column: str) -> None:
        self.table, self.column = table, column
        super().__init__(self._forward, self._backward)

    def _forward(self, apps: Any, schema_editor: Any) -> None:
        t, c = schema_editor.quote_name(self.table), schema_editor.quote_name(self.column)
        schema_editor.execute(
            f"ALTER TABLE {t} ALTER COLUMN {c} TYPE bytea USING convert_to({c}::text, 'UTF8')"
        )
        schema_editor.execute(f"ALTER TABLE {t} ALTER COLUMN {c} SET STORAGE EXTERNAL")

    def _backward(self, apps: Any, schema_editor: Any) -> None:
        t, c = schema_editor.quote_name(self.table), schema_editor.quote_name(self.column)
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id, {c} FROM {t} WHERE substring({c} FROM 1 FOR 4) = %s", [LZ4_FRAME_MAGIC]
            )
            for row_id, data in cursor.fetchall():
                plain = lz4.frame.decompress(bytes(data))
                cursor.execute(f"UPDATE {t} SET {c} = %s WHERE id = %s", [plain, row_id])
        schema_editor.execute(f"ALTER TABLE {t} ALTER COLUMN {c} SET STORAGE EXTENDED")
        schema_editor.execute(
            f"ALTER TABLE {t} ALTER COLUMN {c} TYPE jsonb USING convert_from({c}, 'UTF8')::jsonb"
        )
