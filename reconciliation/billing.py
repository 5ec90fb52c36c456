"""Importing provider billing exports and usage reports, and reconciling them with the ledger.

Per-request records settle RECONCILING (and still-open dispatched) reservations at the billed usage through
correcting ledger entries; settled ones are compared and any difference is recorded. Bucket records (our
exports' buckets, OpenAI's usage buckets, Anthropic's usage report) are compared with what we captured for
that model and UTC bucket; cost lines are kept as the provider reported them. An import's identity is its
format and its normalised text (no BOM, LF line ends), so the same export imported again — from the admin,
from ``manage.py import_billing`` or fetched by the beat — changes nothing. A request billed twice with the
same amounts is flagged and counted once; with other amounts it is a mismatch and not counted; missing or
extra requests are reported.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Sum

from budgeting.catalog.changes import Actor, record_change, require_reason, snapshot
from budgeting.catalog.errors import InvalidChange, InvalidInput, NotFound
from budgeting.catalog.models import ModelPool
from budgeting.db.cursor import db_now as read_db_now
from ledger.models import Reservation, State
from ledger.services import settlement
from reconciliation.costs import compare_bucket_costs, compare_request_costs
from reconciliation.models import (
    BilledCost,
    BilledRequest,
    BillingFinding,
    BillingImport,
    BucketDrift,
    FindingKind,
)
from reconciliation.providers import registry
from reconciliation.providers.exports import (
    BUCKET_REQUIRED_FIELDS,
    EXPORT_FORMAT_CHOICES,
    REQUEST_REQUIRED_FIELDS,
    BillingExportFormat,
    scan_billing_export,
)
from reconciliation.providers.records import (
    BillingExportScan,
    BucketBillingRecord,
    CostRecord,
    ProblemKind,
    RequestBillingRecord,
)
from reconciliation.reclaim import pool_provider

logger = logging.getLogger(__name__)

OPEN_AFTER_DISPATCH = [State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED, State.RECONCILING]
FORMAT_NAMES = dict(EXPORT_FORMAT_CHOICES)


class ExportRefused(InvalidInput):
    """A file that is not a billing export of the format named (wrong columns, another format): nothing of
    it is stored, and ``detail`` says why."""

    code = "EXPORT_REFUSED"
    title = "Billing export refused"


@dataclass(frozen=True)
class ImportResult:
    billing_import: BillingImport
    created: bool

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kind in self.billing_import.findings.values_list("kind", flat=True):
            counts[kind] = counts.get(kind, 0) + 1
        return {"records": self.billing_import.records, "settled": self.billing_import.settled, **counts}


PROBLEM_FINDINGS = {
    ProblemKind.BAD_LINE: FindingKind.BAD_LINE,
    ProblemKind.DUPLICATE: FindingKind.DUPLICATE,
    ProblemKind.CONFLICT: FindingKind.MISMATCH,
}


def normalise_export(text: str) -> str:
    """The text an import is parsed and identified by: no byte-order mark, LF line ends, one final newline.

    An upload keeps the file's CRLF and BOM while an editor or ``import_billing`` may not; none of that is
    part of what the provider billed.
    """
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip("\n") + "\n" if text.strip() else ""


def export_digest(text: str, fmt: str) -> str:
    """An import's identity: its format and its normalised text."""
    return hashlib.sha256(f"{fmt}\n{normalise_export(text)}".encode()).hexdigest()


def import_export(*, text: str, fmt: BillingExportFormat, source: str, now: datetime) -> ImportResult:
    """Import one billing export or usage report; bad lines of an export that is otherwise readable become
    findings.

    Raises ExportRefused, storing nothing, when the file is not an export of that format: a CSV header without
    the columns of a per-request or a per-bucket export, or no line readable at all. Raises ValueError for an
    unknown format.
    """
    text = normalise_export(text)
    digest = export_digest(text, fmt)
    existing = BillingImport.objects.filter(content_sha256=digest).first()
    if existing is not None:
        return ImportResult(existing, created=False)
    scan = scan_billing_export(text, fmt)
    refusal = _refusal(text, fmt, scan)
    if refusal:
        raise ExportRefused(
            f"{source} is not a {FORMAT_NAMES.get(fmt, fmt)} export: {refusal}. Nothing was stored."
        )
    requests = [r for r in scan.records if isinstance(r, RequestBillingRecord)]
    # A call whose gateway still holds its lease is left for a later (cumulative) export: the gateway is about
    # to settle it itself, and settling underneath it would refuse its final usage.
    live = _live_provider_ids([r.request_id for r in requests])
    requests = [r for r in requests if r.request_id not in live]
    buckets = [r for r in scan.records if isinstance(r, BucketBillingRecord)]
    costs = [r for r in scan.records if isinstance(r, CostRecord)]
    findings: list[BillingFinding] = []
    try:
        with transaction.atomic(durable=True):
            # Imports run one at a time: two overlapping cumulative exports must not both store a request.
            _lock_imports()
            if BillingImport.objects.filter(content_sha256=digest).exists():
                raise _AlreadyImported
            billing_import = BillingImport.objects.create(
                source=source[:200],
                fmt=fmt,
                content_sha256=digest,
                records=len(scan.records),
                period_start=min((r.start_time for r in requests), default=None),
                period_end=max((r.start_time for r in requests), default=None),
            )
            findings += [
                BillingFinding(
                    billing_import=billing_import,
                    kind=PROBLEM_FINDINGS[problem.kind],
                    line=problem.line,
                    detail=problem.reason[:500],
                )
                for problem in scan.problems
            ]
            fresh, seen_again = _store_requests(billing_import, requests, findings)
            _store_buckets(billing_import, buckets, findings)
            _store_costs(billing_import, costs)
            findings += compare_bucket_costs(billing_import, costs)
            BillingFinding.objects.bulk_create(findings)
    except _AlreadyImported:
        return ImportResult(BillingImport.objects.get(content_sha256=digest), created=False)
    # Settlement happens per reservation, each in its own transaction (the ledger's write path).
    settled_findings = _settle(billing_import, fresh, now)
    settled_findings += [f for f in _settle(billing_import, seen_again, now) if f.kind == FindingKind.SETTLED]
    _report_missing(billing_import, requests, settled_findings, deferred=live)
    settled_findings += compare_request_costs(billing_import, requests)
    BillingFinding.objects.bulk_create(settled_findings)
    billing_import.settled = sum(1 for f in settled_findings if f.kind == FindingKind.SETTLED)
    billing_import.findings_count = billing_import.findings.count()
    billing_import.save(update_fields=["settled", "findings_count"])
    return ImportResult(billing_import, created=True)


def _refusal(text: str, fmt: BillingExportFormat, scan: BillingExportScan) -> str:
    """Why a file cannot be an export of ``fmt`` (empty when it can): a CSV header that has neither the
    per-request nor the per-bucket columns, or problems on every line and not one record."""
    if fmt == "csv" and text:
        header = set(next(csv.reader(io.StringIO(text, newline="")), []))
        if not header.issuperset(REQUEST_REQUIRED_FIELDS) and not header.issuperset(BUCKET_REQUIRED_FIELDS):
            return (
                f"its header has {', '.join(sorted(header)) or 'no columns'}; a per-request export needs "
                f"{', '.join(REQUEST_REQUIRED_FIELDS)}, a per-bucket one "
                f"{', '.join(BUCKET_REQUIRED_FIELDS)}"
            )
    bad = [p for p in scan.problems if p.kind is ProblemKind.BAD_LINE]
    if bad and not scan.records:
        first = bad[0]
        more = f" (and {len(bad) - 1} more line{'s' if len(bad) > 2 else ''} like it)" if len(bad) > 1 else ""
        return f"no line could be read (line {first.line}: {first.reason}){more}"
    return ""


def remove_failed_import(*, import_id: int, reason: str, actor: Actor) -> None:
    """Delete an import that stored nothing but its findings (no billed request, bucket, cost or settlement),
    with the change log keeping what it was. Raises NotFound, InvalidChange (it holds records: imports that
    settled or recorded usage are history and stay).
    """
    reason = require_reason(reason)
    with transaction.atomic(durable=True):
        # The imports' lock: an import running now cannot be adding to this one meanwhile.
        _lock_imports()
        billing_import = BillingImport.objects.filter(pk=import_id).first()
        if billing_import is None:
            raise NotFound("no such billing import")
        if (
            billing_import.records
            or billing_import.settled
            or billing_import.billed_requests.exists()
            or billing_import.buckets.exists()
            or billing_import.costs.exists()
        ):
            raise InvalidChange(
                "this import holds billed records; only an import that stored nothing can be removed"
            )
        before = {
            **snapshot(billing_import),
            "findings": list(billing_import.findings.values_list("detail", flat=True)[:20]),
        }
        record_change(
            actor=actor,
            action="billing.remove_import",
            target=billing_import,
            before=before,
            after=None,
            reason=reason,
        )
        billing_import.findings.all().delete()
        billing_import.delete()


def _lock_imports() -> None:
    """Take the transaction-scoped lock every import and removal of an import holds."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext('reconciliation.billing_import'))")


class _AlreadyImported(Exception):
    """The same export was imported while we waited for the import lock."""


def _store_requests(
    billing_import: BillingImport, records: Sequence[RequestBillingRecord], findings: list[BillingFinding]
) -> tuple[list[RequestBillingRecord], list[RequestBillingRecord]]:
    """Store first-seen records. Returns (fresh, seen again with the same amounts).

    Provider exports are cumulative, so a record seen before with the same amounts is no news; one seen before
    with other amounts contradicts the first bill: a mismatch, not counted.
    """
    known = {
        b.provider_request_id: b
        for b in BilledRequest.objects.filter(provider_request_id__in=[r.request_id for r in records])
    }
    fresh: list[RequestBillingRecord] = []
    seen_again: list[RequestBillingRecord] = []
    for record in records:
        earlier = known.get(record.request_id)
        if earlier is None:
            fresh.append(record)
        elif (earlier.input_tokens, earlier.output_tokens) == (record.input_tokens, record.output_tokens):
            seen_again.append(record)
        else:
            findings.append(
                BillingFinding(
                    billing_import=billing_import,
                    kind=FindingKind.MISMATCH,
                    provider_request_id=record.request_id,
                    line=record.line,
                    detail=f"billed again with other amounts ({record.input_tokens}/{record.output_tokens}, "
                    f"first {earlier.input_tokens}/{earlier.output_tokens}); not counted",
                )
            )
    BilledRequest.objects.bulk_create(
        BilledRequest(
            billing_import=billing_import,
            provider_request_id=r.request_id,
            model=r.model,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            start_time=r.start_time,
            line=r.line,
        )
        for r in fresh
    )
    return fresh, seen_again


def _store_buckets(
    billing_import: BillingImport, records: Sequence[BucketBillingRecord], findings: list[BillingFinding]
) -> None:
    """Compare each bucket with what we captured. Exports are cumulative and an open bucket keeps growing,
    so a bucket seen before is brought up to date (latest figures win) rather than stored twice."""
    for record in records:
        ours = Reservation.objects.filter(
            model_revision__name=record.model,
            dispatched_at__gte=record.bucket_start,
            dispatched_at__lt=record.bucket_end,
        ).aggregate(i=Sum("input_consumed"), c=Sum("captured"), o=Sum("overrun"))
        before = BucketDrift.objects.filter(
            model=record.model,
            api_key_id=record.api_key_id or "",
            bucket_start=record.bucket_start,
            bucket_end=record.bucket_end,
        ).first()
        drift, _ = BucketDrift.objects.update_or_create(
            model=record.model,
            api_key_id=record.api_key_id or "",
            bucket_start=record.bucket_start,
            bucket_end=record.bucket_end,
            defaults={
                "billing_import": billing_import,
                "billed_input": record.input_tokens,
                "billed_output": record.output_tokens,
                "captured_input": ours["i"] or 0,
                "captured_output": (ours["c"] or 0) + (ours["o"] or 0),
            },
        )
        unchanged = before is not None and (before.drift_input, before.drift_output) == (
            drift.drift_input,
            drift.drift_output,
        )
        if (drift.drift_input or drift.drift_output) and not unchanged:
            findings.append(
                BillingFinding(
                    billing_import=billing_import,
                    kind=FindingKind.BUCKET_DRIFT,
                    line=record.line,
                    detail=f"{record.model} {record.bucket_start:%Y-%m-%d %H:%M}: "
                    f"billed {record.input_tokens}/{record.output_tokens}, "
                    f"captured {drift.captured_input}/{drift.captured_output} "
                    f"(drift {drift.drift_input:+d}/{drift.drift_output:+d})",
                )
            )


def _store_costs(billing_import: BillingImport, records: Sequence[CostRecord]) -> None:
    """Keep each cost line; reports are cumulative, so a line seen before takes the latest amount."""
    for record in records:
        BilledCost.objects.update_or_create(
            line_item=record.line_item or "",
            project_id=record.project_id or "",
            api_key_id=record.api_key_id or "",
            currency=record.currency,
            bucket_start=record.bucket_start,
            bucket_end=record.bucket_end,
            defaults={"billing_import": billing_import, "amount": record.amount},
        )


def _settle(
    billing_import: BillingImport, records: Sequence[RequestBillingRecord], now: datetime
) -> list[BillingFinding]:
    findings = []
    by_id: dict[str, list[Reservation]] = {}
    for r in Reservation.objects.filter(provider_request_id__in=[rec.request_id for rec in records]):
        by_id.setdefault(r.provider_request_id, []).append(r)
    for record in records:
        calls = by_id.get(record.request_id, [])
        if len(calls) > 1:
            # Ids are unique per tenant only; a bill naming calls of several tenants settles none of them.
            findings.append(
                BillingFinding(
                    billing_import=billing_import,
                    kind=FindingKind.AMBIGUOUS,
                    provider_request_id=record.request_id,
                    line=record.line,
                    detail=f"billed {record.input_tokens}/{record.output_tokens}; {len(calls)} calls of ours "
                    "carry this id: left for a person",
                )
            )
            continue
        reservation = calls[0] if calls else None
        if reservation is None:
            findings.append(
                BillingFinding(
                    billing_import=billing_import,
                    kind=FindingKind.EXTRA,
                    provider_request_id=record.request_id,
                    line=record.line,
                    detail="billed request with no reservation of ours",
                )
            )
            continue
        # settle_from_evidence itself leaves a dispatched call alone while its gateway's lease is live.
        if reservation.state in OPEN_AFTER_DISPATCH:
            evidence = settlement.Evidence(
                settlement.EvidenceKind.COMPLETED,
                record.input_tokens,
                record.output_tokens,
                source=f"billing import {billing_import.pk}",
            )
            if settlement.settle_from_evidence(
                reservation_id=reservation.pk, fence=None, evidence=evidence, now=now
            ):
                findings.append(
                    BillingFinding(
                        billing_import=billing_import,
                        kind=FindingKind.SETTLED,
                        provider_request_id=record.request_id,
                        line=record.line,
                        detail=f"settled at billed {record.input_tokens}/{record.output_tokens}",
                    )
                )
                continue
            reservation.refresh_from_db()
        ours = (reservation.input_consumed, reservation.captured + reservation.overrun)
        billed = (record.input_tokens, record.output_tokens)
        kind = FindingKind.MATCHED if ours == billed else FindingKind.MISMATCH
        findings.append(
            BillingFinding(
                billing_import=billing_import,
                kind=kind,
                provider_request_id=record.request_id,
                line=record.line,
                detail=f"billed {billed[0]}/{billed[1]}, settled {ours[0]}/{ours[1]} ({reservation.state})",
            )
        )
    return findings


def _live_provider_ids(provider_request_ids: list[str]) -> set[str]:
    return set(
        Reservation.objects.filter(
            provider_request_id__in=provider_request_ids,
            state__in=[State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED],
            lease_expires_at__gt=read_db_now(),
        ).values_list("provider_request_id", flat=True)
    )


def _report_missing(
    billing_import: BillingImport,
    records: Sequence[RequestBillingRecord],
    findings: list[BillingFinding],
    *,
    deferred: set[str],
) -> None:
    if not records:
        return
    start = min(r.start_time for r in records)
    end = max(r.start_time for r in records)
    billed = set(BilledRequest.objects.values_list("provider_request_id", flat=True))
    dispatched = (
        Reservation.objects.filter(dispatched_at__gte=start, dispatched_at__lte=end)
        .exclude(provider_request_id="")
        .values_list("provider_request_id", "outcome")
    )
    for provider_request_id, outcome in dispatched:
        # A call whose gateway still holds its lease was left for a later export, billed or not.
        if (
            provider_request_id not in billed
            and provider_request_id not in deferred
            and outcome != "RELEASED"
        ):
            findings.append(
                BillingFinding(
                    billing_import=billing_import,
                    kind=FindingKind.MISSING,
                    provider_request_id=provider_request_id,
                    detail="dispatched in the export's period but not billed",
                )
            )


def fetch_and_import(*, now: datetime) -> dict[str, int]:
    """Fetch what each pool's provider bills and import it; a report seen before (same digest) is no news.

    Simulator pools: the per-request and hourly bucket exports (JSONL). OpenAI and Anthropic pools: the usage
    (and cost) reports of the last two days through the provider's API, only once the pool names an admin key
    that is set — until then their import is off and files saved from the provider are imported by hand.
    """
    totals = {"imports": 0, "unchanged": 0, "failed": 0}
    for pool in ModelPool.objects.exclude(provider_base_url=""):
        for text, fmt, label in _fetch(pool, now, totals):
            try:
                result = import_export(text=text, fmt=fmt, source=f"pool {pool.slug} ({label})", now=now)
            except ExportRefused as refused:
                logger.warning("billing export of pool %s refused: %s", pool.slug, refused.detail)
                totals["failed"] += 1
                continue
            totals["imports" if result.created else "unchanged"] += 1
    return totals


def _fetch(
    pool: ModelPool, now: datetime, totals: dict[str, int]
) -> list[tuple[str, BillingExportFormat, str]]:
    if pool.adapter == "simulator":
        fetched: list[tuple[str, BillingExportFormat, str]] = []
        for granularity in ("request", "bucket"):
            url = (
                f"{pool.provider_base_url.rstrip('/')}/v1/billing/export?format=jsonl"
                f"&granularity={granularity}&bucket=1h"
            )
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    fetched.append((response.read().decode("utf-8"), "jsonl", granularity))
            except (OSError, UnicodeDecodeError) as exc:
                logger.warning("billing export of pool %s unavailable: %s", pool.slug, exc)
                totals["failed"] += 1
        return fetched
    adapter = registry.build(pool_provider(pool))
    feeds = registry.usage_feeds(adapter) if adapter is not None else []
    if not feeds:
        logger.info("usage import of pool %s is off: it names no admin key that is set", pool.slug)
        return []
    hour = now.replace(minute=0, second=0, microsecond=0)
    start, end = hour - timedelta(days=2), hour + timedelta(hours=1)
    fetched = []
    for feed, pages in feeds:
        try:
            fetched.append((json.dumps(pages(start, end), sort_keys=True), feed.fmt, feed.label))
        except registry.FETCH_ERRORS as exc:
            logger.warning("%s of pool %s unavailable: %s", feed.label, pool.slug, exc)
            totals["failed"] += 1
    return fetched
