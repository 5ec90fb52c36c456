"""Strict reading of untrusted JSON values: types, ranges, string hygiene and size limits.

Every failure is a ``ComponentError`` naming the exact path, so that ``ladder.parser`` can build on these
primitives without repeating a check. A boolean is never a number here, whatever Python says.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from ladder.components import (
    DUPLICATE,
    INVALID_STRING,
    INVALID_VALUE,
    MISSING_FIELD,
    OUT_OF_RANGE,
    TOO_LONG,
    TOO_MANY,
    UNKNOWN_FIELD,
    WRONG_TYPE,
    ComponentError,
    Limits,
    canonical_json,
)

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

_T = TypeVar("_T")


def member_path(path: str, key: object) -> str:
    """Path of a member. A client-chosen key that is not a plain name is quoted with JSON escapes (ASCII
    only, shortened), so that an error path is always safe to echo back."""
    text = str(key)
    if _PLAIN_KEY.fullmatch(text):
        return f"{path}.{text}"
    return f"{path}[{json.dumps(text[:64])}]"


def unique(values: Sequence[object], path: str, what: str) -> None:
    """Raises ComponentError (``duplicate``) at the first repeated value; ``what`` names it in the message."""
    seen: set[object] = set()
    for index, value in enumerate(values):
        if value in seen:
            raise ComponentError(f"{path}[{index}]", f"duplicate {what} {value!r}", DUPLICATE)
        seen.add(value)


class StrictReader:
    """Reads JSON values against one ``Limits``; it counts characters and JSON values across all its reads."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total_chars = 0
        self.json_nodes = 0

    def obj(
        self,
        value: object,
        path: str,
        *,
        required: Sequence[str],
        optional: Sequence[str] = (),
        extra: bool = False,
    ) -> dict[str, object]:
        if not isinstance(value, dict):
            raise ComponentError(path, "expected an object", WRONG_TYPE)
        data = cast(dict[object, object], value)
        if not extra:
            allowed = set(required) | set(optional)
            unknown = sorted(str(key) for key in data if key not in allowed)
            if unknown:
                raise ComponentError(member_path(path, unknown[0]), "unknown field", UNKNOWN_FIELD)
        for key in required:
            if key not in data:
                raise ComponentError(f"{path}.{key}", "required field is missing", MISSING_FIELD)
        return cast(dict[str, object], data)

    def array(self, value: object, path: str, max_items: int) -> list[object]:
        if not isinstance(value, list):
            raise ComponentError(path, "expected an array", WRONG_TYPE)
        if len(value) > max_items:
            raise ComponentError(path, f"at most {max_items} elements are allowed", TOO_MANY)
        return cast(list[object], value)

    def string(
        self, value: object, path: str, *, max_chars: int | None = None, non_empty: bool = False
    ) -> str:
        if not isinstance(value, str):
            raise ComponentError(path, "expected a string", WRONG_TYPE)
        limit = self.limits.max_string_chars if max_chars is None else max_chars
        if len(value) > limit:
            raise ComponentError(path, f"longer than {limit} characters", TOO_LONG)
        if non_empty and not value:
            raise ComponentError(path, "must not be empty", INVALID_VALUE)
        if "\x00" in value:
            raise ComponentError(path, "NUL characters are not allowed", INVALID_STRING)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ComponentError(path, "lone surrogates are not allowed", INVALID_STRING) from None
        self.total_chars += len(value)
        if self.total_chars > self.limits.max_total_chars:
            raise ComponentError(
                path, f"components exceed {self.limits.max_total_chars} characters", TOO_LONG
            )
        return value

    def ident(self, value: object, path: str) -> str:
        text = self.string(value, path, max_chars=self.limits.max_id_chars, non_empty=True)
        if _CONTROL.search(text):
            raise ComponentError(path, "control characters are not allowed in identifiers", INVALID_STRING)
        return text

    def integer(self, value: object, path: str, *, low: int, high: int) -> int:
        # bool is a subclass of int in Python, but true/false is not a number in this API.
        if type(value) is not int:
            raise ComponentError(path, "expected an integer", WRONG_TYPE)
        if not low <= value <= high:
            raise ComponentError(path, f"must be between {low} and {high}", OUT_OF_RANGE)
        return value

    def number(self, value: object, path: str, *, low: float, high: float) -> float:
        if type(value) is not int and type(value) is not float:
            raise ComponentError(path, "expected a number", WRONG_TYPE)
        number = float(cast(float, value))
        if not math.isfinite(number) or not low <= number <= high:
            raise ComponentError(path, f"must be a finite number between {low} and {high}", OUT_OF_RANGE)
        return number

    def boolean(self, value: object, path: str) -> bool:
        if type(value) is not bool:
            raise ComponentError(path, "expected true or false", WRONG_TYPE)
        return value

    def json_value(self, value: object, path: str, depth: int = 0) -> None:
        """Check that ``value`` is plain, finite, well-formed JSON within the depth and node limits."""
        if depth > self.limits.max_json_depth:
            raise ComponentError(path, f"nested deeper than {self.limits.max_json_depth}", TOO_LONG)
        self.json_nodes += 1
        if self.json_nodes > self.limits.max_json_nodes:
            raise ComponentError(path, f"more than {self.limits.max_json_nodes} JSON values", TOO_MANY)
        if value is None or type(value) is bool:
            return
        if type(value) is int:
            if abs(value) > 2**63:
                raise ComponentError(path, "integer out of range", OUT_OF_RANGE)
            return
        if type(value) is float:
            if not math.isfinite(value):
                raise ComponentError(path, "must be finite", OUT_OF_RANGE)
            return
        if isinstance(value, str):
            self.string(value, path)
            return
        if isinstance(value, list):
            for index, item in enumerate(cast(list[object], value)):
                self.json_value(item, f"{path}[{index}]", depth + 1)
            return
        if isinstance(value, dict):
            for key, item in cast(dict[object, object], value).items():
                if not isinstance(key, str):
                    raise ComponentError(path, "object keys must be strings", WRONG_TYPE)
                self.string(key, member_path(path, key))
                self.json_value(item, member_path(path, key), depth + 1)
            return
        raise ComponentError(path, "not a JSON value", WRONG_TYPE)

    def json_object(self, value: object, path: str) -> str:
        if not isinstance(value, dict):
            raise ComponentError(path, "expected an object", WRONG_TYPE)
        self.json_value(value, path)
        return canonical_json(value)

    def items(
        self, value: object, path: str, max_items: int, parse: Callable[[object, str], _T]
    ) -> tuple[_T, ...]:
        return tuple(parse(item, f"{path}[{i}]") for i, item in enumerate(self.array(value, path, max_items)))
