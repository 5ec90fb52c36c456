"""The admission request as a typed value: what the API validated, handed inward (and rebuilt for replay)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class MalformedRequest(ValueError):
    """A stored or handed-in request does not have the admission envelope's shape."""


@dataclass(frozen=True)
class ClientEstimate:
    input_tokens: int


@dataclass(frozen=True)
class AdmissionRequest:
    """The envelope of ``POST /admissions`` (SPEC §8); ``components`` stay raw (the ladder parses them)."""

    request_id: str
    tenant_id: str
    task_class: str
    model_pool: str
    model_revision: str
    max_output: int
    components: Mapping[str, Any]
    tokenizer_digest: str | None = None
    prompt_bundle_digest: str | None = None
    policy_revision: int | None = None
    client_estimate: ClientEstimate | None = None
    provider_request_id: str | None = None
    """``dispatch.providerRequestId``: admit and record the dispatch in one call."""

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> AdmissionRequest:
        """From the camelCase body (already validated by the API, or stored in a manifest).
        Raises MalformedRequest when a field is missing or of the wrong type."""
        estimate = data.get("clientEstimate")
        dispatch = data.get("dispatch")
        request = cls(
            request_id=_str(data, "requestId"),
            tenant_id=_str(data, "tenantId"),
            task_class=_str(data, "taskClass"),
            model_pool=_str(data, "modelPool"),
            model_revision=_str(data, "modelRevision"),
            max_output=_int(data, "maxOutput"),
            components=_mapping(data, "components"),
            tokenizer_digest=_optional_str(data, "tokenizerDigest"),
            prompt_bundle_digest=_optional_str(data, "promptBundleDigest"),
            policy_revision=None if data.get("policyRevision") is None else _int(data, "policyRevision"),
            client_estimate=None
            if estimate is None
            else ClientEstimate(_int(_mapping(data, "clientEstimate"), "inputTokens")),
            provider_request_id=None
            if dispatch is None
            else _str(_mapping(data, "dispatch"), "providerRequestId"),
        )
        if request.max_output < 1:
            raise MalformedRequest("maxOutput must be at least 1")
        return request

    def fingerprint_fields(self) -> dict[str, object]:
        """The envelope fields an Idempotency-Key is bound to besides the payload (a retry repeats them)."""
        fields: dict[str, object] = {
            "requestId": self.request_id,
            "taskClass": self.task_class,
            "modelPool": self.model_pool,
            "modelRevision": self.model_revision,
            "maxOutput": self.max_output,
        }
        if self.provider_request_id is not None:
            # Only when given, so the digests of admissions without it stay what they were.
            fields["dispatch"] = {"providerRequestId": self.provider_request_id}
        return fields


def _str(data: Mapping[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise MalformedRequest(f"{name} must be a non-empty string")
    return value


def _optional_str(data: Mapping[str, Any], name: str) -> str | None:
    return None if data.get(name) is None else _str(data, name)


def _int(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedRequest(f"{name} must be an integer")
    return value


def _mapping(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name)
    if not isinstance(value, Mapping):
        raise MalformedRequest(f"{name} must be an object")
    return value
