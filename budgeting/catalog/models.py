"""The catalog: tenants, task classes, model pools and revisions, tokenizers, service clients, policies."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.db.models import Q

from ladder import families, templates

CAPABILITIES = {"tools", "json_schema", "vision"}
"""What a model revision may declare it supports."""
TEMPLATE_FAMILIES = set(templates.TEMPLATE_FAMILIES)
"""The chat-template families ``ladder.templates`` renders."""
TOKENIZER_FAMILY_CHOICES = [
    (name, families.FAMILIES[name].description) for name in families.TOKENIZER_FAMILIES
]
"""The tokenizer families ``ladder.families`` can load (a new one is a migration of the choices)."""


class RolloutMode(models.TextChoices):
    SHADOW = "SHADOW", "Shadow (decide and record, hold nothing)"
    ENFORCE = "ENFORCE", "Enforce"


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    internal = models.BooleanField(default=False)
    rollout_mode = models.CharField(max_length=8, choices=RolloutMode.choices, default=RolloutMode.SHADOW)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class TaskClass(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=300, blank=True)
    max_output_cap = models.PositiveIntegerField(help_text="Server-side cap on output tokens per request.")
    input_cap = models.PositiveIntegerField(help_text="Cap on input tokens per request.")
    queue_allowed = models.BooleanField(default=False)
    queue_deadline_seconds = models.PositiveIntegerField(default=60)
    ramp_percent = models.PositiveSmallIntegerField(
        default=100, help_text="Share of ENFORCE traffic (stable hash of requestId) that holds capacity."
    )
    tenant_account_defaults = models.JSONField(
        null=True,
        blank=True,
        help_text="Limits for a tenant × task-class account created on a tenant's first request "
        '({"period": "MONTH", "inputLimit": n, "outputLimit": n, "concurrencyLimit": n}).',
    )

    class Meta:
        ordering = ["slug"]
        verbose_name_plural = "task classes"
        constraints = [
            models.CheckConstraint(condition=Q(max_output_cap__gt=0), name="taskclass_output_cap_positive"),
            models.CheckConstraint(condition=Q(input_cap__gt=0), name="taskclass_input_cap_positive"),
            models.CheckConstraint(condition=Q(ramp_percent__lte=100), name="taskclass_ramp_percent_le_100"),
        ]

    def __str__(self) -> str:
        return self.slug


class Provider(models.TextChoices):
    SIMULATOR = "simulator", "Provider simulator"
    OPENAI = "openai", "OpenAI"
    ANTHROPIC = "anthropic", "Anthropic"


class ProviderAdapter(models.TextChoices):
    """How the reconciler reads a pool's provider (``reconciliation.providers.registry`` builds each one)."""

    SIMULATOR = "simulator", "Simulator: lookups by our request id, 'not found' vouched for"
    OPENAI = "openai", "OpenAI: stored chat completions and Responses by id; usage and costs import"
    ANTHROPIC_BATCHES = "anthropic-batches", "Anthropic Message Batches: results by batch; usage report"
    ANTHROPIC_MESSAGES = "anthropic-messages", "Anthropic Messages: no lookup (cannot vouch); usage report"


class ModelPool(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    region = models.CharField(max_length=32)
    provider_base_url = models.CharField(
        max_length=300,
        blank=True,
        help_text="Base URL of the provider adapter used for lookups (simulator or real).",
    )
    provider = models.CharField(max_length=16, choices=Provider.choices, default=Provider.SIMULATOR)
    adapter = models.CharField(
        max_length=24,
        choices=ProviderAdapter.choices,
        default=ProviderAdapter.SIMULATOR,
        help_text="What the reconciler may prove through this provider; recorded on each call at dispatch.",
    )
    api_key_env = models.CharField(
        max_length=64,
        blank=True,
        help_text="Name of the environment variable holding the API key lookups use (never the key itself).",
    )
    admin_key_env = models.CharField(
        max_length=64,
        blank=True,
        help_text="Name of the environment variable holding the organization admin key; the usage and cost "
        "import from the provider's API is off until it is set.",
    )
    max_call_seconds = models.PositiveIntegerField(
        default=600,
        help_text="The longest a provider call of this pool can run. A call whose lease expired and that was "
        "dispatched longer ago than this cannot still be running: its concurrency slot is released (SPEC §5) "
        "while its tokens stay held until evidence.",
    )

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=Q(provider="simulator", adapter="simulator")
                | Q(provider="openai", adapter="openai")
                | Q(provider="anthropic", adapter__in=["anthropic-batches", "anthropic-messages"]),
                name="modelpool_adapter_of_its_provider",
            )
        ]

    def __str__(self) -> str:
        return self.slug


class Tokenizer(models.Model):
    name = models.CharField(max_length=100, unique=True)
    family = models.CharField(
        max_length=40,
        choices=TOKENIZER_FAMILY_CHOICES,
        help_text="How the file is read and which chat templates may frame it (ladder/families.py).",
    )
    source = models.CharField(max_length=300, help_text="Where the file came from (package and member).")
    file_name = models.CharField(max_length=200, help_text="File name under TOKENIZER_DIR.")
    digest = models.CharField(
        max_length=71, unique=True, help_text="sha256: + hex digest of the file's bytes."
    )
    nfkc = models.BooleanField(default=False, help_text="The tokenizer applies NFKC before BPE.")
    upper_bound_rule = models.CharField(
        max_length=20,
        blank=True,
        help_text="Proven upper bound used when counting is unavailable (empty: none).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(digest__regex=r"^sha256:[0-9a-f]{64}$"), name="tokenizer_digest_format"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.digest[:19]}…)"


class ImageFormula(models.TextChoices):
    TILES_512 = "tiles512", "85 + 170 per 512px tile"
    PIXELS_750 = "pixels750", "width × height / 750"


class Counter(models.TextChoices):
    """What counts a model revision's final payload (SPEC §4 "Counters"; ``countMethod`` follows from it)."""

    LOCAL = "local", "Its tokenizer (EXACT)"
    ANTHROPIC = "anthropic", "Anthropic count_tokens (PROVIDER_COUNT)"
    GEMINI = "gemini", "Gemini countTokens (PROVIDER_COUNT)"
    OPENAI = "openai", "OpenAI responses/input_tokens (PROVIDER_COUNT)"


class ModelRevision(models.Model):
    name = models.CharField(max_length=100, unique=True, help_text="model@YYYY-MM-DD")
    pools = models.ManyToManyField(ModelPool, related_name="revisions")
    tokenizer = models.ForeignKey(Tokenizer, on_delete=models.PROTECT, related_name="model_revisions")
    context_window = models.PositiveIntegerField()
    max_output = models.PositiveIntegerField()
    template_family = models.CharField(max_length=40)
    image_formula = models.CharField(
        max_length=16, choices=ImageFormula.choices, default=ImageFormula.TILES_512
    )
    capabilities = models.JSONField(default=list, help_text='Subset of ["tools", "json_schema", "vision"].')
    data_residency = models.CharField(max_length=32)
    safety_tier = models.PositiveSmallIntegerField(default=1)
    counter = models.CharField(
        max_length=16,
        choices=Counter.choices,
        default=Counter.LOCAL,
        help_text="Who counts the final payload: the tokenizer, or the provider's counting API through the "
        "pool's provider base URL and key (the tokenizer then only guides the ladder's walk).",
    )
    provider_model = models.CharField(
        max_length=100,
        blank=True,
        help_text="The model id the counting API is asked about (empty: the name before the @).",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(context_window__gt=0), name="modelrevision_window_positive"),
            models.CheckConstraint(condition=Q(max_output__gt=0), name="modelrevision_max_output_positive"),
            models.CheckConstraint(
                condition=Q(max_output__lt=models.F("context_window")),
                name="modelrevision_output_below_window",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ServiceClient(models.Model):
    # DRF's IsAuthenticated asks the authenticated principal this.
    is_authenticated = True

    name = models.CharField(max_length=100, unique=True)
    tenants = models.ManyToManyField(Tenant, related_name="service_clients", blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


def hash_token(raw: str) -> str:
    """API tokens are stored as their sha256; the raw value is shown once."""
    return hashlib.sha256(raw.encode()).hexdigest()


def new_token_value() -> str:
    return "tb_" + secrets.token_urlsafe(32)


class ApiToken(models.Model):
    client = models.ForeignKey(ServiceClient, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=100, blank=True, help_text="What the token is for: 'gateway eu-1'.")
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(
        max_length=12, help_text="First characters, to recognise a token without storing it."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="The API refuses the token from this time on (empty: never)."
    )
    last_used_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the API last accepted it, to the minute; copied from Redis by a beat task.",
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.client.name}:{self.prefix}…"


class PolicyState(models.TextChoices):
    DRAFT = "DRAFT", "Draft"
    VALIDATED = "VALIDATED", "Validated (immutable)"


class PolicyVersion(models.Model):
    revision = models.PositiveIntegerField(unique=True)
    state = models.CharField(max_length=10, choices=PolicyState.choices, default=PolicyState.DRAFT)
    document = models.JSONField()
    note = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    validated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-revision"]

    def __str__(self) -> str:
        return f"policy r{self.revision} ({self.state})"


class PolicyAlias(models.Model):
    name = models.SlugField(max_length=40, unique=True)
    version = models.ForeignKey(PolicyVersion, on_delete=models.PROTECT, related_name="+")
    previous = models.ForeignKey(
        PolicyVersion, on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    global_cap_floor = models.PositiveIntegerField(
        null=True, blank=True, help_text="Lower global per-request cap kept after a rollback."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "policy aliases"

    def __str__(self) -> str:
        return f"{self.name} → r{self.version.revision}"


# --- people's side: audit log, prices, temporary increases, reports -----------------------------------------


class ChangeRecord(models.Model):
    """One privileged change made by a person (or by the system on their behalf): append-only.

    A database trigger refuses UPDATE and DELETE (migration 0003), so the log cannot be edited from the admin
    or anywhere else.
    """

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey("auth.User", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    actor_username = models.CharField(
        "who", max_length=150, help_text="Kept even if the user is deleted; 'system' for scheduled work."
    )
    action = models.CharField(max_length=40, db_index=True)
    target_type = models.CharField(max_length=60, help_text="app_label.model of the changed object.")
    target_id = models.CharField(max_length=64)
    target_repr = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField()

    class Meta:
        ordering = ["-at", "-id"]
        default_permissions = ("view",)
        verbose_name = "change log entry"
        verbose_name_plural = "change log"
        indexes = [models.Index(fields=["target_type", "target_id"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.actor_username} {self.action} {self.target_repr}"


class Price(models.Model):
    """The price of a model revision from ``effective_from`` until the next row's ``effective_from``.

    One row per (model revision, start) makes overlapping periods impossible by construction. A price an
    admission used is immutable and a new one cannot start before an admission already made (triggers of
    migration budgeting 0017): a correction is a new row effective from now (``catalog.prices.add_price``).
    """

    model_revision = models.ForeignKey(ModelRevision, on_delete=models.PROTECT, related_name="prices")
    effective_from = models.DateTimeField(help_text="UTC; the price applies until the next row starts.")
    currency = models.CharField(max_length=3, default="USD", help_text="ISO 4217 code.")
    input_per_million = models.DecimalField(
        max_digits=14, decimal_places=6, help_text="Price of one million input tokens."
    )
    output_per_million = models.DecimalField(
        max_digits=14, decimal_places=6, help_text="Price of one million output tokens."
    )
    cached_input_per_million = models.DecimalField(
        max_digits=14,
        decimal_places=6,
        null=True,
        blank=True,
        help_text="Price of one million cached input tokens; empty means the input price.",
    )
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_revision__name", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model_revision", "effective_from"], name="price_unique_start"),
            models.CheckConstraint(
                condition=Q(input_per_million__gte=0)
                & Q(output_per_million__gte=0)
                & (Q(cached_input_per_million__isnull=True) | Q(cached_input_per_million__gte=0)),
                name="price_non_negative",
            ),
            models.CheckConstraint(condition=Q(currency__regex=r"^[A-Z]{3}$"), name="price_currency_iso"),
        ]

    def __str__(self) -> str:
        return f"{self.model_revision} from {self.effective_from:%Y-%m-%d}"


class TemporaryIncrease(models.Model):
    """Extra limit granted on a capacity account until ``expires_at``: tokens, concurrent requests, and spend
    (micro-units of the account's currency).

    Granting adds the amounts to the account's limits; expiry or revocation subtracts them again
    (``ledger.services.limits``), so admission keeps reading one limit per dimension.
    """

    account = models.ForeignKey(
        "ledger.CapacityAccount", on_delete=models.PROTECT, related_name="temporary_increases"
    )
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    concurrency = models.IntegerField(default=0)
    spend = models.BigIntegerField(default=0, help_text="Micro-units of the account's currency.")
    starts_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    reason = models.TextField()
    created_by = models.CharField(max_length=150)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-starts_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(input_tokens__gte=0)
                & Q(output_tokens__gte=0)
                & Q(concurrency__gte=0)
                & Q(spend__gte=0),
                name="temporary_increase_non_negative",
            ),
            models.CheckConstraint(
                condition=Q(input_tokens__gt=0)
                | Q(output_tokens__gt=0)
                | Q(concurrency__gt=0)
                | Q(spend__gt=0),
                name="temporary_increase_not_empty",
            ),
            models.CheckConstraint(
                condition=Q(expires_at__gt=models.F("starts_at")), name="temporary_increase_expires_later"
            ),
        ]
        indexes = [models.Index(fields=["ended_at", "expires_at"])]

    def __str__(self) -> str:
        return (
            f"+{self.input_tokens}/{self.output_tokens}/{self.concurrency} until {self.expires_at:%Y-%m-%d}"
        )

    @property
    def active(self) -> bool:
        return self.ended_at is None


class CatalogVersion(models.Model):
    """One row whose ``version`` goes up in the same transaction as any change to the catalog, the policies,
    the service clients and their tokens, or which capacity accounts exist (database triggers, so every write
    path counts). Each process keeps a snapshot of the catalog and reloads it when the version moved."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    version = models.BigIntegerField(default=1)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="catalog_version_single_row")]

    def __str__(self) -> str:
        return f"catalog v{self.version}"


# The catalog version now, as a scalar subquery: the snapshot's version read and the reservation's read
# (``ledger.locks``, for an unchecked caller) both read it so.
CURRENT_VERSION_SQL = f"SELECT version FROM {CatalogVersion._meta.db_table} WHERE id = 1"
