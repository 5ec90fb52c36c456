"""Fixtures of the API tests: a client of the demo gateway with the demo configuration provisioned."""

from __future__ import annotations

from pathlib import Path

import pytest
from rest_framework.test import APIClient

from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
DEMO_TOKEN = "tb_demo_gateway_eu_0000000000000000"


@pytest.fixture
def demo_api(redis_db):
    apply_config(load_file(DEMO))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {DEMO_TOKEN}")
    return client
