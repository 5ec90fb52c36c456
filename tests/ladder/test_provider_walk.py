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
