"""The served OpenAPI document: typed success bodies, every operation described, the headers declared, real
answers valid against their declared schemas; the problems' ``type`` pages."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.test import Client

from budgeting.api.problem_pages import codes
from tests.api.test_admissions import request_body
from tests.demo import DEMO_TOKEN
from tests.live import gunicorn

pytestmark = pytest.mark.django_db


def served_schema() -> dict[str, Any]:
    response = Client().get("/api/v1/schema?format=json")
    assert response.status_code == 200
    return json.loads(response.content)


def operations(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {op["operationId"]: op for item in schema["paths"].values() for op in item.values()}


def as_json_schema(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable`` in JSON Schema terms, so jsonschema reads it."""
    if isinstance(node, list):
        return [as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: as_json_schema(value) for key, value in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def validate(schema: dict[str, Any], operation_id: str, status: int, body: Any) -> None:
    declared = operations(schema)[operation_id]["responses"][str(status)]["content"]["application/json"]
    root = as_json_schema({**declared["schema"], "components": schema["components"]})
    jsonschema.Draft202012Validator(root).validate(body)


def resolved(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


def test_every_operation_is_described_and_every_success_body_typed():
    schema = served_schema()
    ops = operations(schema)
    assert {"admit", "countAdmission", "getReservation", "recordUsage", "getReport"} <= set(ops)
    for operation_id, op in ops.items():
        assert op.get("summary") and op.get("description"), operation_id
        for status, response in op["responses"].items():
            if not status.startswith("2"):
                continue
            body = resolved(schema, response["content"]["application/json"]["schema"])
            assert body.get("properties") or body.get("oneOf"), (operation_id, status)
            assert body.get("additionalProperties") != {}, (operation_id, status)
    summaries = [op["summary"] for op in ops.values()]
    assert len(set(summaries)) == len(summaries)


def test_headers_and_examples_are_declared():
    admit = operations(served_schema())["admit"]
    assert {"name": "Idempotency-Key", "in": "header"}.items() <= admit["parameters"][0].items()
    assert admit["parameters"][0]["required"] is True
    assert set(admit["responses"]["202"]["headers"]) >= {"Retry-After", "Idempotent-Replayed"}
    assert "Idempotent-Replayed" in admit["responses"]["200"]["headers"]
    assert "Retry-After" in admit["responses"]["429"]["headers"]
    assert admit["requestBody"]["content"]["application/json"]["examples"]
    assert admit["responses"]["201"]["content"]["application/json"]["examples"]
    count = operations(served_schema())["countAdmission"]
    assert count["responses"]["200"]["content"]["application/json"]["examples"]


def post(api: Any, url: str, body: Any, **headers: Any) -> Any:
    return api.post(url, json.dumps(body), content_type="application/json", **headers)


def test_real_answers_validate_against_their_schemas(demo_api):
    schema = served_schema()
    admitted = post(demo_api, "/api/v1/admissions", request_body(), HTTP_IDEMPOTENCY_KEY="k-openapi")
    assert admitted.status_code == 201, admitted.json()
    validate(schema, "admit", 201, admitted.json())
    replayed = post(demo_api, "/api/v1/admissions", request_body(), HTTP_IDEMPOTENCY_KEY="k-openapi")
    assert replayed["Idempotent-Replayed"] == "true"
    validate(schema, "admit", 200, replayed.json())
    counted = post(demo_api, "/api/v1/admissions:count?include=payload", request_body())
    validate(schema, "countAdmission", 200, counted.json())
    validate(schema, "countAdmission", 200, post(demo_api, "/api/v1/admissions:count", request_body()).json())
    body = admitted.json()
    url = f"/api/v1/reservations/{body['reservationId']}"
    fence = body["lease"]["fence"]
    dispatched = post(
        demo_api,
        f"{url}/dispatch",
        {"fence": fence, "providerRequestId": "p-openapi", "admittedDigest": body["admittedDigest"]},
    )
    validate(schema, "dispatchReservation", 200, dispatched.json())
    used = post(
        demo_api, f"{url}/usage", {"fence": fence, "usageEventId": "u1", "outputTokens": 9, "final": True}
    )
    assert used.json()["state"] == "SETTLED"
    validate(schema, "recordUsage", 200, used.json())
    validate(schema, "getReservation", 200, demo_api.get(url).json())
    validate(schema, "apiIndex", 200, demo_api.get("/api/v1/").json())
    # An admission dispatched by itself, and the admission's answer with it.
    dispatching = {**request_body(requestId="r-openapi-2"), "dispatch": {"providerRequestId": "p-openapi-2"}}
    admitted = post(demo_api, "/api/v1/admissions", dispatching, HTTP_IDEMPOTENCY_KEY="k-openapi-2")
    assert admitted.json()["state"] == "DISPATCHED"
    validate(schema, "admit", 201, admitted.json())


def declared_fields(schema: dict[str, Any], operation_id: str) -> set[str]:
    declared = operations(schema)[operation_id]["responses"]["200"]["content"]["application/json"]
    return set(resolved(schema, declared["schema"])["properties"])


def test_every_lifecycle_answer_is_exactly_what_its_schema_declares(demo_api):
    """No field beyond the declared ones (the schema validation above allows extra properties)."""
    schema = served_schema()
    calls = [
        ("renewLease", "lease", {}),
        ("topUpReservation", "top-up", {"topUpId": "t1", "outputTokens": 5}),
        ("dispatchReservation", "dispatch", {"providerRequestId": "p-exact"}),
        ("recordUsage", "usage", {"usageEventId": "u1", "outputTokens": 3, "final": False}),
        ("failReservation", "fail", {"reason": "timeout", "requestSent": "unknown"}),
        ("reportOutcome", "outcome", {"taskSuccess": True, "citedEvidenceIds": []}),
    ]
    admitted = post(demo_api, "/api/v1/admissions", request_body(), HTTP_IDEMPOTENCY_KEY="k-exact").json()
    url = f"/api/v1/reservations/{admitted['reservationId']}"
    for operation_id, action, extra in calls:
        payload = {"fence": 1, **extra} if action != "outcome" else extra
        if action == "dispatch":
            payload["admittedDigest"] = admitted["admittedDigest"]
        answer = post(demo_api, f"{url}/{action}", payload)
        assert answer.status_code == 200, (action, answer.json())
        validate(schema, operation_id, 200, answer.json())
        assert set(answer.json()) == declared_fields(schema, operation_id), action
    other = post(demo_api, "/api/v1/admissions", request_body(requestId="r-x"), HTTP_IDEMPOTENCY_KEY="k-x")
    cancelled = post(demo_api, f"/api/v1/reservations/{other.json()['reservationId']}/cancel", {"fence": 1})
    validate(schema, "cancelReservation", 200, cancelled.json())
    assert set(cancelled.json()) == declared_fields(schema, "cancelReservation")


def test_a_changed_body_fails_validation(demo_api):
    schema = served_schema()
    body = post(demo_api, "/api/v1/admissions:count", request_body()).json()
    with pytest.raises(jsonschema.ValidationError):
        validate(schema, "countAdmission", 200, {**body, "fits": "yes"})
    with pytest.raises(jsonschema.ValidationError):
        validate(schema, "countAdmission", 200, {k: v for k, v in body.items() if k != "tokens"})


def test_problem_types_resolve_to_a_page_documenting_the_code(demo_api):
    problem = post(demo_api, "/api/v1/admissions", request_body())
    assert problem.status_code == 400
    assert problem.json()["type"] == "/problems/idempotency-key-required"
    page = Client().get(problem.json()["type"])
    assert page.status_code == 200
    text = page.content.decode()
    assert "IDEMPOTENCY_KEY_REQUIRED" in text and "HTTP 400" in text
    for code in ("QUOTA_EXCEEDED", "CONTEXT_BUDGET_EXCEEDED", "STALE_FENCE", "SERVICE_UNAVAILABLE"):
        assert code in text
    table = codes()
    assert (table["quota-exceeded"].status, table["context-budget-exceeded"].status) == (429, 422)
    assert table["stale-fence"].status == 409 and table["body-too-large"].status == 413
    assert Client().get("/problems/no-such-code").status_code == 404


GENERATOR = "openapi-python-client==0.29.1"
OPTIONS = ("--meta", "none", "--output-path", "tbclient")

# The README's walkthrough through the generated client: count, admit, dispatch, final usage, read it back.
WALKTHROUGH = textwrap.dedent(
    """
    import json, sys
    from tbclient import AuthenticatedClient
    from tbclient.api.admissions import admit
    from tbclient.api.admissionscount import count_admission
    from tbclient.api.reservations import dispatch_reservation, get_reservation, record_usage
    from tbclient.models import AdmissionInRequest, DispatchInRequest, UsageInRequest

    base, token, raw = sys.argv[1:4]
    client = AuthenticatedClient(base_url=base, token=token, raise_on_unexpected_status=True)
    request = AdmissionInRequest.from_dict(json.loads(raw))
    counted = count_admission.sync(client=client, body=request)
    admitted = admit.sync(client=client, body=request, idempotency_key="walkthrough-1")
    rid, fence = str(admitted.reservation_id), admitted.lease.fence
    dispatched = dispatch_reservation.sync(
        rid,
        client=client,
        body=DispatchInRequest(
            fence=fence, provider_request_id="prov-walk-1", admitted_digest=admitted.admitted_digest
        ),
    )
    used = record_usage.sync(
        rid,
        client=client,
        body=UsageInRequest(fence=fence, usage_event_id="u-1", output_tokens=120, final=True),
    )
    read = get_reservation.sync(rid, client=client)
    print(json.dumps({
        "counted": [type(counted).__name__, counted.tokens.input_],
        "admitted": [type(admitted).__name__, admitted.state, admitted.reserved.output],
        "dispatched": [type(dispatched).__name__, dispatched.state],
        "used": [type(used).__name__, used.applied, used.state, used.output.captured],
        "read": [
            type(read).__name__, read.state, read.outcome,
            sorted({e.kind for e in read.ledger_entries}),
        ],
    }))
    """
)


def generator_venv() -> Path:
    """``$XDG_CACHE_HOME/token-budget/openapi-client-<hash>``: the generator (with the httpx and attrs the
    client needs) apart from the platform's venv, built once."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "token-budget" / f"openapi-client-{hashlib.sha256(GENERATOR.encode()).hexdigest()[:12]}"
    if not (venv / "ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GENERATOR], check=True, timeout=600)
        (venv / "ready").touch()
    return venv


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_client_generated_from_the_served_schema_runs_the_walkthrough(demo_api, tmp_path):
    venv = generator_venv()
    with gunicorn() as base:
        with urllib.request.urlopen(f"{base}/api/v1/schema?format=json") as served:
            (tmp_path / "schema.json").write_bytes(served.read())
        generated = subprocess.run(
            [str(venv / "bin" / "openapi-python-client"), "generate", "--path", "schema.json", *OPTIONS],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert generated.returncode == 0, generated.stdout + generated.stderr
        (tmp_path / "walkthrough.py").write_text(WALKTHROUGH)
        run = subprocess.run(
            [str(venv / "bin" / "python"), "walkthrough.py", base, DEMO_TOKEN, json.dumps(request_body())],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert run.returncode == 0, run.stderr
    # DeepSeek's published template renders the admitted payload in 113 tokens, and does not show the tool
    # definition: its 155 UTF-8 bytes are the bound (tests/ladder/test_deepseek_golden.py's reference).
    assert json.loads(run.stdout) == {
        "counted": ["CountOut", 113 + 155],
        "admitted": ["AdmittedOut", "RESERVED", 1600],
        "dispatched": ["LifecycleOut", "DISPATCHED"],
        "used": ["LifecycleAppliedOut", True, "SETTLED", 120],
        "read": ["ReservationOut", "SETTLED", "COMPLETED", ["HOLD", "POST", "RELEASE"]],
    }
