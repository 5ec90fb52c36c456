"""drf-spectacular post-processing: request bodies refuse unknown fields, as the API does."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


def forbid_additional_request_properties(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result


class ServiceTokenScheme(OpenApiAuthenticationExtension):
    """Documents the gateway bearer token in the OpenAPI document."""

    target_class = "budgeting.api.auth.ServiceTokenAuthentication"
    name = "serviceToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "A service client's API token."}
