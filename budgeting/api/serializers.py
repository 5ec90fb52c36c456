"""Input and output serializers of the v1 API. Input fields never coerce: "12" is not 12 and true is not 1."""

from __future__ import annotations

from typing import Any, get_args

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from ladder.counting import CountMethod

COUNT_METHODS = get_args(CountMethod)

MAX_TOKENS = 10_000_000
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,199}$"


class StrictInteger(serializers.IntegerField):
    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBoolean(serializers.BooleanField):
    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictString(serializers.CharField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictRegex(serializers.RegexField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


def tokens(**kwargs: Any) -> StrictInteger:
    return StrictInteger(min_value=0, max_value=MAX_TOKENS, **kwargs)


def identifier(**kwargs: Any) -> StrictRegex:
    return StrictRegex(ID_PATTERN, max_length=200, **kwargs)


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not declare."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        elif data is not None:
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        return super().to_internal_value(data)


class FenceIn(StrictSerializer):
    fence = StrictInteger(min_value=1, max_value=2**53 - 1)


class DispatchIn(FenceIn):
    providerRequestId = identifier()
    admittedDigest = StrictRegex(r"^sha256:[0-9a-f]{64}$")


class UsageIn(FenceIn):
    usageEventId = identifier()
    inputTokens = tokens(required=False, allow_null=True)
    cachedInputTokens = tokens(required=False, allow_null=True)
    outputTokens = tokens()
    final = StrictBoolean()


MAX_USAGE_REPORTS = 100


class UsageReportIn(UsageIn):
    """One report of ``POST /reservations:usage``: a usage call's body, with the reservation it is for."""

    reservationId = StrictRegex(r"^[0-9A-Za-z-]{1,64}$", max_length=64)


class UsageReportsIn(StrictSerializer):
    # DRF's stubs lack the length arguments that ``many=True`` hands its ListSerializer.
    usage = UsageReportIn(many=True, min_length=1, max_length=MAX_USAGE_REPORTS)  # type: ignore[call-arg]


class TopUpIn(FenceIn):
    topUpId = identifier()
    outputTokens = StrictInteger(min_value=1, max_value=MAX_TOKENS)


@extend_schema_field({"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["unknown"]}]})
class RequestSentField(serializers.Field):
    """``requestSent``: true, false or "unknown"."""

    def to_internal_value(self, data: Any) -> str:
        if data is True:
            return "yes"
        if data is False:
            return "no"
        if data == "unknown":
            return "unknown"
        raise serializers.ValidationError('must be true, false or "unknown"')

    def to_representation(self, value: Any) -> Any:
        return {"yes": True, "no": False}.get(value, "unknown")


class FailUsageIn(StrictSerializer):
    usageEventId = identifier()
    inputTokens = tokens(required=False, allow_null=True)
    outputTokens = tokens()


class FailIn(FenceIn):
    reason = StrictString(max_length=300)
    requestSent = RequestSentField()
    usage = FailUsageIn(required=False, allow_null=True)


class OutcomeIn(StrictSerializer):
    taskSuccess = StrictBoolean()
    citedEvidenceIds = serializers.ListField(child=identifier(), max_length=1000)


class ClientEstimateIn(StrictSerializer):
    inputTokens = tokens()


class DispatchAtAdmissionIn(StrictSerializer):
    providerRequestId = identifier(
        help_text="the id the gateway will send the provider call under (unique per tenant)"
    )


class AdmissionIn(StrictSerializer):
    """The envelope; ``components`` is validated by the pure ``ladder.components`` parser."""

    requestId = identifier()
    tenantId = identifier()
    taskClass = identifier()
    modelPool = identifier()
    modelRevision = identifier()
    tokenizerDigest = StrictRegex(r"^sha256:[0-9a-f]{64}$", required=False)
    promptBundleDigest = StrictRegex(r"^sha256:[0-9a-f]{1,64}$", required=False)
    policyRevision = StrictInteger(min_value=1, max_value=2**31 - 1, required=False)
    components = serializers.DictField()
    maxOutput = StrictInteger(min_value=1, max_value=MAX_TOKENS)
    clientEstimate = ClientEstimateIn(required=False)
    estimatorRevision = StrictString(max_length=100, required=False)
    dispatch = DispatchAtAdmissionIn(
        required=False,
        help_text="admit and record the dispatch in one call: a 201 answers state DISPATCHED (input posted "
        "as consumed); send the payload under this providerRequestId next, then report usage, or /fail "
        "with requestSent false if it was never sent. A queued (202) admission is not dispatched: call "
        "/dispatch once it is admitted.",
    )


# Output serializers: the views answer dicts built by the services; these classes only describe those bodies
# in the OpenAPI document. tests/api/test_openapi.py validates real answers against them, so a body that
# changes without its serializer fails there.


class TokensOut(serializers.Serializer):
    input = serializers.IntegerField(allow_null=True, help_text="counted input tokens (null if not counted)")
    maxOutput = serializers.IntegerField()
    buckets = serializers.DictField(child=serializers.IntegerField(), help_text="input tokens per bucket")


class BudgetOut(serializers.Serializer):
    input = serializers.IntegerField(allow_null=True)
    maxOutput = serializers.IntegerField()
    contextWindow = serializers.IntegerField()


class RemovedOut(serializers.Serializer):
    id = serializers.CharField()
    bucket = serializers.CharField()
    reason = serializers.CharField()
    rung = serializers.CharField(allow_null=True)
    detail = serializers.CharField(allow_blank=True)


class CandidateOut(serializers.Serializer):
    modelId = serializers.CharField()
    failed = serializers.ListField(child=serializers.CharField())
    tokens = serializers.IntegerField(allow_null=True)
    budget = serializers.IntegerField(allow_null=True)


class StepOut(serializers.Serializer):
    rung = serializers.CharField()
    removedIds = serializers.ListField(child=serializers.CharField())
    replacedIds = serializers.ListField(child=serializers.CharField())
    addedIds = serializers.ListField(child=serializers.CharField())
    reason = serializers.CharField(allow_blank=True)
    tokensBefore = serializers.IntegerField()
    tokensAfter = serializers.IntegerField()
    modelId = serializers.CharField()
    candidates = CandidateOut(many=True)


class ClientEstimateOut(serializers.Serializer):
    inputTokens = serializers.IntegerField()
    deviation = serializers.IntegerField(allow_null=True, help_text="client estimate minus our count")


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "additionalProperties": {}}},
        ],
        "nullable": True,
        "description": "one string (a text-only message, for the template families that send it so), the "
        "content parts (text, image placeholders), or null (an assistant turn that only calls tools)",
    }
)
class MessageContentField(serializers.Field):
    """A payload message's ``content``, as the model revision's template family sends it."""

    def to_representation(self, value: Any) -> Any:
        return value


class MessageOut(serializers.Serializer):
    role = serializers.CharField()
    content = MessageContentField()


class PayloadOut(serializers.Serializer):
    """The provider payload to send (OpenAI chat-completions shape)."""

    messages = MessageOut(many=True)
    tools = serializers.ListField(child=serializers.DictField(), required=False)
    model = serializers.CharField()
    max_tokens = serializers.IntegerField()


class DecisionOut(serializers.Serializer):
    """The ladder's decision, as admit and count answer it."""

    requestId = serializers.CharField()
    decision = serializers.CharField(help_text="ADMITTED, DEGRADED, or the rejection's code")
    fits = serializers.BooleanField()
    rung = serializers.CharField(allow_null=True)
    tokens = TokensOut()
    countMethod = serializers.ChoiceField(
        choices=COUNT_METHODS,
        allow_null=True,
        help_text="EXACT: the model's tokenizer, proven equal to the vendor's; UPPER_BOUND: an approved "
        "bound that never undercounts; PROVIDER_COUNT: the provider's counting API counted the final payload "
        "(its estimate, never called exact); null: nothing was counted",
    )
    renderedDigest = serializers.CharField(help_text="digest of the full (not degraded) payload")
    budget = BudgetOut()
    modelRevision = serializers.CharField()
    removed = RemovedOut(many=True)
    excluded = RemovedOut(many=True)
    admittedDigest = serializers.CharField(allow_null=True, help_text="digest of the payload to send")
    tokenizerDigest = serializers.CharField()
    policyRevision = serializers.IntegerField()
    steps = StepOut(many=True)
    clientEstimate = ClientEstimateOut(allow_null=True)
    code = serializers.CharField(required=False, allow_null=True, help_text="only when it does not fit")
    detail = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    minimumTokensNeeded = serializers.IntegerField(required=False, allow_null=True)
    rungsTried = serializers.ListField(child=serializers.CharField(), required=False)
    recommendations = serializers.ListField(child=serializers.CharField(), required=False)


class CountOut(DecisionOut):
    payload = PayloadOut(required=False, help_text="only with ?include=payload")


class ReservedOut(serializers.Serializer):
    input = serializers.IntegerField()
    output = serializers.IntegerField()
    concurrency = serializers.IntegerField()


class LeaseOut(serializers.Serializer):
    fence = serializers.IntegerField()
    expiresAt = serializers.DateTimeField(allow_null=True)


class AdmittedOut(DecisionOut):
    """201 (and 200 when an Idempotency-Key is replayed): admitted and reserved; send ``payload``."""

    payload = PayloadOut()
    mode = serializers.CharField()
    reservationId = serializers.UUIDField()
    state = serializers.CharField()
    reserved = ReservedOut()
    lease = LeaseOut()
    manifestId = serializers.IntegerField(allow_null=True)
    providerRequestId = serializers.CharField(
        required=False, help_text="with `dispatch`: the dispatch is recorded (state DISPATCHED)"
    )


class ProblemOut(serializers.Serializer):
    """RFC 9457 problem details; a problem may carry further fields of its own."""

    type = serializers.CharField(help_text="a page documenting the code: /problems/<code>")
    title = serializers.CharField()
    status = serializers.IntegerField()
    code = serializers.CharField()
    detail = serializers.CharField(allow_blank=True)


class ShadowOut(DecisionOut):
    """200 in SHADOW mode: the decision is recorded, nothing is held, the request goes unchanged."""

    mode = serializers.CharField()
    manifestId = serializers.IntegerField()
    payload = PayloadOut()
    note = serializers.CharField()
    wouldReject = ProblemOut(required=False, help_text="the problem ENFORCE would have answered")


class QueuedOut(serializers.Serializer):
    """202: waiting in the queue; poll ``poll`` after Retry-After seconds."""

    reservationId = serializers.UUIDField()
    state = serializers.CharField()
    queuePosition = serializers.IntegerField(allow_null=True)
    queueDeadline = serializers.DateTimeField(allow_null=True)
    poll = serializers.CharField()
    reason = serializers.CharField(allow_blank=True, allow_null=True)
    manifestId = serializers.IntegerField(allow_null=True)


class InputOut(serializers.Serializer):
    reserved = serializers.IntegerField()
    consumed = serializers.IntegerField()
    reported = serializers.IntegerField(allow_null=True)


class OutputOut(serializers.Serializer):
    reserved = serializers.IntegerField()
    topUps = serializers.IntegerField()
    captured = serializers.IntegerField()
    remaining = serializers.IntegerField()
    released = serializers.IntegerField()
    overrun = serializers.IntegerField()


class UsageEventOut(serializers.Serializer):
    usageEventId = serializers.CharField()
    inputTokens = serializers.IntegerField(allow_null=True)
    outputTokens = serializers.IntegerField()
    final = serializers.BooleanField()
    captured = serializers.IntegerField()
    overrun = serializers.IntegerField()
    at = serializers.DateTimeField()


class LedgerEntryOut(serializers.Serializer):
    id = serializers.IntegerField()
    account = serializers.IntegerField()
    kind = serializers.CharField()
    inputReserved = serializers.IntegerField()
    outputReserved = serializers.IntegerField()
    inputConsumed = serializers.IntegerField()
    outputConsumed = serializers.IntegerField()
    inFlight = serializers.IntegerField()
    reason = serializers.CharField(allow_blank=True)
    at = serializers.DateTimeField()


class HoldOut(serializers.Serializer):
    account = serializers.IntegerField()
    scope = serializers.CharField()
    # The metaclass takes declared fields out of the class, so this does not shadow Field.label at run time.
    label = serializers.CharField()  # type: ignore[assignment]


class ManifestSummaryOut(serializers.Serializer):
    id = serializers.IntegerField()
    decision = serializers.CharField()
    rung = serializers.CharField(allow_null=True)
    policyRevision = serializers.IntegerField(allow_null=True)
    countMethod = serializers.ChoiceField(choices=COUNT_METHODS, allow_null=True, allow_blank=True)
    inputTokens = serializers.IntegerField(allow_null=True)


class PricesOut(serializers.Serializer):
    input = serializers.DecimalField(max_digits=14, decimal_places=6)
    cachedInput = serializers.DecimalField(max_digits=14, decimal_places=6)
    output = serializers.DecimalField(max_digits=14, decimal_places=6)


class SpendOut(serializers.Serializer):
    """Money as decimal text of ``currency`` (stored in integer micro-units), at the prices frozen at
    admission: ``reserved`` = ``captured`` + ``remaining`` + ``released``; ``cost`` = ``captured`` +
    ``overrun``."""

    currency = serializers.CharField()
    priceId = serializers.IntegerField(allow_null=True)
    pricePerMillion = PricesOut()
    cachedInputTokens = serializers.IntegerField()
    reserved = serializers.DecimalField(max_digits=20, decimal_places=6)
    captured = serializers.DecimalField(max_digits=20, decimal_places=6)
    remaining = serializers.DecimalField(max_digits=20, decimal_places=6)
    released = serializers.DecimalField(max_digits=20, decimal_places=6)
    overrun = serializers.DecimalField(max_digits=20, decimal_places=6)
    cost = serializers.DecimalField(max_digits=20, decimal_places=6)


class ReservationOut(serializers.Serializer):
    """A reservation (SPEC §8): what it holds, what was used, its lease, events, ledger entries and holds."""

    reservationId = serializers.UUIDField()
    requestId = serializers.CharField()
    tenantId = serializers.CharField()
    taskClass = serializers.CharField()
    modelPool = serializers.CharField()
    modelRevision = serializers.CharField()
    state = serializers.CharField()
    outcome = serializers.CharField(allow_null=True)
    mode = serializers.CharField()
    rung = serializers.CharField(allow_null=True)
    policyRevision = serializers.IntegerField(allow_null=True)
    input = InputOut()
    output = OutputOut()
    concurrencyHeld = serializers.BooleanField()
    spend = SpendOut(allow_null=True)
    providerRequestId = serializers.CharField(allow_null=True)
    admittedDigest = serializers.CharField(allow_null=True, allow_blank=True)
    lease = LeaseOut()
    failureReason = serializers.CharField(allow_null=True)
    usageEvents = UsageEventOut(many=True)
    ledgerEntries = LedgerEntryOut(many=True)
    holds = HoldOut(many=True)
    manifestId = serializers.IntegerField(allow_null=True)
    manifest = ManifestSummaryOut(allow_null=True)
    createdAt = serializers.DateTimeField()
    dispatchedAt = serializers.DateTimeField(allow_null=True)
    settledAt = serializers.DateTimeField(allow_null=True)
    updatedAt = serializers.DateTimeField()


class LifecycleOut(serializers.Serializer):
    """A lifecycle call's answer: the reservation's state, amounts and lease as the call left them. The
    whole detail (usage events, ledger entries, holds, manifest) is ``GET /reservations/{id}``'s."""

    reservationId = serializers.UUIDField()
    state = serializers.CharField()
    outcome = serializers.CharField(allow_null=True)
    input = InputOut()
    output = OutputOut()
    concurrencyHeld = serializers.BooleanField()
    providerRequestId = serializers.CharField(allow_null=True)
    lease = LeaseOut()
    failureReason = serializers.CharField(allow_null=True)


class LifecycleAppliedOut(LifecycleOut):
    applied = serializers.BooleanField(help_text="false when this event id was already recorded (a repeat)")


class UsageResultOut(serializers.Serializer):
    """What one report did: ``status`` 200 with the reservation as it left it, or the status and problem its
    own call would have answered."""

    reservationId = serializers.CharField()
    status = serializers.IntegerField(help_text="200, or the status of the report's problem")
    applied = serializers.BooleanField(required=False, help_text="present with status 200")
    state = serializers.CharField(required=False, help_text="present with status 200")
    problem = ProblemOut(required=False, help_text="present with any other status")


class UsageResultsOut(serializers.Serializer):
    results = UsageResultOut(many=True, help_text="one per report, in the order sent")


class EndpointsOut(serializers.Serializer):
    admit = serializers.CharField()
    count = serializers.CharField()
    reservation = serializers.CharField()
    lifecycle = serializers.ListField(child=serializers.CharField())
    usageReports = serializers.CharField()
    reports = serializers.CharField()


class IndexOut(serializers.Serializer):
    name = serializers.CharField()
    version = serializers.CharField()
    schema = serializers.CharField()
    authentication = serializers.CharField()
    endpoints = EndpointsOut()
