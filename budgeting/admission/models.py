"""The manifest: the replayable record of every admission decision (SPEC §7)."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import models

from budgeting.catalog.models import ModelPool, ModelRevision, RolloutMode, TaskClass, Tenant
from ladder.decision import CONTEXT_BUDGET_EXCEEDED, COUNTING_UNAVAILABLE, MINIMUM_EVIDENCE_UNAVAILABLE
from ladder.policy import RUNGS
from ledger.jsonfields import FastJSONEncoder, PackedJSONField


class Decision(models.TextChoices):
    """What the ladder decided (what a replay reproduces)."""

    ADMITTED = "ADMITTED"
    DEGRADED = "DEGRADED"
    CONTEXT_BUDGET_EXCEEDED = CONTEXT_BUDGET_EXCEEDED
    COUNTING_UNAVAILABLE = COUNTING_UNAVAILABLE
    MINIMUM_EVIDENCE_UNAVAILABLE = MINIMUM_EVIDENCE_UNAVAILABLE
    REJECTED = "REJECTED"


class Answer(models.TextChoices):
    """What the caller was finally answered."""

    RESERVED = "RESERVED"
    QUEUED = "QUEUED"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    PRICE_UNAVAILABLE = "PRICE_UNAVAILABLE"
    REPLAYED = "REPLAYED"
    SHADOW = "SHADOW"
    CONTEXT_BUDGET_EXCEEDED = CONTEXT_BUDGET_EXCEEDED
    COUNTING_UNAVAILABLE = COUNTING_UNAVAILABLE
    MINIMUM_EVIDENCE_UNAVAILABLE = MINIMUM_EVIDENCE_UNAVAILABLE
    REJECTED = "REJECTED"


def longest(values: Iterable[str]) -> int:
    """The column width that fits every value by construction (a code added later widens the column)."""
    return max(len(value) for value in values)


class Manifest(models.Model):
    """The replayable record of one admission decision (SPEC §7)."""

    request_id = models.CharField(max_length=128)
    # No index of its own: the (tenant, request_id) index leads with it.
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="manifests", db_index=False)
    task_class = models.ForeignKey(TaskClass, on_delete=models.PROTECT, related_name="+")
    model_pool = models.ForeignKey(ModelPool, on_delete=models.PROTECT, related_name="+")
    model_revision = models.ForeignKey(ModelRevision, on_delete=models.PROTECT, related_name="+")
    tokenizer_digest = models.CharField(max_length=71)
    policy_revision = models.PositiveIntegerField(null=True, blank=True)
    decision = models.CharField(max_length=longest(Decision.values), help_text="What the ladder decided.")
    answer = models.CharField(
        max_length=longest(Answer.values), blank=True, help_text="What the caller was finally answered."
    )
    rung = models.CharField(max_length=longest(RUNGS))
    mode = models.CharField(max_length=8, choices=RolloutMode.choices)
    rendered_digest = models.CharField(max_length=71)
    input_tokens = models.PositiveIntegerField()
    count_method = models.CharField(max_length=16)
    request = PackedJSONField(
        help_text="The admission request as received (components included) for replay.",
    )
    record = models.JSONField(
        encoder=FastJSONEncoder, help_text="Locked revisions, digests, per-component counts, ladder steps."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "request_id"]), models.Index(fields=["created_at"])]

    def __str__(self) -> str:
        return f"{self.request_id} {self.decision}/{self.rung}"
