"""``manage.py simulate``: its traffic generator (pure) and one short real run against the live server with a
real Celery worker on the real Redis broker doing the reconciliation."""

from __future__ import annotations

import io
import random
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import call_command

from budgeting.catalog.models import ModelPool
from ladder.components import Limits
from ladder.parser import parse_components
from ledger.models import Reservation, State
from simulation.traffic import TASK_CLASSES, Corpus, FaultKind, Plan, build_request, plan_request
from tests.e2e_faults.harness import Platform, celery_workers


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(7)


@pytest.mark.parametrize("task_class", [name for name, _ in TASK_CLASSES])
@pytest.mark.parametrize("size", ["small", "ladder", "oversize"])
def test_every_generated_request_is_well_formed(corpus: Corpus, task_class: str, size: str) -> None:
    plan = Plan("sim-1-0-1", "t-19", task_class, size, 200, None, 1)
    body = build_request(plan, corpus, random.Random(1))
    # The strict parser of the API: a generated request is never answered 400.
    components = parse_components(body["components"], limits=Limits())
    assert body["requestId"] == "sim-1-0-1" and body["taskClass"] == task_class
    if task_class != "support-chat":
        assert any(item.minimum_retention for item in components.evidence), "the task needs marked evidence"
    if task_class == "support-chat" and size == "ladder":
        assert components.compactions and components.compactions[0].request_id == "sim-1-0-1"


def test_plans_follow_the_seed_and_the_fault_rate() -> None:
    def draw(seed: str) -> list[Plan]:
        rng = random.Random(seed)
        return [plan_request(rng, f"r-{n}", 0.2) for n in range(2000)]

    plans = draw("7:0")
    assert plans == draw("7:0"), "a gateway thread's traffic is reproducible from the seed"
    assert plans != draw("7:1")
    faulty = sum(plan.fault is not None for plan in plans)
    assert 300 < faulty < 500
    assert {plan.fault for plan in plans} == {*FaultKind, None}, "every fault kind is exercised"
    sizes = Counter(plan.size for plan in plans)
    assert sizes["small"] > sizes["ladder"] > sizes["oversize"] > 0


@pytest.mark.django_db(transaction=True)
def test_a_short_simulate_run_reconciles_everything_and_settles_what_was_billed(
    platform: Platform, settings, tmp_path: Path
) -> None:
    # A short lease so that crashed gateways' reservations are reclaimed within the test (the live server
    # runs in this process; the worker gets it through its environment).
    settings.LEASE_SECONDS = 3
    out = io.StringIO()
    # A queue of the test's own, so that no other worker on the same Redis can take its tasks.
    with celery_workers(1, tmp_path, env={"LEASE_SECONDS": "3"}) as (queue, _):
        call_command(
            "simulate",
            f"--task-queue={queue}",
            "--duration=4",
            "--seed=5",
            "--concurrency=3",
            "--fault-rate=0.5",
            f"--api-url={platform.api_url}",
            "--settle-timeout=60",
            stdout=out,
        )
    text = out.getvalue()
    assert "reconciled]" in text and "ledger audit (whole ledger)\n  OK:" in text, text
    assert "0 mismatches, 0 billed but not settled" in text, text
    assert '"MISMATCH"' not in text, text
    assert Reservation.objects.exists()
    assert not Reservation.objects.exclude(state__in=[State.SETTLED, State.REJECTED]).exists()
    # The pools point back where they were (the fixture had pointed them at the test's own simulator).
    assert set(ModelPool.objects.values_list("provider_base_url", flat=True)) == {platform.sim.base_url}
