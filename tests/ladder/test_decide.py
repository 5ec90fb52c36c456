"""The ladder: each rung alone and in sequence, its invariants on every fixture and on random components."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ladder import decide as decide_module
from ladder.components import Components, Limits
from ladder.counting import (
    Count,
    CountingUnavailable,
    CountMethod,
    MemoryCountCache,
    SegmentCounter,
    TokenizerCounter,
    image_tokens,
)
from ladder.decide import decide
from ladder.decision import Decision
from ladder.parser import parse_components
from ladder.policy import TaskPolicy
from ladder.rungs import ModelSpec, minimum_evidence_ids, trim_order
from ladder.templates import Image, Piece, get_template, stream_text
from ladder.walk import Target
from ladder.wire import decision_manifest, decision_response

from .conftest import counter_for, models
from .fixtures import ALL_RUNGS, FIXTURES, Gen, base_components, evidence_item, fixture, task_policy
from .strategies import components_json

MAX_OUTPUT = 1000
LIMITS = Limits()


def run(
    data: dict[str, Any] | Components,
    *,
    budget: int = 190_000,
    policy: TaskPolicy | None = None,
    request_id: str = "req-1",
    cache: MemoryCountCache | None = None,
    counters: Callable[[ModelSpec], SegmentCounter] = counter_for,
    model: ModelSpec | None = None,
) -> Decision:
    """Decide with an input budget of exactly ``budget`` tokens on ds@1 (the window is sized to give it)."""
    components = data if isinstance(data, Components) else parse_components(data, limits=LIMITS)
    policy = policy or task_policy()
    specs = models(context_window=budget + MAX_OUTPUT)
    return decide(
        components,
        request_id=request_id,
        model=model or specs["ds@1"],
        requested_max_output=MAX_OUTPUT,
        task_policy=policy,
        global_cap=10_000_000,
        fallback_models=[specs[model_id] for model_id in policy.fallback_models],
        counter_for=counters,
        cache=cache if cache is not None else MemoryCountCache(),
    )


def full_tokens(data: dict[str, Any] | Components) -> int:
    decision = run(data, budget=10_000_000)
    assert decision.admitted and decision.rung == "FULL" and decision.count is not None
    return decision.count.total


def readings(decision: Decision, tokenizers: dict[str, Tokenizer]) -> tuple[int, int]:
    """Re-render the final state and encode it with the model's own tokenizer, in both readings of an image
    the template does not render: the whole stream at once (the image left out, the texts beside it
    touching), and each stretch between two images on its own (something in its place); plus the image
    formula in both."""
    pieces = get_template(decision.model.template_family).render(decision.components)
    stretches: list[list[Piece]] = [[]]
    for piece in pieces:
        if isinstance(piece, Image):
            stretches.append([])
        else:
            stretches[-1].append(piece)
    tokenizer = tokenizers[decision.model.tokenizer_digest]
    formula = decision.model.image_formula
    images = sum(image_tokens(p.width, p.height, formula) for p in pieces if isinstance(p, Image))
    touching = len(tokenizer.encode(stream_text(pieces), add_special_tokens=False))
    apart = sum(
        len(tokenizer.encode(stream_text(stretch), add_special_tokens=False)) for stretch in stretches
    )
    return touching + images, apart + images


def check_invariants(
    decision: Decision, original: Components, policy: TaskPolicy, tokenizers: dict[str, Tokenizer]
) -> None:
    """What must hold of every decision, whatever the input."""
    assert decision.hard_bucket_changes == 0
    assert decision.digests_before["trustedState"] == decision.digests_after["trustedState"]
    for bucket in ("immutableRules", "authorizationScope", "outputSafety", "question", "outputSchema"):
        assert decision.digests_before[bucket] == decision.digests_after[bucket]
    final = decision.components
    assert final.immutable_rules == original.immutable_rules and final.question == original.question

    # Fits, or is rejected with a machine-decidable code; an exact count is the whole-stream count.
    if decision.admitted:
        assert decision.code is None and decision.count is not None
        assert decision.count.total <= decision.budget
    else:
        assert decision.code in (
            "CONTEXT_BUDGET_EXCEEDED",
            "COUNTING_UNAVAILABLE",
            "MINIMUM_EVIDENCE_UNAVAILABLE",
        )
    if decision.count is not None:
        assert sum(decision.count.per_bucket.values()) == decision.count.total
        # EXACT only where both readings agree with it; any other count covers both.
        if decision.count.method == "EXACT":
            assert {decision.count.total} == set(readings(decision, tokenizers))
        else:
            assert decision.count.total >= max(readings(decision, tokenizers))

    # Permissions first: nothing not permitted, and every permitted marked item kept.
    granted = original.authorization_scope.permissions
    permitted = [item for item in original.evidence if item.permissions <= granted]
    assert all(item.permissions <= granted for item in final.evidence)
    assert {item.id for item in decision.excluded} == {item.id for item in original.evidence} - {
        item.id for item in permitted
    }
    kept_ids = {item.id for item in final.evidence}
    assert {item.id for item in permitted if item.minimum_retention} <= kept_ids
    # The minimum set's content survives (a duplicate may stand in for a removed copy).
    minimum = minimum_evidence_ids(permitted, policy.minimum_evidence)
    kept_content = {(item.parts, item.permissions) for item in final.evidence}
    assert {(item.parts, item.permissions) for item in permitted if item.id in minimum} <= kept_content
    assert not kept_ids & {item.id for item in decision.removed if item.bucket == "evidence"}

    # A tool call and its result are one unit.
    original_results = {result.call_id for turn in original.recent_turns for result in turn.tool_results}
    calls: set[str] = set()
    results: set[str] = set()
    for turn in final.recent_turns:
        calls.update(call.id for call in turn.tool_calls)
        for result in turn.tool_results:
            assert result.call_id in calls, "orphan tool result"
            results.add(result.call_id)
    assert (calls & original_results) == results

    # The payload is the final state, for the final model.
    assert decision.payload["model"] == decision.model.id
    assert decision.payload["max_tokens"] == decision.max_output
    payload: dict[str, Any] = decision.payload
    assert [tool["function"]["name"] for tool in payload.get("tools", [])] == [
        tool.name for tool in final.tools
    ]
    json.dumps(decision_manifest(decision))


@pytest.fixture
def tokenizers(raw_tokenizers: dict[str, Tokenizer]) -> dict[str, Tokenizer]:
    return raw_tokenizers


def ladder(*rungs: str) -> list[str]:
    return ["FULL", *rungs, "QUEUE_OR_REJECT"]


# ------------------------------------------------------------------------------------------------- FULL


def test_fits_at_full(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("everything")
    decision = run(data)
    assert decision.admitted and decision.rung == "FULL" and decision.steps == ()
    # Its tools and output schema are request fields DeepSeek's published template does not show: bounded.
    assert decision.count_method == "UPPER_BOUND"
    assert decision.max_output == MAX_OUTPUT
    check_invariants(decision, parse_components(data, limits=LIMITS), task_policy(), tokenizers)


def test_not_permitted_evidence_is_excluded_before_full() -> None:
    decision = run(fixture("duplicates"))
    assert [(item.id, item.reason, item.rung) for item in decision.excluded] == [
        ("ev-6", "NOT_PERMITTED", None)
    ]
    assert "ev-6" not in {item.id for item in decision.components.evidence}
    assert decision.rung == "FULL" and decision.removed == ()


def test_budget_is_the_smallest_of_window_task_and_global_caps() -> None:
    specs = models(context_window=50_000)
    components = parse_components(fixture("cjk"), limits=LIMITS)
    common: dict[str, Any] = {
        "request_id": "req-1",
        "model": specs["ds@1"],
        "fallback_models": [],
        "counter_for": counter_for,
        "cache": MemoryCountCache(),
    }
    policy = task_policy(outputCap=700, inputCap=30_000, ladder=ladder())
    decision = decide(components, requested_max_output=5000, task_policy=policy, global_cap=10**6, **common)
    assert (decision.max_output, decision.budget) == (700, 30_000)
    decision = decide(components, requested_max_output=5000, task_policy=policy, global_cap=20_000, **common)
    assert decision.budget == 20_000
    roomy = task_policy(outputCap=7000, inputCap=10**6, ladder=ladder())
    decision = decide(components, requested_max_output=5000, task_policy=roomy, global_cap=10**6, **common)
    assert (decision.max_output, decision.budget) == (5000, 45_000)
    with pytest.raises(ValueError):
        decide(components, requested_max_output=0, task_policy=policy, global_cap=10**6, **common)


# ------------------------------------------------------------------------------------------ each rung alone


def test_dedup_evidence_alone(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("duplicates")
    policy = task_policy(ladder=ladder("DEDUP_EVIDENCE"))
    decision = run(data, budget=full_tokens(data) - 1, policy=policy)
    assert decision.admitted and decision.rung == "DEDUP_EVIDENCE"
    # ev-1 and ev-3 copy ev-0 (same content and permissions); ev-2 has other permissions; ev-4 is marked.
    assert [(item.id, item.detail) for item in decision.removed] == [
        ("ev-1", "copy of ev-0"),
        ("ev-3", "copy of ev-0"),
    ]
    (step,) = decision.steps
    assert step.removed_ids == ("ev-1", "ev-3") and step.tokens_after < step.tokens_before
    assert step.tokens_before == full_tokens(data)
    check_invariants(decision, parse_components(data, limits=LIMITS), policy, tokenizers)


def test_compact_history_alone_uses_only_artifacts_that_pass_the_gate(
    tokenizers: dict[str, Tokenizer],
) -> None:
    data = fixture("near_window")
    policy = task_policy(ladder=ladder("COMPACT_HISTORY"))
    decision = run(data, budget=1000, policy=policy)
    assert not decision.admitted and decision.code == "CONTEXT_BUDGET_EXCEEDED"
    (step,) = decision.steps
    assert step.added_ids == ("cmp-ok", "cmp-ok2")
    assert step.replaced_ids == tuple(str(n) for n in [1, 2, 3, 4, 5, 6, 7, 8, 21, 22, 23, 24])
    for refusal in (
        "cmp-low: BELOW_FIDELITY_THRESHOLD",
        "cmp-gate: GATE_NOT_APPROVED",
        "cmp-other: OTHER_REQUEST",
        "cmp-split: SPLITS_TOOL_CALL",
    ):
        assert refusal in step.reason
    assert [c.id for c in decision.components.compactions] == ["cmp-ok", "cmp-ok2"]
    check_invariants(decision, parse_components(data, limits=LIMITS), policy, tokenizers)

    # With room for the first artifact only, the ladder stops there.
    first = run(data, budget=full_tokens(data) - 1, policy=policy)
    assert first.admitted and first.rung == "COMPACT_HISTORY"
    assert first.steps[0].added_ids == ("cmp-ok",)
    check_invariants(first, parse_components(data, limits=LIMITS), policy, tokenizers)


def test_compactions_bound_to_another_request_are_never_used() -> None:
    data = fixture("near_window")
    decision = run(
        data, budget=1000, policy=task_policy(ladder=ladder("COMPACT_HISTORY")), request_id="req-other"
    )
    (step,) = decision.steps
    assert step.added_ids == ("cmp-other",)


def test_narrow_workflow_drops_tool_definitions_only(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("huge_tools")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(ladder=ladder("NARROW_WORKFLOW"))
    decision = run(data, budget=full_tokens(data) - 1, policy=policy)
    assert decision.admitted and decision.rung == "NARROW_WORKFLOW"
    assert [tool.name for tool in decision.components.tools] == ["search"]
    assert decision.components.recent_turns == original.recent_turns
    assert {item.reason for item in decision.removed} == {"NON_ESSENTIAL_TOOL"}
    check_invariants(decision, original, policy, tokenizers)


def test_narrow_workflow_switches_to_the_clarification_workflow(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("huge_tools")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(ladder=ladder("NARROW_WORKFLOW"), essentialTools=["search", "tool_1"])
    dropped = run(data, budget=10_000_000, policy=task_policy(essentialTools=["search", "tool_1"]))
    assert dropped.count is not None
    only_essential = replace(
        original, tools=tuple(t for t in original.tools if t.name in ("search", "tool_1"))
    )
    decision = run(data, budget=full_tokens(only_essential) - 1, policy=policy)
    assert decision.admitted and decision.rung == "NARROW_WORKFLOW"
    first, second = decision.steps
    assert first.reason == "dropped non-essential tool definitions"
    assert second.reason == "switched to the clarification workflow"
    assert second.removed_ids == ("tool_1",) and "workflowInstruction" in second.added_ids
    assert decision.components.workflow_instruction == "Ask one clarifying question."
    assert [tool.name for tool in decision.components.tools] == ["search"]
    assert any("Ask one clarifying question." in str(m) for m in decision.payload["messages"])  # type: ignore[attr-defined]
    check_invariants(decision, original, policy, tokenizers)


def test_trim_evidence_drops_lowest_ranked_first_and_no_more_than_needed(
    tokenizers: dict[str, Tokenizer],
) -> None:
    data = fixture("cjk")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(
        ladder=ladder("TRIM_EVIDENCE"), minimumEvidence={"minItems": 3, "requireMarked": False}
    )
    full = full_tokens(data)
    decision = run(data, budget=full - 500, policy=policy)
    assert decision.admitted and decision.rung == "TRIM_EVIDENCE"
    removed = [item.id for item in decision.removed]
    ranked = sorted(enumerate(original.evidence), key=lambda e: (e[1].score, -e[0]))
    expected = [item.id for _, item in ranked if not item.minimum_retention][: len(removed)]
    assert removed == expected
    # Minimal: keeping the last removed item would not fit.
    last = next(item for item in original.evidence if item.id == removed[-1])
    fewer = replace(decision.components, evidence=(*decision.components.evidence, last))
    assert full_tokens(fewer) > decision.budget
    check_invariants(decision, original, policy, tokenizers)


@pytest.mark.parametrize("share", [0.15, 0.5, 0.9, 0.995])
def test_trim_finds_the_fewest_that_fit_in_a_few_recounts(
    share: float, monkeypatch: pytest.MonkeyPatch, tokenizers: dict[str, Tokenizer]
) -> None:
    gen = Gen(11)
    data = base_components(gen)
    data["evidence"] = [evidence_item(gen, i, size=30 + 7 * (i % 5)) for i in range(64)]
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(ladder=ladder("TRIM_EVIDENCE"))
    full = full_tokens(data)
    recounts: list[int] = []
    count = Target.count

    def counting(self: Target, state: Components) -> Count:
        recounts.append(len(state.evidence))
        return count(self, state)

    monkeypatch.setattr(Target, "count", counting)
    decision = run(data, budget=int(full * share), policy=policy)
    monkeypatch.undo()
    assert decision.admitted and decision.rung == "TRIM_EVIDENCE"
    # The fewest that fit: keeping the last item removed would not.
    removed = [item.id for item in decision.removed]
    last = next(item for item in original.evidence if item.id == removed[-1])
    assert full_tokens(replace(decision.components, evidence=(*decision.components.evidence, last))) > (
        decision.budget
    )
    # The full count, then the trim's: bisection over 64 items alone takes 7 recounts.
    assert recounts[0] == 64 and len(recounts) - 1 <= 3, recounts
    check_invariants(decision, original, policy, tokenizers)


@pytest.mark.parametrize("guesses", ["predicted", "always the lowest"])
def test_trim_drops_exactly_the_fewest_at_every_budget_where_the_answer_changes(
    guesses: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every budget at which the fewest items to drop changes, and the token below it: the search finds what
    a scan of every k finds, with the predicted probes and with probes that tell it nothing (the halving
    after them then does the work)."""
    if guesses == "always the lowest":
        monkeypatch.setattr(decide_module, "_first_predicted_fit", lambda *args: args[4])
    gen = Gen(5)
    data = base_components(gen)
    data["evidence"] = [
        evidence_item(gen, i, text=gen.cjk(20 + 9 * (i % 4)) if i % 3 else None, size=10 + 11 * (i % 6))
        for i in range(20)
    ]
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(ladder=ladder("TRIM_EVIDENCE"))
    order = trim_order(original.evidence, minimum_evidence_ids(original.evidence, policy.minimum_evidence))
    counts = [
        full_tokens(replace(original, evidence=tuple(e for e in original.evidence if e not in order[:k])))
        for k in range(len(order) + 1)
    ]
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == len(counts), "strictly falling"
    for k in range(1, len(order) + 1):
        for budget, fewest in ((counts[k], k), (counts[k] - 1, k + 1)):
            decision = run(data, budget=budget, policy=policy)
            dropped = [item.id for item in decision.removed if item.rung == "TRIM_EVIDENCE"]
            if fewest > len(order):
                assert not decision.admitted and len(dropped) == len(order)
            else:
                assert decision.admitted and dropped == [item.id for item in order[:fewest]], (budget, k)


def test_trim_never_goes_below_the_minimum_set(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("cjk")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(
        ladder=ladder("TRIM_EVIDENCE"), minimumEvidence={"minItems": 3, "requireMarked": False}
    )
    decision = run(data, budget=500, policy=policy)
    assert not decision.admitted and decision.code == "CONTEXT_BUDGET_EXCEEDED"
    assert len(decision.components.evidence) == 3
    assert "ev-0" in {item.id for item in decision.components.evidence}  # marked, lowest score or not
    assert decision.rungs_tried == ("FULL", "TRIM_EVIDENCE", "QUEUE_OR_REJECT")
    assert decision.recommendations == ("NARROW_SCOPE", "PROCESS_ASYNC")
    # Minimum needed: hard buckets + trusted state + minimum evidence + template; nothing else.
    minimal = replace(decision.components, recent_turns=(), tools=(), compactions=())
    assert decision.minimum_tokens_needed == full_tokens(minimal)
    response = decision_response(decision)
    assert response["code"] == "CONTEXT_BUDGET_EXCEEDED" and response["budget"] == 500
    assert set(response["tokens"]["buckets"]) >= {"immutableRules", "evidence", "template"}  # type: ignore[index]
    check_invariants(decision, original, policy, tokenizers)


def test_relevance_never_overrides_permissions_or_the_marked_set() -> None:
    data = fixture("cjk")
    data["evidence"][0]["score"] = 0.0  # marked, and the lowest score of all
    data["evidence"][1]["score"] = 1.0
    data["evidence"][1]["permissions"] = ["hr"]  # best score, not permitted
    decision = run(data, budget=500, policy=task_policy(ladder=ladder("TRIM_EVIDENCE")))
    kept = {item.id for item in decision.components.evidence}
    assert "ev-0" in kept and "ev-1" not in kept


def test_smaller_model_checks_every_dimension(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("code")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(
        ladder=ladder("SMALLER_MODEL"), fallbackModels=["us@1", "notools@1", "lowtier@1", "legacy@1"]
    )
    decision = run(data, budget=full_tokens(data) - 1, policy=policy)
    assert decision.admitted and decision.rung == "SMALLER_MODEL"
    assert decision.model.id == "legacy@1" and decision.original_model_id == "ds@1"
    assert decision.template_revision == "meta/2"
    (step,) = decision.steps
    assert [(c.model_id, c.failed) for c in step.candidates] == [
        ("us@1", ("dataResidency",)),
        ("notools@1", ("capabilities:tools",)),
        ("lowtier@1", ("safetyTier",)),
        ("legacy@1", ()),
    ]
    assert decision.payload["model"] == "legacy@1"
    check_invariants(decision, original, policy, tokenizers)


def test_smaller_model_needs_vision_and_schema_support() -> None:
    data = fixture("images")
    data["outputSchema"] = {"type": "object"}
    specs = models()
    blind = replace(specs["legacy@1"], id="blind@1", capabilities=frozenset({"tools", "json_schema"}))
    plain = replace(specs["legacy@1"], id="plain@1", capabilities=frozenset({"tools", "vision"}))
    small = replace(specs["legacy@1"], id="small@1", max_output=10)
    policy = task_policy(ladder=ladder("SMALLER_MODEL"), fallbackModels=["blind@1", "plain@1", "small@1"])
    decision = decide(
        parse_components(data, limits=LIMITS),
        request_id="req-1",
        model=replace(specs["ds@1"], context_window=2000),
        requested_max_output=MAX_OUTPUT,
        task_policy=policy,
        global_cap=10**6,
        fallback_models=[small, plain, blind],
        counter_for=counter_for,
        cache=MemoryCountCache(),
    )
    assert not decision.admitted
    assert [(c.model_id, c.failed) for c in decision.steps[0].candidates] == [
        ("blind@1", ("capabilities:vision",)),
        ("plain@1", ("outputSchema",)),
        ("small@1", ("maxOutput",)),
    ]


def test_a_fallback_the_policy_does_not_list_is_refused() -> None:
    specs = models()
    with pytest.raises(ValueError):
        decide(
            parse_components(fixture("code"), limits=LIMITS),
            request_id="req-1",
            model=specs["ds@1"],
            requested_max_output=MAX_OUTPUT,
            task_policy=task_policy(fallbackModels=["legacy@1"]),
            global_cap=10**6,
            fallback_models=[specs["us@1"]],
            counter_for=counter_for,
            cache=MemoryCountCache(),
        )


# ------------------------------------------------------------------------------------------ rungs in sequence


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("fraction", [1.0, 0.9, 0.6, 0.3, 0.05])
def test_every_fixture_under_shrinking_budgets(
    name: str, fraction: float, tokenizers: dict[str, Tokenizer]
) -> None:
    data = fixture(name)
    original = parse_components(data, limits=LIMITS)
    policy = task_policy()
    decision = run(data, budget=int(full_tokens(data) * fraction), policy=policy)
    check_invariants(decision, original, policy, tokenizers)
    tried = list(decision.rungs_tried)
    assert tried == ALL_RUNGS[: len(tried)] or tried == [*ALL_RUNGS[: len(tried) - 1], "QUEUE_OR_REJECT"]
    for step in decision.steps:
        if step.rung != "SMALLER_MODEL":
            assert step.tokens_after <= step.tokens_before


def test_the_full_ladder_in_order(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("everything")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(fallbackModels=["legacy@1"])
    budget = 3000
    decision = run(data, budget=budget, policy=policy)
    assert [step.rung for step in decision.steps][:3] == [
        "DEDUP_EVIDENCE",
        "COMPACT_HISTORY",
        "NARROW_WORKFLOW",
    ]
    assert "TRIM_EVIDENCE" in decision.rungs_tried
    check_invariants(decision, original, policy, tokenizers)
    # Determinism: the same inputs replay to the same manifest, with a cold or a warm cache.
    cache = MemoryCountCache()
    cold = run(data, budget=budget, policy=policy, cache=cache)
    warm = run(data, budget=budget, policy=policy, cache=cache)
    assert decision_manifest(cold) == decision_manifest(decision) == decision_manifest(warm)
    assert cold.payload == warm.payload and cold.rendered_digest == decision.rendered_digest


def test_a_tool_added_after_rendering_changes_the_digest() -> None:
    data = fixture("code")
    before = run(data)
    data["tools"].append({"name": "late_tool", "parameters": {"type": "object"}})
    after = run(data)
    assert before.rendered_digest != after.rendered_digest
    assert before.digests_after["tools"] != after.digests_after["tools"]


# ------------------------------------------------------------------------------------- counting unavailable


class FailingCounter:
    """A counter whose service times out after ``calls`` successful batches."""

    def __init__(self, inner: TokenizerCounter, calls: int = 0) -> None:
        self.inner = inner
        self.calls = calls

    @property
    def digest(self) -> str:
        return self.inner.digest

    @property
    def method(self) -> CountMethod:
        return "EXACT"

    def count_many(self, texts: Sequence[str]) -> list[int]:
        if self.calls <= 0:
            raise CountingUnavailable("counting timed out")
        self.calls -= 1
        return self.inner.count_many(texts)


def failing(calls: int = 0) -> Callable[[ModelSpec], SegmentCounter]:
    def counters(model: ModelSpec) -> SegmentCounter:
        inner = counter_for(model)
        assert isinstance(inner, TokenizerCounter)
        return FailingCounter(inner, calls)

    return counters


def missing_file(model: ModelSpec) -> SegmentCounter:
    return TokenizerCounter.from_file("/nonexistent/tokenizer.json")


def test_counting_unavailable_with_reject_policy() -> None:
    for counters in (failing(), missing_file):
        decision = run(fixture("duplicates"), counters=counters)
        assert not decision.admitted and decision.code == "COUNTING_UNAVAILABLE"
        assert decision.count is None and decision.steps == ()


def test_upper_bound_admits_at_full_when_the_bound_fits(tokenizers: dict[str, Tokenizer]) -> None:
    data = fixture("emoji_nfkc")
    policy = task_policy(countingUnavailable="UPPER_BOUND")
    decision = run(data, policy=policy, counters=failing())
    assert decision.admitted and decision.rung == "FULL" and decision.count_method == "UPPER_BOUND"
    assert decision.count is not None and decision.count.total >= full_tokens(data)
    check_invariants(decision, parse_components(data, limits=LIMITS), policy, tokenizers)
    legacy = run(data, policy=policy, counters=failing(), model=models(190_000 + MAX_OUTPUT)["legacy@1"])
    assert legacy.count_method == "UPPER_BOUND" and legacy.counter_digest is not None
    assert legacy.counter_digest.startswith("upper-bound:nfkc-utf8:")


def test_the_bound_never_degrades(tokenizers: dict[str, Tokenizer]) -> None:
    """Exact counting admits after DEDUP; under the bound nothing is removed and the request is refused."""
    data = fixture("duplicates")
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(countingUnavailable="UPPER_BOUND")
    budget = full_tokens(data) - 1
    assert run(data, budget=budget, policy=policy).rung == "DEDUP_EVIDENCE"
    decision = run(data, budget=budget, policy=policy, counters=failing())
    assert not decision.admitted and decision.code == "COUNTING_UNAVAILABLE"
    assert decision.count_method == "UPPER_BOUND"
    assert decision.steps == () and decision.removed == ()
    assert len(decision.components.evidence) == len(original.evidence) - 1  # only NOT_PERMITTED is excluded
    check_invariants(decision, original, policy, tokenizers)


def test_a_timeout_in_the_middle_of_the_ladder_discards_the_walk(tokenizers: dict[str, Tokenizer]) -> None:
    """FULL is counted, then the counter times out on the compaction's new text: no rung result survives."""
    data = fixture("near_window")
    original = parse_components(data, limits=LIMITS)
    for unavailable in ("REJECT", "UPPER_BOUND"):
        policy = task_policy(ladder=ladder("COMPACT_HISTORY"), countingUnavailable=unavailable)
        decision = run(data, budget=full_tokens(data) - 1, policy=policy, counters=failing(calls=1))
        assert decision.code == "COUNTING_UNAVAILABLE" and decision.steps == () and decision.removed == ()
        assert decision.components.recent_turns == original.recent_turns
        assert decision.count_method == (None if unavailable == "REJECT" else "UPPER_BOUND")
        check_invariants(decision, original, policy, tokenizers)


def test_upper_bound_needs_an_approved_bound() -> None:
    specs = models()
    policy = task_policy(countingUnavailable="UPPER_BOUND")
    decision = run(
        fixture("code"), policy=policy, counters=failing(), model=replace(specs["ds@1"], upper_bound=None)
    )
    assert decision.code == "COUNTING_UNAVAILABLE" and decision.count is None


def test_a_counter_for_another_tokenizer_is_not_trusted() -> None:
    decision = run(fixture("code"), counters=lambda model: counter_for(models()["legacy@1"]))
    assert decision.code == "COUNTING_UNAVAILABLE"


# ----------------------------------------------------------------------------------------- minimum evidence


def test_require_marked_rejects_when_a_marked_item_is_not_permitted() -> None:
    data = fixture("duplicates")
    data["evidence"][6]["minimumRetention"] = True  # ev-6 is not permitted
    strict = task_policy(minimumEvidence={"minItems": 1, "requireMarked": True})
    decision = run(data, policy=strict)
    assert not decision.admitted and decision.code == "MINIMUM_EVIDENCE_UNAVAILABLE"
    assert "ev-6" in decision.detail
    lenient = run(data, policy=task_policy(minimumEvidence={"minItems": 1, "requireMarked": False}))
    assert lenient.admitted and [item.id for item in lenient.excluded] == ["ev-6"]
    too_few = run(
        fixture("code"), policy=task_policy(minimumEvidence={"minItems": 50, "requireMarked": True})
    )
    assert too_few.code == "MINIMUM_EVIDENCE_UNAVAILABLE"


# ------------------------------------------------------------------------------------------------ properties

LADDERS = st.lists(st.sampled_from(ALL_RUNGS[1:-1]), unique=True).map(
    lambda rungs: ["FULL", *rungs, "QUEUE_OR_REJECT"]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    data=components_json(),
    rungs=LADDERS,
    fraction=st.one_of(st.floats(0.0, 1.1), st.floats(0.8, 1.0)),
    min_items=st.integers(0, 3),
    unavailable=st.sampled_from(["REJECT", "UPPER_BOUND"]),
)
def test_random_requests_keep_every_invariant(
    raw_tokenizers: dict[str, Tokenizer],
    data: dict[str, Any],
    rungs: list[str],
    fraction: float,
    min_items: int,
    unavailable: str,
) -> None:
    tokenizers = raw_tokenizers
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(
        ladder=rungs,
        minimumEvidence={"minItems": min_items, "requireMarked": False},
        countingUnavailable=unavailable,
        fallbackModels=["us@1", "legacy@1"],
    )
    budget = max(1, int(full_tokens(original) * fraction))
    decision = run(original, budget=budget, policy=policy)
    check_invariants(decision, original, policy, tokenizers)
    # One step per rung tried (NARROW_WORKFLOW may take two: drop tools, then switch workflow).
    step_rungs = [step.rung for step in decision.steps]
    distinct = [rung for index, rung in enumerate(step_rungs) if index == 0 or step_rungs[index - 1] != rung]
    assert distinct == [rung for rung in decision.rungs_tried if rung not in ("FULL", "QUEUE_OR_REJECT")]
    assert decision_manifest(run(original, budget=budget, policy=policy)) == decision_manifest(decision)
    bounded = run(original, budget=budget, policy=policy, counters=failing())
    check_invariants(bounded, original, policy, tokenizers)
    assert bounded.steps == () and bounded.removed == ()


@pytest.mark.parametrize("rung", ALL_RUNGS[1:-1])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# CI's find: texts that touch across an image DeepSeek's template does not render, once counted EXACT as if
# apart (272) when left out of the stream they merge ("\n\n" + "\n\n" is one token: 271).
@example(
    data={
        "immutableRules": ["", [{"type": "image", "width": 1, "height": 1}]],
        "authorizationScope": {"permissions": [], "note": ""},
        "outputSafety": [],
        "question": {"parts": [{"type": "text", "text": ""}]},
        "trustedState": [],
        "evidence": [],
        "recentTurns": [],
        "compactions": [],
        "tools": [],
    },
    shortfall=1,
)
@given(data=components_json(), shortfall=st.integers(1, 400))
def test_each_rung_alone_on_random_requests(
    raw_tokenizers: dict[str, Tokenizer], rung: str, data: dict[str, Any], shortfall: int
) -> None:
    original = parse_components(data, limits=LIMITS)
    policy = task_policy(ladder=ladder(rung), fallbackModels=["lowtier@1", "legacy@1"])
    decision = run(original, budget=max(1, full_tokens(original) - shortfall), policy=policy)
    check_invariants(decision, original, policy, raw_tokenizers)
    assert {step.rung for step in decision.steps} == {rung}
    assert decision.rung in (rung, "QUEUE_OR_REJECT")
    changed = any(step.removed_ids or step.replaced_ids or step.added_ids for step in decision.steps)
    if decision.admitted:
        assert changed or rung == "SMALLER_MODEL"
