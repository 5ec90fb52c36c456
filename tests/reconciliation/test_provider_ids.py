"""providerRequestId is unique per tenant: another tenant's use of an id is not observable (issue 11.12)."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from ledger.models import Reservation, State
from tests.factories import ServiceClientFactory, TenantFactory, issue_token
from tests.ledger.helpers import Catalog, admit, catalog, spec, tenant_account

pytestmark = pytest.mark.django_db


def gateway(cat: Catalog, token: str) -> APIClient:
    client = ServiceClientFactory(tenants=[cat.tenant])
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {issue_token(client, token)}")  # type: ignore[arg-type]
    return api


def dispatch(api: APIClient, reservation: Reservation, provider_request_id: str):
    return api.post(
        f"/api/v1/reservations/{reservation.pk}/dispatch",
        data=json.dumps(
            {
                "fence": 1,
                "providerRequestId": provider_request_id,
                "admittedDigest": reservation.admitted_digest,
            }
        ),
        content_type="application/json",
    )


@pytest.fixture
def two_tenants():
    first = catalog()
    second = Catalog(TenantFactory(slug="t-2"), first.task_class, first.pool, first.model)
    for cat in (first, second):
        tenant_account(cat, input_limit=10**6, output_limit=10**6)
    return (first, gateway(first, "tb_test_token_first_aaaaaaaaaaa")), (
        second,
        gateway(second, "tb_test_token_second_aaaaaaaaaa"),
    )


def test_two_tenants_may_use_the_same_provider_request_id(two_tenants):
    (first, api_1), (second, api_2) = two_tenants
    mine = admit(spec(first)).reservation
    theirs = admit(spec(second)).reservation
    assert dispatch(api_1, mine, "chatcmpl-shared").status_code == 200
    answer = dispatch(api_2, theirs, "chatcmpl-shared")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["state"] == State.DISPATCHED
    assert Reservation.objects.filter(provider_request_id="chatcmpl-shared").count() == 2


def test_the_same_tenant_cannot_name_two_calls_with_one_id(two_tenants):
    (first, api_1), _ = two_tenants
    one, other = admit(spec(first)).reservation, admit(spec(first)).reservation
    assert dispatch(api_1, one, "chatcmpl-mine").status_code == 200
    refused = dispatch(api_1, other, "chatcmpl-mine")
    assert refused.status_code == 409
    assert refused.json()["code"] == "PROVIDER_REQUEST_ID_IN_USE"
    assert Reservation.objects.get(pk=other.pk).state == State.RESERVED


def test_dispatch_records_the_endpoint_and_adapter_the_pool_names(two_tenants):
    (first, api_1), _ = two_tenants
    first.pool.provider_base_url = "http://provider.example/v1/"
    first.pool.save()
    r = admit(spec(first)).reservation
    assert dispatch(api_1, r, "prov-x").status_code == 200
    r.refresh_from_db()
    assert (r.provider_adapter, r.provider_endpoint) == ("simulator", "http://provider.example/v1/")
