"""Input and output serializers of the v1 API. Input fields never coerce: "12" is not 12 and true is not 1."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

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
    outputTokens = tokens()
    final = StrictBoolean()


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
