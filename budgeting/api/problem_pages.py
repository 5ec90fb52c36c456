"""The pages the problems' ``type`` URIs name (``/problems/<code-lower-dashed>``): each code, its status, its
meaning."""

from __future__ import annotations

from dataclasses import dataclass

from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse

# Imported for the error classes they define: every code must be on the page, whichever module raises it.
from budgeting.admission import orchestrator  # noqa: F401
from budgeting.api import parsers  # noqa: F401
from budgeting.api.problems import _DRF_CODES, STATUS_BY_KIND, Problem, ServiceUnavailable
from budgeting.catalog import policies, snapshot  # noqa: F401
from budgeting.catalog.errors import Conflict, DomainError, InvalidInput, NotFound, Unavailable, Unprocessable
from ledger import errors  # noqa: F401
from ledger.errors import UsageEventConflict


@dataclass(frozen=True)
class Code:
    code: str
    status: int
    meaning: str

    @property
    def slug(self) -> str:
        return self.code.lower().replace("_", "-")


# Codes given where they are raised (``code=`` of a broader kind), with the kind that gives their status.
_RAISED_WITH_CODE: tuple[tuple[str, type[DomainError], int | None, str], ...] = (
    ("BODY_TOO_LARGE", Problem, 413, "The body is larger than the platform accepts."),
    ("NON_FINITE_NUMBER", Problem, None, "The JSON holds NaN or Infinity, which JSON does not allow."),
    ("INTEGER_OUT_OF_RANGE", Problem, None, "A JSON integer is too large to be exact."),
    ("DUPLICATE_KEY", Problem, None, "A JSON object names the same key twice."),
    ("INVALID_STRING", Problem, None, "A JSON string is not valid Unicode (e.g. a lone surrogate)."),
    ("NESTING_TOO_DEEP", Problem, None, "The JSON is nested deeper than the platform reads."),
    ("INTERNAL_ERROR", Problem, 500, "A bug on our side; the request id in the logs finds it."),
    ("METHOD_NOT_ALLOWED", Problem, 405, "The path does not answer this HTTP method."),
    ("REQUEST_TIMEOUT", Problem, 408, "The request was not sent in time (the front's limit)."),
    ("URI_TOO_LONG", Problem, 414, "The request line is longer than the server reads."),
    ("HEADERS_TOO_LARGE", Problem, 431, "The headers are larger than the server reads."),
    ("IDEMPOTENCY_KEY_REQUIRED", InvalidInput, None, "Admit needs an Idempotency-Key header (at most 200)."),
    ("INVALID_COMPONENTS", InvalidInput, None, "The request's components do not follow the format."),
    ("TENANT_NOT_FOUND", NotFound, None, "The tenant is unknown or not served to this client."),
    ("TASK_CLASS_NOT_FOUND", NotFound, None, "The tenant has no such task class."),
    ("MODEL_POOL_NOT_FOUND", NotFound, None, "No such model pool for this task class."),
    ("MODEL_REVISION_NOT_FOUND", NotFound, None, "The pool has no such model revision."),
    ("TOKENIZER_MISMATCH", Conflict, None, "The client's tokenizer digest is not the model's."),
    ("POLICY_REVISION_MISMATCH", Conflict, None, "The policy revision asked for is not the active one."),
    ("POLICY_NOT_DRAFT", Conflict, None, "Only a draft policy can be changed."),
    (
        "QUEUE_DEADLINE_PASSED",
        Conflict,
        None,
        "This key's request was queued and then rejected; use a new key.",
    ),
    (
        "PROVIDER_REQUEST_ID_IN_USE",
        Conflict,
        None,
        "Another reservation was dispatched with this provider id.",
    ),
    ("TOP_UP_CONFLICT", Conflict, None, "This top-up id was used with other values."),
    ("INPUT_ALREADY_REPORTED", UsageEventConflict, None, "Input tokens were already reported differently."),
    ("COUNTING_UNAVAILABLE", Unavailable, None, "Exact counting is unavailable and the policy rejects."),
    (
        "MINIMUM_EVIDENCE_UNAVAILABLE",
        Unprocessable,
        None,
        "The minimum evidence set does not fit the budget.",
    ),
    ("INVALID_REPORT_QUERY", InvalidInput, None, "A parameter of /api/v1/reports is not valid."),
)


def _status(kind: type[DomainError]) -> int:
    if issubclass(kind, Problem):
        return kind.status
    return next((STATUS_BY_KIND[k] for k in kind.__mro__ if k in STATUS_BY_KIND), 400)


def _meaning(kind: type[DomainError]) -> str:
    own_doc = kind.__dict__.get("__doc__")
    return (own_doc or kind.title).strip().split("\n")[0]


def _subclasses(kind: type[DomainError]) -> list[type[DomainError]]:
    found: list[type[DomainError]] = []
    for sub in kind.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def codes() -> dict[str, Code]:
    """Every problem code the platform answers, by its slug."""
    table: dict[str, Code] = {}
    kinds: list[type[DomainError]] = [DomainError, *_subclasses(DomainError)]
    for kind in kinds:
        if kind.code != DomainError.code and "code" in kind.__dict__:
            table.setdefault(kind.code, Code(kind.code, _status(kind), _meaning(kind)))
    table.setdefault(ServiceUnavailable.code, Code(ServiceUnavailable.code, 503, ServiceUnavailable.title))
    for exc, (code, title) in _DRF_CODES.items():
        table.setdefault(code, Code(code, int(getattr(exc, "status_code", 400)), title))
    for code, kind, status, meaning in _RAISED_WITH_CODE:
        table.setdefault(code, Code(code, status or _status(kind), meaning))
    return {c.slug: c for c in sorted(table.values(), key=lambda c: (c.status, c.code))}


def problem_page(request: HttpRequest, slug: str) -> HttpResponse:
    """``GET /problems/<slug>``: the code's status and meaning above the table of every code; unknown: 404."""
    table = codes()
    if slug not in table:
        raise Http404("no such problem code")
    return TemplateResponse(
        request, "problems/problem.html", {"problem": table[slug], "codes": table.values()}
    )
