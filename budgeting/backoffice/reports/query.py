"""The report query: a period of UTC days and an optional scope, read from the request's parameters."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.db.models import Q

from budgeting.catalog.errors import InvalidInput
from budgeting.catalog.models import ModelPool, TaskClass, Tenant

# A SlugField's value (the catalog's slugs are at most 64 characters).
_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,64}")
DEFAULT_DAYS = 30
MAX_DAYS = 400


class ReportQueryInvalid(InvalidInput):
    code = "INVALID_REPORT_QUERY"
    title = "The report query is not valid"


@dataclass(frozen=True)
class ReportQuery:
    """A period [start, end) in UTC and an optional scope (slugs)."""

    start: datetime
    end: datetime
    tenant: str | None = None
    task_class: str | None = None
    pool: str | None = None

    @property
    def days(self) -> list[date]:
        first = self.start.date()
        count = (self.end - self.start + timedelta(seconds=86399)).days
        return [first + timedelta(days=i) for i in range(count)]

    def scope(self) -> Q:
        """The scope as a filter of manifests or reservations (both name the pool ``model_pool``)."""
        slugs = (
            ("tenant__slug", self.tenant),
            ("task_class__slug", self.task_class),
            ("model_pool__slug", self.pool),
        )
        return Q(**{lookup: slug for lookup, slug in slugs if slug})

    def as_params(self) -> dict[str, str]:
        """The query as the API's parameters (``to`` is the last day included)."""
        params = {
            "from": self.start.date().isoformat(),
            "to": (self.end - timedelta(seconds=1)).date().isoformat(),
        }
        for name, value in (("tenant", self.tenant), ("taskClass", self.task_class), ("pool", self.pool)):
            if value:
                params[name] = value
        return params


def _day(raw: str, name: str) -> date:
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise ReportQueryInvalid(f"{name} must be a date (YYYY-MM-DD)", field=name) from None


def parse_query(params: Mapping[str, str], *, today: date) -> ReportQuery:
    """Read ``from``/``to`` (inclusive UTC days; default the last 30 days) and the
    ``tenant``/``taskClass``/``pool`` slugs. Raises ReportQueryInvalid naming the parameter (bad date,
    reversed or too long period, unknown slug)."""
    last = _day(params["to"], "to") if params.get("to") else today
    first = _day(params["from"], "from") if params.get("from") else last - timedelta(days=DEFAULT_DAYS - 1)
    if first > last:
        raise ReportQueryInvalid("from is after to", field="from")
    if (last - first).days + 1 > MAX_DAYS:
        raise ReportQueryInvalid(f"a report covers at most {MAX_DAYS} days", field="from")
    scope: dict[str, str | None] = {}
    for name, model in (("tenant", Tenant), ("taskClass", TaskClass), ("pool", ModelPool)):
        slug = (params.get(name) or "").strip() or None
        # Not a slug (a NUL byte, which PostgreSQL refuses in text, or over the column's length) is no
        # tenant, task class or pool either, and is not sent to the database.
        if slug is not None and not (_SLUG.fullmatch(slug) and model.objects.filter(slug=slug).exists()):
            raise ReportQueryInvalid(f"unknown {name} {slug!r}", field=name)
        scope[name] = slug
    return ReportQuery(
        start=datetime.combine(first, time.min, tzinfo=UTC),
        end=datetime.combine(last + timedelta(days=1), time.min, tzinfo=UTC),
        tenant=scope["tenant"],
        task_class=scope["taskClass"],
        pool=scope["pool"],
    )
