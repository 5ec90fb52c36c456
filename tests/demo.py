"""The demo configuration the tests provision, and its development gateway token."""

from __future__ import annotations

from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "budgeting" / "demo" / "demo.yaml"
DEMO_TOKEN = "tb_demo_gateway_eu_0000000000000000"
