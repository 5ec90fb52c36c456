"""The large JSON documents an admission keeps (the manifest's request, the reservation's stored answer) are
stored packed: read back exactly as written, lz4-framed only when large, with no key lookups that would
silently compare bytes; and the migration's column change keeps what was stored, both ways."""

from __future__ import annotations

import json

import lz4.frame
import pytest
from django.db import connection
from hypothesis import given, settings

from ledger.jsonfields import LZ4_FRAME_MAGIC, PACK_ABOVE_BYTES, PackColumn, pack, unpack
from ledger.models import Reservation
from tests.json_values import json_values
from tests.ledger.helpers import admit, catalog, spec, tenant_account

JSON = json_values(max_integer=2**80, size=6, leaves=60)


@given(JSON)
@settings(max_examples=100)
def test_any_json_value_is_read_back_as_written(value):
    assert unpack(pack(value)) == value


def test_a_small_document_is_plain_json_and_a_large_one_an_lz4_frame():
    small = {"decision": "ADMITTED", "text": "第七条"}
    large = {"evidence": ["supplier shall indemnify the customer " * 40] * 10}
    assert json.loads(pack(small)) == small
    packed = pack(large)
    assert len(json.dumps(large)) > PACK_ABOVE_BYTES
    assert packed.startswith(LZ4_FRAME_MAGIC)
    assert json.loads(lz4.frame.decompress(packed)) == large
    assert len(packed) < len(json.dumps(large)) / 4


@pytest.mark.django_db
def test_a_reservation_stores_its_answer_packed_and_reads_it_back():
    answer = {"payload": {"messages": [{"role": "user", "content": "indemnify " * 500}]}, "big": 2**70}
    cat = catalog()
    tenant_account(cat)
    reservation = admit(spec(cat)).reservation
    Reservation.objects.filter(pk=reservation.pk).update(response_body=answer)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT response_body, request_body IS NULL FROM ledger_reservation WHERE id = %s",
            [reservation.pk],
        )
        stored, no_request = cursor.fetchone()
    assert bytes(stored).startswith(LZ4_FRAME_MAGIC) and no_request
    assert Reservation.objects.get(pk=reservation.pk).response_body == answer
    assert Reservation.objects.filter(pk=reservation.pk).values_list("response_body", flat=True)[0] == answer


@pytest.mark.django_db
def test_a_key_lookup_into_a_packed_document_is_refused_rather_than_comparing_bytes():
    with pytest.raises(NotImplementedError, match="no key lookups"):
        Reservation.objects.filter(response_body__decision="ADMITTED").exists()
    assert not Reservation.objects.filter(response_body__isnull=False).exists()


@pytest.mark.django_db
def test_the_column_change_keeps_every_document_both_ways():
    documents = [{"n": 1, "text": "plain"}, {"evidence": ["indemnify " * 300]}, [1, 2.5, None, "第七条"]]
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE packed_probe (id serial PRIMARY KEY, doc jsonb)")
        for doc in documents:
            cursor.execute("INSERT INTO packed_probe (doc) VALUES (%s::jsonb)", [json.dumps(doc)])
    operation = PackColumn("packed_probe", "doc")
    with connection.schema_editor(atomic=False) as editor:
        operation.code(None, editor)
    big = {"answer": ["supplier " * 400]}
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO packed_probe (doc) VALUES (%s)", [pack(big)])
        cursor.execute("SELECT doc FROM packed_probe ORDER BY id")
        read = [unpack(doc) for (doc,) in cursor.fetchall()]
        cursor.execute(
            "SELECT format_type(atttypid, atttypmod), attstorage FROM pg_attribute "
            "WHERE attrelid = 'packed_probe'::regclass AND attname = 'doc'"
        )
        assert cursor.fetchone() == ("bytea", "e")
    assert read == [*documents, big]
    assert operation.reverse_code is not None
    with connection.schema_editor(atomic=False) as editor:
        operation.reverse_code(None, editor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT doc::text FROM packed_probe ORDER BY id")
        assert [json.loads(doc) for (doc,) in cursor.fetchall()] == [*documents, big]
        cursor.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = 'packed_probe'::regclass AND attname = 'doc'"
        )
        assert cursor.fetchone() == ("jsonb",)
