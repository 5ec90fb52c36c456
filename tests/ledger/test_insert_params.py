"""The reserving statement's parameters skip Django's per-field preparation only where it would change
nothing: for every field of the rows it inserts, a value of the types it passes through is exactly what
``get_db_prep_save`` gives."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from budgeting.admission.models import Manifest
from budgeting.db.rows import _columns, _db_value
from ledger.models import Hold, LedgerEntry, Reservation

SAMPLES = {
    str: ["", "sha256:abc", "第七条"],
    int: [0, 7, 2**40, -3],
    bool: [True, False],
    uuid.UUID: [uuid.UUID("12345678-1234-5678-1234-567812345678")],
    type(None): [None],
}


@pytest.mark.parametrize("model", [Reservation, Manifest, Hold, LedgerEntry])
def test_a_value_passed_through_is_what_django_would_send(model):
    passed = 0
    row = model()
    for column in _columns(model):
        if column.primary_key:
            continue
        for kind in column.plain:
            for value in SAMPLES[kind]:
                row.__dict__[column.attname] = value  # past django-fsm's protected descriptor
                expected = column.field.get_db_prep_save(value, connection)
                assert _db_value(column, row, connection) == expected, column.field
                assert type(_db_value(column, row, connection)) is type(expected), column.field
                passed += 1
    assert passed > 0


def test_fields_that_convert_are_not_passed_through():
    kinds = {c.field.name: c.plain for c in _columns(Reservation)}
    # Set on save (auto_now_add, auto_now): never read from the attribute.
    assert kinds["created_at"] == () and kinds["updated_at"] == ()
    # Packed, or a list encoded as JSON: only None passes.
    assert kinds["response_body"] == () and kinds["minimum_evidence_ids"] == (type(None),)
    assert kinds["dispatched_at"] == (type(None),)  # a datetime goes through Django (naive ones get a zone)
    assert kinds["tenant"] == (int, type(None)) and kinds["request_id"] == (str, type(None))
    assert kinds["state"] == (str, type(None))  # django-fsm's field prepares as a CharField
