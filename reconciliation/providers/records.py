"""What a billing export or usage report says, whatever the provider: billed calls, buckets, costs."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from enum import StrEnum


@dataclass(frozen=True)
class RequestBillingRecord:
    """One billed provider request from a per-request export. ``line`` is where it was read (1-based);
    ``cost`` is what the provider charged for it in ``currency`` (upper case), where the export says."""

    request_id: str
    model: str
    input_tokens: int
    output_tokens: int
    start_time: datetime
    api_key_id: str | None = None
    project_id: str | None = None
    cost: Decimal | None = None
    currency: str | None = None
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class BucketBillingRecord:
    """Billed totals of one (api key, project or workspace, model, time bucket).

    ``input_tokens`` is every input token billed, cached or not; ``cached_input_tokens`` (read from a cache)
    and ``cache_creation_tokens`` (written to one) are the parts providers price apart, where they say.
    """

    bucket_start: datetime
    bucket_end: datetime
    model: str
    input_tokens: int
    output_tokens: int
    api_key_id: str | None = None
    project_id: str | None = None
    num_model_requests: int | None = None
    cached_input_tokens: int | None = None
    cache_creation_tokens: int | None = None
    line: int = field(default=0, compare=False)

    @property
    def key(self) -> tuple[str | None, str | None, str, datetime, datetime]:
        """The identity of a bucket row: two rows with the same key are duplicates."""
        return (self.api_key_id, self.project_id, self.model, self.bucket_start, self.bucket_end)


@dataclass(frozen=True)
class CostRecord:
    """What one cost line (a line item, project or API key) of one time bucket was charged; ``model`` is the
    model the line bills, where it names one."""

    bucket_start: datetime
    bucket_end: datetime
    amount: Decimal
    currency: str
    line_item: str | None = None
    project_id: str | None = None
    api_key_id: str | None = None
    model: str | None = None
    line: int = field(default=0, compare=False)

    @property
    def key(self) -> tuple[str | None, str | None, str | None, str, datetime, datetime]:
        return (
            self.line_item,
            self.project_id,
            self.api_key_id,
            self.currency,
            self.bucket_start,
            self.bucket_end,
        )


BillingRecord = RequestBillingRecord | BucketBillingRecord | CostRecord


class ProblemKind(StrEnum):
    BAD_LINE = "BAD_LINE"
    """The line could not be read; its usage is not in the records."""
    DUPLICATE = "DUPLICATE"
    """An exact copy of an earlier line: kept once, nothing lost."""
    CONFLICT = "CONFLICT"
    """The same request or bucket again with other amounts: every copy dropped (which one is right?)."""


@dataclass(frozen=True)
class ExportProblem:
    """A bad, duplicate or conflicting line of an export (``line``: 1-based; in a JSON report, the row)."""

    line: int
    reason: str
    kind: ProblemKind = ProblemKind.BAD_LINE

    @property
    def counted(self) -> bool:
        """The line's usage is in the records all the same (an exact duplicate, counted once)."""
        return self.kind is ProblemKind.DUPLICATE


@dataclass(frozen=True)
class BillingExportScan:
    """Every well-formed, unique record of an export, and every problem found, in line order."""

    records: tuple[BillingRecord, ...]
    problems: tuple[ExportProblem, ...]


class BillingExportError(ValueError):
    """A billing export had bad or duplicate lines; ``problems`` lists all of them, not just the first."""

    def __init__(self, problems: tuple[ExportProblem, ...]) -> None:
        self.problems = problems
        shown = "; ".join(f"line {p.line}: {p.reason}" for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(f"{len(problems)} bad line(s) in billing export: {shown}{more}")


def drop_duplicates(parsed: list[BillingRecord], problems: list[ExportProblem]) -> list[BillingRecord]:
    """Keep each record once. Exact copies are flagged and counted once; copies that disagree are all dropped
    (the export does not say which one is right) and flagged as conflicts."""
    copies: dict[object, list[BillingRecord]] = {}
    for record in parsed:
        copies.setdefault(_identity(record), []).append(record)
    kept: list[BillingRecord] = []
    for record in parsed:
        group = copies[_identity(record)]
        first = group[0]
        # Record equality ignores the line number: identical values are one billed request written twice.
        identical = all(copy == first for copy in group)
        if record is first:
            if identical:
                kept.append(record)
            continue
        if identical:
            problems.append(
                ExportProblem(
                    record.line, f"exact duplicate of line {first.line}; counted once", ProblemKind.DUPLICATE
                )
            )
        else:
            problems.append(
                ExportProblem(
                    record.line,
                    f"billed again with other amounts than line {first.line}; every copy dropped",
                    ProblemKind.CONFLICT,
                )
            )
    return kept


def _identity(record: BillingRecord) -> object:
    if isinstance(record, RequestBillingRecord):
        return ("request", record.request_id)
    if isinstance(record, CostRecord):
        return ("cost", record.key)
    return ("bucket", record.key)
