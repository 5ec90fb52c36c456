"""OpenAI's published framing of tools and response formats, written out so its UTF-8 bytes can bound it.

OpenAI does not document how its chat models see a request's ``tools`` and ``response_format``. The one
rendering OpenAI has published is the renderer of its open-weight models (openai-harmony: the tools section of
``HarmonyEncoding``, and the response formats of its ``docs/format.md``), the same TypeScript-like namespace
that GPT-4o's reverse-engineered prompts show in the system or developer message::

    # Tools

    ## functions

    namespace functions {

    // Get the current weather in a given location
    type get_current_weather = (_: {
    // The city and state, e.g. San Francisco, CA
    location: string,
    unit?: "celsius" | "fahrenheit",
    }) => any;

    } // namespace functions

It is not a JSON text: a tool's description is one ``// `` comment a line, a property's examples one comment
each, nested objects are indented four spaces a level. So the JSON we send does not bound it (a description
of many short lines costs 4 tokens a line rendered and 3 bytes a line in JSON). This module writes the text as
that renderer does (``tests/ladder/test_openai_bound.py`` compares it with openai-harmony's own output on
generated tools), and ``OpenAITemplate`` bounds each item by the bytes of the longer of its two public
renderings.

A tool call and a tool result are messages of their own in that framing, the function's name in their
headers (checked against openai-harmony's ``Message`` builders in the same tests)::

    <|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>
    <|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{result}<|end|>

The model itself writes the call's content type as ``<|constrain|>json`` (harmony's ``docs/format.md``), one
special more, and may move the recipient into the channel (``commentary to=functions.{name}
<|constrain|>json``): the same characters, cut elsewhere. ``call_text`` and ``result_header_text`` are the
texts between the specials, concatenated. A text the assistant writes beside its calls is a message of its
own, in a channel (``commentary`` for the preamble harmony's ``docs/format.md`` describes)::

    <|start|>assistant<|channel|>commentary<|message|>{text}<|end|>
"""

from __future__ import annotations

import json
import math
import unicodedata
from functools import lru_cache

# The tools section opens and closes once per request; the "\n\n" joins it to the instructions before it.
TOOLS_OPEN = "\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
TOOLS_CLOSE = "} // namespace functions"
# A response format is a section of its own: its name (``output``, the name the payload gives it), then the
# schema as compact JSON.
RESPONSE_FORMAT_OPEN = "\n\n# Response Formats\n\n## output\n\n"
# The specials of a call message (``<|constrain|>`` where the content type is written with it) and of a
# result message.
CALL_SPECIALS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")
RESULT_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
# The special that opens the channel of an assistant's text beside its calls, and the longest in bytes of
# harmony's channels (``analysis``, ``commentary``, ``final``): its bytes bound whichever the text is in.
CHANNEL_SPECIAL = "<|channel|>"
TEXT_CHANNEL = "commentary"


def tool_text(name: str, description: str, parameters: object) -> str:
    """The tool's part of the tools section: its description, a comment a line, its type and the blank line
    the renderer puts after it."""
    comments = "".join(f"// {line}\n" for line in _lines(description))
    return f"{comments}type {name} = (_: {_typescript(parameters, '')}) => any;\n\n"


def response_format_text(schema: object) -> str:
    """The response-format section of the output schema ``schema`` (a parsed JSON value)."""
    return RESPONSE_FORMAT_OPEN + json_text(schema)


@lru_cache(maxsize=4096)
def tool_bound_text(definition: str) -> str:
    """Whichever of a tool's two renderings has more UTF-8 bytes: the JSON definition we send (``definition``,
    as ``ladder.messages`` writes it) or its part of the tools section. Cached: the same definitions come back
    on every rung and every request."""
    function = json.loads(definition)["function"]
    rendered = tool_text(function["name"], function["description"], function["parameters"])
    return max(definition, rendered, key=_utf8_bytes)


@lru_cache(maxsize=256)
def schema_bound_text(message_text: str, schema_json: str) -> str:
    """Whichever of the output schema's two renderings has more UTF-8 bytes: the system text other families
    show (``message_text``) or the response-format section of ``schema_json``."""
    return max(message_text, response_format_text(json.loads(schema_json)), key=_utf8_bytes)


def call_text(name: str, arguments: str) -> str:
    """The texts of the call message of ``name`` with ``arguments``, between its specials, concatenated."""
    return f"assistant to=functions.{name}commentary json{arguments}"


def result_header_text(name: str) -> str:
    """The texts of a result message of ``name`` before its content, between its specials, concatenated."""
    return f"functions.{name} to=assistantcommentary"


@lru_cache(maxsize=4096)
def call_bound_text(call_id: str, name: str, arguments: str) -> str:
    """Whichever of a tool call's two renderings has more UTF-8 bytes: what we send (its id, name and
    arguments) or the texts of its call message. Cached, as ``tool_bound_text``: a turn's calls come back on
    every rung."""
    return max(call_id + name + arguments, call_text(name, arguments), key=_utf8_bytes)


@lru_cache(maxsize=4096)
def result_bound_text(call_id: str, name: str) -> str:
    """Whichever has more UTF-8 bytes: the ``tool_call_id`` a result is sent with, or the header texts of its
    result message (the function ``name`` of the call it answers). The result's content is bounded on its
    own: it is in both."""
    return max(call_id, result_header_text(name), key=_utf8_bytes)


@lru_cache(maxsize=256)
def trailing_run(text: str) -> str:
    """The end of ``text`` after its last letter or digit (Unicode categories L and N), all of it when it has
    none: the only part of ``text`` whose pre-tokens may change when a text starting with a line break is
    appended (``OpenAITemplate``, step 3). Cached: the same instructions come back on every rung."""
    end = len(text)
    while end and unicodedata.category(text[end - 1])[0] not in "LN":
        end -= 1
    return text[end:]


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _lines(text: str) -> list[str]:
    """``text``'s lines as Rust's ``str::lines`` gives them (the renderer's): split at LF, a CR before the LF
    dropped, no line after a final LF, none at all for an empty text."""
    pieces = text.split("\n")
    lines = [piece.removesuffix("\r") for piece in pieces[:-1]]
    if pieces[-1]:
        lines.append(pieces[-1])
    return lines


def json_text(value: object) -> str:
    """``value`` as compact JSON the way the renderer's serde_json writes it: keys in their order, UTF-8 kept,
    and floats in its layout (``0.00001``, ``1e16``, where Python writes ``1e-05`` and ``1e+16``), at its
    longest (``_float_text``)."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None or isinstance(value, bool | int):
        return json.dumps(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, list):
        return "[" + ",".join(json_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json_text(key)}:{json_text(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _float_text(value: float) -> str:
    """A finite float laid out as serde_json lays it out (the ryu crate's), with 17 significant digits.

    serde_json writes a float's shortest digits, but its parser may land a decimal an ulp away from Python's
    reading of it, whose shortest digits are longer (seen: ``…0244e20`` read back as ``…02442e20``). 17
    digits always round-trip, so no float serde_json writes at the same magnitude is longer than this.
    """
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent_text = f"{abs(value):.16e}".partition("e")
    digits = mantissa.replace(".", "")
    point = int(exponent_text) + 1
    if 0 < point <= 16:
        text = digits[:point] + "." + digits[point:]
    elif -5 < point <= 0:
        text = "0." + "0" * -point + digits
    else:
        text = f"{digits[0]}.{digits[1:]}e{point - 1}"
    return sign + text


def _get(schema: object, key: str) -> object:
    return schema.get(key) if isinstance(schema, dict) else None


def _has(schema: object, key: str) -> bool:
    return isinstance(schema, dict) and key in schema


def _is_enum(schema: object) -> bool:
    values = _get(schema, "enum")
    return isinstance(values, list) and bool(values)


def _nullable(schema: object, type_text: str) -> str:
    if _get(schema, "nullable") is True and "null" not in type_text:
        return f"{type_text} | null"
    return type_text


def _default_comment(schema: object, *, quote_enum_strings: bool = False) -> str | None:
    """The ``default: …`` comment of ``schema``, or None without a default. A string default is quoted unless
    the schema is an enum, where the renderer writes it bare (or, for a top-level ``oneOf`` variant, as JSON:
    ``quote_enum_strings``)."""
    if not _has(schema, "default"):
        return None
    default = _get(schema, "default")
    if isinstance(default, str) and not _is_enum(schema):
        return f'default: "{default}"'
    if isinstance(default, str) and not quote_enum_strings:
        return f"default: {default}"
    return f"default: {json_text(default)}"


def _typescript(schema: object, indent: str) -> str:
    """A JSON schema as the renderer's TypeScript type, nested objects indented by ``indent`` and four spaces
    a level."""
    variants = _get(schema, "oneOf")
    if isinstance(variants, list):
        out = ""
        for variant in variants:
            out += f"\n{indent} | " + _nullable(variant, _typescript(variant, indent + "   "))
            comments = []
            description = _get(variant, "description")
            if isinstance(description, str):
                comments.append(description)
            default = _default_comment(variant, quote_enum_strings=True)
            if default is not None:
                comments.append(default)
            if comments:
                out += " // " + " ".join(comments)
        return out
    kind = _get(schema, "type")
    if isinstance(kind, list):
        names = ["number" if item == "integer" else item for item in kind if isinstance(item, str)]
        if names:
            return " | ".join(names)
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = _get(schema, "enum")
        quoted = (
            [f'"{value}"' for value in values if isinstance(value, str)] if isinstance(values, list) else []
        )
        return " | ".join(quoted) if quoted else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return _typescript(_get(schema, "items"), indent) + "[]" if _has(schema, "items") else "Array<any>"
    return "any"


def _object(schema: object, indent: str) -> str:
    out = ""
    description = _get(schema, "description")
    if isinstance(description, str):
        out += f"{indent}// {description}\n"
    out += "{\n"
    properties = _get(schema, "properties")
    required_list = _get(schema, "required")
    required = (
        {name for name in required_list if isinstance(name, str)}
        if isinstance(required_list, list)
        else set()
    )
    for key, value in properties.items() if isinstance(properties, dict) else ():
        optional = "" if key in required else "?"
        title = _get(value, "title")
        if isinstance(title, str):
            out += f"{indent}// {title}\n{indent}//\n"
        own = _get(value, "description")
        if not _has(value, "oneOf") and isinstance(own, str):
            out += f"{indent}// {own}\n"
        examples = _get(value, "examples")
        if isinstance(examples, list) and examples:
            out += f"{indent}// Examples:\n"
            out += "".join(f'{indent}// - "{example}"\n' for example in examples if isinstance(example, str))
        variants = _get(value, "oneOf")
        if isinstance(variants, list):
            out += _one_of_property(key + optional, value, variants, indent)
            continue
        out += f"{indent}{key}{optional}: " + _nullable(value, _typescript(value, indent + "    ")) + ","
        default = None if _has(value, "oneOf") else _default_comment(value)
        if default is not None:
            out += f" // {default}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(label: str, value: object, variants: list[object], indent: str) -> str:
    """A property whose schema is a ``oneOf``: its comments, then each variant on a line of its own."""
    out = ""
    own = _get(value, "description")
    described = own if isinstance(own, str) else None
    first = _get(variants[0], "description") if variants else None
    above = described is not None and first != described
    if above:
        out += f"{indent}// {described}\n"
    default = _default_comment(value)
    if default is not None:
        out += f"{indent}// {default}\n"
    out += f"{indent}{label}:\n"
    for index, variant in enumerate(variants):
        out += f"{indent} | " + _nullable(variant, _typescript(variant, indent + "   "))
        comments = []
        description = _get(variant, "description")
        if not (index == 0 and above) and isinstance(description, str) and description != described:
            comments.append(description)
        variant_default = _default_comment(variant)
        if variant_default is not None:
            comments.append(variant_default)
        if comments:
            out += " // " + " ".join(comments)
        out += "\n"
    return out + f"{indent},\n"
