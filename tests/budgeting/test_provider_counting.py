"""Provider counting APIs through the HTTP API, on the demo configuration with real PostgreSQL and Redis, and
the provider simulator over real HTTP answering Anthropic's, Gemini's and OpenAI's counting APIs through the
real adapters (the official SDKs for Anthropic and OpenAI).

Proven here: a provider-counted model's answer is ``PROVIDER_COUNT`` with the provider's own number; one
remote call per payload, then none (the count cache, Redis included); a degraded walk asks the provider for
the FULL payload and the final one only, never once per rung; a counting API that fails follows the task's
counting-unavailable rule (REJECT: 503, UPPER_BOUND: the bound), and the breaker opens after repeated
failures (no call, no timeout), says so in the log and the metrics, and closes when the API answers again.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from rest_framework.test import APIClient

from budgeting.admission.count_cache import count_cache
from budgeting.admission.counters import service
from budgeting.admission.decision_memo import decision_memo
from budgeting.admission.models import Manifest
from budgeting.admission.replay import replay_manifest
from budgeting.catalog.models import ModelPool, ModelRevision, PolicyAlias, PolicyState, PolicyVersion
from budgeting.catalog.snapshot import ACTIVE_ALIAS
from budgeting.observability import scrape as scraping
from simulation.provider import Simulator
from tests.budgeting.test_ladder_api import (
    admit,
    base_components,
    demo_api,
    evidence,
    post,
    prose,
    publish_policy,
)

pytestmark = pytest.mark.django_db

CLAUDE = "claude-sonnet-4-5@2025-09-29"
GEMINI = "gemini-2.5-flash@2025-06-17"
GPT = "gpt-4o@2024-08-06"
POOL = "eu-frontier"
# The demo's pool where the simulator's OpenAI counting API counts what gpt-4o's framing leaves out.
GPT_POOL = "us-frontier"


@pytest.fixture
def sim() -> Iterator[Simulator]:
    service.reset()
    with Simulator() as simulator:
        yield simulator
    service.reset()


@pytest.fixture
def api(redis_db: Any, sim: Simulator) -> APIClient:
    client = demo_api()
    # As ``manage.py simulate`` does: the demo pool's provider is this test's simulator.
    ModelPool.objects.filter(slug__in=[POOL, GPT_POOL]).update(provider_base_url=sim.base_url)
    return client


def body(
    model: str, request_id: str, *, task_class: str = "contract-review", pool: str = POOL, **components: Any
) -> dict[str, Any]:
    return {
        "requestId": request_id,
        "tenantId": "t-19",
        "taskClass": task_class,
        "modelPool": pool,
        "modelRevision": model,
        "maxOutput": 800,
        "components": {**base_components(), **components},
    }


def forget_local_caches() -> None:
    """Only Redis is left to remember a count: the decision memo and the in-process count layer go."""
    decision_memo().clear()
    count_cache().forget_local()


@pytest.mark.parametrize(
    ("model", "counter", "api_name"),
    [(CLAUDE, "anthropic", "anthropic"), (GEMINI, "gemini", "gemini"), (GEMINI, "openai", "openai")],
)
def test_each_counting_api_counts_once_per_payload_then_the_cache_answers(
    api: APIClient, sim: Simulator, model: str, counter: str, api_name: str
) -> None:
    ModelRevision.objects.filter(name=model).update(counter=counter)
    first = admit(api, body(model, f"req-{api_name}-1"))
    assert first.status_code == 201, first.json()
    data = first.json()
    assert data["countMethod"] == "PROVIDER_COUNT"
    counts = sim.counts()
    assert len(counts) == 1, counts
    called, provider_model, tokens = counts[0]
    assert called == api_name
    assert provider_model == ModelRevision.objects.get(name=model).provider_model
    assert data["tokens"]["input"] == tokens, "the answer carries the provider's own count"
    assert sum(data["tokens"]["buckets"].values()) == tokens
    manifest = Manifest.objects.get(pk=data["manifestId"])
    assert manifest.count_method == "PROVIDER_COUNT"
    assert manifest.record["providerCounts"] == [{"payloadDigest": data["admittedDigest"], "tokens": tokens}]

    forget_local_caches()
    again = admit(api, body(model, f"req-{api_name}-2"))
    assert again.status_code == 201, again.json()
    assert again.json()["tokens"]["input"] == tokens
    assert sim.count_attempts == 1, "the second admission of the same payload made no call (Redis answered)"

    changed = admit(api, body(model, f"req-{api_name}-3", question={"text": "And clause 8?"}))
    assert changed.status_code == 201
    assert sim.count_attempts == 2, "a new payload is a new count"


def test_a_degraded_walk_asks_the_provider_for_two_payloads_not_one_per_rung(
    api: APIClient, sim: Simulator
) -> None:
    items = [evidence(f"x{i}", prose(i, 400), 0.5 - i / 100) for i in range(12)]
    request = body(CLAUDE, "req-walk", evidence=[*base_components()["evidence"], *items])
    full = post(api, "/api/v1/admissions:count", request)
    assert full.status_code == 200, full.json()
    full_tokens = full.json()["tokens"]["input"]
    assert sim.count_attempts == 1

    # A revision of the policy whose input cap leaves half of FULL: TRIM_EVIDENCE must drop items.
    publish_policy(1900, inputCap=full_tokens // 2)
    forget_local_caches()
    before = sim.count_attempts
    degraded = admit(api, {**request, "requestId": "req-walk-2"})
    assert degraded.status_code == 201, degraded.json()
    data = degraded.json()
    assert data["rung"] == "TRIM_EVIDENCE" and data["countMethod"] == "PROVIDER_COUNT"
    assert data["tokens"]["input"] <= data["budget"]["input"] == full_tokens // 2
    # FULL came from the cache; the walk's end is the one new call, and it is what the answer reports.
    assert sim.count_attempts - before == 1, sim.counts()
    assert sim.counts()[-1][2] == data["tokens"]["input"]
    # Every rung before it was applied and recounted on the way, locally.
    assert [step["rung"] for step in data["steps"]] == [
        "DEDUP_EVIDENCE",
        "COMPACT_HISTORY",
        "NARROW_WORKFLOW",
        "TRIM_EVIDENCE",
    ]

    # The replay decides again from the recorded provider counts, and calls nothing.
    attempts = sim.count_attempts
    replayed = replay_manifest(data["manifestId"])
    assert replayed.differences == [], replayed.differences
    assert sim.count_attempts == attempts


@pytest.mark.parametrize("fault", ["rate_limited", "http_5xx"])
def test_a_failing_counting_api_follows_the_counting_unavailable_rule(
    api: APIClient, sim: Simulator, fault: str
) -> None:
    sim.script_count(fault, count=2)
    rejected = admit(api, body(CLAUDE, f"req-{fault}-reject"))
    assert rejected.status_code == 503, rejected.json()
    assert rejected.json()["code"] == "COUNTING_UNAVAILABLE"
    assert rejected["Retry-After"] == "5"

    # support-chat's policy counts with the approved upper bound instead; the bound never degrades.
    bounded = admit(api, body(CLAUDE, f"req-{fault}-bound", task_class="support-chat", tools=[]))
    assert bounded.status_code == 201, bounded.json()
    data = bounded.json()
    assert (data["countMethod"], data["rung"]) == ("UPPER_BOUND", "FULL")
    manifest = Manifest.objects.get(pk=data["manifestId"])
    assert manifest.record["hardBucketChanges"] == 0
    assert sim.counts() == [], "nothing was counted by the provider"

    counted = admit(api, body(CLAUDE, f"req-{fault}-back", task_class="support-chat", tools=[]))
    assert counted.json()["countMethod"] == "PROVIDER_COUNT", "counting comes back with the API"


def gpt(request_id: str, *, pool: str = GPT_POOL, **components: Any) -> dict[str, Any]:
    return body(GPT, request_id, pool=pool, **components)


def test_an_openai_request_with_tools_is_counted_by_openai_once_then_the_cache_answers(
    api: APIClient, sim: Simulator
) -> None:
    first = admit(api, gpt("req-gpt-tools-1"))
    assert first.status_code == 201, first.json()
    data = first.json()
    assert data["countMethod"] == "PROVIDER_COUNT", "tools: OpenAI's count, never called EXACT"
    [(called, provider_model, tokens)] = sim.counts()
    assert (called, provider_model) == ("openai", "gpt-4o")
    assert data["tokens"]["input"] == tokens
    manifest = Manifest.objects.get(pk=data["manifestId"])
    assert manifest.count_method == "PROVIDER_COUNT"
    assert manifest.record["providerCounts"] == [{"payloadDigest": data["admittedDigest"], "tokens": tokens}]

    forget_local_caches()
    again = admit(api, gpt("req-gpt-tools-2"))
    assert (again.status_code, again.json()["tokens"]["input"]) == (201, tokens)
    assert sim.count_attempts == 1, "the same payload again: the count cache answered"

    # The replay decides again from the recorded count, and calls nothing.
    replayed = replay_manifest(data["manifestId"])
    assert replayed.differences == [], replayed.differences
    assert sim.count_attempts == 1


def test_an_openai_request_without_tools_is_exact_and_calls_nothing(api: APIClient, sim: Simulator) -> None:
    res = admit(api, gpt("req-gpt-plain", tools=[]))
    assert res.status_code == 201, res.json()
    assert res.json()["countMethod"] == "EXACT"
    assert sim.count_attempts == 0


def test_an_openai_request_with_tools_in_a_pool_without_the_counting_api_keeps_the_upper_bound(
    api: APIClient, sim: Simulator
) -> None:
    res = admit(api, gpt("req-gpt-us-small", pool="us-small"))
    assert res.status_code == 201, res.json()
    assert res.json()["countMethod"] == "UPPER_BOUND"
    assert sim.count_attempts == 0


@pytest.mark.parametrize("fault", ["rate_limited", "http_5xx"])
def test_openai_counting_down_follows_the_counting_unavailable_rule(
    api: APIClient, sim: Simulator, fault: str
) -> None:
    sim.script_count(fault, count=2)
    rejected = admit(api, gpt(f"req-gpt-{fault}-reject"))
    assert rejected.status_code == 503, rejected.json()
    assert rejected.json()["code"] == "COUNTING_UNAVAILABLE"

    # support-chat's policy counts with the approved upper bound instead, without degrading anything.
    bounded = admit(api, gpt(f"req-gpt-{fault}-bound", task_class="support-chat"))
    assert bounded.status_code == 201, bounded.json()
    data = bounded.json()
    assert (data["countMethod"], data["rung"]) == ("UPPER_BOUND", "FULL")
    assert Manifest.objects.get(pk=data["manifestId"]).record["hardBucketChanges"] == 0
    assert sim.counts() == [], "nothing was counted by the provider"

    back = admit(api, gpt(f"req-gpt-{fault}-back", task_class="support-chat"))
    assert back.json()["countMethod"] == "PROVIDER_COUNT", "counting comes back with the API"


def scrape() -> str:
    return generate_latest(scraping.registry()).decode()


def test_the_breaker_opens_on_a_dead_api_and_closes_when_it_answers(
    api: APIClient, sim: Simulator, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.COUNTING_API_TIMEOUT_SECONDS = 0.3
    settings.COUNTING_BREAKER_FAILURES = 2
    settings.COUNTING_BREAKER_COOLDOWN_SECONDS = 1
    sim.script_count("hang", count=100, delay_s=2.0)

    def timed(request_id: str, **components: Any) -> tuple[int, float]:
        started = time.perf_counter()
        res = admit(api, body(CLAUDE, request_id, question={"text": request_id}, **components))
        return res.status_code, time.perf_counter() - started

    with caplog.at_level(logging.WARNING, logger="budgeting.admission.counters.breaker"):
        first, second = timed("req-dead-1"), timed("req-dead-2")
    assert first[0] == second[0] == 503
    assert min(first[1], second[1]) >= 0.3, "each waited for the timeout"
    assert sim.count_attempts == 2
    assert any("circuit open" in record.getMessage() for record in caplog.records)
    assert 'tokenbudget_counting_circuit_open{counter="anthropic"' in scrape()
    assert (
        f'tokenbudget_counting_circuit_open{{counter="anthropic",endpoint="{sim.base_url}"}} 1.0' in scrape()
    )

    status, elapsed = timed("req-dead-3")
    assert status == 503
    assert sim.count_attempts == 2, "an open circuit makes no call"
    assert elapsed < 0.3, "and adds no timeout"
    assert 'tokenbudget_provider_counts_total{counter="anthropic",outcome="circuit_open"}' in scrape()

    sim.clear_scripts()
    time.sleep(1.05)
    status, _ = timed("req-alive")
    assert status == 201, "after the cooldown one trial call goes through, and it answers"
    assert sim.count_attempts == 3
    assert (
        f'tokenbudget_counting_circuit_open{{counter="anthropic",endpoint="{sim.base_url}"}} 0.0' in scrape()
    )
    assert timed("req-alive-2")[0] == 201
    assert sim.count_attempts == 4, "closed: calls go through again"


# ----------------------------------------------------------------------------------- validated consistency


def settle(api: APIClient, admitted: Any, reported: int) -> None:
    """Dispatch an admitted call and settle it with the provider-reported input ``reported``."""
    data = admitted.json()
    base = f"/api/v1/reservations/{data['reservationId']}"
    fence = data["lease"]["fence"]
    dispatched = post(
        api,
        f"{base}/dispatch",
        {
            "fence": fence,
            "providerRequestId": f"p-{data['requestId']}",
            "admittedDigest": data["admittedDigest"],
        },
    )
    assert dispatched.status_code == 200, dispatched.json()
    usage = {"fence": fence, "usageEventId": "u1", "outputTokens": 5, "final": True, "inputTokens": reported}
    settled = post(api, f"{base}/usage", usage)
    assert settled.json()["state"] == "SETTLED", settled.json()


def publish_drift_bound(revision: int, **bound: Any) -> None:
    """A validated copy of the demo policy with this ``counterDrift`` bound, made the production alias."""
    document = copy.deepcopy(PolicyVersion.objects.get(revision=18).document)
    document.update(revision=revision, counterDrift=bound)
    version = PolicyVersion.objects.create(revision=revision, state=PolicyState.VALIDATED, document=document)
    PolicyAlias.objects.filter(name=ACTIVE_ALIAS).update(version=version)


def test_drift_is_measured_from_settled_calls_and_can_make_counting_unavailable(
    api: APIClient, sim: Simulator, admin_client: Any
) -> None:
    # Five settled Claude calls: the provider reported 0 %, 2 %, 4 %, 10 % and 30 % more than admitted.
    for index, excess in enumerate((0, 2, 4, 10, 30)):
        admitted = admit(api, body(CLAUDE, f"req-drift-{index}", question={"text": f"Clause {index}?"}))
        assert admitted.status_code == 201, admitted.json()
        tokens = admitted.json()["tokens"]["input"]
        settle(api, admitted, tokens + tokens * excess // 100)
    from budgeting.admission import drift

    [status] = drift.statuses(None, model_revision=CLAUDE)
    assert (status.count_method, status.calls) == ("PROVIDER_COUNT", 5)
    assert status.p50 == pytest.approx(0.04, abs=0.01)
    assert status.p99 == pytest.approx(0.30, abs=0.01)
    assert not status.exceeded, "no bound in the policy: nothing is flagged"

    # A bound that only alerts: flagged in the admin and the metrics, counting goes on.
    publish_drift_bound(1950, maxP99=0.2, minCalls=3, window=50)
    drift.forget()
    page = admin_client.get(
        f"/admin/budgeting/modelrevision/{ModelRevision.objects.get(name=CLAUDE).pk}/change/"
    )
    assert "OUT OF BOUND" in page.content.decode()
    flagged = f'count_method="PROVIDER_COUNT",fallback="0",model_revision="{CLAUDE}"'
    assert f"tokenbudget_counter_drift_exceeded{{{flagged}}} 1.0" in scrape()
    assert 'tokenbudget_counter_drift_ratio{count_method="PROVIDER_COUNT",model_revision="' in scrape()
    still = admit(api, body(CLAUDE, "req-drift-alert"))
    assert (still.status_code, still.json()["countMethod"]) == (201, "PROVIDER_COUNT")

    # The same bound falling back: the counter is unavailable, each task's rule decides.
    publish_drift_bound(1951, maxP99=0.2, minCalls=3, window=50, onExceeded="COUNTING_UNAVAILABLE")
    drift.forget()
    rejected = admit(api, body(CLAUDE, "req-drift-reject"))
    assert rejected.status_code == 503, rejected.json()
    assert rejected.json()["code"] == "COUNTING_UNAVAILABLE"
    bounded = admit(api, body(CLAUDE, "req-drift-bound", task_class="support-chat", tools=[]))
    assert (bounded.status_code, bounded.json()["countMethod"]) == (201, "UPPER_BOUND")

    # A window of the latest calls only: the three latest drifts (4 %, 10 %, 30 %) still exceed 20 % at p99,
    # but a wider bound puts the counter back in use.
    publish_drift_bound(1952, maxP99=0.5, minCalls=3, window=50, onExceeded="COUNTING_UNAVAILABLE")
    drift.forget()
    back = admit(api, body(CLAUDE, "req-drift-back"))
    assert (back.status_code, back.json()["countMethod"]) == (201, "PROVIDER_COUNT")


def test_a_drifted_openai_count_makes_a_tools_request_counting_unavailable_and_leaves_plain_ones_exact(
    api: APIClient, sim: Simulator
) -> None:
    # Three settled gpt-4o calls with tools: OpenAI's usage said 30 % more input than its own count.
    for index in range(3):
        admitted = admit(api, gpt(f"req-gpt-drift-{index}", question={"text": f"Clause {index}?"}))
        assert admitted.json()["countMethod"] == "PROVIDER_COUNT", admitted.json()
        tokens = admitted.json()["tokens"]["input"]
        settle(api, admitted, tokens + tokens * 30 // 100)
    from budgeting.admission import drift

    publish_drift_bound(1960, maxP99=0.2, minCalls=3, window=50, onExceeded="COUNTING_UNAVAILABLE")
    drift.forget()
    [status] = [s for s in drift.statuses(None, model_revision=GPT) if s.count_method == "PROVIDER_COUNT"]
    assert (status.calls, status.p99) == (3, pytest.approx(0.3, abs=0.01))
    attempts = sim.count_attempts
    rejected = admit(api, gpt("req-gpt-drift-reject"))
    assert rejected.status_code == 503, rejected.json()
    assert rejected.json()["code"] == "COUNTING_UNAVAILABLE"
    assert sim.count_attempts == attempts, "the drifted counter is not asked"
    # Without tools the local tokenizer counts (its own drift is not the provider count's): still EXACT.
    plain = admit(api, gpt("req-gpt-drift-plain", tools=[]))
    assert (plain.status_code, plain.json()["countMethod"]) == (201, "EXACT")
