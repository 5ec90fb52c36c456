"""The policy document (SPEC §6): a pure model and its validator.

A policy version is immutable once validated; ``parse_policy`` is the only way to build one, and it refuses an
incoherent document naming the field at fault, so a bad document can never become the active version.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

Rung = Literal[
    "FULL",
    "DEDUP_EVIDENCE",
    "COMPACT_HISTORY",
    "NARROW_WORKFLOW",
    "TRIM_EVIDENCE",
    "SMALLER_MODEL",
    "QUEUE_OR_REJECT",
]
RUNGS: tuple[Rung, ...] = get_args(Rung)
CountingUnavailablePolicy = Literal["REJECT", "UPPER_BOUND"]
DriftAction = Literal["ALERT", "COUNTING_UNAVAILABLE"]

_SLUG = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_MAX_TOKENS = 100_000_000
_MAX_QUEUE_DEADLINE = 7 * 24 * 3600


class PolicyError(ValueError):
    """An invalid or incoherent policy document; ``path`` names the field (``taskClasses.x.ladder[2]``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class MinimumEvidence:
    """The minimum evidence set of a task class.

    ``min_items``: TRIM_EVIDENCE never leaves fewer eligible evidence items than this (the best-ranked fill
    the set after every ``minimumRetention`` item, which is never dropped). ``require_marked``: the request
    must be able to keep its whole minimum set: a ``minimumRetention`` item excluded as not permitted, or
    fewer eligible items than ``min_items``, rejects the request (``MINIMUM_EVIDENCE_UNAVAILABLE``) instead of
    answering on a smaller set.
    """

    min_items: int
    require_marked: bool


@dataclass(frozen=True)
class CompactionGate:
    """Which compaction artifacts COMPACT_HISTORY may use."""

    fidelity_threshold: float
    approved_gates: frozenset[str]


@dataclass(frozen=True)
class ClarificationWorkflow:
    """The narrower workflow NARROW_WORKFLOW may switch to: these tools only, plus this instruction."""

    tools: tuple[str, ...]
    instruction: str


@dataclass(frozen=True)
class QueuePolicy:
    """Whether a request that lacks capacity may wait, and for how long."""

    allowed: bool
    deadline_seconds: int


@dataclass(frozen=True)
class TaskPolicy:
    """The policy of one task class."""

    input_cap: int
    output_cap: int
    ladder: tuple[Rung, ...]
    minimum_evidence: MinimumEvidence
    compaction: CompactionGate
    essential_tools: frozenset[str]
    clarification_workflow: ClarificationWorkflow | None
    counting_unavailable: CountingUnavailablePolicy
    queue: QueuePolicy
    ramp_percent: int
    fallback_models: tuple[str, ...]


@dataclass(frozen=True)
class DriftBound:
    """How far a counter's counts may drift from what providers report, per model revision and counter.

    The drift of a settled call is ``|reported − admitted| / admitted``; over the latest ``window`` settled
    calls (once there are ``min_calls``), its p99 must stay within ``max_p99`` (and its p50 within
    ``max_p50``, when set). Out of bound it is flagged (admin, metrics, alert); with ``on_exceeded``
    ``COUNTING_UNAVAILABLE`` the model's counter is also treated as unavailable, so each task's
    counting-unavailable rule decides (REJECT, or the approved upper bound).
    """

    max_p99: float
    max_p50: float | None = None
    window: int = 200
    min_calls: int = 20
    on_exceeded: DriftAction = "ALERT"


@dataclass(frozen=True)
class Policy:
    """A validated policy version."""

    revision: int
    global_max_input_tokens: int
    task_classes: Mapping[str, TaskPolicy]
    counter_drift: DriftBound | None = None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _obj(
    value: object, path: str, required: Sequence[str], optional: Sequence[str] = ()
) -> dict[str, object]:
    if not isinstance(value, dict):
        raise PolicyError(path, "expected an object")
    data = cast(dict[object, object], value)
    allowed = set(required) | set(optional)
    for key in sorted(str(key) for key in data):
        if key not in allowed:
            raise PolicyError(_join(path, key), "unknown field")
    for key in required:
        if key not in data:
            raise PolicyError(_join(path, key), "required field is missing")
    return cast(dict[str, object], data)


def _int(value: object, path: str, low: int, high: int) -> int:
    if type(value) is not int:
        raise PolicyError(path, "expected an integer")
    if not low <= value <= high:
        raise PolicyError(path, f"must be between {low} and {high}")
    return value


def _bool(value: object, path: str) -> bool:
    if type(value) is not bool:
        raise PolicyError(path, "expected true or false")
    return value


def _str(value: object, path: str, max_chars: int = 256) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyError(path, "expected a non-empty string")
    if len(value) > max_chars or "\x00" in value:
        raise PolicyError(path, f"must be at most {max_chars} characters without NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PolicyError(path, "lone surrogates are not allowed") from None
    return value


def _names(value: object, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise PolicyError(path, "expected an array of strings")
    names: list[str] = []
    for index, item in enumerate(cast(list[object], value)):
        name = _str(item, f"{path}[{index}]")
        if name in names:
            raise PolicyError(f"{path}[{index}]", f"duplicate {name!r}")
        names.append(name)
    return tuple(names)


def _ladder(value: object, path: str) -> tuple[Rung, ...]:
    names = _names(value, path)
    for index, name in enumerate(names):
        if name not in RUNGS:
            raise PolicyError(f"{path}[{index}]", f"unknown rung {name!r}; rungs are {', '.join(RUNGS)}")
    if len(names) < 2 or names[0] != "FULL" or names[-1] != "QUEUE_OR_REJECT":
        raise PolicyError(path, "a ladder starts with FULL and ends with QUEUE_OR_REJECT")
    return cast(tuple[Rung, ...], names)


def _task(value: object, path: str) -> TaskPolicy:
    data = _obj(
        value,
        path,
        required=("inputCap", "outputCap", "ladder", "countingUnavailable", "rampPercent"),
        optional=(
            "minimumEvidence",
            "compaction",
            "essentialTools",
            "clarificationWorkflow",
            "queue",
            "fallbackModels",
        ),
    )
    input_cap = _int(data["inputCap"], f"{path}.inputCap", 1, _MAX_TOKENS)
    output_cap = _int(data["outputCap"], f"{path}.outputCap", 1, _MAX_TOKENS)
    ladder = _ladder(data["ladder"], f"{path}.ladder")

    minimum = _obj(
        data.get("minimumEvidence", {}), f"{path}.minimumEvidence", (), ("minItems", "requireMarked")
    )
    minimum_evidence = MinimumEvidence(
        _int(minimum.get("minItems", 0), f"{path}.minimumEvidence.minItems", 0, 10_000),
        _bool(minimum.get("requireMarked", False), f"{path}.minimumEvidence.requireMarked"),
    )

    compaction_path = f"{path}.compaction"
    compaction = _obj(data.get("compaction", {}), compaction_path, (), ("fidelityThreshold", "approvedGates"))
    threshold = compaction.get("fidelityThreshold", 1.0)
    if type(threshold) not in (int, float) or not math.isfinite(cast(float, threshold)):
        raise PolicyError(f"{compaction_path}.fidelityThreshold", "expected a number")
    if not 0.0 <= cast(float, threshold) <= 1.0:
        raise PolicyError(f"{compaction_path}.fidelityThreshold", "must be between 0 and 1")
    gates = _names(compaction.get("approvedGates", []), f"{compaction_path}.approvedGates")
    if "COMPACT_HISTORY" in ladder and not gates:
        raise PolicyError(
            f"{compaction_path}.approvedGates", "COMPACT_HISTORY needs at least one approved gate"
        )

    essential = _names(data.get("essentialTools", []), f"{path}.essentialTools")

    workflow: ClarificationWorkflow | None = None
    workflow_path = f"{path}.clarificationWorkflow"
    raw_workflow = data.get("clarificationWorkflow")
    if raw_workflow is not None:
        workflow_data = _obj(raw_workflow, workflow_path, ("tools", "instruction"))
        workflow = ClarificationWorkflow(
            _names(workflow_data["tools"], f"{workflow_path}.tools"),
            _str(workflow_data["instruction"], f"{workflow_path}.instruction", max_chars=20_000),
        )
        if "NARROW_WORKFLOW" not in ladder:
            raise PolicyError(workflow_path, "a clarification workflow is only used by NARROW_WORKFLOW")

    counting = data["countingUnavailable"]
    if counting not in ("REJECT", "UPPER_BOUND"):
        raise PolicyError(f"{path}.countingUnavailable", "must be 'REJECT' or 'UPPER_BOUND'")

    queue_path = f"{path}.queue"
    queue_data = _obj(data.get("queue", {"allowed": False}), queue_path, ("allowed",), ("deadlineSeconds",))
    allowed = _bool(queue_data["allowed"], f"{queue_path}.allowed")
    deadline = _int(
        queue_data.get("deadlineSeconds", 0), f"{queue_path}.deadlineSeconds", 0, _MAX_QUEUE_DEADLINE
    )
    if allowed and deadline == 0:
        raise PolicyError(
            f"{queue_path}.deadlineSeconds", "a queue that is allowed needs a positive deadline"
        )

    fallbacks = _names(data.get("fallbackModels", []), f"{path}.fallbackModels")
    if "SMALLER_MODEL" in ladder and not fallbacks:
        raise PolicyError(f"{path}.fallbackModels", "SMALLER_MODEL needs at least one fallback model")
    if fallbacks and "SMALLER_MODEL" not in ladder:
        raise PolicyError(f"{path}.fallbackModels", "fallback models are only used by SMALLER_MODEL")

    return TaskPolicy(
        input_cap=input_cap,
        output_cap=output_cap,
        ladder=ladder,
        minimum_evidence=minimum_evidence,
        compaction=CompactionGate(float(cast(float, threshold)), frozenset(gates)),
        essential_tools=frozenset(essential),
        clarification_workflow=workflow,
        counting_unavailable=counting,
        queue=QueuePolicy(allowed, deadline),
        ramp_percent=_int(data["rampPercent"], f"{path}.rampPercent", 0, 100),
        fallback_models=fallbacks,
    )


def parse_policy(doc: object) -> Policy:
    """Validate a policy document and return it as a frozen ``Policy``.

    Raises PolicyError naming the field for unknown fields, wrong types (a boolean is not a number), values
    out of range, and incoherent combinations: a ladder that does not run from FULL to QUEUE_OR_REJECT or
    repeats a rung, SMALLER_MODEL without fallback models (or fallback models without SMALLER_MODEL),
    COMPACT_HISTORY without an approved gate, a clarification workflow without NARROW_WORKFLOW, a queue
    without a deadline.
    """
    data = _obj(doc, "", ("revision", "globalMaxInputTokens", "taskClasses"), ("counterDrift",))
    revision = _int(data["revision"], "revision", 1, 2**31 - 1)
    global_cap = _int(data["globalMaxInputTokens"], "globalMaxInputTokens", 1, _MAX_TOKENS)
    classes = data["taskClasses"]
    if not isinstance(classes, dict) or not classes:
        raise PolicyError("taskClasses", "expected a non-empty object")
    tasks: dict[str, TaskPolicy] = {}
    for slug in sorted(cast(dict[object, object], classes), key=str):
        if not isinstance(slug, str) or not _SLUG.fullmatch(slug):
            raise PolicyError(f"taskClasses.{slug}", "task class slugs match [a-z0-9][a-z0-9-]{0,63}")
        tasks[slug] = _task(classes[slug], f"taskClasses.{slug}")
    drift = data.get("counterDrift")
    return Policy(revision, global_cap, tasks, None if drift is None else _drift(drift, "counterDrift"))


def _ratio(value: object, path: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(cast(float, value)):
        raise PolicyError(path, "expected a number")
    if not 0.0 <= cast(float, value) <= 10.0:
        raise PolicyError(path, "must be between 0 and 10")
    return float(cast(float, value))


def _drift(value: object, path: str) -> DriftBound:
    data = _obj(value, path, ("maxP99",), ("maxP50", "window", "minCalls", "onExceeded"))
    action = data.get("onExceeded", "ALERT")
    if action not in ("ALERT", "COUNTING_UNAVAILABLE"):
        raise PolicyError(f"{path}.onExceeded", "must be 'ALERT' or 'COUNTING_UNAVAILABLE'")
    window = _int(data.get("window", 200), f"{path}.window", 10, 100_000)
    min_calls = _int(data.get("minCalls", 20), f"{path}.minCalls", 1, 100_000)
    if min_calls > window:
        raise PolicyError(f"{path}.minCalls", "cannot exceed window")
    max_p50 = data.get("maxP50")
    return DriftBound(
        max_p99=_ratio(data["maxP99"], f"{path}.maxP99"),
        max_p50=None if max_p50 is None else _ratio(max_p50, f"{path}.maxP50"),
        window=window,
        min_calls=min_calls,
        on_exceeded=action,
    )
