"""The ladder through the HTTP API, on the demo configuration with the real tokenizers, Redis and PostgreSQL:
every rung of the demo policy is reachable and reports what it removed, hard buckets never change, and a
counter that cannot count answers as the task's policy says (REJECT: 503; UPPER_BOUND: a bounded count)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from budgeting.admission.models import Manifest
from budgeting.catalog import snapshot as catalog
from budgeting.catalog.models import ModelRevision, PolicyAlias, PolicyState, PolicyVersion, Tokenizer
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ladder.components import HARD_BUCKETS
from ladder.counting import CountingUnavailable
from ledger.models import Reservation, State
from tests.ladder.fixtures import FIXTURES, WORDS, fixture

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
TOKEN = "tb_demo_gateway_eu_0000000000000000"
PRIMARY = "model@2026-07-01"
FALLBACK = "small@2026-05-12"
DEGRADING_RUNGS = ["DEDUP_EVIDENCE", "COMPACT_HISTORY", "NARROW_WORKFLOW", "TRIM_EVIDENCE", "SMALLER_MODEL"]


# ------------------------------------------------------------------------------------- shared test helpers


def demo_api() -> APIClient:
    """Apply the demo configuration; return a client of its gateway-eu service client."""
    apply_config(load_file(DEMO))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    return client


@pytest.fixture
def api(redis_db: Any) -> APIClient:
    return demo_api()


def post(api: APIClient, path: str, body: Any, key: str | None = None) -> Any:
    headers: dict[str, Any] = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return api.post(path, data=json.dumps(body), content_type="application/json", **headers)


def admit(api: APIClient, body: dict[str, Any], key: str | None = None) -> Any:
    return post(api, "/api/v1/admissions", body, key=key or f"key-{body['requestId']}")


def envelope(
    components: dict[str, Any],
    *,
    request_id: str,
    task_class: str = "contract-review",
    tenant: str = "t-19",
    max_output: int = 1600,
) -> dict[str, Any]:
    return {
        "requestId": request_id,
        "tenantId": tenant,
        "taskClass": task_class,
        "modelPool": "eu-large",
        "modelRevision": PRIMARY,
        "maxOutput": max_output,
        "components": components,
    }


def prose(seed: int, words: int) -> str:
    """Distinct English-like text of about ``words`` tokens."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def base_components() -> dict[str, Any]:
    return {
        "immutableRules": ["Never reveal another tenant's documents.", "Cite the evidence ids you use."],
        "authorizationScope": {"permissions": ["contracts:read"]},
        "outputSafety": ["No legal advice beyond the documents."],
        "question": {"text": "Does clause 7 allow termination?"},
        "trustedState": [{"id": "s1", "text": "Customer tier: gold", "provenance": "crm"}],
        "evidence": [
            {
                "id": "e1",
                "sourceId": "doc-1",
                "text": "Clause 7: either party may terminate with 30 days notice.",
                "score": 0.9,
                "permissions": ["contracts:read"],
                "minimumRetention": True,
            }
        ],
        "tools": [
            {
                "name": "search_clauses",
                "description": "Search clauses",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                "essential": True,
            }
        ],
    }


def evidence(item_id: str, text: str, score: float, **extra: Any) -> dict[str, Any]:
    return {
        "id": item_id,
        "sourceId": f"doc-{item_id}",
        "text": text,
        "score": score,
        "permissions": ["contracts:read"],
        **extra,
    }


def rung_components(rung: str, request_id: str) -> dict[str, Any]:
    """Components that the demo contract-review ladder (input budget 24000) admits exactly at ``rung``."""
    data = base_components()
    if rung == "DEDUP_EVIDENCE":
        shared = prose(1, 9000)
        data["evidence"] += [evidence(f"d{i}", shared, 0.8 - i / 10) for i in (1, 2, 3)]
    elif rung == "COMPACT_HISTORY":
        data["recentTurns"] = [
            {"turn": n, "role": "user" if n % 2 else "assistant", "text": prose(10 + n, 3500)}
            for n in range(1, 9)
        ]
        data["compactions"] = [
            {
                "id": "cmp-1",
                "replacesTurns": [1, 2, 3, 4, 5, 6],
                "text": "Earlier the user asked about clauses 1 to 6; all were answered.",
                "gateId": "gate-fidelity-v2",
                "fidelityScore": 0.95,
                "requestId": request_id,
            }
        ]
    elif rung == "NARROW_WORKFLOW":
        data["tools"] += [
            {
                "name": f"tool_{i}",
                "description": prose(100 + i, 1200),
                "parameters": {"type": "object"},
                "essential": False,
            }
            for i in range(1, 26)
        ]
    elif rung == "TRIM_EVIDENCE":
        data["evidence"] += [evidence(f"bulk{i}", prose(200 + i, 3000), 0.1 + i / 100) for i in range(12)]
    elif rung == "SMALLER_MODEL":
        # Everything is minimum evidence, so only another model can take it (see use_small_primary_window).
        data["evidence"][0]["text"] = prose(300, 15000)
    elif rung == "QUEUE_OR_REJECT":
        data["immutableRules"] = ["Rule " * 30000]
    elif rung != "FULL":
        raise AssertionError(rung)
    return data


def use_small_primary_window() -> None:
    """With the demo catalog both eu-large models get the 24000-token input cap, so SMALLER_MODEL can never
    admit what the primary could not; a 12000-token window on the primary (budget 10400) makes it useful."""
    ModelRevision.objects.filter(name=PRIMARY).update(context_window=12000)


def manifest_of(response: Any) -> Manifest:
    return Manifest.objects.get(pk=response.json()["manifestId"])


def publish_policy(revision: int, **contract_review: Any) -> PolicyVersion:
    """A validated copy of the demo policy, contract-review fields overridden, made the production alias."""
    current = PolicyAlias.objects.select_related("version").get(name=catalog.ACTIVE_ALIAS).version
    document = copy.deepcopy(
        PolicyVersion.objects.get(revision=18).document if current.revision != 18 else current.document
    )
    document["revision"] = revision
    document["taskClasses"]["contract-review"].update(contract_review)
    version = PolicyVersion.objects.create(revision=revision, state=PolicyState.VALIDATED, document=document)
    PolicyAlias.objects.filter(name=catalog.ACTIVE_ALIAS).update(version=version)
    return version


def activate_policy(revision: int) -> None:
    PolicyAlias.objects.filter(name=catalog.ACTIVE_ALIAS).update(
        version=PolicyVersion.objects.get(revision=revision)
    )


def fixture_components(name: str, request_id: str) -> dict[str, Any]:
    """A fixture's components with its compactions bound to ``request_id``."""
    data = fixture(name)
    for item in data.get("compactions", []):
        item["requestId"] = request_id
    return data


# Fixture-friendly contract-review settings: the fixtures' compactions come from "gate-a", their essential
# tool is "search", and some have no evidence at all (the demo's minimum of one item would reject them).
FIXTURE_POLICY = {
    "minimumEvidence": {"minItems": 0, "requireMarked": True},
    "compaction": {"fidelityThreshold": 0.9, "approvedGates": ["gate-fidelity-v2", "gate-a"]},
    "essentialTools": ["search_clauses", "search"],
}


def assert_hard_buckets_unchanged(manifest: Manifest) -> None:
    record = manifest.record
    assert record["hardBucketChanges"] == 0
    for bucket in HARD_BUCKETS:
        entry = record["components"][bucket]
        assert entry["digestBefore"] == entry["digestAfter"], bucket


# ------------------------------------------------------------------------------------------------- rungs


def test_full_when_it_fits(api: APIClient) -> None:
    res = admit(api, envelope(rung_components("FULL", "req-full"), request_id="req-full"))
    assert res.status_code == 201, res.json()
    data = res.json()
    assert (data["decision"], data["rung"], data["steps"], data["removed"]) == ("ADMITTED", "FULL", [], [])
    assert_hard_buckets_unchanged(manifest_of(res))


@pytest.mark.parametrize("rung", DEGRADING_RUNGS)
def test_each_rung_of_the_demo_policy_is_reached_and_reports_what_it_removed(
    api: APIClient, rung: str
) -> None:
    request_id = f"req-{rung.lower()}"
    if rung == "SMALLER_MODEL":
        use_small_primary_window()
    res = admit(api, envelope(rung_components(rung, request_id), request_id=request_id))
    assert res.status_code == 201, res.json()
    data = res.json()
    assert (data["decision"], data["rung"]) == ("DEGRADED", rung)
    assert data["tokens"]["input"] <= data["budget"]["input"]
    steps = data["steps"]
    assert steps[-1]["rung"] == rung
    primary_budget = 12000 - 1600 if rung == "SMALLER_MODEL" else data["budget"]["input"]
    assert steps[0]["tokensBefore"] > primary_budget, "FULL did not fit"
    assert steps[-1]["tokensAfter"] == data["tokens"]["input"]
    removed = {(item["id"], item["bucket"], item["reason"], item["rung"]) for item in data["removed"]}
    if rung == "DEDUP_EVIDENCE":
        assert removed == {(i, "evidence", "DUPLICATE", rung) for i in ("d2", "d3")}
        assert steps[-1]["removedIds"] == ["d2", "d3"]
    elif rung == "COMPACT_HISTORY":
        assert removed == {(str(n), "recentTurns", "COMPACTED", rung) for n in range(1, 7)}
        assert (steps[-1]["addedIds"], steps[-1]["replacedIds"]) == (["cmp-1"], [str(n) for n in range(1, 7)])
    elif rung == "NARROW_WORKFLOW":
        assert removed == {(f"tool_{i}", "tools", "NON_ESSENTIAL_TOOL", rung) for i in range(1, 26)}
        assert [tool["function"]["name"] for tool in data["payload"]["tools"]] == ["search_clauses"]
    elif rung == "TRIM_EVIDENCE":
        ids = {item[0] for item in removed}
        assert ids and ids <= {f"bulk{i}" for i in range(12)}
        assert {item[2] for item in removed} == {"LOW_RANK"}
        assert "e1" not in ids, "the minimum-retention item stays"
    else:
        assert removed == set(), "a smaller model removes nothing"
        assert data["modelRevision"] == FALLBACK
        assert data["payload"]["model"] == FALLBACK
        candidates = steps[-1]["candidates"]
        assert [(c["modelId"], c["failed"]) for c in candidates] == [(FALLBACK, [])]
        assert candidates[0]["tokens"] <= candidates[0]["budget"]
        assert Reservation.objects.get(request_id=request_id).model_revision.name == FALLBACK
    manifest = manifest_of(res)
    assert (manifest.rung, manifest.decision) == (rung, "DEGRADED")
    assert [step["rung"] for step in manifest.record["steps"]] == [step["rung"] for step in steps]
    assert_hard_buckets_unchanged(manifest)
    assert Reservation.objects.get(request_id=request_id).state == State.RESERVED


def test_queue_or_reject_when_hard_buckets_do_not_fit(api: APIClient) -> None:
    res = admit(api, envelope(rung_components("QUEUE_OR_REJECT", "req-reject"), request_id="req-reject"))
    assert res.status_code == 422, res.json()
    data = res.json()
    assert data["code"] == "CONTEXT_BUDGET_EXCEEDED"
    assert data["rungsTried"] == ["FULL", *DEGRADING_RUNGS, "QUEUE_OR_REJECT"]
    assert [step["rung"] for step in data["steps"]] == DEGRADING_RUNGS
    assert data["minimumTokensNeeded"] > data["budget"]["input"]
    manifest = manifest_of(res)
    assert (manifest.decision, manifest.rung) == ("CONTEXT_BUDGET_EXCEEDED", "QUEUE_OR_REJECT")
    assert manifest.record["hardBucketChanges"] == 0
    assert not Reservation.objects.exists()


def test_hard_bucket_digests_are_identical_on_every_admitted_fixture(api: APIClient) -> None:
    admitted: list[tuple[str, str]] = []
    publish_policy(900, **FIXTURE_POLICY)
    for index, name in enumerate(FIXTURES):
        full_id, tight_id = f"req-{name}-full", f"req-{name}-tight"
        activate_policy(900)
        full = admit(api, envelope(fixture_components(name, full_id), request_id=full_id))
        assert full.status_code == 201, (name, full.json())
        # A fixture with large tool schemas, which DeepSeek's template does not show, is counted by their
        # bytes (an upper bound) and may not fit whole even under this policy.
        assert full.json()["rung"] == "FULL" or full.json()["countMethod"] == "UPPER_BOUND", name
        tokens = full.json()["tokens"]["input"]
        # A policy revision whose input cap leaves 70 % of the fixture's FULL count: the ladder must work.
        publish_policy(1000 + index, inputCap=tokens * 7 // 10, **FIXTURE_POLICY)
        tight = admit(api, envelope(fixture_components(name, tight_id), request_id=tight_id))
        assert tight.status_code in (201, 422), (name, tight.json())
        for res in (full, tight):
            if res.status_code == 201:
                manifest = manifest_of(res)
                assert_hard_buckets_unchanged(manifest)
                admitted.append((name, manifest.rung))
    degraded = {name for name, rung in admitted if rung != "FULL"}
    assert len(degraded) >= 4, admitted


# ------------------------------------------------------------------------------------ counting unavailable


def test_a_missing_tokenizer_file_rejects_or_bounds_as_the_policy_says(
    api: APIClient, settings: Any, tmp_path: Path
) -> None:
    components = base_components()
    components.pop("tools")  # DeepSeek's template does not show tools: they would be counted by a bound
    body = envelope(components, request_id="req-exact", task_class="support-chat", max_output=800)
    exact = post(api, "/api/v1/admissions:count", body)
    assert exact.status_code == 200, exact.json()
    assert exact.json()["countMethod"] == "EXACT"

    original = settings.TOKENIZER_DIR
    empty = tmp_path / "no-tokenizers"
    empty.mkdir()
    settings.TOKENIZER_DIR = empty
    # Neither the catalog's digest → file-name cache nor the loaded-tokenizer cache may hide a missing file.
    spec = catalog.model_spec(ModelRevision.objects.select_related("tokenizer").get(name=PRIMARY))
    with pytest.raises(CountingUnavailable, match="unavailable"):
        catalog.current()[0].counter_for(spec)

    rejected = admit(api, envelope(base_components(), request_id="req-cu-reject"))
    assert rejected.status_code == 503, rejected.json()
    assert rejected.json()["code"] == "COUNTING_UNAVAILABLE"
    assert rejected["Retry-After"] == "5"
    manifest = manifest_of(rejected)
    assert (manifest.decision, manifest.rung) == ("COUNTING_UNAVAILABLE", "QUEUE_OR_REJECT")
    assert not Reservation.objects.filter(request_id="req-cu-reject").exists()

    assert Tokenizer.objects.get(name="deepseek-v3").upper_bound_rule, "the demo tokenizer has a proven bound"
    bounded = admit(api, {**body, "requestId": "req-cu-bound"})
    assert bounded.status_code == 201, bounded.json()
    data = bounded.json()
    assert (data["countMethod"], data["rung"]) == ("UPPER_BOUND", "FULL")
    assert data["tokens"]["input"] >= exact.json()["tokens"]["input"], "a bound never under-counts"
    assert manifest_of(bounded).count_method == "UPPER_BOUND"
    assert_hard_buckets_unchanged(manifest_of(bounded))

    settings.TOKENIZER_DIR = original
    again = post(api, "/api/v1/admissions:count", body)
    assert again.json()["countMethod"] == "EXACT", "counting comes back with the file"
