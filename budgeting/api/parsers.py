"""A JSON parser that refuses what ``json.loads`` would quietly accept.

Refused, each with a stable code: bodies over ``MAX_REQUEST_BYTES``, invalid UTF-8, duplicate keys, NaN and
Infinity, integers outside ±2^53 (they do not survive a JavaScript client), nesting deeper than 64, lone
surrogates and NUL characters in strings or keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework.parsers import BaseParser

from budgeting.api.problems import Problem

MAX_DEPTH = 64
MAX_SAFE_INTEGER = 2**53 - 1


class BadJSON(Problem):
    status = 400
    code = "MALFORMED_JSON"
    title = "The body is not acceptable JSON"


def _reject_constant(name: str) -> Any:
    raise BadJSON(f"{name} is not allowed in JSON", code="NON_FINITE_NUMBER")


def _parse_int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_SAFE_INTEGER:
        raise BadJSON(f"integer {text[:24]} is outside ±2^53", code="INTEGER_OUT_OF_RANGE")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadJSON("number overflows a double", code="NON_FINITE_NUMBER")
    return value


def _check_string(value: str) -> None:
    if "\x00" in value:
        raise BadJSON("NUL characters are not allowed in strings", code="INVALID_STRING")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadJSON("lone surrogates are not allowed in strings", code="INVALID_STRING") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        _check_string(key)
        if key in result:
            raise BadJSON(f"duplicate key {key!r}", code="DUPLICATE_KEY")
        if isinstance(value, str):
            _check_string(value)
        elif isinstance(value, list):
            _check_list(value)
        result[key] = value
    return result


def _check_list(values: list[Any]) -> None:
    for item in values:
        if isinstance(item, str):
            _check_string(item)


def _depth_ok(text: str) -> bool:
    """Bracket depth outside strings, counted without recursion (json.loads would hit RecursionError)."""
    depth = 0
    in_string = False
    escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif char in "]}":
            depth -= 1
    return True


def loads_strict(raw: bytes) -> Any:
    """Parse a JSON document strictly. Raises BadJSON (a Problem) on anything refused."""
    if len(raw) > settings.MAX_REQUEST_BYTES:
        raise BadJSON(f"body exceeds {settings.MAX_REQUEST_BYTES} bytes", status=413, code="BODY_TOO_LARGE")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadJSON("body is not UTF-8", code="MALFORMED_JSON") from None
    if not text.strip():
        raise BadJSON("empty body", code="MALFORMED_JSON")
    if not _depth_ok(text):
        raise BadJSON(f"nesting deeper than {MAX_DEPTH}", code="NESTING_TOO_DEEP")
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as exc:
        raise BadJSON(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if isinstance(value, str):
        _check_string(value)
    elif isinstance(value, list):
        _check_list(value)
    return value


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(
        self,
        stream: IO[bytes],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > settings.MAX_REQUEST_BYTES:
            raise BadJSON(
                f"body exceeds {settings.MAX_REQUEST_BYTES} bytes", status=413, code="BODY_TOO_LARGE"
            )
        return loads_strict(stream.read(settings.MAX_REQUEST_BYTES + 1))
