"""Billing exports from the provider simulator, imported against the real ledger."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from ledger.models import LedgerEntry, Outcome, Reservation, State
from ledger.selectors import audit
from ledger.services import lifecycle, settlement
from reconciliation.billing import import_export
from reconciliation.models import BilledRequest, BillingFinding, BillingImport, BucketDrift, FindingKind
from simulation.provider import Simulator
from tests.factories import TenantFactory
from tests.ledger.helpers import Catalog, catalog, now, tenant_account
from tests.reconciliation.helpers import call_provider, dispatched, expire

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sim():
    simulator = Simulator(seed=5)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.fixture
def cat():
    c = catalog()
    tenant_account(c, input_limit=10**6, output_limit=10**6)
    return c


def frozen(cat, sim, max_tokens: int = 20) -> Reservation:
    """A reservation whose call completed at the provider but whose outcome we never heard: RECONCILING."""
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id, max_tokens=max_tokens)
    sim.script_lookup("unknown", count=1)
    expire(r)
    settlement.claim_expired_leases(now=now())
    r.refresh_from_db()
    assert r.state == State.RECONCILING
    return r


def kinds(billing_import: BillingImport) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in billing_import.findings.values_list("kind", flat=True):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_per_request_records_settle_reconciling_at_billed_usage(cat, sim, fmt):
    r = frozen(cat, sim)
    billed = sim.entry(r.provider_request_id)
    result = import_export(text=sim.billing_export(fmt), fmt=fmt, source=f"export.{fmt}", now=now())
    r.refresh_from_db()
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RECONCILED)
    assert (r.input_consumed, r.captured + r.overrun) == (billed.prompt_tokens, billed.completion_tokens)
    assert kinds(result.billing_import) == {FindingKind.SETTLED: 1}
    assert LedgerEntry.objects.filter(reservation=r, kind="CORRECTION").exists() or r.input_consumed == 100
    assert audit().ok


def test_importing_the_same_export_twice_changes_nothing(cat, sim):
    frozen(cat, sim)
    text = sim.billing_export("jsonl")
    first = import_export(text=text, fmt="jsonl", source="a", now=now())
    entries = LedgerEntry.objects.count()
    second = import_export(text=text, fmt="jsonl", source="a-again", now=now())
    assert first.created and not second.created
    assert second.billing_import.pk == first.billing_import.pk
    assert LedgerEntry.objects.count() == entries
    assert BillingImport.objects.count() == 1


def test_a_cumulative_export_seen_again_is_no_news(cat, sim):
    frozen(cat, sim)
    import_export(text=sim.billing_export("jsonl"), fmt="jsonl", source="a", now=now())
    entries = LedgerEntry.objects.count()
    again = import_export(text=sim.billing_export("csv"), fmt="csv", source="same requests as CSV", now=now())
    assert again.created
    assert kinds(again.billing_import) == {}
    assert LedgerEntry.objects.count() == entries


def test_a_request_billed_again_with_other_amounts_is_a_mismatch_not_counted(cat, sim):
    r = frozen(cat, sim)
    text = sim.billing_export("jsonl")
    import_export(text=text, fmt="jsonl", source="a", now=now())
    entries = LedgerEntry.objects.count()
    billed = sim.entry(r.provider_request_id)
    inflated = text.replace(f'"output_tokens":{billed.completion_tokens}', '"output_tokens":999')
    assert inflated != text
    again = import_export(text=inflated, fmt="jsonl", source="b", now=now())
    assert kinds(again.billing_import) == {FindingKind.MISMATCH: 1}
    assert LedgerEntry.objects.count() == entries
    assert (
        BilledRequest.objects.get(provider_request_id=r.provider_request_id).output_tokens
        == billed.completion_tokens
    )


def test_a_call_whose_gateway_holds_a_live_lease_is_left_to_the_gateway(cat, sim):
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id)
    result = import_export(text=sim.billing_export("jsonl"), fmt="jsonl", source="live", now=now())
    assert kinds(result.billing_import) == {}
    assert Reservation.objects.get(pk=r.pk).state == State.DISPATCHED
    assert not BilledRequest.objects.exists(), "a later cumulative export carries it again"


def test_a_duplicate_line_is_flagged_and_counted_once(cat, sim):
    r = frozen(cat, sim)
    lines = sim.billing_export("jsonl").strip().splitlines()
    text = "\n".join([*lines, lines[0]]) + "\n"
    result = import_export(text=text, fmt="jsonl", source="dup", now=now())
    found = kinds(result.billing_import)
    assert found.get(FindingKind.DUPLICATE, 0) >= 1
    r.refresh_from_db()
    billed = sim.entry(r.provider_request_id)
    assert found.get(FindingKind.SETTLED) == 1, "an identical duplicate line still settles, once"
    assert r.captured + r.overrun == billed.completion_tokens, "settled once, not twice"
    assert audit().ok


def test_missing_and_extra_requests_are_reported(cat, sim):
    # Extra: the provider billed requests we have no reservation for.
    call_provider(sim, "stranger-1")
    # Missing: a call we dispatched and settled, inside the export's period, that the export does not contain.
    completed = dispatched(cat)
    lifecycle.record_usage(
        reservation_id=completed.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        usage=lifecycle.Usage("u", 10, 100, True),
        now=now(),
    )
    call_provider(sim, "stranger-2")
    result = import_export(text=sim.billing_export("csv"), fmt="csv", source="x.csv", now=now())
    found = kinds(result.billing_import)
    assert found == {FindingKind.EXTRA: 2, FindingKind.MISSING: 1}
    missing = BillingFinding.objects.get(kind=FindingKind.MISSING)
    assert missing.provider_request_id == completed.provider_request_id


def test_bucket_records_are_compared_with_what_we_captured(cat, sim):
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id, max_tokens=15)
    billed = sim.entry(r.provider_request_id)
    lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        usage=lifecycle.Usage("u", billed.completion_tokens - 3, billed.prompt_tokens, True),
        now=now(),
    )
    Reservation.objects.filter(pk=r.pk).update(dispatched_at=billed.started_at)
    model_name = billed.model
    cat.model.name = model_name
    cat.model.save()
    text = sim.billing_export("jsonl", granularity="bucket", bucket=timedelta(hours=1))
    result = import_export(text=text, fmt="jsonl", source="buckets", now=now())
    bucket = BucketDrift.objects.get(billing_import=result.billing_import)
    assert (bucket.billed_input, bucket.billed_output) == (billed.prompt_tokens, billed.completion_tokens)
    assert (bucket.drift_input, bucket.drift_output) == (0, 3)
    assert kinds(result.billing_import) == {FindingKind.BUCKET_DRIFT: 1}


def test_bad_lines_are_findings_and_the_rest_is_imported(cat, sim):
    frozen(cat, sim)
    text = sim.billing_export("jsonl") + "{not json}\n"
    result = import_export(text=text, fmt="jsonl", source="bad", now=now())
    found = kinds(result.billing_import)
    assert found.get(FindingKind.BAD_LINE) == 1
    assert found.get(FindingKind.SETTLED) == 1


def test_management_command(cat, sim, tmp_path):
    frozen(cat, sim)
    path = tmp_path / "export.csv"
    path.write_text(sim.billing_export("csv"))
    out = StringIO()
    call_command("import_billing", str(path), stdout=out)
    assert out.getvalue().startswith("imported:")
    out = StringIO()
    call_command("import_billing", str(path), stdout=out)
    assert out.getvalue().startswith("already imported")


def test_a_bucket_drift_is_reported_once_until_it_changes(cat, sim):
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id, max_tokens=15)
    billed = sim.entry(r.provider_request_id)
    lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        usage=lifecycle.Usage("u", billed.completion_tokens - 3, billed.prompt_tokens, True),
        now=now(),
    )
    Reservation.objects.filter(pk=r.pk).update(dispatched_at=billed.started_at)
    cat.model.name = billed.model
    cat.model.save()
    first = import_export(
        text=sim.billing_export("jsonl", granularity="bucket"), fmt="jsonl", source="b1", now=now()
    )
    again = import_export(
        text=sim.billing_export("csv", granularity="bucket"), fmt="csv", source="b2", now=now()
    )
    assert kinds(first.billing_import) == {FindingKind.BUCKET_DRIFT: 1}
    assert kinds(again.billing_import) == {}
    assert BucketDrift.objects.count() == 1


def test_one_export_is_one_import_whatever_its_line_endings_bom_or_channel(cat, sim, tmp_path):
    frozen(cat, sim)
    text = sim.billing_export("csv")
    # The admin upload keeps the file's bytes: CRLF line endings and a byte-order mark.
    uploaded = "\ufeff" + text.replace("\n", "\r\n")
    first = import_export(text=uploaded, fmt="csv", source="upload.csv", now=now())
    assert first.created and kinds(first.billing_import) == {FindingKind.SETTLED: 1}
    path = tmp_path / "export.csv"
    path.write_bytes(text.encode())
    out = StringIO()
    call_command("import_billing", str(path), stdout=out)
    assert out.getvalue().startswith("already imported")
    path.write_bytes(uploaded.encode())
    call_command("import_billing", str(path), stdout=out)
    assert BillingImport.objects.count() == 1


def test_a_request_billed_twice_in_one_export_with_other_amounts_is_a_mismatch(cat, sim):
    r = frozen(cat, sim)
    [line] = sim.billing_export("jsonl").strip().splitlines()
    billed = sim.entry(r.provider_request_id)
    other = line.replace(f'"output_tokens":{billed.completion_tokens}', '"output_tokens":999')
    result = import_export(text=f"{line}\n{other}\n", fmt="jsonl", source="twice", now=now())
    assert kinds(result.billing_import) == {FindingKind.MISMATCH: 1}
    assert Reservation.objects.get(pk=r.pk).state == State.RECONCILING, "neither copy is trusted"


def test_a_bill_naming_calls_of_two_tenants_settles_neither(cat, sim):
    r = frozen(cat, sim)
    other = Catalog(TenantFactory(slug="t-2"), cat.task_class, cat.pool, cat.model)
    tenant_account(other, input_limit=10**6, output_limit=10**6)
    theirs = dispatched(other, r.provider_request_id)
    expire(theirs)
    settlement.claim_expired_leases(now=now())
    result = import_export(text=sim.billing_export("jsonl"), fmt="jsonl", source="shared", now=now())
    assert kinds(result.billing_import) == {FindingKind.AMBIGUOUS: 1}
    assert {x.state for x in Reservation.objects.filter(provider_request_id=r.provider_request_id)} == {
        State.RECONCILING
    }
