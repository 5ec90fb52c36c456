"""``manage.py simulate --adapter openai``: one short real run in which the platform reads the simulator
through the real OpenAI adapter (the official SDK: stored-completion lookups, usage and cost buckets)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import call_command

from budgeting.catalog.models import ModelPool
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ledger.models import LedgerEntry, Reservation, State
from reconciliation.models import BilledCost, BillingImport
from simulation.provider import Simulator
from tests.e2e_faults.harness import DEMO, celery_workers, point_pools_at


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_short_simulate_run_through_the_openai_adapter(
    live_server, redis_db, settings, tmp_path: Path
) -> None:
    settings.LEASE_SECONDS = 3
    apply_config(load_file(DEMO))
    out = io.StringIO()
    with Simulator(seed=13) as before, celery_workers(1, tmp_path, env={"LEASE_SECONDS": "3"}) as (queue, _):
        point_pools_at(before.base_url)
        call_command(
            "simulate",
            "--adapter=openai",
            f"--task-queue={queue}",
            "--duration=4",
            "--seed=6",
            "--concurrency=3",
            "--fault-rate=0.5",
            f"--api-url={live_server.url}",
            "--settle-timeout=60",
            stdout=out,
        )
        text = out.getvalue()
        assert "reconciled]" in text and "ledger audit (whole ledger)\n  OK:" in text, text
        assert "0 mismatches, 0 billed but not settled" in text, text
        assert "cannot vouch for 'not found'" in text, text
        unresolved = Reservation.objects.exclude(state__in=[State.SETTLED, State.REJECTED])
        # Only calls OpenAI never stored (never processed) are left, each waiting for a person, none refunded.
        assert all(r.state == State.RECONCILING and r.needs_person for r in unresolved)
        assert not LedgerEntry.objects.filter(reason__startswith="lookup at openai: never processed").exists()
        assert {i.fmt for i in BillingImport.objects.all()} >= {"openai-usage", "openai-costs"}
        assert BilledCost.objects.exists()
        assert set(ModelPool.objects.values_list("provider_base_url", "adapter")) == {
            (before.base_url, "simulator")
        }
