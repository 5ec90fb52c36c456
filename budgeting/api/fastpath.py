"""Input serializers checked without building a serializer, for bodies that are plainly valid.

A DRF serializer deep-copies its declared fields on every request and validates field by field through
several layers (its share of an admission: bench/README.md). ``fast_validator`` compiles a serializer
class's declaration once into plain checks, and answers its ``validated_data`` only for a body it can prove
valid with exactly the value DRF would give; for anything else — a missing or unknown field, a null, a
string DRF would trim, a value out of range — it answers None and the serializer decides, with its errors.
So the fast path never accepts what DRF refuses and never changes what DRF accepts
(``tests/api/test_fastpath.py`` checks both against DRF on generated bodies).

Only the field types the input serializers use are compiled; a serializer with any other field, a custom
``validate``, ``validate_<field>`` or ``to_internal_value``, or serializer validators has no fast path
(``fast_validator`` answers None for its class).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from django.core import validators
from rest_framework import fields, serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from budgeting.api.serializers import RequestSentField, StrictSerializer

_DEFER = object()
# A serializer's conversion is compiled only when it is DRF's or StrictSerializer's (which refuses unknown
# fields: the compiled check defers on those).
_KNOWN_TO_INTERNAL_VALUE = (serializers.Serializer.to_internal_value, StrictSerializer.to_internal_value)

Check = Callable[[Any], Any]
"""A compiled field: the validated value, or ``_DEFER`` when the serializer must decide."""


@functools.cache
def fast_validator(
    serializer_class: type[serializers.Serializer],
) -> Callable[[Any], dict[str, Any] | None] | None:
    """The compiled check of ``serializer_class`` (None when it cannot be compiled): it answers the
    validated data of a plainly valid body, or None when the serializer must decide."""
    check = _compile_serializer(serializer_class())
    if check is None:
        return None

    def validate(data: Any) -> dict[str, Any] | None:
        value = check(data)
        return None if value is _DEFER else value

    return validate


def _compile_serializer(serializer: serializers.Serializer) -> Check | None:
    cls = type(serializer)
    if (
        cls.validate is not serializers.Serializer.validate
        or cls.to_internal_value not in _KNOWN_TO_INTERNAL_VALUE
        or serializer.validators
    ):
        return None
    compiled: list[tuple[str, bool, bool, Check]] = []
    for name, field in serializer.fields.items():
        check = _compile(field)
        if (
            check is None
            or field.read_only
            or field.source != name
            or field.default is not fields.empty
            or hasattr(serializer, f"validate_{name}")
        ):
            return None
        compiled.append((name, field.required, field.allow_null, check))
    known = frozenset(name for name, *_ in compiled)

    def check_object(data: Any) -> Any:
        if type(data) is not dict or not known.issuperset(data):
            return _DEFER
        result: dict[str, Any] = {}
        for name, required, allow_null, check in compiled:
            if name not in data:
                if required:
                    return _DEFER
                continue
            value = data[name]
            if value is None:
                if not allow_null:
                    return _DEFER
                result[name] = None
                continue
            value = check(value)
            if value is _DEFER:
                return _DEFER
            result[name] = value
        return result

    return check_object


# The validators DRF gives the compiled fields from their arguments, which the compiled checks enforce.
_KNOWN_VALIDATORS = (
    validators.RegexValidator,
    validators.MaxLengthValidator,
    validators.MinLengthValidator,
    validators.MaxValueValidator,
    validators.MinValueValidator,
    validators.ProhibitNullCharactersValidator,
    ProhibitSurrogateCharactersValidator,
)


def _compile(field: fields.Field) -> Check | None:
    if any(type(v) not in _KNOWN_VALIDATORS for v in field.validators):
        return None
    if isinstance(field, serializers.Serializer):
        return _compile_serializer(field)
    if isinstance(field, serializers.ListSerializer):
        return _compile_list(field)
    if isinstance(field, fields.BooleanField):
        return lambda value: value if type(value) is bool else _DEFER
    if type(field) is RequestSentField:
        return _request_sent
    if isinstance(field, fields.IntegerField):
        return _integer(field)
    if isinstance(field, fields.CharField):
        return _string(field)
    if isinstance(field, fields.DictField) and isinstance(field.child, fields._UnvalidatedField):
        allow_empty = field.allow_empty
        return lambda value: dict(value) if type(value) is dict and (value or allow_empty) else _DEFER
    return None


def _compile_list(field: serializers.ListSerializer) -> Check | None:
    """A ``many=True`` serializer: a list of its length limits, each item its child's check."""
    child = None if field.child is None else _compile(field.child)
    if child is None:
        return None
    # Set by DRF from the serializer's arguments (its stubs do not declare them).
    shortest = max(getattr(field, "min_length", None) or 0, 0 if field.allow_empty else 1)
    longest = getattr(field, "max_length", None) or 2**31

    def check(value: Any) -> Any:
        if type(value) is not list or not shortest <= len(value) <= longest:
            return _DEFER
        items = [child(item) for item in value]
        return _DEFER if any(item is _DEFER for item in items) else items

    return check


def _request_sent(value: Any) -> Any:
    """``RequestSentField``'s conversion, for the values it accepts."""
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return "unknown" if type(value) is str and value == "unknown" else _DEFER


def _integer(field: fields.IntegerField) -> Check:
    low = -(2**63) if field.min_value is None else field.min_value
    high = 2**63 if field.max_value is None else field.max_value
    return lambda value: value if type(value) is int and low <= value <= high else _DEFER


def _string(field: fields.CharField) -> Check | None:
    """Only strings DRF keeps as they are: ASCII (no surrogates), no NUL, nothing to trim, not blank."""
    if any(isinstance(v, validators.RegexValidator) and v.inverse_match for v in field.validators):
        return None
    patterns = [re.compile(v.regex) for v in field.validators if isinstance(v, validators.RegexValidator)]
    shortest = max(1, field.min_length or 0)
    longest = field.max_length or 2**31

    def check(value: Any) -> Any:
        if (
            type(value) is not str
            or not shortest <= len(value) <= longest
            or not value.isascii()
            or "\x00" in value
            or value != value.strip()
            or not all(pattern.search(value) for pattern in patterns)
        ):
            return _DEFER
        return value

    return check
