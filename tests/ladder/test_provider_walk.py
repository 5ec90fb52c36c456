"""The ladder with a provider-counted model (no database, no network: a provider count function of the
payload stands in for the API, as ``budgeting.admission.counters`` does over HTTP).

Properties: at most ``MAX_PROVIDER_COUNTS`` provider counts per decision, each payload at most once; an
admitted payload's count is the provider's own count of exactly that payload and fits the budget; hard
buckets never change; buckets and objects add up to the provider's total; and an estimate that is off in
either direction only costs a re-walk, never an over-budget admission.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladder.components import Limits
from ladder.counting import CountingUnavailable, MemoryCountCache, apportion, rendered_digest
from ladder.decide import MAX_PROVIDER_COUNTS, decide
from ladder.decision import Decision
from ladder.parser import parse_components
from ladder.rungs import ModelSpec

from .conftest import counter_for, models
from .fixtures import FIXTURES, fixture, task_policy
from .test_family_ladder import counter_for as family_counter_for
from .test_family_ladder import recount
from .test_family_ladder import spec as family_spec

LIMITS = Limits()
MAX_OUTPUT = 1000


class FakeProvider:
    """Counts a payload as ``bytes of its message texts // divisor + per_message`` and records each call."""

    def __init__(self, divisor: int, per_message: int) -> None:
        self.divisor, self.per_message = divisor, per_message
        self.calls: list[str] = []

    def count_of(self, payload: Mapping[str, object]) -> int:
        messages: Any = payload["messages"]
        total = 0
        for message in messages:
            text = json.dumps(message.get("content"), ensure_ascii=False) + json.dumps(
                message.get("tool_calls")
            )
            total += len(text.encode()) // self.divisor + self.per_message
        return total + len(json.dumps(payload.get("tools", []))) // self.divisor

    def __call__(self, spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
        assert digest == rendered_digest(payload)
        self.calls.append(digest)
        return self.count_of(payload)


def provider_spec(budget: int) -> ModelSpec:
    return replace(models(context_window=budget + MAX_OUTPUT)["ds@1"], provider_counter="anthropic")


def run(name: str, provider: FakeProvider, budget: int) -> Decision:
    policy = task_policy()
    specs = models(context_window=budget + MAX_OUTPUT)
    return decide(
        parse_components(fixture(name), limits=LIMITS),
        request_id="req-1",
        model=provider_spec(budget),
        requested_max_output=MAX_OUTPUT,
        task_policy=policy,
        global_cap=10_000_000,
        fallback_models=[specs[model_id] for model_id in policy.fallback_models],
        counter_for=counter_for,
        cache=MemoryCountCache(),
        provider_count=provider,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(FIXTURES)),
    divisor=st.integers(1, 6),
    per_message=st.integers(0, 12),
    fraction=st.sampled_from([1.5, 1.0, 0.8, 0.6, 0.4, 0.2]),
)
def test_a_provider_counted_decision_is_bounded_exact_for_its_payload_and_within_budget(
    name: str, divisor: int, per_message: int, fraction: float
) -> None:
    probe = FakeProvider(divisor, per_message)
    full = run(name, probe, 10_000_000)
    assert full.admitted and full.rung == "FULL" and full.count is not None
    assert len(probe.calls) == 1, "a payload that fits is counted once"
    budget = max(1, int(full.count.total * fraction))

    provider = FakeProvider(divisor, per_message)
    decision = run(name, provider, budget)
    assert len(provider.calls) <= MAX_PROVIDER_COUNTS
    assert len(set(provider.calls)) == len(provider.calls), "no payload is counted twice"
    assert decision.hard_bucket_changes == 0
    assert [digest for digest, _ in decision.provider_counts] == provider.calls
    if decision.admitted and decision.model.provider_counter is None:
        # SMALLER_MODEL went to a locally exact model: its own tokenizer counted the payload.
        assert decision.rung == "SMALLER_MODEL" and decision.count_method == "EXACT"
    elif decision.admitted:
        assert decision.count is not None and decision.count_method == "PROVIDER_COUNT"
        assert decision.count.total == provider.count_of(decision.payload) <= decision.budget
        assert dict(decision.provider_counts)[decision.rendered_digest] == decision.count.total
        assert sum(decision.count.per_bucket.values()) == decision.count.total
        assert sum(decision.count.per_object.values()) == decision.count.total
    elif decision.count is not None and decision.code == "CONTEXT_BUDGET_EXCEEDED":
        assert decision.count.total > decision.budget


def test_without_a_counting_api_a_provider_counted_model_cannot_count() -> None:
    policy = task_policy()
    decision = decide(
        parse_components(fixture("cjk"), limits=LIMITS),
        request_id="req-1",
        model=provider_spec(190_000),
        requested_max_output=MAX_OUTPUT,
        task_policy=policy,
        global_cap=10_000_000,
        fallback_models=[],
        counter_for=counter_for,
        cache=MemoryCountCache(),
    )
    assert (decision.admitted, decision.code) == (False, "COUNTING_UNAVAILABLE")


def test_a_failing_counting_api_is_counting_unavailable() -> None:
    def down(spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
        raise CountingUnavailable("the counting API timed out")

    decision = decide(
        parse_components(fixture("cjk"), limits=LIMITS),
        request_id="req-1",
        model=provider_spec(190_000),
        requested_max_output=MAX_OUTPUT,
        task_policy=task_policy(),
        global_cap=10_000_000,
        fallback_models=[],
        counter_for=counter_for,
        cache=MemoryCountCache(),
        provider_count=down,
    )
    assert (decision.admitted, decision.code) == (False, "COUNTING_UNAVAILABLE")
    assert "timed out" in decision.detail


@given(
    parts=st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 10_000), max_size=12),
    total=st.integers(0, 1_000_000),
)
def test_apportion_shares_a_total_in_proportion(parts: dict[str, int], total: int) -> None:
    shares = apportion(parts, total)
    assert set(shares) == set(parts)
    if not parts:
        return
    assert sum(shares.values()) == total
    weight = sum(parts.values())
    for name, value in parts.items():
        if weight:
            assert abs(shares[name] - value * total / weight) < 1 + 1e-9


def test_apportion_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        apportion({"a": -1}, 3)


# ------------------------------------------------------------- an OpenAI model's tools, counted by its API


def openai_spec(budget: int, *, bound_counter: str | None = "openai") -> ModelSpec:
    return replace(family_spec("gpt-4o@1", budget + MAX_OUTPUT), bound_counter=bound_counter)


def openai_run(
    data: dict[str, Any], provider: Any, budget: int, *, bound_counter: str | None = "openai", **policy: Any
) -> Decision:
    return decide(
        parse_components(data, limits=LIMITS),
        request_id="req-1",
        model=openai_spec(budget, bound_counter=bound_counter),
        requested_max_output=MAX_OUTPUT,
        task_policy=task_policy(**policy),
        global_cap=10_000_000,
        fallback_models=[],
        counter_for=family_counter_for,
        cache=MemoryCountCache(),
        provider_count=provider,
    )


def without_unpublished_framing(data: dict[str, Any]) -> dict[str, Any]:
    """The request without tools, output schema, tool calls or results: what OpenAI publishes framing of."""
    data.pop("tools", None)
    data.pop("outputSchema", None)
    data["recentTurns"] = [
        turn for turn in data.get("recentTurns", []) if turn["role"] != "tool" and not turn.get("toolCalls")
    ]
    return data


def test_an_openai_request_with_tools_is_counted_by_the_api_once_and_never_called_exact() -> None:
    provider = FakeProvider(4, 3)
    decision = openai_run(fixture("huge_tools"), provider, 10_000_000)
    assert decision.admitted and decision.rung == "FULL" and decision.count is not None
    assert decision.count_method == "PROVIDER_COUNT"
    assert provider.calls == [decision.rendered_digest], "one call, for the payload answered"
    assert decision.count.total == provider.count_of(decision.payload)
    assert sum(decision.count.per_bucket.values()) == decision.count.total

    # The same request where the pool has no counting API: the local bound, as before.
    local = openai_run(fixture("huge_tools"), provider, 10_000_000, bound_counter=None)
    assert local.count_method == "UPPER_BOUND" and len(provider.calls) == 1


def test_an_openai_request_without_unpublished_framing_stays_exact_and_calls_nothing() -> None:
    provider = FakeProvider(4, 3)
    decision = openai_run(without_unpublished_framing(fixture("code")), provider, 10_000_000)
    assert decision.admitted and decision.count_method == "EXACT"
    assert provider.calls == []


def test_a_failing_counting_api_for_an_openai_request_with_tools_follows_the_policy() -> None:
    def down(spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
        raise CountingUnavailable("OpenAI input_tokens answered 503")

    rejected = openai_run(fixture("huge_tools"), down, 10_000_000)
    assert (rejected.admitted, rejected.code) == (False, "COUNTING_UNAVAILABLE")
    assert "503" in rejected.detail
    bounded = openai_run(fixture("huge_tools"), down, 10_000_000, countingUnavailable="UPPER_BOUND")
    assert bounded.admitted and bounded.count_method == "UPPER_BOUND" and bounded.rung == "FULL"
    assert bounded.hard_bucket_changes == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["code", "huge_tools", "everything"]),
    divisor=st.integers(1, 6),
    per_message=st.integers(0, 40),
    fraction=st.sampled_from([1.2, 1.0, 0.8, 0.5, 0.3]),
)
def test_an_openai_walk_on_the_bound_asks_the_api_for_its_end_only(
    name: str, divisor: int, per_message: int, fraction: float
) -> None:
    local = openai_run(fixture(name), None, 10_000_000)
    assert local.count is not None and local.count_method == "UPPER_BOUND"
    budget = max(1, int(local.count.total * fraction))

    provider = FakeProvider(divisor, per_message)
    decision = openai_run(fixture(name), provider, budget)
    assert len(provider.calls) <= MAX_PROVIDER_COUNTS - 1, "no call for FULL, none per rung"
    assert len(set(provider.calls)) == len(provider.calls)
    assert decision.hard_bucket_changes == 0
    assert decision.count is not None
    if decision.count_method == "PROVIDER_COUNT":
        assert decision.count.total == provider.count_of(decision.payload)
        assert provider.calls[-1] == decision.rendered_digest
        assert decision.admitted == (decision.count.total <= decision.budget)
    else:
        # The ladder dropped everything OpenAI does not publish the framing of: its own tokenizer counted.
        assert decision.count_method == "EXACT"
        assert decision.count.total == recount(decision.model, decision.components)
    if decision.admitted:
        assert decision.count.total <= decision.budget
