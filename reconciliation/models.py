"""Billing imports: what a provider's export said, and what we found comparing it with our ledger."""

from __future__ import annotations

from decimal import Decimal

from django.db import models


class BillingImport(models.Model):
    source = models.CharField(max_length=200, help_text="File name or task that supplied the export.")
    fmt = models.CharField(
        max_length=16, help_text="csv, jsonl, openai-usage, openai-costs, anthropic-usage or anthropic-costs"
    )
    content_sha256 = models.CharField(
        max_length=64,
        unique=True,
        help_text="Digest of the format and the normalised text: the same export twice is one import.",
    )
    records = models.PositiveIntegerField(default=0)
    settled = models.PositiveIntegerField(default=0)
    findings_count = models.PositiveIntegerField(default=0)
    period_start = models.DateTimeField(null=True, blank=True)
    period_end = models.DateTimeField(null=True, blank=True)
    imported_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-imported_at"]

    def __str__(self) -> str:
        return f"{self.source} ({self.imported_at:%Y-%m-%d %H:%M})"


class BilledRequest(models.Model):
    """One per-request billing record; a provider request is billed once across all imports."""

    billing_import = models.ForeignKey(
        BillingImport, on_delete=models.PROTECT, related_name="billed_requests"
    )
    provider_request_id = models.CharField(max_length=200, unique=True)
    model = models.CharField(max_length=100)
    input_tokens = models.BigIntegerField()
    output_tokens = models.BigIntegerField()
    start_time = models.DateTimeField()
    line = models.PositiveIntegerField()

    class Meta:
        ordering = ["start_time"]

    def __str__(self) -> str:
        return f"{self.provider_request_id}: {self.input_tokens}/{self.output_tokens}"


class BucketDrift(models.Model):
    """Billed usage of one model in one UTC time bucket next to what we captured for it."""

    billing_import = models.ForeignKey(BillingImport, on_delete=models.PROTECT, related_name="buckets")
    model = models.CharField(max_length=100)
    api_key_id = models.CharField(max_length=100, blank=True)
    bucket_start = models.DateTimeField()
    bucket_end = models.DateTimeField()
    billed_input = models.BigIntegerField()
    billed_output = models.BigIntegerField()
    captured_input = models.BigIntegerField()
    captured_output = models.BigIntegerField()

    class Meta:
        ordering = ["bucket_start", "model"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "api_key_id", "bucket_start", "bucket_end"],
                name="bucket_drift_unique_bucket",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.bucket_start:%Y-%m-%d %H:%M}"

    @property
    def drift_input(self) -> int:
        return self.billed_input - self.captured_input

    @property
    def drift_output(self) -> int:
        return self.billed_output - self.captured_output


class BilledCost(models.Model):
    """What one cost line (line item, project, API key) of one time bucket was charged, as last reported."""

    billing_import = models.ForeignKey(BillingImport, on_delete=models.PROTECT, related_name="costs")
    line_item = models.CharField(max_length=200, blank=True)
    project_id = models.CharField(max_length=100, blank=True)
    api_key_id = models.CharField(max_length=100, blank=True)
    currency = models.CharField(max_length=8)
    bucket_start = models.DateTimeField()
    bucket_end = models.DateTimeField()
    amount = models.DecimalField(max_digits=20, decimal_places=8)

    class Meta:
        ordering = ["bucket_start", "line_item"]
        constraints = [
            models.UniqueConstraint(
                fields=["line_item", "project_id", "api_key_id", "currency", "bucket_start", "bucket_end"],
                name="billed_cost_unique_line",
            )
        ]

    def __str__(self) -> str:
        return f"{self.line_item or 'total'} {self.bucket_start:%Y-%m-%d}: {self.amount} {self.currency}"


class CostDimension(models.TextChoices):
    MODEL = "MODEL", "Model revision"
    ACCOUNT = "ACCOUNT", "Capacity account"


class CostDrift(models.Model):
    """Billed cost next to our settled cost (what the ledger posted at the prices frozen on the reservations)
    for one model revision or one capacity account, in one currency: per request of an import that bills
    each request's cost (the bucket is then the import's requests), or per UTC bucket of a cost report."""

    billing_import = models.ForeignKey(BillingImport, on_delete=models.PROTECT, related_name="cost_drifts")
    dimension = models.CharField(max_length=8, choices=CostDimension.choices)
    key = models.CharField(max_length=200, help_text="The model revision's name or the account's label.")
    account = models.ForeignKey(
        "ledger.CapacityAccount", on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    currency = models.CharField(max_length=3)
    bucket_start = models.DateTimeField(null=True, blank=True)
    bucket_end = models.DateTimeField(null=True, blank=True)
    requests = models.PositiveIntegerField(default=0, help_text="Our reservations compared.")
    billed = models.DecimalField(max_digits=20, decimal_places=8)
    settled = models.DecimalField(max_digits=20, decimal_places=6)

    class Meta:
        ordering = ["billing_import", "dimension", "key"]
        constraints = [
            models.UniqueConstraint(
                fields=["billing_import", "dimension", "key", "currency", "bucket_start"],
                name="cost_drift_unique",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        return (
            f"{self.dimension.lower()} {self.key}: billed {self.billed} {self.currency}, ours {self.settled}"
        )

    @property
    def drift(self) -> Decimal:
        return self.billed - self.settled


class FindingKind(models.TextChoices):
    SETTLED = "SETTLED", "Settled a reservation at billed usage"
    MATCHED = "MATCHED", "Billed usage equals what we settled"
    MISMATCH = "MISMATCH", "Billed usage differs from what we settled"
    DUPLICATE = "DUPLICATE", "Duplicate line or request (not counted twice)"
    MISSING = "MISSING", "Dispatched by us, absent from the export"
    EXTRA = "EXTRA", "Billed, unknown to us"
    AMBIGUOUS = "AMBIGUOUS", "Billed id names calls of several tenants (left for a person)"
    BAD_LINE = "BAD_LINE", "Line could not be read"
    BUCKET_DRIFT = "BUCKET_DRIFT", "Bucket totals differ from what we captured"
    COST_DRIFT = "COST_DRIFT", "Billed cost differs from our settled cost"


class BillingFinding(models.Model):
    billing_import = models.ForeignKey(BillingImport, on_delete=models.PROTECT, related_name="findings")
    kind = models.CharField(max_length=12, choices=FindingKind.choices)
    provider_request_id = models.CharField(max_length=200, blank=True)
    line = models.PositiveIntegerField(null=True, blank=True)
    detail = models.CharField(max_length=500)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["kind"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.provider_request_id or self.line or ''}"
