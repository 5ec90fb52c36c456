"""Fuzzing with a tool nobody here wrote: schemathesis generates requests from our served OpenAPI document
and checks that no answer is a 5xx or breaks the documented schema. Bounded examples keep CI fast."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from budgeting.wsgi import application
from ledger.models import Reservation

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
TOKEN = "tb_demo_gateway_eu_0000000000000000"

schema = schemathesis.openapi.from_wsgi("/api/v1/schema", application)
REAL_IDS = {
    "tenantId": "t-19",
    "taskClass": "contract-review",
    "modelPool": "eu-large",
    "modelRevision": "model@2026-07-01",
}


@pytest.fixture
def no_connection_recycling():
    """The WSGI handler closes the connection after each request; the test's transaction lives on it."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def demo(db, redis_db, no_connection_recycling):
    from budgeting.provisioning.apply import apply_config
    from budgeting.provisioning.source import load_file
    from tests.ledger.helpers import DIGEST

    apply_config(load_file(DEMO))
    from budgeting.catalog.models import ModelPool, ModelRevision, TaskClass, Tenant
    from ledger.services import admission
    from tests.ledger.helpers import body, now

    pool = ModelPool.objects.get(slug="eu-large")
    spec = admission.AdmissionSpec(
        tenant=Tenant.objects.get(slug="t-19"),
        task_class=TaskClass.objects.get(slug="support-chat"),
        pool=pool,
        model_revision=ModelRevision.objects.get(name="model@2026-07-01"),
        request_id="fuzz",
        idempotency_key="fuzz",
        rendered_digest=DIGEST,
        admitted_digest=DIGEST,
        input_tokens=10,
        output_tokens=10,
        policy_revision=18,
        rung="FULL",
        manifest_id=None,
    )
    return admission.reserve(spec=spec, build_body=body, now=now()).reservation


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_never_answers_5xx_or_off_schema(case, demo: Reservation):
    # Most cases reach real objects: the provisioned tenant, catalog ids and a real reservation with its fence
    # (generated ids alone would only ever exercise the 404 paths).
    chance = random.Random(str(case.body) + case.path)
    if "reservation_id" in (case.path_parameters or {}) and chance.random() < 0.7:
        case.path_parameters["reservation_id"] = str(demo.pk)
        # Only a valid generated fence is replaced: negative cases must stay invalid.
        fence = case.body.get("fence") if isinstance(case.body, dict) else None
        if type(fence) is int and 1 <= fence < 2**53 and chance.random() < 0.7:
            case.body["fence"] = demo.fence
    if isinstance(case.body, dict) and chance.random() < 0.7:
        case.body.update(
            {k: v for k, v in REAL_IDS.items() if isinstance(case.body.get(k), str) and case.body[k]}
        )
    # positive_data_acceptance is excluded: the schema documents ``components`` as a free-form object whose
    # structure the ladder's parser validates, so a schema-valid body may rightly be refused with 400.
    case.call_and_validate(
        headers={"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": "fuzz-key"},
        excluded_checks=[checks.positive_data_acceptance],
    )
