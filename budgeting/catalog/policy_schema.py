"""The published JSON Schema of the policy document (``policy_schema.json``) and every error it finds, each
with the path of the field at fault, in the validator's words (``taskClasses.x.ladder[2]: unknown rung``).

``ladder.policy.parse_policy`` stays the source of truth for what a document means; the schema states the same
rules so that editors and tools can check a document before it reaches us, and so that a person sees all of a
document's errors at once instead of the first one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator, ValidationError

SCHEMA_PATH = Path(__file__).with_name("policy_schema.json")

_TYPES = {
    "object": "expected an object",
    "array": "expected an array of strings",
    "integer": "expected an integer",
    "number": "expected a number",
    "boolean": "expected true or false",
    "string": "expected a non-empty string",
    "null": "expected null",
}


@dataclass(frozen=True)
class FieldError:
    """A validation message and the document field it is about (``taskClasses.x.ladder[2]``)."""

    path: str
    message: str


@cache
def schema() -> dict[str, Any]:
    """The policy document's JSON Schema (draft 7, the dialect most editors understand)."""
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return loaded


@cache
def _validator() -> Draft7Validator:
    return Draft7Validator(schema())


def join_path(parts: Sequence[object]) -> str:
    """``["taskClasses", "x", 2]`` -> ``taskClasses.x[2]``, the notation of the ladder validator."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def schema_errors(document: Any) -> list[FieldError]:
    """Every error the schema finds in ``document``, sorted by path (empty when it conforms)."""
    found = {error for raw in _validator().iter_errors(document) for error in _explain(raw)}
    return sorted(found, key=lambda e: (e.path, e.message))


def _rule_message(error: ValidationError) -> str | None:
    """The ``errorMessage`` of the innermost schema on the failing keyword's path: the rule a cross-field
    constraint (``if``/``then``) or a shape (``anyOf``) stands for, in words."""
    node: Any = schema()
    message = None
    for key in error.absolute_schema_path:
        if isinstance(node, dict):
            if key not in node and "$ref" in node:
                # A draft-7 "$ref" stands for the schema it points at; the error's path steps right into it.
                node = _definition(node["$ref"])
            message = node.get("errorMessage", message)
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int):
            node = node[key]
        else:
            break
    return message


def _explain(error: ValidationError) -> Iterator[FieldError]:
    parts = list(error.absolute_path)
    path = join_path(parts) or "(document)"
    rule = _rule_message(error)
    if rule is not None:
        if "propertyNames" in error.absolute_schema_path:
            parts = [*parts, str(error.instance)]
        elif error.validator == "required":
            parts = [*parts, *_missing(error)[:1]]
        yield FieldError(join_path(parts) or "(document)", rule)
    elif error.validator == "required":
        for key in _missing(error):
            yield FieldError(join_path([*parts, key]), "required field is missing")
    elif error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        for key in extra:
            yield FieldError(join_path([*parts, key]), "unknown field")
    elif error.validator == "type":
        yield FieldError(path, _TYPES.get(str(error.validator_value), f"expected {error.validator_value}"))
    elif error.validator in ("minimum", "maximum"):
        low, high = error.schema.get("minimum"), error.schema.get("maximum")
        bounds = f"between {low} and {high}" if low is not None and high is not None else ""
        yield FieldError(path, f"must be {bounds or _bound(error)}")
    elif error.validator == "enum":
        choices = ", ".join(str(c) for c in error.validator_value)
        yield FieldError(path, f"{json.dumps(error.instance)} is not one of {choices}")
    elif error.validator == "minLength":
        yield FieldError(path, "expected a non-empty string")
    elif error.validator == "maxLength":
        yield FieldError(path, f"must be at most {error.validator_value} characters")
    elif error.validator == "pattern":
        yield FieldError(path, "must not contain NUL characters")
    elif error.validator == "uniqueItems":
        index, item = _first_repeat(error.instance)
        yield FieldError(join_path([*parts, index]), f"duplicate {item!r}")
    elif error.validator == "minProperties":
        yield FieldError(path, "expected a non-empty object")
    elif error.validator == "oneOf":
        yield from _explain(_closest(error))
    else:
        yield FieldError(path, error.message)


def _definition(ref: str) -> Any:
    """The schema a local ``$ref`` (``#/definitions/name``) points at."""
    node: Any = schema()
    for key in ref.removeprefix("#/").split("/"):
        node = node[key]
    return node


def _first_repeat(items: list[Any]) -> tuple[int, Any]:
    """The index and value of the first item that repeats an earlier one."""
    seen: list[Any] = []
    for index, item in enumerate(items):
        if item in seen:
            return index, item
        seen.append(item)
    return 0, items[0]


def _missing(error: ValidationError) -> list[str]:
    return [key for key in error.validator_value if key not in error.instance]


def _bound(error: ValidationError) -> str:
    word = "at least" if error.validator == "minimum" else "at most"
    return f"{word} {error.validator_value}"


def _closest(error: ValidationError) -> ValidationError:
    """Of a ``oneOf``'s alternatives (``null`` or an object), the error of the one the value was meant as."""
    return min(error.context or [error], key=lambda e: (e.validator == "type", -len(e.absolute_path)))
