"""The published policy JSON Schema agrees with ladder.policy, the source of truth: every fixture policy is
valid under both, and every incoherent variant the ladder's tests refuse is refused by the schema too, at the
same field (the one documented exception: an integer written with a fraction, which only the validator
catches — the admin runs both)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator

from budgeting.catalog.policies import document_errors
from budgeting.catalog.policy_schema import schema, schema_errors
from budgeting.provisioning.source import load_file
from ladder.policy import PolicyError, parse_policy
from tests.admin.conftest import policy_document
from tests.ladder.fixtures import policy_doc
from tests.ladder.test_policy import CASES

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
ONLY_THE_VALIDATOR = {"float output cap"}


def fixture_policies() -> list[tuple[str, dict[str, Any]]]:
    demo = load_file(DEMO)["policies"]["versions"]
    minimal = policy_document(3, ladder=["FULL", "QUEUE_OR_REJECT"])
    minimal["taskClasses"]["contract-review"].update(countingUnavailable="UPPER_BOUND", rampPercent=0)
    return [
        ("ladder fixture (every section)", policy_doc()),
        ("minimal", minimal),
        ("admin fixture", policy_document(18)),
        *((f"demo r{v['revision']}", v["document"]) for v in demo),
    ]


def test_the_schema_is_a_valid_draft_7_schema():
    Draft7Validator.check_schema(schema())


@pytest.mark.parametrize(
    ("name", "document"), fixture_policies(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_fixture_policy_is_valid_under_both(name: str, document: dict[str, Any]):
    parse_policy(document)
    assert schema_errors(document) == []
    assert document_errors(document, revision=document["revision"]) == []


@pytest.mark.parametrize(("case", "mutate", "path"), CASES, ids=[case[0] for case in CASES])
def test_every_incoherent_variant_is_refused_by_both_at_its_field(
    case: str, mutate: Callable[[dict[str, Any]], None], path: str
):
    doc = copy.deepcopy(policy_doc())
    mutate(doc)
    with pytest.raises(PolicyError):
        parse_policy(doc)
    reported = {e.path for e in document_errors(doc, revision=1)}
    assert path in reported, reported
    if case in ONLY_THE_VALIDATOR:
        assert schema_errors(doc) == []
    else:
        assert path in {e.path for e in schema_errors(doc)}


def test_all_errors_are_reported_at_once_each_with_its_path():
    doc = copy.deepcopy(policy_doc())
    task = doc["taskClasses"]["contract-review"]
    task.update(outputCap=0, rampPercent=-1, countingUnavailable="GUESS", fallbackModels=[])
    task["queue"]["deadlineSeconds"] = 0
    doc["extra"] = 1
    errors = {e.path: e.message for e in document_errors(doc, revision=1)}
    prefix = "taskClasses.contract-review"
    assert errors == {
        "extra": "unknown field",
        f"{prefix}.outputCap": "must be between 1 and 100000000",
        f"{prefix}.rampPercent": "must be between 0 and 100",
        f"{prefix}.countingUnavailable": '"GUESS" is not one of REJECT, UPPER_BOUND',
        f"{prefix}.fallbackModels": "SMALLER_MODEL needs at least one fallback model",
        f"{prefix}.queue.deadlineSeconds": "a queue that is allowed needs a positive deadline",
    }


def test_a_mismatched_revision_is_reported_with_the_rest():
    doc = policy_document(5)
    doc["globalMaxInputTokens"] = 0
    paths = [e.path for e in document_errors(doc, revision=6)]
    assert paths == ["globalMaxInputTokens", "revision"]
