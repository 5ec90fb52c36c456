"""POST /admissions and /admissions:count against the demo configuration: real tokenizers, real Redis cache,
real PostgreSQL."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from budgeting.admission.models import Manifest
from budgeting.admission.orchestrator import in_ramp
from budgeting.catalog.models import Tenant, Tokenizer
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ladder.templates import Special, Text
from ledger.models import CapacityAccount, LedgerEntry, Reservation, Scope, State
from tests.ladder.test_deepseek_golden import reference_ids

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
TOKEN = "tb_demo_gateway_eu_0000000000000000"


@pytest.fixture
def api(redis_db):
    apply_config(load_file(DEMO))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    return client


def request_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "requestId": "req-74d1",
        "tenantId": "t-19",
        "taskClass": "contract-review",
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "maxOutput": 1600,
        "components": {
            "immutableRules": ["Never reveal another tenant's documents.", "Cite the evidence ids you use."],
            "authorizationScope": {"permissions": ["contracts:read"]},
            "outputSafety": ["No legal advice beyond the documents."],
            "question": {"text": "Does clause 7 allow termination? 第七条允许终止吗？"},
            "trustedState": [{"id": "s1", "text": "Customer tier: gold", "provenance": "crm"}],
            "evidence": [
                {
                    "id": "e1",
                    "sourceId": "doc-1",
                    "text": "Clause 7: either party may terminate with 30 days notice.",
                    "score": 0.9,
                    "permissions": ["contracts:read"],
                    "minimumRetention": True,
                },
                {
                    "id": "e2",
                    "sourceId": "doc-2",
                    "text": "第七条：任何一方可提前三十天通知终止。",
                    "score": 0.7,
                    "permissions": ["contracts:read"],
                },
                {
                    "id": "e3",
                    "sourceId": "doc-9",
                    "text": "Board minutes (restricted).",
                    "score": 0.99,
                    "permissions": ["board:read"],
                },
            ],
            "tools": [
                {
                    "name": "search_clauses",
                    "description": "Search clauses",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                    "essential": True,
                }
            ],
        },
    }
    body.update(overrides)
    return body


def post(api: APIClient, path: str, body: Any, key: str | None = None) -> Any:
    headers: dict[str, Any] = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return api.post(path, data=json.dumps(body), content_type="application/json", **headers)


def whole_stream_count(tokenizer_file: str, pieces: Any) -> int:
    """The independent check: encode the whole rendered stream at once, special tokens recognised."""
    from django.conf import settings
    from tokenizers import Tokenizer as HF

    hf = HF.from_file(str(Path(settings.TOKENIZER_DIR) / tokenizer_file))
    stream = "".join(
        p.token if isinstance(p, Special) else p.text for p in pieces if isinstance(p, Special | Text)
    )
    return len(hf.encode(stream, add_special_tokens=False).ids)


@pytest.mark.parametrize(
    ("pool", "model", "tenant"),
    [
        ("eu-large", "model@2026-07-01", "t-19"),
        ("us-small", "claude-legacy@2024-03-01", "t-20"),
    ],
)
def test_count_is_exact_for_both_real_tokenizers(api, pool, model, tenant):
    from budgeting.catalog.models import ModelRevision
    from budgeting.catalog.snapshot import model_spec
    from ladder.components import Limits
    from ladder.parser import parse_components
    from ladder.templates import get_template

    body = request_body(modelPool=pool, modelRevision=model, tenantId=tenant)
    # Neither the legacy tokenizer's template nor DeepSeek's published one shows tool definitions.
    body["components"].pop("tools")
    res = post(api, "/api/v1/admissions:count", body)
    assert res.status_code == 200, res.json()
    data = res.json()
    revision = ModelRevision.objects.get(name=model)
    assert data["countMethod"] == "EXACT"
    assert data["tokenizerDigest"] == revision.tokenizer.digest
    assert data["fits"] is True
    assert sum(data["tokens"]["buckets"].values()) == data["tokens"]["input"]
    components = parse_components(body["components"], limits=Limits())
    from dataclasses import replace

    permitted = replace(components, evidence=tuple(e for e in components.evidence if e.id != "e3"))
    template = get_template(model_spec(revision).template_family)
    pieces = template.render(permitted)
    assert whole_stream_count(revision.tokenizer.file_name, pieces) == data["tokens"]["input"]
    if template.family == "deepseek":
        assert len(reference_ids(template.payload(permitted))) == data["tokens"]["input"]
    assert [e["id"] for e in data["excluded"]] == ["e3"]
    assert Reservation.objects.count() == 0, "a dry run reserves nothing"


def test_tokenizer_mismatch_names_the_server_digest(api):
    res = post(api, "/api/v1/admissions:count", request_body(tokenizerDigest="sha256:" + "0" * 64))
    assert res.status_code == 409
    assert res.json()["code"] == "TOKENIZER_MISMATCH"
    assert res.json()["serverTokenizerDigest"] == Tokenizer.objects.get(name="deepseek-v3").digest


def test_policy_revision_mismatch(api):
    res = post(api, "/api/v1/admissions", request_body(policyRevision=17), key="k")
    assert (res.status_code, res.json()["code"]) == (409, "POLICY_REVISION_MISMATCH")
    assert Reservation.objects.count() == 0


def test_admit_then_replay_then_conflict(api):
    res = post(api, "/api/v1/admissions", request_body(), key="key-1")
    assert res.status_code == 201, res.json()
    body = res.json()
    assert body["state"] == "RESERVED"
    assert body["reserved"] == {"input": body["tokens"]["input"], "output": 1600, "concurrency": 1}
    assert body["lease"]["fence"] == 1
    assert body["payload"]["messages"]
    replay = post(api, "/api/v1/admissions", request_body(), key="key-1")
    assert replay.status_code == 200
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.json() == body
    changed = request_body()
    changed["components"]["evidence"][0]["text"] += "!"
    conflict = post(api, "/api/v1/admissions", changed, key="key-1")
    assert (conflict.status_code, conflict.json()["code"]) == (409, "IDEMPOTENCY_CONFLICT")
    assert Reservation.objects.count() == 1
    assert Manifest.objects.count() == 1


def test_output_is_reserved_at_the_server_cap_not_the_client_value(api):
    res = post(api, "/api/v1/admissions", request_body(maxOutput=100_000), key="k-cap")
    assert res.status_code == 201
    assert res.json()["reserved"]["output"] == 1600


def test_missing_idempotency_key_is_400(api):
    res = post(api, "/api/v1/admissions", request_body())
    assert (res.status_code, res.json()["code"]) == (400, "IDEMPOTENCY_KEY_REQUIRED")


def test_quota_exceeded_names_account_and_dimension_and_changes_nothing(api):
    CapacityAccount.objects.filter(scope=Scope.TENANT, tenant__slug="t-19").update(input_limit=10)
    entries = LedgerEntry.objects.count()
    body = request_body(taskClass="support-chat")
    res = post(api, "/api/v1/admissions", body, key="k-q")
    assert res.status_code == 429, res.json()
    data = res.json()
    assert data["code"] == "QUOTA_EXCEEDED"
    assert (data["dimension"], data["account"]["scope"], data["available"]) == ("input", "TENANT", 10)
    assert int(res["Retry-After"]) > 0
    assert LedgerEntry.objects.count() == entries
    assert not Reservation.objects.exists()
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant__slug="t-19")
    assert (account.output_reserved, account.in_flight) == (0, 0), (
        "a rejection on one dimension changes nothing"
    )


def test_queueing_task_class_answers_202_with_position(api):
    CapacityAccount.objects.filter(scope=Scope.TENANT, tenant__slug="t-19").update(concurrency_limit=0)
    res = post(api, "/api/v1/admissions", request_body(), key="k-queue")
    assert res.status_code == 202, res.json()
    assert res.json()["state"] == "PROPOSED"
    assert res.json()["queuePosition"] == 1
    assert api.get(res.json()["poll"]).json()["state"] == "PROPOSED"


def test_shadow_tenant_is_decided_and_recorded_but_holds_nothing(api):
    body = request_body(tenantId="t-20")
    res = post(api, "/api/v1/admissions", body, key="k-shadow")
    assert res.status_code == 200, res.json()
    assert res.json()["mode"] == "SHADOW"
    assert Manifest.objects.filter(mode="SHADOW").count() == 1
    assert not Reservation.objects.exists()
    assert not LedgerEntry.objects.exists()


def test_ramp_is_a_stable_hash_of_the_request_id():
    ids = [f"req-{i}" for i in range(2000)]
    share = sum(in_ramp(i, 25) for i in ids) / len(ids)
    assert 0.2 < share < 0.3
    assert [in_ramp(i, 25) for i in ids] == [in_ramp(i, 25) for i in ids]
    assert not any(in_ramp(i, 0) for i in ids)
    assert all(in_ramp(i, 100) for i in ids)


def test_unknown_tenant_and_foreign_tenant_answer_alike(api):
    Tenant.objects.create(slug="t-foreign", name="not ours")
    unknown = post(api, "/api/v1/admissions:count", request_body(tenantId="t-nobody"))
    foreign = post(api, "/api/v1/admissions:count", request_body(tenantId="t-foreign"))
    assert unknown.status_code == foreign.status_code == 404
    assert unknown.json()["code"] == foreign.json()["code"] == "TENANT_NOT_FOUND"


@pytest.mark.parametrize(
    ("mutate", "status", "code"),
    [
        (lambda b: b.update(taskClass="nope"), 404, "TASK_CLASS_NOT_FOUND"),
        (lambda b: b.update(modelPool="nope"), 404, "MODEL_POOL_NOT_FOUND"),
        (lambda b: b.update(modelRevision="claude-legacy@2024-03-01"), 404, "MODEL_REVISION_NOT_FOUND"),
        (lambda b: b.update(maxOutput=-5), 400, "INVALID_INPUT"),
        (lambda b: b.update(maxOutput="1600"), 400, "INVALID_INPUT"),
        (lambda b: b.update(maxOutput=True), 400, "INVALID_INPUT"),
        (lambda b: b.update(surprise=1), 400, "INVALID_INPUT"),
        (lambda b: b["components"].update(unknown=[]), 400, "INVALID_COMPONENTS"),
        (lambda b: b["components"]["evidence"][0].update(score="high"), 400, "INVALID_COMPONENTS"),
        (lambda b: b["components"]["evidence"][0].update(score=True), 400, "INVALID_COMPONENTS"),
        (
            lambda b: b["components"]["evidence"].append(dict(b["components"]["evidence"][0])),
            400,
            "INVALID_COMPONENTS",
        ),
        (
            lambda b: b["components"].update(
                evidence=[
                    {"id": f"x{i}", "sourceId": "s", "text": "t", "score": 0, "permissions": []}
                    for i in range(5000)
                ]
            ),
            400,
            "INVALID_COMPONENTS",
        ),
        (lambda b: b["components"].pop("question"), 400, "INVALID_COMPONENTS"),
    ],
)
def test_bad_admission_input_is_4xx_with_nothing_written(api, mutate, status, code):
    body = copy.deepcopy(request_body())
    mutate(body)
    res = post(api, "/api/v1/admissions", body, key="k-bad")
    assert res.status_code == status, res.json()
    assert res.json()["code"] == code
    assert not Reservation.objects.exists()
    assert not Manifest.objects.exists()


def test_a_degraded_admission_reports_what_it_removed(api):
    body = request_body(taskClass="summarize")
    filler = "Clause text that matters only a little. " * 400
    body["components"]["evidence"] += [
        {
            "id": f"bulk{i}",
            "sourceId": f"doc-b{i}",
            "text": filler + str(i),
            "score": 0.1 + i / 100,
            "permissions": ["contracts:read"],
        }
        for i in range(12)
    ]
    res = post(api, "/api/v1/admissions", body, key="k-degrade")
    assert res.status_code == 201, res.json()
    data = res.json()
    assert data["rung"] == "TRIM_EVIDENCE"
    removed = {r["id"] for r in data["removed"]}
    assert removed and removed <= {f"bulk{i}" for i in range(12)}
    assert "e1" not in removed, "the minimum-retention item stays"
    assert data["tokens"]["input"] <= data["budget"]["input"]
    assert Reservation.objects.get().state == State.RESERVED


def test_a_structured_rejection_when_hard_buckets_do_not_fit(api):
    body = request_body()
    body["components"]["immutableRules"] = ["Rule " * 30000]
    res = post(api, "/api/v1/admissions", body, key="k-reject")
    assert res.status_code == 422, res.json()
    data = res.json()
    assert data["code"] == "CONTEXT_BUDGET_EXCEEDED"
    assert data["minimumTokensNeeded"] > data["budget"]["input"]
    assert set(data["recommendations"]) == {"NARROW_SCOPE", "PROCESS_ASYNC"}
    assert data["rungsTried"]
    assert Manifest.objects.get(pk=data["manifestId"]).decision == "CONTEXT_BUDGET_EXCEEDED"
    assert not Reservation.objects.exists()


def test_replaying_a_request_the_queue_rejected_says_so(api):
    from datetime import UTC, datetime

    from budgeting.admission.queue import admit_queue

    CapacityAccount.objects.filter(scope=Scope.TENANT, tenant__slug="t-19").update(concurrency_limit=0)
    queued = post(api, "/api/v1/admissions", request_body(), key="k-late")
    assert queued.status_code == 202
    Reservation.objects.filter(pk=queued.json()["reservationId"]).update(
        queue_deadline=datetime(2020, 1, 1, tzinfo=UTC)
    )
    assert admit_queue(now=datetime.now(UTC))["rejected"] == 1
    replay = post(api, "/api/v1/admissions", request_body(), key="k-late")
    assert (replay.status_code, replay.json()["code"]) == (409, "QUEUE_DEADLINE_PASSED")


def test_a_shadow_tenant_is_never_blocked_even_when_the_decision_would_reject(api):
    body = request_body(tenantId="t-20")
    body["components"]["immutableRules"] = ["Rule " * 30000]
    res = post(api, "/api/v1/admissions", body, key="k-shadow-reject")
    assert res.status_code == 200, res.json()
    data = res.json()
    assert data["mode"] == "SHADOW"
    assert data["wouldReject"]["code"] == "CONTEXT_BUDGET_EXCEEDED"
    assert data["payload"]["messages"][0]["content"][0]["text"].startswith("Rule Rule"), "request unchanged"
    manifest = Manifest.objects.get()
    assert (manifest.decision, manifest.answer) == ("CONTEXT_BUDGET_EXCEEDED", "SHADOW")
    assert not Reservation.objects.exists()


def test_the_same_key_with_another_task_class_or_request_id_conflicts(api):
    assert post(api, "/api/v1/admissions", request_body(), key="k-env").status_code == 201
    other_task = post(api, "/api/v1/admissions", request_body(taskClass="summarize"), key="k-env")
    other_id = post(api, "/api/v1/admissions", request_body(requestId="req-other"), key="k-env")
    assert other_task.json()["code"] == other_id.json()["code"] == "IDEMPOTENCY_CONFLICT"
    assert Reservation.objects.count() == 1


def test_a_quota_refusal_is_what_the_manifest_records(api):
    CapacityAccount.objects.filter(scope=Scope.TENANT, tenant__slug="t-19").update(input_limit=10)
    res = post(api, "/api/v1/admissions", request_body(taskClass="support-chat"), key="k-q2")
    assert res.status_code == 429
    manifest = Manifest.objects.get()
    assert (manifest.decision, manifest.answer) == ("ADMITTED", "QUOTA_EXCEEDED")


def test_minimum_evidence_missing_is_a_422_problem_and_the_manifest_records_it(api):
    """contract-review requires one marked evidence item; t-19 is enforced. (This was an HTML 500: the
    manifest's answer column was shorter than MINIMUM_EVIDENCE_UNAVAILABLE.)"""
    body = request_body()
    body["components"]["evidence"] = []
    res = api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="k-min-ev")
    assert res.status_code == 422, res.content
    assert res["Content-Type"].startswith("application/problem+json")
    assert res.json()["code"] == "MINIMUM_EVIDENCE_UNAVAILABLE"
    manifest = Manifest.objects.get(request_id=body["requestId"])
    assert (manifest.decision, manifest.answer) == ("MINIMUM_EVIDENCE_UNAVAILABLE",) * 2
    assert not Reservation.objects.exists()
