"""The hot path's cursor: statements numbered once, and cursors kept per statement, never without bound."""

from __future__ import annotations

import pytest
from django.db import connection

from budgeting.db import cursor as db

pytestmark = pytest.mark.django_db


def kept() -> dict:
    return getattr(connection, "_kept_cursors", {})


STATEMENT = "SELECT %s::int + 1"


def test_the_same_statement_runs_on_the_same_cursor_and_a_closed_one_is_replaced():
    with db.prepared_cursor() as cursor:
        cursor.execute(STATEMENT, [1])
        assert cursor.fetchone() == (2,)
    first = kept()[db._numbered(STATEMENT)]
    with db.prepared_cursor() as cursor:
        cursor.execute(STATEMENT, [41])
        assert cursor.fetchone() == (42,)
    assert kept()[db._numbered(STATEMENT)] is first
    first.close()
    with db.prepared_cursor() as cursor:
        cursor.execute(STATEMENT, [1])
        assert cursor.fetchone() == (2,)
    second = kept()[db._numbered(STATEMENT)]
    assert second is not first and not second.closed


def test_statements_whose_text_varies_keep_at_most_a_bounded_number_of_cursors():
    opened = []
    for n in range(3 * db._MAX_KEPT):
        with db.prepared_cursor() as cursor:
            cursor.execute(f"SELECT {n} + %s::int", [1])
            assert cursor.fetchone() == (n + 1,)
        opened.extend(c for c in kept().values() if c not in opened)
        assert len(kept()) <= db._MAX_KEPT
    assert sum(not c.closed for c in opened) <= db._MAX_KEPT  # the ones let go were closed


def test_numbered_placeholders_are_postgresql_s_own():
    assert db._numbered("SELECT %s, %s") == "SELECT $1, $2"
    with pytest.raises(ValueError):
        db._numbered("SELECT '%' || %s")
