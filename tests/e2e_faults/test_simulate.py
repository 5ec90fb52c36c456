"""``manage.py simulate``: its traffic generator (pure), one short real run against the live server with a
real Celery worker on the real Redis broker doing the reconciliation, and the command in its own process on a
demo whose contract-review capacity is exhausted (every queued request rejected at its deadline)."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from budgeting.catalog.models import ModelPool
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from ladder.components import Limits
from ladder.parser import parse_components
from ledger.models import Hold, Reservation, State
from ledger.selectors import audit
from simulation.traffic import TASK_CLASSES, Corpus, FaultKind, Plan, build_request, plan_request
from tests.e2e_faults.harness import DEMO, ROOT, Platform, celery_workers, database_url_for_subprocesses


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


QUEUE_DEADLINE_S = 2
"""The exhausted demo's queue deadline for contract review (60 s in the demo): it passes within the test."""


def exhausted_demo() -> dict[str, Any]:
    """The demo with contract review's concurrency exhausted: every account of that task class allows no
    call at once, so each contract review is queued and, its deadline passing, rejected."""
    document: dict[str, Any] = load_file(DEMO)
    for task_class in document["taskClasses"]:
        if task_class["slug"] == "contract-review":
            task_class["tenantAccountDefaults"]["concurrencyLimit"] = 0
            task_class["queue"]["deadlineSeconds"] = QUEUE_DEADLINE_S
    for account in document["accounts"]:
        if account.get("taskClass") == "contract-review":
            account["concurrencyLimit"] = 0
    for version in document["policies"]["versions"]:
        version["document"]["taskClasses"]["contract-review"]["queue"]["deadlineSeconds"] = QUEUE_DEADLINE_S
    return document


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_simulate_passes_on_a_demo_whose_contract_review_capacity_is_exhausted(
    live_server, redis_db, settings, tmp_path: Path
) -> None:
    """The README's end-to-end check, ``manage.py simulate``, run as a person runs it (its own process, exit
    status), on a demo where every queued contract review is rejected at its deadline: the audit finds no
    leak (before issue 21 each such rejection kept its output on its row and the command exited 1)."""
    settings.LEASE_SECONDS = 3
    apply_config(exhausted_demo())
    env = {**os.environ, "DATABASE_URL": database_url_for_subprocesses(), "DB_CONN_MAX_AGE": "0"}
    queue = f"e2e-{uuid.uuid4().hex[:10]}"
    command = [
        sys.executable, "manage.py", "simulate", "--duration=4", "--seed=7", "--concurrency=3",
        f"--api-url={live_server.url}", f"--task-queue={queue}", "--settle-timeout=60",
    ]  # fmt: skip
    # The traffic needs no worker, so the command starts while the worker does: the tasks it sends to settle
    # the run wait in Redis until the worker is up.
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        try:
            with celery_workers(1, tmp_path, queue=queue, env={"LEASE_SECONDS": "3"}):
                output, _ = run.communicate(timeout=120)
        finally:
            run.kill()
    assert run.returncode == 0, output
    rejected = Reservation.objects.filter(state=State.REJECTED, failure_reason="queue deadline passed")
    # The run proves something only if contract reviews were queued and rejected at their deadline.
    assert rejected.count() >= 1, output
    assert set(rejected.values_list("task_class__slug", flat=True)) == {"contract-review"}
    assert all(r.remaining == 0 and r.released == r.output_reserved for r in rejected)
    assert not Hold.objects.filter(reservation__in=rejected).exists()
    report = audit(timezone.now())
    assert report.ok and report.reservations_checked >= rejected.count(), report.leaks
    assert "ledger audit (whole ledger)\n  OK:" in output, output

    # Negative control: the row such a rejection wrote before the fix (its output still ``remaining``,
    # nothing released) is a leak to the same audit on this database, so the command would exit 1.
    leaked = rejected.first()
    assert leaked is not None
    Reservation.objects.filter(pk=leaked.pk).update(remaining=leaked.output_reserved, released=0)
    leaks = audit(timezone.now()).leaks
    assert [leak for leak in leaks if str(leaked.pk) in leak], "the audit misses the planted leak"
