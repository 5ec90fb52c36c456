"""The input serializers' fast path (budgeting/api/fastpath.py) answers only what DRF answers: for every
generated body it either defers (None) or gives exactly DRF's validated data for a body DRF accepts; and it
does answer the plainly valid bodies the hot path sees."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgeting.api import serializers as api
from budgeting.api.fastpath import fast_validator

VALID: dict[type, dict[str, Any]] = {
    api.AdmissionIn: {
        "requestId": "req-1",
        "tenantId": "t-internal",
        "taskClass": "contract-review",
        "modelPool": "eu-large",
        "modelRevision": "large@2026-07-01",
        "tokenizerDigest": "sha256:" + "a" * 64,
        "promptBundleDigest": "sha256:" + "b" * 12,
        "policyRevision": 3,
        "components": {"question": {"text": "What is owed?"}, "evidence": [], "memory": None},
        "maxOutput": 1600,
        "clientEstimate": {"inputTokens": 900},
        "estimatorRevision": "heuristic-2",
    },
    api.FenceIn: {"fence": 1},
    api.DispatchIn: {"fence": 2, "providerRequestId": "chatcmpl-1", "admittedDigest": "sha256:" + "c" * 64},
    api.UsageIn: {"fence": 1, "usageEventId": "u1", "inputTokens": None, "outputTokens": 5, "final": True},
    api.UsageReportIn: {
        "reservationId": "0b5f0a4e-8d1c-4f55-9d7e-2f1b6c9a7e10",
        "fence": 1,
        "usageEventId": "u1",
        "outputTokens": 5,
        "final": True,
    },
    api.TopUpIn: {"fence": 1, "topUpId": "top-1", "outputTokens": 200},
    api.FailIn: {
        "fence": 1,
        "reason": "connection refused",
        "requestSent": "unknown",
        "usage": {"usageEventId": "u1", "inputTokens": None, "outputTokens": 5},
    },
}
VALID[api.UsageReportsIn] = {
    "usage": [VALID[api.UsageReportIn], {**VALID[api.UsageReportIn], "usageEventId": "u2", "inputTokens": 9}]
}

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 10_000_000, 10_000_001, 2**53 - 1, 2**53, 2**64]),
    st.sampled_from(
        ["", " ", "req-1", " req-1", "req-1\n", "req 1", "é", "a" * 200, "a" * 201, "12", "true"]
    ),
    st.sampled_from(
        ["sha256:" + "a" * 64, "sha256:" + "A" * 64, "sha256:", "x\x00y", "\x1creq", "heuristic-2 "]
    ),
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
    st.dictionaries(
        st.sampled_from(["inputTokens", "other", "text"]), st.integers(-1, 5) | st.none(), max_size=2
    ),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def near_valid(draw: st.DrawFn, serializer_class: type) -> dict[str, Any]:
    """A valid body with some fields changed, dropped, or added."""
    body = dict(VALID[serializer_class])
    names = [*body, "unknownField"]
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(ODD_VALUES)
    return body


def plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("serializer_class", list(VALID))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_fast_path_answers_exactly_what_drf_answers_or_defers(serializer_class, data):
    body = data.draw(near_valid(serializer_class))
    fast = fast_validator(serializer_class)
    assert fast is not None
    answered = fast(body)
    if answered is None:
        return
    serializer = serializer_class(data=body)
    assert serializer.is_valid(), (body, serializer.errors)
    assert plain(answered) == plain(dict(serializer.validated_data))
    assert answered == dict(serializer.validated_data)


@pytest.mark.parametrize("serializer_class", list(VALID))
def test_a_plainly_valid_body_takes_the_fast_path(serializer_class):
    fast = fast_validator(serializer_class)
    assert fast is not None
    serializer = serializer_class(data=VALID[serializer_class])
    assert serializer.is_valid(), serializer.errors
    assert fast(VALID[serializer_class]) == dict(serializer.validated_data)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_list_of_reports_is_answered_exactly_as_drf_answers_it_or_deferred(data):
    """The compiled ``many=True`` serializer: its items changed as ``near_valid`` changes a body, its length
    from none to one past the limit, or something other than a list."""
    length = data.draw(st.sampled_from([0, 1, 2, 3, api.MAX_USAGE_REPORTS, api.MAX_USAGE_REPORTS + 1]))
    reports = [
        data.draw(near_valid(api.UsageReportIn))
        if data.draw(st.booleans())
        else dict(VALID[api.UsageReportIn])
        for _ in range(min(length, 3))
    ]
    reports += [dict(VALID[api.UsageReportIn])] * (length - len(reports))
    body = {"usage": data.draw(st.sampled_from([reports, {"0": reports}, None, "reports"]))}
    fast = fast_validator(api.UsageReportsIn)
    assert fast is not None
    answered = fast(body)
    serializer = api.UsageReportsIn(data=body)
    valid = serializer.is_valid()
    if answered is None:
        # It defers to DRF only where it must: a body whose every report is plainly valid is answered.
        assert not (valid and all(fast_validator(api.UsageReportIn)(r) for r in body["usage"])), body
        return
    assert valid, (body, serializer.errors)
    assert plain(answered) == plain(dict(serializer.validated_data))


def test_a_body_drf_would_change_is_left_to_drf():
    """DRF trims " t-internal " to "t-internal": the fast path must not answer it, trimmed or not."""
    body = {**VALID[api.AdmissionIn], "tenantId": " t-internal "}
    serializer = api.AdmissionIn(data=body)
    assert serializer.is_valid() and serializer.validated_data["tenantId"] == "t-internal"
    fast = fast_validator(api.AdmissionIn)
    assert fast is not None and fast(body) is None


def test_serializers_with_fields_it_does_not_compile_have_no_fast_path():
    class Sent(api.RequestSentField):
        """A subclass may convert otherwise: only RequestSentField itself is compiled."""

    class CustomField(api.FenceIn):
        requestSent = Sent()

    assert fast_validator(CustomField) is None
    assert fast_validator(api.OutcomeIn) is None  # a list of identifiers


def test_request_sent_takes_the_fast_path_with_drfs_values():
    fast = fast_validator(api.FailIn)
    assert fast is not None
    for sent, stored in ((True, "yes"), (False, "no"), ("unknown", "unknown")):
        body = {"fence": 1, "reason": "connection refused", "requestSent": sent}
        answered = fast(body)
        assert answered is not None and answered["requestSent"] == stored
    assert fast({"fence": 1, "reason": "x", "requestSent": "yes"}) is None


def test_a_serializer_with_its_own_conversion_has_no_fast_path():
    class Converting(api.StrictSerializer):
        fence = api.StrictInteger(min_value=1)

        def to_internal_value(self, data):
            return {**super().to_internal_value(data), "converted": True}

    assert fast_validator(Converting) is None
    assert fast_validator(api.FenceIn) is not None
