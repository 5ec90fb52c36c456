"""Billing-export parsing (CSV and JSON Lines, per request and per bucket). No database."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciliation.providers.exports import REQUEST_FIELDS, parse_billing_export, scan_billing_export
from reconciliation.providers.records import (
    BillingExportError,
    BucketBillingRecord,
    CostRecord,
    ProblemKind,
    RequestBillingRecord,
)

GOOD_CSV = (
    "request_id,model,api_key_id,project_id,input_tokens,output_tokens,start_time\n"
    "r1,m,key_a,default,10,20,2026-07-01T10:00:00Z\n"
    "r2,m,,,11,0,2026-07-01T12:00:00+02:00\n"
)


def test_csv_per_request_rows_parse() -> None:
    records = parse_billing_export(GOOD_CSV, "csv")
    assert records == [
        RequestBillingRecord("r1", "m", 10, 20, datetime(2026, 7, 1, 10, tzinfo=UTC), "key_a", "default"),
        RequestBillingRecord("r2", "m", 11, 0, datetime(2026, 7, 1, 10, tzinfo=UTC), None, None),
    ]
    assert [r.line for r in records] == [2, 3]


def test_jsonl_bucket_rows_parse() -> None:
    text = (
        json.dumps(
            {
                "bucket_start": "2026-07-01T10:00:00Z",
                "bucket_end": "2026-07-01T11:00:00Z",
                "model": "m",
                "input_tokens": 5,
                "output_tokens": 7,
                "num_model_requests": 2,
                "a_new_column": "ignored",
            }
        )
        + "\n"
    )
    [record] = parse_billing_export(text, "jsonl")
    assert isinstance(record, BucketBillingRecord)
    assert record.bucket_end - record.bucket_start == timedelta(hours=1)
    assert (record.input_tokens, record.output_tokens, record.num_model_requests) == (5, 7, 2)


def test_every_bad_line_is_reported_with_its_line_number() -> None:
    text = (
        "request_id,model,input_tokens,output_tokens,start_time\n"
        "r1,m,10,20,2026-07-01T10:00:00Z\n"  # 2: fine
        "r2,m,-1,20,2026-07-01T10:00:00Z\n"  # 3: negative
        "r3,m,1.0,20,2026-07-01T10:00:00Z\n"  # 4: not an integer
        "r4,m,1,2,2026-07-01T10:00:00\n"  # 5: naive timestamp
        "r5,m,1,2\n"  # 6: too few columns
        ",m,1,2,2026-07-01T10:00:00Z\n"  # 7: empty id
        "r1,m,10,20,2026-07-01T10:00:00Z\n"  # 8: exact duplicate of 2
        "r6,m,1,2,yesterday\n"  # 9: not ISO-8601
    )
    with pytest.raises(BillingExportError) as caught:
        parse_billing_export(text, "csv")
    assert [p.line for p in caught.value.problems] == [3, 4, 5, 6, 7, 8, 9]
    assert "duplicate of line 2" in caught.value.problems[5].reason
    assert [p.counted for p in caught.value.problems] == [False] * 5 + [True, False]
    scan = scan_billing_export(text, "csv")
    assert [(r.line, r.request_id) for r in scan.records if isinstance(r, RequestBillingRecord)] == [
        (2, "r1")
    ]


def test_an_exact_duplicate_line_is_kept_once_and_flagged() -> None:
    header = "request_id,model,input_tokens,output_tokens,start_time\n"
    row = "r1,m,10,20,2026-07-01T10:00:00Z\n"
    text = header + row + "r2,m,1,2,2026-07-01T10:00:00Z\n" + row + row
    scan = scan_billing_export(text, "csv")
    assert [(p.line, p.reason, p.counted) for p in scan.problems] == [
        (4, "exact duplicate of line 2; counted once", True),
        (5, "exact duplicate of line 2; counted once", True),
    ]
    assert [
        (r.line, r.input_tokens, r.output_tokens) for r in scan.records if not isinstance(r, CostRecord)
    ] == [(2, 10, 20), (3, 1, 2)]
    # Nothing billed is lost, so the strict parser accepts it, with each request once.
    assert [r.line for r in parse_billing_export(text, "csv")] == [2, 3]


def test_conflicting_duplicates_are_all_dropped_and_reported() -> None:
    header = "request_id,model,input_tokens,output_tokens,start_time\n"
    text = (
        header
        + "r1,m,10,20,2026-07-01T10:00:00Z\n"
        + "r1,m,10,20,2026-07-01T10:00:00Z\n"
        + "r1,m,10,21,2026-07-01T10:00:00Z\n"
        + "r2,m,1,2,2026-07-01T10:00:00Z\n"
    )
    scan = scan_billing_export(text, "csv")
    assert [(p.line, p.kind) for p in scan.problems] == [(3, ProblemKind.CONFLICT), (4, ProblemKind.CONFLICT)]
    assert all("billed again with other amounts than line 2" in p.reason for p in scan.problems)
    # The export does not say which copy is right, so none of them is used.
    assert [r.line for r in scan.records] == [5]
    with pytest.raises(BillingExportError):
        parse_billing_export(text, "csv")


def test_jsonl_problems_are_collected() -> None:
    good = {
        "request_id": "r1",
        "model": "m",
        "input_tokens": 1,
        "output_tokens": 2,
        "start_time": "2026-07-01T10:00:00Z",
    }
    lines = [
        json.dumps(good),
        "{not json",
        "",
        json.dumps([1, 2]),
        json.dumps({**good, "request_id": "r2", "input_tokens": "1"}),  # numbers are numbers in JSONL
        json.dumps({**good, "request_id": "r3", "output_tokens": True}),
        json.dumps({"model": "m"}),
        json.dumps({**good, "request_id": "r4", "bucket_start": "2026-07-01T10:00:00Z"}),
        json.dumps({k: v for k, v in good.items() if k != "start_time"} | {"request_id": "r5"}),
        json.dumps(
            {
                "bucket_start": "2026-07-01T11:00:00Z",
                "bucket_end": "2026-07-01T10:00:00Z",
                "model": "m",
                "input_tokens": 1,
                "output_tokens": 1,
            }
        ),
        json.dumps({**good, "request_id": "r6"}),
    ]
    scan = scan_billing_export("\n".join(lines) + "\n", "jsonl")
    assert [p.line for p in scan.problems] == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [r.line for r in scan.records] == [1, 11]


def test_bucket_duplicates_are_reported() -> None:
    row = "2026-07-01T10:00:00Z,2026-07-01T11:00:00Z,key_a,p,m,1,2,1\n"
    text = ",".join(("bucket_start", "bucket_end", "api_key_id", "project_id", "model")) + (
        ",input_tokens,output_tokens,num_model_requests\n"
    )
    scan = scan_billing_export(text + row + row, "csv")
    assert [(p.line, p.reason) for p in scan.problems] == [(3, "exact duplicate of line 2; counted once")]
    assert [r.line for r in scan.records] == [2]


def test_empty_export_is_empty_and_unknown_format_raises() -> None:
    assert parse_billing_export("", "csv") == []
    assert parse_billing_export("", "jsonl") == []
    assert parse_billing_export("request_id,model,input_tokens,output_tokens,start_time\n", "csv") == []
    with pytest.raises(ValueError):
        parse_billing_export("", "xml")  # type: ignore[arg-type]


def test_csv_header_problems_are_reported() -> None:
    scan = scan_billing_export("request_id,request_id\nr1,r1\n", "csv")
    assert scan.problems and scan.problems[0].line == 1


def test_quoted_multiline_csv_fields_keep_correct_line_numbers() -> None:
    text = (
        "request_id,model,input_tokens,output_tokens,start_time\n"
        '"r1","a\nmulti-line model",1,2,2026-07-01T10:00:00Z\n'
        "r2,m,x,2,2026-07-01T10:00:00Z\n"
    )
    scan = scan_billing_export(text, "csv")
    assert [r.line for r in scan.records] == [2]
    assert [p.line for p in scan.problems] == [4]


_ids = st.text(
    alphabet=st.characters(categories=("L", "N"), include_characters="-_:/"), min_size=1, max_size=20
)
_counts = st.integers(min_value=0, max_value=10**9)
_times = st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2040, 1, 1), timezones=st.just(UTC))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_ids, _ids, _counts, _counts, _times), min_size=0, max_size=15, unique_by=lambda row: row[0]
    )
)
def test_request_exports_round_trip_in_both_formats(rows: list[tuple[str, str, int, int, datetime]]) -> None:
    expected = [
        RequestBillingRecord(request_id, model, prompt, completion, start)
        for request_id, model, prompt, completion, start in rows
    ]
    dicts = [
        {
            "request_id": r.request_id,
            "model": r.model,
            "api_key_id": "",
            "project_id": "",
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "start_time": r.start_time.isoformat(),
        }
        for r in expected
    ]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=REQUEST_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(dicts)
    assert parse_billing_export(out.getvalue(), "csv") == expected
    jsonl = "".join(json.dumps({k: v for k, v in d.items() if v != ""}) + "\n" for d in dicts)
    assert parse_billing_export(jsonl, "jsonl") == expected
