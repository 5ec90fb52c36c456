"""The policy validator: coherent documents parse; each incoherent one is refused naming its field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from ladder.policy import PolicyError, parse_policy

from .fixtures import policy_doc

TASK = "taskClasses.contract-review"


def test_a_coherent_document_parses() -> None:
    policy = parse_policy(policy_doc())
    task = policy.task_classes["contract-review"]
    assert policy.revision == 1
    assert task.ladder[0] == "FULL" and task.ladder[-1] == "QUEUE_OR_REJECT"
    assert task.compaction.approved_gates == frozenset({"gate-a"})
    assert task.fallback_models == ("legacy@1", "us@1", "notools@1", "lowtier@1")
    assert task.clarification_workflow is not None
    assert task.counting_unavailable == "REJECT"


def test_a_minimal_ladder_needs_no_optional_sections() -> None:
    doc = {
        "revision": 3,
        "globalMaxInputTokens": 100_000,
        "taskClasses": {
            "chat": {
                "inputCap": 1000,
                "outputCap": 100,
                "ladder": ["FULL", "QUEUE_OR_REJECT"],
                "countingUnavailable": "UPPER_BOUND",
                "rampPercent": 0,
            }
        },
    }
    task = parse_policy(doc).task_classes["chat"]
    assert task.minimum_evidence.min_items == 0
    assert task.queue.allowed is False
    assert task.clarification_workflow is None


def _task(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["taskClasses"]["contract-review"].update(changes)

    return mutate


def _nested(section: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["taskClasses"]["contract-review"][section].update(changes)

    return mutate


def _top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc.update(changes)

    return mutate


CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown top-level field", _top(extra=1), "extra"),
    ("revision zero", _top(revision=0), "revision"),
    ("bool revision", _top(revision=True), "revision"),
    ("global cap zero", _top(globalMaxInputTokens=0), "globalMaxInputTokens"),
    ("no task classes", _top(taskClasses={}), "taskClasses"),
    ("bad slug", lambda doc: doc["taskClasses"].update({"Bad Slug": {}}), "taskClasses.Bad Slug"),
    ("unknown task field", _task(bogus=1), f"{TASK}.bogus"),
    ("output cap zero", _task(outputCap=0), f"{TASK}.outputCap"),
    ("negative input cap", _task(inputCap=-5), f"{TASK}.inputCap"),
    ("float output cap", _task(outputCap=10.0), f"{TASK}.outputCap"),
    ("ladder without FULL first", _task(ladder=["DEDUP_EVIDENCE", "QUEUE_OR_REJECT"]), f"{TASK}.ladder"),
    ("ladder without QUEUE_OR_REJECT last", _task(ladder=["FULL", "DEDUP_EVIDENCE"]), f"{TASK}.ladder"),
    ("unknown rung", _task(ladder=["FULL", "TRUNCATE", "QUEUE_OR_REJECT"]), f"{TASK}.ladder[1]"),
    (
        "duplicate rung",
        _task(ladder=["FULL", "DEDUP_EVIDENCE", "DEDUP_EVIDENCE", "QUEUE_OR_REJECT"]),
        f"{TASK}.ladder[2]",
    ),
    ("smaller model without fallbacks", _task(fallbackModels=[]), f"{TASK}.fallbackModels"),
    (
        "fallbacks without smaller model",
        _task(ladder=["FULL", "DEDUP_EVIDENCE", "COMPACT_HISTORY", "NARROW_WORKFLOW", "QUEUE_OR_REJECT"]),
        f"{TASK}.fallbackModels",
    ),
    ("duplicate fallback", _task(fallbackModels=["a@1", "a@1"]), f"{TASK}.fallbackModels[1]"),
    (
        "compaction without approved gates",
        _nested("compaction", approvedGates=[]),
        f"{TASK}.compaction.approvedGates",
    ),
    (
        "fidelity above one",
        _nested("compaction", fidelityThreshold=1.5),
        f"{TASK}.compaction.fidelityThreshold",
    ),
    (
        "fidelity as text",
        _nested("compaction", fidelityThreshold="0.9"),
        f"{TASK}.compaction.fidelityThreshold",
    ),
    ("negative min items", _nested("minimumEvidence", minItems=-1), f"{TASK}.minimumEvidence.minItems"),
    (
        "require marked as int",
        _nested("minimumEvidence", requireMarked=1),
        f"{TASK}.minimumEvidence.requireMarked",
    ),
    ("counting unavailable unknown", _task(countingUnavailable="GUESS"), f"{TASK}.countingUnavailable"),
    ("ramp above 100", _task(rampPercent=101), f"{TASK}.rampPercent"),
    ("queue without deadline", _nested("queue", deadlineSeconds=0), f"{TASK}.queue.deadlineSeconds"),
    (
        "workflow without NARROW_WORKFLOW",
        _task(ladder=["FULL", "DEDUP_EVIDENCE", "COMPACT_HISTORY", "SMALLER_MODEL", "QUEUE_OR_REJECT"]),
        f"{TASK}.clarificationWorkflow",
    ),
    (
        "workflow without instruction",
        _task(clarificationWorkflow={"tools": []}),
        f"{TASK}.clarificationWorkflow.instruction",
    ),
    ("essential tools not a list", _task(essentialTools="search"), f"{TASK}.essentialTools"),
]


@pytest.mark.parametrize(("case", "mutate", "path"), CASES, ids=[case[0] for case in CASES])
def test_incoherent_documents_name_their_field(
    case: str, mutate: Callable[[dict[str, Any]], None], path: str
) -> None:
    doc = copy.deepcopy(policy_doc())
    mutate(doc)
    with pytest.raises(PolicyError) as caught:
        parse_policy(doc)
    assert caught.value.path == path, caught.value
