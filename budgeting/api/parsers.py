"""A JSON parser that refuses what ``json.loads`` would quietly accept.

Refused, each with a stable code: bodies over ``MAX_REQUEST_BYTES``, a declared charset other than UTF-8
(415), invalid UTF-8, duplicate keys, NaN and Infinity, integers outside ±2^53 (they do not survive a
JavaScript client), nesting deeper than 64, lone surrogates and NUL characters in strings or keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import exceptions as drf_exceptions
from rest_framework.parsers import BaseParser

from budgeting.api.problems import Problem
from budgeting.observability.logging import PARSED_BODY

MAX_DEPTH = 64
MAX_SAFE_INTEGER = 2**53 - 1
# A \u escape of NUL or of a surrogate (paired or not); raw UTF-8 can hold neither.
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


class BadJSON(Problem):
    status = 400
    code = "MALFORMED_JSON"
    title = "The body is not acceptable JSON"


def _reject_constant(name: str) -> Any:
    raise BadJSON(f"{name} is not allowed in JSON", code="NON_FINITE_NUMBER")


def _check_number(value: int | float) -> None:
    if type(value) is float:
        if value in (_INF, -_INF):
            raise BadJSON("number overflows a double", code="NON_FINITE_NUMBER")
    elif not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        raise BadJSON(f"integer {str(value)[:24]} is outside ±2^53", code="INTEGER_OUT_OF_RANGE")


_INF = float("inf")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadJSON(f"duplicate key {key!r}", code="DUPLICATE_KEY")
            seen.add(key)
    return result


def _check_string(value: str) -> None:
    if "\x00" in value:
        raise BadJSON("NUL characters are not allowed in strings", code="INVALID_STRING")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadJSON("lone surrogates are not allowed in strings", code="INVALID_STRING") from None


def _walk(value: Any, *, check_strings: bool) -> None:
    """Depth and numbers of the parsed document (and, when the body may hold them, NUL or lone surrogates in
    its strings and keys), without recursion: one step per container, number or string, not per character."""
    followed = (dict, list, str, int, float) if check_strings else (dict, list, int, float)
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        kind = type(node)
        if kind is int or kind is float:
            _check_number(node)
            continue
        if kind is str:
            _check_string(node)
            continue
        if kind is bool:
            continue
        if depth > MAX_DEPTH and (kind is dict or kind is list):
            raise BadJSON(f"nesting deeper than {MAX_DEPTH}", code="NESTING_TOO_DEEP")
        if kind is dict:
            if check_strings:
                stack.extend((key, depth) for key in node)
            node = node.values()
        if isinstance(node, Iterable):
            stack.extend((child, depth + 1) for child in node if isinstance(child, followed))


def loads_strict(raw: bytes) -> Any:
    """Parse a JSON document strictly. Raises BadJSON on anything refused.

    The C scanner of ``json`` does the parsing, numbers included; Python runs once per object (duplicate
    keys), and the walk once per container and number (range, overflow). Strings are checked one by one only
    when the raw body holds an escape that could encode a NUL or a surrogate (a regular expression over the
    bytes decides).
    """
    if len(raw) > settings.MAX_REQUEST_BYTES:
        raise BadJSON(f"body exceeds {settings.MAX_REQUEST_BYTES} bytes", status=413, code="BODY_TOO_LARGE")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadJSON("body is not UTF-8", code="MALFORMED_JSON") from None
    if not text.strip():
        raise BadJSON("empty body", code="MALFORMED_JSON")
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadJSON(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError:
        # int() refuses more than 4,300 digits: far outside ±2^53.
        raise BadJSON(
            "an integer of thousands of digits is outside ±2^53", code="INTEGER_OUT_OF_RANGE"
        ) from None
    except RecursionError:
        raise BadJSON(f"nesting deeper than {MAX_DEPTH}", code="NESTING_TOO_DEEP") from None
    _walk(value, check_strings=_SUSPECT_ESCAPE.search(raw) is not None)
    return value


def media_charset(media_type: str) -> str | None:
    """The ``charset`` parameter of a Content-Type, lower case and unquoted, or None."""
    for param in media_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(
        self,
        stream: IO[bytes],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        charset = media_charset(media_type or "")
        if charset not in (None, "utf-8", "utf8"):
            raise drf_exceptions.UnsupportedMediaType(
                media_type or "",
                detail=f"JSON bodies are UTF-8 (RFC 8259), not charset={charset}",
            )
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > settings.MAX_REQUEST_BYTES:
            raise BadJSON(
                f"body exceeds {settings.MAX_REQUEST_BYTES} bytes", status=413, code="BODY_TOO_LARGE"
            )
        http_request = getattr(request, "_request", None)
        if http_request is not None and PARSED_BODY in http_request.__dict__:
            # The hot path parsed this body strictly already, then left the request to the view.
            return http_request.__dict__[PARSED_BODY]
        return loads_strict(stream.read(settings.MAX_REQUEST_BYTES + 1))
