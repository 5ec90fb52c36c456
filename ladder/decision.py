"""The outcome of an admission decision: ``Decision`` and the steps, removals and candidates it records.

Plain frozen values; ``ladder.decide`` makes them and ``ladder.wire`` gives them their JSON shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from ladder.components import BUCKETS, HARD_BUCKETS, Components
from ladder.counting import Count, CountMethod
from ladder.policy import Rung
from ladder.rungs import ModelSpec
from ladder.templates import TEMPLATE_BUCKET

CONTEXT_BUDGET_EXCEEDED: Final = "CONTEXT_BUDGET_EXCEEDED"
COUNTING_UNAVAILABLE: Final = "COUNTING_UNAVAILABLE"
MINIMUM_EVIDENCE_UNAVAILABLE: Final = "MINIMUM_EVIDENCE_UNAVAILABLE"
RejectionCode = Literal["CONTEXT_BUDGET_EXCEEDED", "COUNTING_UNAVAILABLE", "MINIMUM_EVIDENCE_UNAVAILABLE"]


@dataclass(frozen=True)
class CandidateCheck:
    """One fallback model considered by SMALLER_MODEL: the dimensions it failed, or its count and budget."""

    model_id: str
    failed: tuple[str, ...]
    tokens: int | None = None
    budget: int | None = None


@dataclass(frozen=True)
class LadderStep:
    """One rung application: what it removed, replaced or added, why, and the count before and after."""

    rung: Rung
    removed_ids: tuple[str, ...]
    replaced_ids: tuple[str, ...]
    reason: str
    tokens_before: int
    tokens_after: int
    model_id: str
    added_ids: tuple[str, ...] = ()
    candidates: tuple[CandidateCheck, ...] = ()


@dataclass(frozen=True)
class RemovedObject:
    """An object left out of the payload; ``rung`` is None for an authorization exclusion."""

    id: str
    bucket: str
    reason: str
    rung: Rung | None
    detail: str = ""


@dataclass(frozen=True)
class Decision:
    """The outcome of ``decide``.

    ``components`` is the final ladder state (evidence after exclusion, ``compactions`` = the applied ones);
    ``payload`` is exactly what to send when ``admitted``; ``count`` is None when nothing could be counted.
    """

    request_id: str
    admitted: bool
    code: RejectionCode | None
    detail: str
    rung: Rung
    steps: tuple[LadderStep, ...]
    removed: tuple[RemovedObject, ...]
    excluded: tuple[RemovedObject, ...]
    components: Components
    payload: dict[str, object]
    rendered_digest: str
    count: Count | None
    budget: int
    max_output: int
    model: ModelSpec
    original_model_id: str
    template_revision: str
    counter_digest: str | None
    digests_before: dict[str, str]
    digests_after: dict[str, str]
    minimum_tokens_needed: int | None
    rungs_tried: tuple[Rung, ...]
    recommendations: tuple[str, ...] = field(default=())
    provider_counts: tuple[tuple[str, int], ...] = field(default=())
    """(payload digest, tokens) of each payload a provider counting API counted for this decision."""

    @property
    def fits(self) -> bool:
        """Whether the request was admitted."""
        return self.admitted

    @property
    def count_method(self) -> CountMethod | None:
        """``EXACT``, ``UPPER_BOUND`` or ``PROVIDER_COUNT`` (None when nothing was counted)."""
        return None if self.count is None else self.count.method

    @property
    def hard_bucket_changes(self) -> int:
        """How many hard buckets differ between the request and the final state (always 0; a metric)."""
        return sum(self.digests_before[name] != self.digests_after[name] for name in HARD_BUCKETS)

    def buckets(self) -> dict[str, int]:
        """Tokens per bucket of the final state, every bucket present (zeros when nothing was counted)."""
        counted = {} if self.count is None else self.count.per_bucket
        return {name: counted.get(name, 0) for name in (*BUCKETS, TEMPLATE_BUCKET)}
