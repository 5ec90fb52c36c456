"""A row's INSERT and UPDATE as Django's compiler writes them, for statements that run them inside their own
text (the reserving statement, a lifecycle call's one statement).

A speed device (ARCHITECTURE, "speed devices"): the INSERT's text is built once per model and columns and a
field's preparation is skipped where it would change nothing, which keeps Django's compiler off the hot path.
It relies on ``Field.pre_save`` / ``get_db_prep_save`` and the concrete field classes' MROs;
``tests/ledger/test_insert_params.py`` fails when a value passed through is not what Django would send.
"""

from __future__ import annotations

import copy
import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connection, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q
from django.db.models.sql import UpdateQuery

from budgeting.db.cursor import prepared_cursor, this_connection

_M = TypeVar("_M", bound=models.Model)


def update_sql(row: models.Model) -> tuple[str, list[Any]]:
    """The row's UPDATE as ``save()`` would run it (auto_now fields included): the fields it loaded (a
    deferred one it never read is left as it is) — or, for a row read by ``fetch_rows``, only the fields whose
    value changed since (and the auto_now ones). Each value is its field's ``get_db_prep_save`` of its
    ``pre_save``, as the compiler sends it, and the text is built once per model and columns; a value that is
    an expression (or a model instance) goes through Django's compiler, which knows how to write it."""
    model = type(row)
    deferred = row.get_deferred_fields()
    fields = [f for f in model._meta.concrete_fields if not f.primary_key and f.attname not in deferred]
    loaded: dict[str, Any] | None = getattr(row, _LOADED, None)
    if loaded is not None:
        fields = [f for f in fields if getattr(f, "auto_now", False) or _changed(loaded, row, f.attname)]
    values = [f.pre_save(row, False) for f in fields]
    if any(
        hasattr(value, "resolve_expression") or hasattr(value, "prepare_database_save") for value in values
    ) or any(hasattr(f, "get_placeholder") for f in fields):
        query = UpdateQuery(model)
        query.add_update_fields([(f, None, value) for f, value in zip(fields, values, strict=True)])
        query.add_q(Q(pk=row.pk))
        sql, params = query.get_compiler(connection=connection).as_sql()
        return sql, list(params)
    db = this_connection()
    params = [f.get_db_prep_save(value, connection=db) for f, value in zip(fields, values, strict=True)]
    pk = model._meta.pk
    assert pk is not None
    params.append(pk.get_db_prep_value(row.pk, db))
    return _update_statement(model, tuple(f.column for f in fields)), params


# Where ``fetch_rows`` keeps the values a row was read with (Django's documented ``from_db`` pattern).
_LOADED = "_loaded_values"
_UNREAD = object()


def written(row: models.Model) -> None:
    """Say that ``row``'s UPDATE ran: what it holds now is what the database holds (for a row read by
    ``fetch_rows``, the next ``update_sql`` compares with these values)."""
    loaded: dict[str, Any] | None = getattr(row, _LOADED, None)
    if loaded is not None:
        for name in loaded:
            value = getattr(row, name)
            loaded[name] = copy.deepcopy(value) if isinstance(value, list | dict) else value


def _changed(loaded: dict[str, Any], row: models.Model, name: str) -> bool:
    before, now = loaded.get(name, _UNREAD), getattr(row, name)
    # type() too: in a JSON value 1 == 1.0 == True, which are three different documents.
    return (
        type(before) is not type(now)
        or before != now
        or (isinstance(now, list | dict) and repr(before) != repr(now))
    )


# The result columns of each statement text ``fetch_rows`` ran: the hot path's texts are fixed and name their
# columns, and ``cursor.description`` builds an object per column on every call.
_COLUMNS: dict[str, tuple[str, ...]] = {}


def fetch_rows(model: type[_M], sql: str, params: Sequence[Any]) -> list[_M]:
    """``model.objects.raw(sql, params)`` on the hot path's prepared cursor (the statement is prepared once
    per connection and its parameters bound on the server). A column named as one of the model's fields
    fills that field (through the field's converters, as Django's compiler applies them); a field the
    statement does not return is deferred; any other column becomes an attribute of the same name. Each row
    keeps the values it was read with, so that ``update_sql`` writes only what changed."""
    with prepared_cursor() as cursor:
        cursor.execute(sql, list(params))
        names = _COLUMNS.get(sql)
        if names is None:
            names = _COLUMNS[sql] = tuple(column.name for column in cursor.description)
        rows = cursor.fetchall()
    plan = _read_plan(model, names)
    db = this_connection()
    out = []
    for row in rows:
        values = [row[index] for index, _ in plan.fields]
        for position, converters in plan.converters:
            for convert in converters:
                values[position] = convert(values[position], None, db)
        instance = model.from_db(db.alias, plan.attnames, values)
        for index, name in plan.extras:
            setattr(instance, name, row[index])
        setattr(
            instance,
            _LOADED,
            {
                name: copy.deepcopy(value) if isinstance(value, list | dict) else value
                for name, value in zip(plan.attnames, values, strict=True)
            },
        )
        out.append(instance)
    return out


@dataclass(frozen=True)
class _ReadPlan:
    fields: tuple[tuple[int, models.Field[Any, Any]], ...]
    """(column index, field), in the model's concrete field order (``from_db`` takes them so)."""
    attnames: tuple[str, ...]
    converters: tuple[tuple[int, tuple[Any, ...]], ...]
    """(position in ``fields``, the field's converters), for the fields that have any."""
    extras: tuple[tuple[int, str], ...]


@functools.lru_cache(maxsize=32)
def _read_plan(model: type[models.Model], names: tuple[str, ...]) -> _ReadPlan:
    by_column = {f.column: f for f in model._meta.concrete_fields}
    index = {name: n for n, name in enumerate(names)}
    fields = tuple((index[f.column], f) for f in model._meta.concrete_fields if f.column in index)
    db = this_connection()
    converters = []
    for position, (_, field) in enumerate(fields):
        found = tuple(
            [*db.ops.get_db_converters(field.get_col(model._meta.db_table)), *field.get_db_converters(db)]
        )
        if found:
            converters.append((position, found))
    extras = tuple((n, name) for n, name in enumerate(names) if name not in by_column)
    return _ReadPlan(fields, tuple(f.attname for _, f in fields), tuple(converters), extras)


@functools.lru_cache(maxsize=64)
def _update_statement(model: type[models.Model], columns: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    pk = model._meta.pk
    assert pk is not None and pk.column is not None
    assignments = ", ".join(f"{quote(column)} = %s" for column in columns)
    return f"UPDATE {table} SET {assignments} WHERE {table}.{quote(pk.column)} = %s"


def insert_sql(row: models.Model, expressions: Mapping[str, str] | None = None) -> tuple[str, list[Any]]:
    """The INSERT of ``row`` and its parameters, as Django's compiler writes them (each field's ``pre_save``
    for an insert, then its ``get_db_prep_save``); the statement's text is built once per model and columns.
    ``expressions`` gives a column an SQL expression instead of the row's value. Raises TypeError for a model
    with a field that has its own placeholder (Django's compiler must write that one)."""
    model = type(row)
    given = expressions or {}
    db = this_connection()
    columns = [c for c in _columns(model) if not (c.primary_key and getattr(row, c.attname) is None)]
    params = [_db_value(c, row, db) for c in columns if c.name not in given]
    statement = _insert_statement(model, tuple(c.name for c in columns), tuple(sorted(given.items())))
    return statement, params


# Fields whose value, when of one of these exact types, is what Django would send (their ``pre_save`` reads
# the attribute; their ``get_db_prep_save`` gives such a value back unchanged, an integer wrapped in the
# PostgreSQL type of its column). A subclass counts only when it changes none of that (django-fsm's state
# field); a field that sets its own value on save (auto_now, auto_now_add) never does.
_PLAIN_TYPES: dict[type, tuple[type, ...]] = {
    models.CharField: (str, type(None)),
    models.TextField: (str, type(None)),
    models.IntegerField: (int, type(None)),
    models.BigIntegerField: (int, type(None)),
    models.PositiveIntegerField: (int, type(None)),
    models.AutoField: (int, type(None)),
    models.BigAutoField: (int, type(None)),
    models.BooleanField: (bool, type(None)),
    models.UUIDField: (uuid.UUID, type(None)),
    models.DateTimeField: (type(None),),
    models.JSONField: (type(None),),
}
_PREPARATION = ("pre_save", "get_db_prep_save", "get_db_prep_value", "get_prep_value")


@dataclass(frozen=True)
class _Column:
    """A concrete field of a model with what ``_db_value`` needs, worked out once per process."""

    field: models.Field[Any, Any]
    name: str
    attname: str
    primary_key: bool
    plain: tuple[type, ...]
    """The value types that pass through as they are."""
    wrapper: type | None
    """The int subclass Django wraps this column's integers in (so a prepared statement's types are fixed)."""


@functools.lru_cache(maxsize=64)
def _columns(model: type[models.Model]) -> tuple[_Column, ...]:
    return tuple(_column(f) for f in model._meta.concrete_fields)


def _column(field: models.Field[Any, Any]) -> _Column:
    target = field.target_field if isinstance(field, models.ForeignKey) else field
    plain: tuple[type, ...] = ()
    if not (getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False)):
        plain = _passes_through(type(target))
    wrapper = type(field.get_db_prep_save(1, connection)) if int in plain else None
    assert field.column is not None
    return _Column(
        field, field.column, field.attname, field.primary_key, plain, None if wrapper is int else wrapper
    )


def _passes_through(cls: type) -> tuple[type, ...]:
    for base in cls.__mro__:
        if base in _PLAIN_TYPES:
            same = all(getattr(cls, name) is getattr(base, name) for name in _PREPARATION)
            return _PLAIN_TYPES[base] if same else ()
    return ()


def _db_value(column: _Column, row: models.Model, db: BaseDatabaseWrapper) -> Any:
    """``field.get_db_prep_save(field.pre_save(row, True))``, without the calls when they would change
    nothing (most of an admission's ~60 columns)."""
    value = getattr(row, column.attname)
    if type(value) in column.plain:
        return value if column.wrapper is None or value is None else column.wrapper(value)
    return column.field.get_db_prep_save(column.field.pre_save(row, True), db)


@functools.lru_cache(maxsize=64)
def _insert_statement(
    model: type[models.Model], columns: tuple[str, ...], expressions: tuple[tuple[str, str], ...]
) -> str:
    if any(hasattr(f, "get_placeholder") for f in model._meta.concrete_fields):
        raise TypeError(f"{model.__name__} has a field with its own placeholder; use Django's compiler")
    quote = connection.ops.quote_name
    given = dict(expressions)
    values = ", ".join(given.get(column, "%s") for column in columns)
    return f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(map(quote, columns))}) VALUES ({values})"


@dataclass(frozen=True)
class RecordInsert:
    """The INSERT of a caller's record of an admission (its manifest), returning the record's id. The
    reserving statement runs it itself: no round trip of its own."""

    sql: str
    params: list[Any]

    @classmethod
    def of(cls, row: models.Model) -> RecordInsert:
        sql, params = insert_sql(row)
        pk = type(row)._meta.pk
        assert pk is not None and pk.column is not None
        return cls(f"{sql} RETURNING {connection.ops.quote_name(pk.column)}", params)

    def run(self) -> int:
        """Run it on its own; returns the new record's id."""
        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)
            (record_id,) = cursor.fetchone()
        return int(record_id)
