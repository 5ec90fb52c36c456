"""The API's orjson renderer writes the same JSON as DRF's JSONRenderer for every JSON value, byte for byte
for the Python types the API answers with (only a float's exponent is spelt differently: 1e-7, not 1e-07);
the JSON columns' orjson encoder stores what Django's would."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid

from hypothesis import given
from hypothesis import strategies as st
from rest_framework.renderers import JSONRenderer

from budgeting.api.renderers import FastJSONRenderer
from ledger.jsonfields import FastJSONEncoder
from tests.json_values import json_values

JSON = json_values(max_integer=2**53)


@given(JSON)
def test_any_json_value_is_rendered_as_drf_renders_it(value):
    assert json.loads(FastJSONRenderer().render([value])) == json.loads(JSONRenderer().render([value]))


# Text around the two separators the renderer escapes, and other characters whose UTF-8 starts with 0xE2
# (U+2000-U+2FFF: dashes, quotes, arrows), which must pass through as they are.
NEAR_SEPARATORS = st.lists(
    st.sampled_from(["a", " ", "\u2028", "\u2029", "\u2014", "\u2019", "\u20ac", "\u2fff", "\u2027"])
    | st.characters(codec="utf-8"),
    max_size=40,
).map("".join)


@given(NEAR_SEPARATORS)
def test_any_text_is_written_byte_for_byte_as_drf_writes_it(text):
    assert FastJSONRenderer().render({"text": text, "list": [text, text]}) == JSONRenderer().render(
        {"text": text, "list": [text, text]}
    )


def test_the_types_the_api_answers_with_are_written_byte_for_byte_as_before():
    value = {
        "separators": "line\u2028paragraph\u2029",
        "at": datetime.datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=datetime.UTC),
        "day": datetime.date(2026, 11, 30),
        "money": decimal.Decimal("12.50"),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "text": "第七条 — ünïcode",
        7: "a key that is not a string",
        "numbers": [0, -1, 2**53, 0.1, 2.5, 1.5e300],
    }
    assert FastJSONRenderer().render(value) == JSONRenderer().render(value)
    assert FastJSONRenderer().render(1e-7) == b"1e-7" and JSONRenderer().render(1e-7) == b"1e-07"
    assert FastJSONRenderer().render(None) == JSONRenderer().render(None) == b""


def test_what_orjson_refuses_is_rendered_by_drf_as_before():
    value = {"big": 2**70}
    expected = b'{"big":1180591620717411303424}'
    assert FastJSONRenderer().render(value) == JSONRenderer().render(value) == expected


def test_the_json_columns_encoder_stores_what_django_would():
    value = {"request": {"text": "第七条", "n": [1, 2.5, None, True]}, "at": "2026-11-30T12:00:00Z"}
    assert json.loads(json.dumps(value, cls=FastJSONEncoder)) == value
    assert json.loads(json.dumps({"big": 2**70}, cls=FastJSONEncoder)) == {"big": 2**70}
    an_id = uuid.UUID(int=1)
    assert json.loads(json.dumps({"id": an_id}, cls=FastJSONEncoder)) == {"id": str(an_id)}
