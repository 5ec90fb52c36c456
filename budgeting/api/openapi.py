"""drf-spectacular additions: strict request bodies, the bearer scheme, the headers the API answers with, and
``/api/v1/reports`` (a plain Django view, for the people's side) in the served document."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}

RESPONSE_HEADERS: dict[str, dict[str, Any]] = {
    "Retry-After": {
        "description": "seconds to wait before asking again",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "Idempotent-Replayed": {
        "description": "`true` when this answer replays the first answer to the same Idempotency-Key",
        "schema": {"type": "string", "enum": ["true"]},
    },
    "Location": {"description": "the reservation: GET it to poll or inspect", "schema": _STRING},
}

# (operationId or "*", status) -> the headers that answer carries.
_HEADERS_BY_ANSWER: dict[tuple[str, str], tuple[str, ...]] = {
    ("admit", "200"): ("Idempotent-Replayed", "Location"),
    ("admit", "201"): ("Location",),
    ("admit", "202"): ("Retry-After", "Location", "Idempotent-Replayed"),
    ("*", "429"): ("Retry-After",),
    ("*", "503"): ("Retry-After",),
}


def forbid_additional_request_properties(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result


def declare_response_headers(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """drf-spectacular has no per-response headers in ``extend_schema``: they are added here by operation."""
    for item in result.get("paths", {}).values():
        for operation in item.values():
            for status, response in operation.get("responses", {}).items():
                names = _HEADERS_BY_ANSWER.get(
                    (operation["operationId"], status), ()
                ) or _HEADERS_BY_ANSWER.get(("*", status), ())
                if names:
                    response["headers"] = {name: RESPONSE_HEADERS[name] for name in names}
    return result


def _array_of(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "object", "properties": properties}}


_REPORT = {
    "type": "object",
    "required": ["query", "generatedAt", "totals", "usage"],
    "properties": {
        "query": {
            "type": "object",
            "properties": {name: _STRING for name in ("from", "to", "tenant", "taskClass", "pool")},
        },
        "generatedAt": {"type": "string", "format": "date-time"},
        "totals": {
            "type": "object",
            "properties": {
                "requests": _INTEGER,
                "inputTokens": _INTEGER,
                "outputTokens": _INTEGER,
                "cost": {"type": "object", "additionalProperties": _STRING, "description": "per currency"},
                "unpricedRequests": _INTEGER,
            },
        },
        "decisions": {
            "type": "object",
            "additionalProperties": _INTEGER,
            "description": "requests per decision",
        },
        "requestsPerRung": _array_of({"day": _STRING, "rung": _STRING, "requests": _INTEGER}),
        "deviationByModel": _array_of({"modelRevision": _STRING}),
        "deviationHistogram": _array_of({"bucket": _STRING, "requests": _INTEGER}),
        "qualityByRung": _array_of({"rung": _STRING}),
        "leaks": {"type": "object", "description": "reservations holding capacity past their lease"},
        "contextOverflows": _INTEGER,
        "settledVsBilled": _array_of({"modelRevision": _STRING}),
        "reconcilingBacklog": {"type": "object", "description": "reservations waiting for reconciliation"},
        "usage": _array_of({"day": _STRING, "tenant": _STRING, "taskClass": _STRING, "pool": _STRING}),
    },
}


def _report_parameters() -> list[dict[str, Any]]:
    described = {
        "from": "first day (YYYY-MM-DD)",
        "to": "last day included (YYYY-MM-DD)",
        "tenant": "a tenant's slug",
        "taskClass": "a task class's slug",
        "pool": "a model pool's slug",
    }
    parameters = [
        {"name": name, "in": "query", "required": False, "schema": _STRING, "description": text}
        for name, text in described.items()
    ]
    parameters.append(
        {
            "name": "format",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "enum": ["json", "csv", "focus"], "default": "json"},
            "description": "json: the whole report; csv: usage rows with cost; focus: usage as FOCUS columns",
        }
    )
    return parameters


def add_reports_path(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """``/api/v1/reports`` is a Django view signed in by the admin session, not a DRF view: described here."""
    problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemOut"}}}
    result.setdefault("components", {}).setdefault("securitySchemes", {})["adminSession"] = {
        "type": "apiKey",
        "in": "cookie",
        "name": "sessionid",
        "description": "a signed-in admin session with the analyst, finance or platform role",
    }
    result["components"].setdefault("schemas", {})["Report"] = _REPORT
    result.setdefault("paths", {})["/api/v1/reports"] = {
        "get": {
            "operationId": "getReport",
            "summary": "Usage, decisions and reconciliation report",
            "description": (
                "The analysts' report over a period: totals, requests per rung, estimate deviation, "
                "quality, leaks, context overflows, settled versus billed, the reconciling backlog and the "
                "usage rows. For people signed in to the admin (gateway tokens cannot read it); csv and "
                "focus are streamed."
            ),
            "tags": ["reports"],
            "parameters": _report_parameters(),
            "security": [{"adminSession": []}],
            "responses": {
                "200": {
                    "description": "the report",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Report"}},
                        "text/csv": {"schema": _STRING},
                    },
                },
                **{
                    str(status): {"description": text, "content": problem}
                    for status, text in (
                        (400, "a parameter is not valid"),
                        (401, "not signed in"),
                        (403, "no report role"),
                        (405, "only GET"),
                    )
                },
            },
        }
    }
    return result


class ServiceTokenScheme(OpenApiAuthenticationExtension):
    """Documents the gateway bearer token in the OpenAPI document."""

    target_class = "budgeting.api.auth.ServiceTokenAuthentication"
    name = "serviceToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "A service client's API token."}


# The served document's hooks (budgeting/urls.py): the enum hook of drf-spectacular, then ours.
POSTPROCESSING_HOOKS = [
    "drf_spectacular.hooks.postprocess_schema_enums",
    *(
        f"{__name__}.{hook.__name__}"
        for hook in (forbid_additional_request_properties, declare_response_headers, add_reports_path)
    ),
]
