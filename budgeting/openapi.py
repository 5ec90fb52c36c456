"""drf-spectacular post-processing: request bodies refuse unknown fields, as the API does."""

from __future__ import annotations

from typing import Any


def forbid_additional_request_properties(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result
