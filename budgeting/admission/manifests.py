"""Writes of the admission path that are not the ledger's: the decision manifests (SPEC §7)."""

from __future__ import annotations

from django.db import transaction

from budgeting.admission.models import Manifest


def record_manifest(*, manifest: Manifest) -> Manifest:
    """Store the replayable record of one admission decision, before anything is reserved for it."""
    with transaction.atomic(durable=True):
        manifest.save(force_insert=True)
    return manifest


def record_answer(*, manifest_id: int, answer: str) -> None:
    """Record what the caller was finally answered; ``decision`` keeps what the ladder decided."""
    with transaction.atomic(durable=True):
        Manifest.objects.filter(pk=manifest_id).update(answer=answer)
