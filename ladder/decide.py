"""The admission decision: render, count, and walk the policy's degradation ladder (SPEC §4, §6, §7).

``decide`` is a pure function of its inputs (the count cache only saves work), so replaying a manifest's
inputs reproduces the decision exactly. Each rung is a function of the walk's shared state, looked up by name
in ``_RUNGS``: a new rung is one such function, one entry there and its name in ``ladder.policy.Rung``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from itertools import accumulate

from ladder.components import Components, bucket_digests
from ladder.counting import (
    Count,
    CountCache,
    CountingUnavailable,
    MemoryCountCache,
    SegmentCounter,
    TextCounts,
    UpperBoundCounter,
    rendered_digest,
    with_total,
)
from ladder.decision import (
    CONTEXT_BUDGET_EXCEEDED,
    COUNTING_UNAVAILABLE,
    MINIMUM_EVIDENCE_UNAVAILABLE,
    CandidateCheck,
    Decision,
    RejectionCode,
    RemovedObject,
)
from ladder.messages import RenderMemo, object_id
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
from ladder.walk import (
    Calibration,
    End,
    ProviderCount,
    Request,
    Target,
    Walk,
    final_payload,
    provider_counted,
)

ESTIMATOR_REVISION = "ladder/1"
# A provider-counted decision asks the provider at most this many payloads (FULL, the walk's end, and one
# re-walk's end when the first estimate was off).
MAX_PROVIDER_COUNTS = 3
RECOMMENDATIONS: tuple[str, ...] = ("NARROW_SCOPE", "PROCESS_ASYNC")


# ----------------------------------------------------------------------------------------------------- rungs


def _dedup(walk: Walk) -> None:
    """DEDUP_EVIDENCE: drop lower-ranked copies of the same evidence content and permission set."""
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


def _compact(walk: Walk) -> None:
    """COMPACT_HISTORY: replace turns by the offered summaries that pass the gate, oldest first."""
    request = walk.request
    before = walk.count.total
    applied: list[str] = []
    replaced: list[str] = []
    notes: list[str] = []
    for compaction in compaction_order(request.components.compactions):
        if walk.fits:
            break
        refusal = compaction_refusal(
            compaction, walk.state.recent_turns, request_id=request.request_id, gate=request.policy.compaction
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


def _narrow(walk: Walk) -> None:
    """NARROW_WORKFLOW: drop non-essential tools, then switch to the clarification workflow if that helps."""
    policy = walk.request.policy
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
    tools = tuple(tool for tool in walk.request.components.tools if tool.name in workflow.tools)
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


def _trim(walk: Walk) -> None:
    """TRIM_EVIDENCE: drop lowest-ranked evidence outside the minimum set: the fewest that fit, else all."""
    before = walk.count.total
    minimum = minimum_evidence_ids(walk.state.evidence, walk.request.policy.minimum_evidence)
    order = trim_order(walk.state.evidence, minimum)
    if not order:
        walk.step("TRIM_EVIDENCE", before, "only the minimum evidence set is left")
        return
    base = walk.state

    def without(k: int) -> Components:
        dropped = {item.id for item in order[:k]}
        return replace(base, evidence=tuple(item for item in base.evidence if item.id not in dropped))

    # Each dropped item removes at least its wrapping special tokens, so the count falls strictly with k: the
    # smallest k that fits is found by bisection, each probe a recount. The first probes are chosen by the
    # untrimmed count instead: k items dropped take their tokens in it off its total, and the specials
    # wrapping each, which it does not show item by item, are learned from each probe's recount. That
    # usually settles it in three recounts, where halving takes one per halving (eight for 200 items). The
    # guesses only choose where to look: every answer is a real recount, so the k found is bisection's.
    probed: dict[int, tuple[Components, Count]] = {}

    def fits(k: int) -> bool:
        state = without(k)
        probed[k] = (state, walk.target.count(state))
        return probed[k][1].total <= walk.target.budget

    total = walk.count.total
    tokens_of = walk.count.per_object
    dropped_tokens = list(
        accumulate((tokens_of.get(object_id("evidence", item.id), 0) for item in order), initial=0)
    )
    # Every k below ``low`` does not fit; ``high`` fits, or is len(order) + 1 while none is known to.
    low, high = 1, len(order) + 1
    per_item = 0
    for _ in range(GUIDED_PROBES):
        if low >= high:
            break
        k = _first_predicted_fit(dropped_tokens, total, per_item, walk.target.budget, low, high)
        if fits(k):
            high = k
        else:
            low = k + 1
        per_item = max(0, (total - dropped_tokens[k] - probed[k][1].total) // k)
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    # None fits: every item outside the minimum set is dropped (its count was the last probe).
    high = min(high, len(order))
    walk.state, walk.count = probed[high]
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


# Probes of TRIM_EVIDENCE chosen by the predicted count before it falls back to halving.
GUIDED_PROBES = 4


def _first_predicted_fit(
    dropped_tokens: Sequence[int], total: int, per_item: int, budget: int, low: int, high: int
) -> int:
    """The smallest k in [low, high) whose predicted count fits ``budget`` (``high - 1`` when none is
    predicted to): ``total`` less ``dropped_tokens[k]`` (the tokens of the first k items in the untrimmed
    count) and ``per_item`` tokens of wrapping for each of them (whole tokens: what the last probe's
    recount showed each dropped item's wrapping to cost, rounded down)."""
    for k in range(low, high):
        if total - dropped_tokens[k] - per_item * k <= budget:
            return k
    return high - 1


def _smaller_model(walk: Walk) -> None:
    """SMALLER_MODEL: switch to the first compatible fallback model the state fits, in the policy's order."""
    before = walk.count.total
    current = walk.target
    checks: list[CandidateCheck] = []
    for candidate in walk.request.fallbacks:
        failed = incompatibilities(current.model, candidate, walk.state, current.route.max_output)
        if failed:
            checks.append(CandidateCheck(candidate.id, failed))
            continue
        route = walk.request.route_to(candidate)
        try:
            target = walk.request.target(candidate, current.cache, current.render_memo)
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


# FULL opens every ladder and QUEUE_OR_REJECT closes it; the rungs between are applied by name.
_RUNGS: Mapping[Rung, Callable[[Walk], None]] = {
    "DEDUP_EVIDENCE": _dedup,
    "COMPACT_HISTORY": _compact,
    "NARROW_WORKFLOW": _narrow,
    "TRIM_EVIDENCE": _trim,
    "SMALLER_MODEL": _smaller_model,
}


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
    provider_count: ProviderCount | None = None,
    known: TextCounts | None = None,
) -> Decision:
    """Decide whether ``components`` may be sent to ``model``, degrading along the task's ladder if needed.

    Evidence not covered by the authorization scope is excluded first (NOT_PERMITTED). The FULL payload is
    rendered and counted; while it does not fit the input budget (``min(context window - max output, task
    input cap, global cap)``) the policy's rungs are applied in order, each re-rendering and recounting.
    ``fallback_models`` are the policy's fallback candidates (any order; the policy's order is used).
    ``counter_for`` returns the exact counter of a model; if counting is unavailable the policy either
    rejects (COUNTING_UNAVAILABLE) or counts with the model's approved upper bound, which is never used to
    degrade anything. Hard buckets are never changed.

    A model with a ``provider_counter`` is counted by ``provider_count`` (its counting API), never one call
    per rung: the FULL payload is counted by the provider first (most requests fit, and that is the one
    call); otherwise the walk counts with the model's local tokenizer scaled by the provider's answer, and
    the payload it ends on is counted by the provider; only when that count and the estimate disagree on
    fitting is the walk repeated on the new scale (at most ``MAX_PROVIDER_COUNTS`` provider counts in all;
    then the last payload is admitted if the provider's count of it fits, else refused). Without
    ``provider_count`` such a model's counting is unavailable. A model with a ``bound_counter``
    (OpenAI's, for the tools and tool calls OpenAI's published framing leaves out) is counted locally,
    EXACT, while its rendering has no ``Bound`` piece; otherwise the walk counts with the local bound, never
    asking the provider per rung, and the payload it ends on is counted by ``provider_count`` (the one call
    for most requests; disagreeing on fitting repeats the walk as above). Without ``provider_count`` such a
    payload keeps its local ``UPPER_BOUND``. ``known`` is the process's segment counts by text, consulted
    before ``cache`` (``ladder.counting.count_stream``).

    Raises ValueError for a non-positive ``requested_max_output`` or ``global_cap``, or a fallback model that
    the policy does not list; TemplateError for an inconsistent ladder state (a bug).
    """
    if requested_max_output <= 0 or global_cap <= 0:
        raise ValueError("requested_max_output and global_cap must be positive")
    rank = {model_id: index for index, model_id in enumerate(task_policy.fallback_models)}
    for candidate in fallback_models:
        if candidate.id not in rank:
            raise ValueError(f"fallback model {candidate.id} is not listed by the task policy")
    permitted, refused = exclude_not_permitted(
        components.evidence, components.authorization_scope.permissions
    )
    request = Request(
        components=components,
        request_id=request_id,
        model=model,
        requested_max_output=requested_max_output,
        policy=task_policy,
        global_cap=global_cap,
        fallbacks=tuple(sorted(fallback_models, key=lambda candidate: rank[candidate.id])),
        counter_for=counter_for,
        base=replace(components, evidence=permitted, compactions=()),
        refused=refused,
        digests_before=bucket_digests(components),
        calibration=None if provider_count is None else Calibration(provider_count),
        known=known,
    )
    missing = _missing_minimum_evidence(request)
    if missing is not None:
        end = End(request.route, request.base)
        return _decision(request, end, "QUEUE_OR_REJECT", code=MINIMUM_EVIDENCE_UNAVAILABLE, detail=missing)
    try:
        return _walk_ladder(request, cache)
    except CountingUnavailable as exc:
        return _upper_bound(request, str(exc))


def _missing_minimum_evidence(request: Request) -> str | None:
    """Why the request cannot keep the minimum evidence set its policy requires, or None if it can."""
    rule = request.policy.minimum_evidence
    if not rule.require_marked:
        return None
    missing = [item.id for item in request.refused if item.minimum_retention]
    if missing:
        return f"minimum-retention evidence not permitted: {', '.join(missing)}"
    permitted = len(request.base.evidence)
    if permitted < rule.min_items:
        return f"{permitted} permitted evidence items, the task needs {rule.min_items}"
    return None


def _walk_ladder(request: Request, cache: CountCache) -> Decision:
    """Count FULL and apply the policy's rungs in order until the payload fits; a provider-counted end is
    confirmed by the provider (``decide``).

    Raises CountingUnavailable when the requested model's counter (or its counting API) cannot count.
    """
    calibration = request.calibration
    memo = RenderMemo()
    if calibration is not None and request.model.provider_counter is not None:
        calibration.measure(request.target(request.model, cache, memo), request.base)
    # FULL was counted above: each pass of the walk may count one more payload.
    for _ in range(MAX_PROVIDER_COUNTS - 1):
        walk = _walk(request, request.target(request.model, cache, memo))
        end_target = walk.target
        if calibration is None or not provider_counted(end_target.model, walk.count):
            return _walked(request, walk)
        remote = calibration.measure(end_target, walk.state)
        provider_fits = remote <= end_target.budget
        if provider_fits == walk.fits:
            walk.count = with_total(walk.count, remote, "PROVIDER_COUNT")
            return _walked(request, walk)
    walk.count = with_total(walk.count, remote, "PROVIDER_COUNT")
    if walk.fits:
        # The provider's own count of the state the walk ended on fits: that state is admissible however far
        # the scaled local estimate still was from it (a bound grows unlike the provider's count).
        return _walked(request, walk)
    return _decision(
        request,
        walk.end(),
        "QUEUE_OR_REJECT",
        code=CONTEXT_BUDGET_EXCEEDED,
        detail=f"the provider's count ({remote}) and the local estimate still disagreed on fitting the "
        f"budget {end_target.budget} after {MAX_PROVIDER_COUNTS} provider counts",
    )


def _walk(request: Request, target: Target) -> Walk:
    """Walk the policy's rungs from FULL on ``target`` until the state fits or the ladder ends."""
    walk = Walk(request, target, request.base, target.count(request.base))
    for rung in request.policy.ladder[1:]:
        if walk.fits:
            break
        walk.tried.append(rung)
        if rung == "QUEUE_OR_REJECT":
            break
        _RUNGS[rung](walk)
    return walk


def _walked(request: Request, walk: Walk) -> Decision:
    """The decision a finished walk stands for: admitted if it fits, else CONTEXT_BUDGET_EXCEEDED."""
    if walk.fits:
        return _decision(request, walk.end(), walk.tried[-1])
    # Only a fitting fallback is ever switched to, so the walk is still on the requested model here.
    minimum_needed = walk.target.count(_minimal(request)).total
    detail = f"{walk.count.total} input tokens after the ladder; the budget is {walk.target.budget}"
    return _decision(
        request,
        walk.end(),
        "QUEUE_OR_REJECT",
        code=CONTEXT_BUDGET_EXCEEDED,
        detail=detail,
        minimum_needed=minimum_needed,
    )


def _minimal(request: Request) -> Components:
    """Hard buckets, trusted state and the minimum evidence set, nothing else."""
    evidence = request.base.evidence
    minimum = minimum_evidence_ids(evidence, request.policy.minimum_evidence)
    return replace(
        request.base,
        evidence=tuple(item for item in evidence if item.id in minimum),
        recent_turns=(),
        compactions=(),
        tools=(),
        workflow_instruction=None,
    )


def _upper_bound(request: Request, unavailable: str) -> Decision:
    """Decide FULL on the requested model's approved upper bound, or reject when there is none to use."""
    policy, model, route = request.policy, request.model, request.route
    if policy.counting_unavailable == "REJECT" or model.upper_bound is None:
        why = "the policy rejects" if policy.counting_unavailable == "REJECT" else "no approved upper bound"
        return _decision(
            request,
            End(route, request.base),
            "QUEUE_OR_REJECT",
            code=COUNTING_UNAVAILABLE,
            detail=f"{unavailable} ({why})",
        )
    bound = UpperBoundCounter(
        nfkc=model.upper_bound == "NFKC_UTF8_BYTES", tokenizer_digest=model.tokenizer_digest
    )
    # The bound is cheap to recompute; a private cache keeps it apart from exact counts entirely.
    count = Target(route, bound, MemoryCountCache()).count(request.base)
    end = End(route, request.base, count, bound.digest)
    if count.total <= route.budget:
        return _decision(request, end, "FULL", detail=f"counted with an upper bound: {unavailable}")
    # Degrading on a bound could remove content that actually fits, so the ladder is not walked.
    return _decision(
        request,
        end,
        "QUEUE_OR_REJECT",
        code=COUNTING_UNAVAILABLE,
        detail=f"{unavailable}; the upper bound {count.total} exceeds the budget {route.budget} and a bound "
        "never degrades a request",
    )


def _decision(
    request: Request,
    end: End,
    rung: Rung,
    *,
    code: RejectionCode | None = None,
    detail: str = "",
    minimum_needed: int | None = None,
) -> Decision:
    """Return the decision that stops at ``end`` on ``rung``: admitted unless ``code`` rejects it."""
    payload = final_payload(end.route, end.state, end.memo)
    return Decision(
        request_id=request.request_id,
        admitted=code is None,
        code=code,
        detail=detail,
        rung=rung,
        steps=end.steps,
        removed=end.removed,
        excluded=tuple(RemovedObject(item.id, "evidence", "NOT_PERMITTED", None) for item in request.refused),
        components=end.state,
        payload=payload,
        rendered_digest=rendered_digest(payload),
        count=end.count,
        budget=end.route.budget,
        max_output=end.route.max_output,
        model=end.route.model,
        original_model_id=request.model.id,
        template_revision=end.route.template.revision,
        counter_digest=end.counter_digest,
        digests_before=request.digests_before,
        digests_after=bucket_digests(end.state),
        minimum_tokens_needed=minimum_needed,
        rungs_tried=end.tried,
        recommendations=RECOMMENDATIONS if code == CONTEXT_BUDGET_EXCEEDED else (),
        provider_counts=() if request.calibration is None else tuple(request.calibration.counted.items()),
    )
