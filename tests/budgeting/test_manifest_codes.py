"""Every code the manifest stores fits its column by construction (derived from the enums)."""

from __future__ import annotations

from typing import get_args

from django.db.models import CharField

from budgeting.admission.models import Answer, Decision, Manifest
from ladder.decision import RejectionCode
from ladder.policy import RUNGS


def width(name: str) -> int:
    field = Manifest._meta.get_field(name)
    assert isinstance(field, CharField) and field.max_length is not None
    return field.max_length


def test_every_rejection_the_ladder_can_decide_is_a_decision_and_an_answer():
    for code in get_args(RejectionCode):
        assert code in Decision.values
        assert code in Answer.values


def test_every_stored_code_fits_its_column():
    assert all(len(value) <= width("decision") for value in Decision.values)
    assert all(len(value) <= width("answer") for value in Answer.values)
    assert all(len(rung) <= width("rung") for rung in RUNGS)
    assert width("answer") >= len("MINIMUM_EVIDENCE_UNAVAILABLE")
