"""How a replay explains a recorded admission: the header, the ladder's steps and what each removed, and what
was held and released (SPEC §7)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from budgeting.admission.models import Manifest
from budgeting.catalog.models import RolloutMode
from ledger.models import LedgerEntry, Reservation

# A tampered or damaged record can differ everywhere; the first ones are enough to see what happened.
MAX_DIFFERENCES = 40
_VALUE_CHARS = 160
AMOUNT_FIELDS: tuple[tuple[str, str], ...] = (
    ("input_reserved", "input reserved"),
    ("output_reserved", "output reserved"),
    ("input_consumed", "input consumed"),
    ("output_consumed", "output consumed"),
    ("in_flight", "in flight"),
)


def mapping(value: object) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _ids(values: object) -> str:
    return ", ".join(str(value) for value in values) if isinstance(values, list) and values else "nothing"


def header(manifest: Manifest, record: dict[str, Any]) -> list[str]:
    locked = mapping(record.get("lockedRevisions"))
    requested = locked.get("requestedModel") or manifest.model_revision.name
    answered = mapping(record.get("model")).get("id") or manifest.model_revision.name
    model = str(answered) if answered == requested else f"{answered} (requested {requested})"
    return [
        f"Manifest {manifest.pk}: request {manifest.request_id} of tenant {manifest.tenant.slug}, task class "
        f"{manifest.task_class.slug}, pool {manifest.model_pool.slug}, mode {manifest.mode}, recorded "
        f"{manifest.created_at:%Y-%m-%d %H:%M:%S} UTC.",
        f"Locked: policy r{manifest.policy_revision}, model {model}, tokenizer {manifest.tokenizer_digest}, "
        f"template {locked.get('templateRevision')}, estimator {locked.get('estimator')}.",
    ]


def explain(record: dict[str, Any]) -> list[str]:
    """Why it was admitted or rejected, the rung, and what each step removed (from the record)."""
    lines: list[str] = []
    steps = [mapping(step) for step in record.get("steps") or [] if isinstance(step, Mapping)]
    tokens = mapping(record.get("tokens"))
    total, method = tokens.get("total"), record.get("countMethod")
    budget, rung = record.get("budget"), record.get("rung")
    first = steps[0].get("tokensBefore") if steps else total
    excluded = [mapping(item) for item in record.get("excluded") or [] if isinstance(item, Mapping)]
    if excluded:
        lines.append(
            "Excluded before counting (not permitted by the authorization scope): "
            + ", ".join(str(item.get("id")) for item in excluded)
            + "."
        )
    model = mapping(record.get("model")).get("id")
    original = record.get("originalModelId") or model
    if record.get("admitted"):
        if rung == "FULL":
            lines.append(
                f"Admitted at FULL: {total} input tokens ({method}) fit the input budget of {budget} "
                f"(max output {record.get('maxOutput')}); nothing was degraded."
            )
        elif model != original:
            lines.append(
                f"Admitted degraded at rung {rung}: the FULL request counted {first} input tokens "
                f"({method}), over {original}'s input budget; after {len(steps)} ladder steps it "
                f"counted {total} on {model}, within that model's input budget of {budget}."
            )
        else:
            lines.append(
                f"Admitted degraded at rung {rung}: the FULL request counted {first} input tokens "
                f"({method}), over the input budget of {budget}; after {len(steps)} ladder steps it "
                f"counted {total}, within the budget."
            )
        if record.get("detail"):
            lines.append(f"Note: {record.get('detail')}.")
    else:
        lines.append(f"Rejected ({record.get('code')}): {record.get('detail')}.")
        needed = record.get("minimumTokensNeeded")
        if needed is not None:
            lines.append(
                f"Even hard buckets, trusted state and the minimum evidence set need {needed} input tokens; "
                f"the budget is {budget}."
            )
        tried = record.get("rungsTried")
        if tried:
            lines.append(f"Rungs tried: {_ids(tried)}.")
        if record.get("recommendations"):
            lines.append(f"Recommendations: {_ids(record.get('recommendations'))}.")
    for number, step in enumerate(steps, 1):
        parts = [f"removed {_ids(step.get('removedIds'))}"]
        if step.get("replacedIds"):
            parts.append(f"replaced turns {_ids(step.get('replacedIds'))}")
        if step.get("addedIds"):
            parts.append(f"added {_ids(step.get('addedIds'))}")
        lines.append(
            f"Step {number} {step.get('rung')} on {step.get('modelId')}: {'; '.join(parts)}; tokens "
            f"{step.get('tokensBefore')} → {step.get('tokensAfter')} ({step.get('reason')})."
        )
        for candidate in step.get("candidates") or []:
            c = mapping(candidate)
            verdict = (
                f"failed {_ids(c.get('failed'))}"
                if c.get("failed")
                else f"counted {c.get('tokens')} against a budget of {c.get('budget')}"
            )
            lines.append(f"  candidate {c.get('modelId')}: {verdict}.")
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for item in record.get("removed") or []:
        removed = mapping(item)
        detail = f" ({removed.get('detail')})" if removed.get("detail") else ""
        key = (str(removed.get("rung")), str(removed.get("reason")), str(removed.get("bucket")))
        groups[key].append(f"{removed.get('id')}{detail}")
    for (removed_at, reason, bucket), ids in groups.items():
        lines.append(f"Removed at {removed_at} ({reason}), {bucket}: {', '.join(ids)}.")
    buckets = mapping(record.get("components"))
    if buckets:
        changed = sorted(name for name, entry in buckets.items() if _digest_changed(entry))
        lines.append(
            f"Hard-bucket changes: {record.get('hardBucketChanges')}; buckets changed: "
            f"{', '.join(changed) or 'none'}."
        )
    return lines


def _digest_changed(entry: object) -> bool:
    data = mapping(entry)
    return data.get("digestBefore") != data.get("digestAfter")


def _amounts(entry: LedgerEntry) -> str:
    parts = [f"{label} {getattr(entry, name):+d}" for name, label in AMOUNT_FIELDS if getattr(entry, name)]
    return ", ".join(parts) or "no amounts"


def resources(manifest: Manifest, record: dict[str, Any]) -> list[str]:
    """Which accounts the manifest's reservations held, posted, released and corrected, with amounts."""
    if manifest.mode == RolloutMode.SHADOW:
        return ["Capacity: shadow mode, the decision was recorded and nothing was held or released."]
    reservations = list(Reservation.objects.filter(manifest=manifest).order_by("created_at"))
    if not reservations:
        if record.get("admitted"):
            return ["Capacity: no reservation was made for this manifest (nothing was held)."]
        return ["Capacity: rejected, so nothing was held."]
    lines: list[str] = []
    for reservation in reservations:
        outcome = f", outcome {reservation.outcome}" if reservation.outcome else ""
        lines.append(
            f"Reservation {reservation.pk}: state {reservation.state}{outcome}; input "
            f"{reservation.input_reserved}, output {reservation.output_reserved} (+{reservation.top_ups} "
            f"top-ups), captured {reservation.captured}, released {reservation.released}."
        )
        entries = list(
            LedgerEntry.objects.filter(reservation=reservation)
            .select_related("account__tenant", "account__task_class", "account__pool")
            .order_by("id")
        )
        if not entries:
            lines.append(
                "  no ledger entries: nothing held yet"
                + (" (queued)" if reservation.state == "PROPOSED" else "")
            )
            continue
        net: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(("input", "output", "slots"), 0))
        by_kind: dict[str, list[str]] = defaultdict(list)
        for entry in entries:
            account = str(entry.account)
            reason = f" ({entry.reason})" if entry.reason else ""
            lines.append(f"  {entry.kind} on {account}: {_amounts(entry)}{reason}")
            if account not in by_kind[entry.kind]:
                by_kind[entry.kind].append(account)
            held = net[account]
            held["input"] += entry.input_reserved
            held["output"] += entry.output_reserved
            held["slots"] += entry.in_flight
        for kind, verb in (
            ("HOLD", "Held"),
            ("POST", "Posted"),
            ("RELEASE", "Released"),
            ("CORRECTION", "Corrected"),
        ):
            if by_kind.get(kind):
                lines.append(f"  {verb} on: {'; '.join(sorted(by_kind[kind]))}.")
        still = [
            f"{account} (input {held['input']}, output {held['output']}, concurrency {held['slots']})"
            for account, held in net.items()
            if any(held.values())
        ]
        lines.append("  Still held: " + ("; ".join(still) if still else "nothing") + ".")
    return lines
