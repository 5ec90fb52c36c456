"""The admission decision: render, count, and walk the policy's degradation ladder (SPEC §4, §6, §7).

``decide`` is a pure function of its inputs (the count cache only saves work), so replaying a manifest's
inputs reproduces the decision exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from ladder.components import (
    BUCKETS,
    DIGESTED,
    HARD_BUCKETS,
    Compaction,
    Components,
    EvidenceItem,
    Tool,
    bucket_digests,
)
from ladder.counting import (
    Count,
    CountCache,
    CountingUnavailable,
    CountMethod,
    MemoryCountCache,
    SegmentCounter,
    UpperBoundCounter,
    count_stream,
    rendered_digest,
)
from ladder.policy import Rung, TaskPolicy
from ladder.rungs import (
    ModelSpec,
    apply_compaction,
    compaction_order,
    compaction_refusal,
    dedup_evidence,
    essential_tool_names,
    exclude_not_permitted,
    incompatibilities,
    minimum_evidence_ids,
    trim_order,
)
from ladder.templates import TEMPLATE_BUCKET, ChatTemplate, RenderMemo, get_template

ESTIMATOR_REVISION = "ladder/1"

CONTEXT_BUDGET_EXCEEDED: Final = "CONTEXT_BUDGET_EXCEEDED"
COUNTING_UNAVAILABLE: Final = "COUNTING_UNAVAILABLE"
MINIMUM_EVIDENCE_UNAVAILABLE: Final = "MINIMUM_EVIDENCE_UNAVAILABLE"
RejectionCode = Literal["CONTEXT_BUDGET_EXCEEDED", "COUNTING_UNAVAILABLE", "MINIMUM_EVIDENCE_UNAVAILABLE"]
RECOMMENDATIONS: tuple[str, ...] = ("NARROW_SCOPE", "PROCESS_ASYNC")


@dataclass(frozen=True)
class CandidateCheck:
    """One fallback model considered by SMALLER_MODEL: the dimensions it failed, or its count and budget."""

    model_id: str
    failed: tuple[str, ...]
    tokens: int | None = None
    budget: int | None = None

    def to_json(self) -> dict[str, object]:
        """Return the camelCase JSON form."""
        return {
            "modelId": self.model_id,
            "failed": list(self.failed),
            "tokens": self.tokens,
            "budget": self.budget,
        }


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

    def to_json(self) -> dict[str, object]:
        """Return the camelCase JSON form."""
        return {
            "rung": self.rung,
            "removedIds": list(self.removed_ids),
            "replacedIds": list(self.replaced_ids),
            "addedIds": list(self.added_ids),
            "reason": self.reason,
            "tokensBefore": self.tokens_before,
            "tokensAfter": self.tokens_after,
            "modelId": self.model_id,
            "candidates": [candidate.to_json() for candidate in self.candidates],
        }


@dataclass(frozen=True)
class RemovedObject:
    """An object left out of the payload; ``rung`` is None for an authorization exclusion."""

    id: str
    bucket: str
    reason: str
    rung: Rung | None
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        """Return the camelCase JSON form."""
        return {
            "id": self.id,
            "bucket": self.bucket,
            "reason": self.reason,
            "rung": self.rung,
            "detail": self.detail,
        }


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

    @property
    def fits(self) -> bool:
        """Whether the request was admitted."""
        return self.admitted

    @property
    def count_method(self) -> CountMethod | None:
        """``EXACT`` or ``UPPER_BOUND`` (None when nothing was counted)."""
        return None if self.count is None else self.count.method

    @property
    def hard_bucket_changes(self) -> int:
        """How many hard buckets differ between the request and the final state (always 0; a metric)."""
        return sum(self.digests_before[name] != self.digests_after[name] for name in HARD_BUCKETS)

    def buckets(self) -> dict[str, int]:
        """Tokens per bucket of the final state, every bucket present (zeros when nothing was counted)."""
        counted = {} if self.count is None else self.count.per_bucket
        return {name: counted.get(name, 0) for name in (*BUCKETS, TEMPLATE_BUCKET)}

    def to_response(self) -> dict[str, object]:
        """Return the decision fields of the admission / count API responses (camelCase)."""
        body: dict[str, object] = {
            "fits": self.admitted,
            "rung": self.rung,
            "tokens": {
                "input": None if self.count is None else self.count.total,
                "maxOutput": self.max_output,
                "buckets": self.buckets(),
            },
            "countMethod": self.count_method,
            "renderedDigest": self.rendered_digest,
            "budget": self.budget,
            "modelRevision": self.model.id,
            "removed": [item.to_json() for item in self.removed],
            "excluded": [item.to_json() for item in self.excluded],
        }
        if not self.admitted:
            body.update(
                {
                    "code": self.code,
                    "detail": self.detail,
                    "minimumTokensNeeded": self.minimum_tokens_needed,
                    "rungsTried": list(self.rungs_tried),
                    "recommendations": list(self.recommendations),
                }
            )
        return body

    def to_manifest(self) -> dict[str, object]:
        """Return the replayable record of this decision (JSON-able; equal for equal inputs)."""
        per_bucket = self.buckets()
        return {
            "estimatorRevision": ESTIMATOR_REVISION,
            "requestId": self.request_id,
            "admitted": self.admitted,
            "code": self.code,
            "detail": self.detail,
            "rung": self.rung,
            "originalModelId": self.original_model_id,
            "model": {
                "id": self.model.id,
                "tokenizerDigest": self.model.tokenizer_digest,
                "templateRevision": self.template_revision,
                "contextWindow": self.model.context_window,
                "maxOutput": self.model.max_output,
            },
            "counterDigest": self.counter_digest,
            "countMethod": self.count_method,
            "maxOutput": self.max_output,
            "budget": self.budget,
            "tokens": None if self.count is None else self.count.to_json(),
            "components": {
                name: {
                    "digestBefore": self.digests_before[name],
                    "digestAfter": self.digests_after[name],
                    "tokens": per_bucket.get(name),
                }
                for name in DIGESTED
            },
            "hardBucketChanges": self.hard_bucket_changes,
            "steps": [step.to_json() for step in self.steps],
            "removed": [item.to_json() for item in self.removed],
            "excluded": [item.to_json() for item in self.excluded],
            "renderedDigest": self.rendered_digest,
            "minimumTokensNeeded": self.minimum_tokens_needed,
            "rungsTried": list(self.rungs_tried),
            "recommendations": list(self.recommendations),
        }


# ------------------------------------------------------------------------------------------------ internals


@dataclass(frozen=True)
class _Route:
    """A model with its template, the output it grants and the input budget that leaves."""

    model: ModelSpec
    template: ChatTemplate
    max_output: int
    budget: int


@dataclass(frozen=True, eq=False)
class _Target:
    """A route with the counter that counts for it.

    ``render_memo`` (shared by every target of one walk: messages do not depend on the template) and
    ``counts`` (this counter's counts under this template) only save work across the walk's recounts.
    """

    route: _Route
    counter: SegmentCounter
    cache: CountCache
    render_memo: RenderMemo = field(default_factory=RenderMemo)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def model(self) -> ModelSpec:
        return self.route.model

    @property
    def budget(self) -> int:
        return self.route.budget

    def count(self, components: Components) -> Count:
        pieces = self.route.template.render(components, self.render_memo)
        return count_stream(
            pieces,
            self.counter,
            self.cache,
            template_revision=self.route.template.revision,
            image_formula=self.route.model.image_formula,
            memo=self.counts,
        )


def _route(model: ModelSpec, requested: int, policy: TaskPolicy, global_cap: int) -> _Route:
    """Return the route to ``model``; its budget may be zero or negative (then nothing fits)."""
    max_output = min(requested, policy.output_cap, model.max_output)
    budget = min(model.context_window - max_output, policy.input_cap, global_cap)
    return _Route(model, get_template(model.template_family), max_output, budget)


def _counter(counter_for: Callable[[ModelSpec], SegmentCounter], model: ModelSpec) -> SegmentCounter:
    """Return the exact counter of ``model``. Raises CountingUnavailable, also for another file's counter."""
    counter = counter_for(model)
    if counter.digest != model.tokenizer_digest or counter.method != "EXACT":
        found = f"{counter.digest} ({counter.method})"
        raise CountingUnavailable(f"counter {found} is not the exact counter of {model.tokenizer_digest}")
    return counter


@dataclass
class _Walk:
    """The mutable bookkeeping of one ladder walk (local to one ``decide`` call)."""

    target: _Target
    state: Components
    count: Count
    steps: list[LadderStep] = field(default_factory=list)
    removed: list[RemovedObject] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.count.total <= self.target.budget

    def step(
        self,
        rung: Rung,
        before: int,
        reason: str,
        *,
        removed: Sequence[str] = (),
        replaced: Sequence[str] = (),
        added: Sequence[str] = (),
        candidates: Sequence[CandidateCheck] = (),
    ) -> None:
        self.steps.append(
            LadderStep(
                rung=rung,
                removed_ids=tuple(removed),
                replaced_ids=tuple(replaced),
                reason=reason,
                tokens_before=before,
                tokens_after=self.count.total,
                model_id=self.target.model.id,
                added_ids=tuple(added),
                candidates=tuple(candidates),
            )
        )


def _dedup(walk: _Walk) -> None:
    before = walk.count.total
    kept, dropped = dedup_evidence(walk.state.evidence)
    if not dropped:
        walk.step("DEDUP_EVIDENCE", before, "no duplicate evidence")
        return
    walk.state = replace(walk.state, evidence=kept)
    walk.count = walk.target.count(walk.state)
    for item, keeper in dropped:
        walk.removed.append(
            RemovedObject(item.id, "evidence", "DUPLICATE", "DEDUP_EVIDENCE", f"copy of {keeper}")
        )
    walk.step(
        "DEDUP_EVIDENCE",
        before,
        "removed lower-ranked copies with the same content digest and permission set",
        removed=[item.id for item, _ in dropped],
    )


def _compact(walk: _Walk, offered: Sequence[Compaction], request_id: str, policy: TaskPolicy) -> None:
    before = walk.count.total
    applied: list[str] = []
    replaced: list[str] = []
    notes: list[str] = []
    for compaction in compaction_order(offered):
        if walk.fits:
            break
        refusal = compaction_refusal(
            compaction, walk.state.recent_turns, request_id=request_id, gate=policy.compaction
        )
        if refusal is not None:
            notes.append(f"{compaction.id}: {refusal}")
            continue
        candidate = apply_compaction(walk.state, compaction)
        counted = walk.target.count(candidate)
        if counted.total >= walk.count.total:
            notes.append(f"{compaction.id}: NO_GAIN")
            continue
        walk.state, walk.count = candidate, counted
        applied.append(compaction.id)
        for number in compaction.replaces_turns:
            replaced.append(str(number))
            walk.removed.append(
                RemovedObject(
                    str(number), "recentTurns", "COMPACTED", "COMPACT_HISTORY", f"replaced by {compaction.id}"
                )
            )
    reason = f"applied {', '.join(applied)}" if applied else "no compaction applied"
    if notes:
        reason += f"; not applied: {'; '.join(notes)}"
    walk.step("COMPACT_HISTORY", before, reason, replaced=replaced, added=applied)


def _narrow(walk: _Walk, request_tools: Sequence[Tool], policy: TaskPolicy) -> None:
    before = walk.count.total
    essential = essential_tool_names(walk.state.tools, policy.essential_tools)
    dropped = [tool.name for tool in walk.state.tools if tool.name not in essential]
    if dropped:
        kept = tuple(tool for tool in walk.state.tools if tool.name in essential)
        walk.state = replace(walk.state, tools=kept)
        walk.count = walk.target.count(walk.state)
        for name in dropped:
            walk.removed.append(RemovedObject(name, "tools", "NON_ESSENTIAL_TOOL", "NARROW_WORKFLOW"))
        walk.step("NARROW_WORKFLOW", before, "dropped non-essential tool definitions", removed=dropped)
    else:
        walk.step("NARROW_WORKFLOW", before, "no non-essential tools")
    workflow = policy.clarification_workflow
    if walk.fits or workflow is None:
        return
    before = walk.count.total
    tools = tuple(tool for tool in request_tools if tool.name in workflow.tools)
    candidate = replace(walk.state, tools=tools, workflow_instruction=workflow.instruction)
    counted = walk.target.count(candidate)
    if counted.total >= before:
        walk.step(
            "NARROW_WORKFLOW", before, "clarification workflow would not reduce the count; not switched"
        )
        return
    current = {tool.name for tool in walk.state.tools}
    names = {tool.name for tool in tools}
    removed = [tool.name for tool in walk.state.tools if tool.name not in names]
    added = [tool.name for tool in tools if tool.name not in current]
    walk.state, walk.count = candidate, counted
    # A tool dropped above and brought back by the workflow is not removed after all.
    walk.removed = [item for item in walk.removed if not (item.bucket == "tools" and item.id in names)]
    for name in removed:
        walk.removed.append(RemovedObject(name, "tools", "CLARIFICATION_WORKFLOW", "NARROW_WORKFLOW"))
    walk.step(
        "NARROW_WORKFLOW",
        before,
        "switched to the clarification workflow",
        removed=removed,
        added=[*added, "workflowInstruction"],
    )


def _trim(walk: _Walk, policy: TaskPolicy) -> None:
    before = walk.count.total
    minimum = minimum_evidence_ids(walk.state.evidence, policy.minimum_evidence)
    order = trim_order(walk.state.evidence, minimum)
    if not order:
        walk.step("TRIM_EVIDENCE", before, "only the minimum evidence set is left")
        return
    base = walk.state

    def without(k: int) -> Components:
        dropped = {item.id for item in order[:k]}
        return replace(base, evidence=tuple(item for item in base.evidence if item.id not in dropped))

    # Each dropped item removes at least its wrapping special tokens, so the count falls strictly with k: the
    # smallest k that fits is found by bisection, with a recount at each probe.
    low, high = 1, len(order)
    best_state = without(high)
    best_count = walk.target.count(best_state)
    if best_count.total <= walk.target.budget:
        while low < high:
            middle = (low + high) // 2
            state = without(middle)
            counted = walk.target.count(state)
            if counted.total <= walk.target.budget:
                high, best_state, best_count = middle, state, counted
            else:
                low = middle + 1
    walk.state, walk.count = best_state, best_count
    dropped_items = order[:high]
    for item in dropped_items:
        walk.removed.append(
            RemovedObject(item.id, "evidence", "LOW_RANK", "TRIM_EVIDENCE", f"score {item.score}")
        )
    walk.step(
        "TRIM_EVIDENCE",
        before,
        "dropped the lowest-ranked evidence outside the minimum set",
        removed=[item.id for item in dropped_items],
    )


def _smaller_model(
    walk: _Walk,
    fallbacks: Sequence[ModelSpec],
    requested_max_output: int,
    policy: TaskPolicy,
    global_cap: int,
    counter_for: Callable[[ModelSpec], SegmentCounter],
) -> None:
    before = walk.count.total
    current = walk.target
    checks: list[CandidateCheck] = []
    for candidate in fallbacks:
        failed = incompatibilities(current.model, candidate, walk.state, current.route.max_output)
        if failed:
            checks.append(CandidateCheck(candidate.id, failed))
            continue
        route = _route(candidate, requested_max_output, policy, global_cap)
        try:
            target = _Target(route, _counter(counter_for, candidate), current.cache, current.render_memo)
            counted = target.count(walk.state)
        except CountingUnavailable:
            checks.append(CandidateCheck(candidate.id, ("counting",), None, route.budget))
            continue
        checks.append(CandidateCheck(candidate.id, (), counted.total, route.budget))
        if counted.total <= route.budget:
            walk.target, walk.count = target, counted
            walk.step("SMALLER_MODEL", before, f"switched to {candidate.id}", candidates=checks)
            return
    walk.step("SMALLER_MODEL", before, "no compatible fallback model fits", candidates=checks)


def _minimal(state: Components, evidence: Sequence[EvidenceItem], policy: TaskPolicy) -> Components:
    """Hard buckets, trusted state and the minimum evidence set, nothing else."""
    minimum = minimum_evidence_ids(evidence, policy.minimum_evidence)
    return replace(
        state,
        evidence=tuple(item for item in evidence if item.id in minimum),
        recent_turns=(),
        compactions=(),
        tools=(),
        workflow_instruction=None,
    )


# ---------------------------------------------------------------------------------------------------- decide


def decide(
    components: Components,
    *,
    request_id: str,
    model: ModelSpec,
    requested_max_output: int,
    task_policy: TaskPolicy,
    global_cap: int,
    fallback_models: Sequence[ModelSpec],
    counter_for: Callable[[ModelSpec], SegmentCounter],
    cache: CountCache,
) -> Decision:
    """Decide whether ``components`` may be sent to ``model``, degrading along the task's ladder if needed.

    Evidence not covered by the authorization scope is excluded first (NOT_PERMITTED). The FULL payload is
    rendered and counted; while it does not fit the input budget (``min(context window - max output, task
    input cap, global cap)``) the policy's rungs are applied in order, each re-rendering and recounting.
    ``fallback_models`` are the policy's fallback candidates (any order; the policy's order is used).
    ``counter_for`` returns the exact counter of a model; if counting is unavailable the policy either
    rejects (COUNTING_UNAVAILABLE) or counts with the model's approved upper bound, which is never used to
    degrade anything. Hard buckets are never changed.

    Raises ValueError for a non-positive ``requested_max_output`` or ``global_cap``, or a fallback model that
    the policy does not list; TemplateError for an inconsistent ladder state (a bug).
    """
    if requested_max_output <= 0 or global_cap <= 0:
        raise ValueError("requested_max_output and global_cap must be positive")
    rank = {model_id: index for index, model_id in enumerate(task_policy.fallback_models)}
    for candidate in fallback_models:
        if candidate.id not in rank:
            raise ValueError(f"fallback model {candidate.id} is not listed by the task policy")
    fallbacks = sorted(fallback_models, key=lambda candidate: rank[candidate.id])

    permitted, refused = exclude_not_permitted(
        components.evidence, components.authorization_scope.permissions
    )
    excluded = tuple(RemovedObject(item.id, "evidence", "NOT_PERMITTED", None) for item in refused)
    base = replace(components, evidence=permitted, compactions=())
    route = _route(model, requested_max_output, task_policy, global_cap)
    before = bucket_digests(components)

    def finish(
        route: _Route,
        state: Components,
        count: Count | None,
        counter_digest: str | None,
        rung: Rung,
        tried: Sequence[Rung],
        *,
        code: RejectionCode | None = None,
        detail: str = "",
        steps: Sequence[LadderStep] = (),
        removed: Sequence[RemovedObject] = (),
        minimum_needed: int | None = None,
        memo: RenderMemo | None = None,
    ) -> Decision:
        payload = dict(route.template.payload(state, memo))
        payload["model"] = route.model.id
        payload["max_tokens"] = route.max_output
        return Decision(
            request_id=request_id,
            admitted=code is None,
            code=code,
            detail=detail,
            rung=rung,
            steps=tuple(steps),
            removed=tuple(removed),
            excluded=excluded,
            components=state,
            payload=payload,
            rendered_digest=rendered_digest(payload),
            count=count,
            budget=route.budget,
            max_output=route.max_output,
            model=route.model,
            original_model_id=model.id,
            template_revision=route.template.revision,
            counter_digest=counter_digest,
            digests_before=before,
            digests_after=bucket_digests(state),
            minimum_tokens_needed=minimum_needed,
            rungs_tried=tuple(tried),
            recommendations=RECOMMENDATIONS if code == CONTEXT_BUDGET_EXCEEDED else (),
        )

    rule = task_policy.minimum_evidence
    if rule.require_marked:
        missing = [item.id for item in refused if item.minimum_retention]
        if missing or len(permitted) < rule.min_items:
            detail = (
                f"minimum-retention evidence not permitted: {', '.join(missing)}"
                if missing
                else f"{len(permitted)} permitted evidence items, the task needs {rule.min_items}"
            )
            return finish(
                route,
                base,
                None,
                None,
                "QUEUE_OR_REJECT",
                ("FULL",),
                code=MINIMUM_EVIDENCE_UNAVAILABLE,
                detail=detail,
            )

    try:
        target = _Target(route, _counter(counter_for, model), cache, RenderMemo())
        walk = _Walk(target, base, target.count(base))
        tried: list[Rung] = ["FULL"]
        if not walk.fits:
            for rung in task_policy.ladder[1:]:
                tried.append(rung)
                if rung == "QUEUE_OR_REJECT":
                    break
                if rung == "DEDUP_EVIDENCE":
                    _dedup(walk)
                elif rung == "COMPACT_HISTORY":
                    _compact(walk, components.compactions, request_id, task_policy)
                elif rung == "NARROW_WORKFLOW":
                    _narrow(walk, base.tools, task_policy)
                elif rung == "TRIM_EVIDENCE":
                    _trim(walk, task_policy)
                elif rung == "SMALLER_MODEL":
                    _smaller_model(
                        walk, fallbacks, requested_max_output, task_policy, global_cap, counter_for
                    )
                if walk.fits:
                    break
        final = walk.target
        if walk.fits:
            return finish(
                final.route,
                walk.state,
                walk.count,
                final.counter.digest,
                tried[-1],
                tried,
                steps=walk.steps,
                removed=walk.removed,
                memo=final.render_memo,
            )
        # Only a fitting fallback is ever switched to, so the walk is still on the requested model here.
        minimum_needed = target.count(_minimal(base, permitted, task_policy)).total
        return finish(
            final.route,
            walk.state,
            walk.count,
            final.counter.digest,
            "QUEUE_OR_REJECT",
            tried,
            code=CONTEXT_BUDGET_EXCEEDED,
            detail=f"{walk.count.total} input tokens after the ladder; the budget is {final.budget}",
            steps=walk.steps,
            removed=walk.removed,
            minimum_needed=minimum_needed,
            memo=final.render_memo,
        )
    except CountingUnavailable as exc:
        unavailable = str(exc)

    if task_policy.counting_unavailable == "REJECT" or model.upper_bound is None:
        why = (
            "the policy rejects"
            if task_policy.counting_unavailable == "REJECT"
            else "no approved upper bound"
        )
        return finish(
            route,
            base,
            None,
            None,
            "QUEUE_OR_REJECT",
            ("FULL",),
            code=COUNTING_UNAVAILABLE,
            detail=f"{unavailable} ({why})",
        )
    bound = UpperBoundCounter(
        nfkc=model.upper_bound == "NFKC_UTF8_BYTES", tokenizer_digest=model.tokenizer_digest
    )
    # The bound is cheap to recompute; a private cache keeps it apart from exact counts entirely.
    count = _Target(route, bound, MemoryCountCache()).count(base)
    if count.total <= route.budget:
        detail = f"counted with an upper bound: {unavailable}"
        return finish(route, base, count, bound.digest, "FULL", ("FULL",), detail=detail)
    # Degrading on a bound could remove content that actually fits, so the ladder is not walked.
    return finish(
        route,
        base,
        count,
        bound.digest,
        "QUEUE_OR_REJECT",
        ("FULL",),
        code=COUNTING_UNAVAILABLE,
        detail=f"{unavailable}; the upper bound {count.total} exceeds the budget {route.budget} and a bound "
        "never degrades a request",
    )
