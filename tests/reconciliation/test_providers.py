"""Provider lookups and billing-export parsing. No database."""

from __future__ import annotations

import csv
import http.client
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciliation.providers import (
    REQUEST_FIELDS,
    BillingExportError,
    BucketBillingRecord,
    LookupResult,
    LookupStatus,
    ProviderLookup,
    RequestBillingRecord,
    SimulatorLookup,
    parse_billing_export,
    scan_billing_export,
)
from simulation.faults import Fault, LookupFault
from simulation.provider import Simulator

MESSAGES = [{"role": "user", "content": "How long is the notice period?"}]


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(seed=11)
    simulator.start()
    yield simulator
    simulator.stop()


def call(sim: Simulator, request_id: str, **body: object) -> None:
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    payload = {"model": "sim-large", "messages": MESSAGES, "max_tokens": 8, **body}
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(payload).encode(),
        headers={
            "Authorization": "Bearer sk-t",
            "Content-Type": "application/json",
            "X-Request-Id": request_id,
        },
    )
    try:
        connection.getresponse().read()
    except (ConnectionError, http.client.HTTPException):
        pass  # some tests provoke faults; the ledger is what they check
    finally:
        connection.close()


# -- LookupResult ------------------------------------------------------------------------------------------


def test_lookup_result_refuses_fabricated_evidence() -> None:
    with pytest.raises(ValueError):
        LookupResult(LookupStatus.UNKNOWN, authoritative=True)
    with pytest.raises(ValueError):
        LookupResult(LookupStatus.RUNNING, authoritative=True)
    with pytest.raises(ValueError):
        LookupResult(LookupStatus.NOT_PROCESSED, input_tokens=3, authoritative=True)
    with pytest.raises(ValueError):
        LookupResult(LookupStatus.COMPLETED, input_tokens=-1, authoritative=True)
    assert LookupResult.unknown("x") == LookupResult(LookupStatus.UNKNOWN, detail="x")


def test_simulator_lookup_is_a_provider_lookup(sim: Simulator) -> None:
    assert isinstance(SimulatorLookup(sim.base_url), ProviderLookup)


# -- SimulatorLookup against the simulator -----------------------------------------------------------------


def test_completed_request_is_authoritative_with_billed_usage(sim: Simulator) -> None:
    call(sim, "prq-1")
    entry = sim.entry("prq-1")
    result = SimulatorLookup(sim.base_url).lookup("prq-1")
    assert entry is not None
    assert result == LookupResult(
        LookupStatus.COMPLETED,
        input_tokens=entry.prompt_tokens,
        output_tokens=entry.completion_tokens,
        authoritative=True,
        detail="completed",
    )


def test_cut_request_is_completed_with_what_was_billed(sim: Simulator) -> None:
    sim.script(Fault.RESET_AFTER_READ)
    call(sim, "prq-cut")
    result = SimulatorLookup(sim.base_url).lookup("prq-cut")
    assert result.status is LookupStatus.COMPLETED and result.authoritative
    assert result.input_tokens > 0 and result.output_tokens == 0 and result.detail == "cut"


def test_unknown_id_and_unprocessed_request_are_not_processed(sim: Simulator) -> None:
    sim.script(Fault.RESET_BEFORE_READ)
    call(sim, "prq-never")
    lookup = SimulatorLookup(sim.base_url)
    for request_id in ("prq-never", "prq-no-such-id"):
        result = lookup.lookup(request_id)
        assert result.status is LookupStatus.NOT_PROCESSED and result.authoritative


def test_running_request_is_running_and_not_authoritative(sim: Simulator) -> None:
    sim.script(completion_tokens=30, chunk_delay_s=0.03)
    worker = threading.Thread(target=call, args=(sim, "prq-run"), kwargs={"stream": True})
    worker.start()
    try:
        while sim.entry("prq-run") is None:
            time.sleep(0.005)
        result = SimulatorLookup(sim.base_url).lookup("prq-run")
        assert result == LookupResult(LookupStatus.RUNNING, detail="running")
    finally:
        worker.join()


def test_stopped_simulator_is_unknown_never_not_processed() -> None:
    simulator = Simulator()
    base_url = simulator.start()
    simulator.stop()
    result = SimulatorLookup(base_url, timeout=1.0).lookup("prq-1")
    assert result.status is LookupStatus.UNKNOWN and not result.authoritative


@pytest.mark.parametrize("fault", [LookupFault.HTTP_500, LookupFault.RESET, LookupFault.UNKNOWN])
def test_lookup_faults_are_unknown(sim: Simulator, fault: LookupFault) -> None:
    sim.script_lookup(fault)
    result = SimulatorLookup(sim.base_url).lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN and not result.authoritative
    # The fault applied once; the next lookup gets the real answer.
    assert SimulatorLookup(sim.base_url).lookup("prq-no-such-id").status is LookupStatus.NOT_PROCESSED


def test_lookup_timeout_is_unknown(sim: Simulator) -> None:
    sim.script_lookup(LookupFault.DELAY, delay_s=0.5)
    result = SimulatorLookup(sim.base_url, timeout=0.1).lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN


def test_wrong_base_url_404_is_unknown(sim: Simulator) -> None:
    # A route that does not exist answers 404 — that says nothing about the request.
    result = SimulatorLookup(sim.base_url + "/wrong-prefix").lookup("prq-no-such-id")
    assert result.status is LookupStatus.UNKNOWN


def test_request_ids_are_quoted_in_the_url(sim: Simulator) -> None:
    call(sim, "tbr-a/b?c")
    assert SimulatorLookup(sim.base_url).lookup("tbr-a/b?c").status is LookupStatus.COMPLETED


class _Canned(BaseHTTPRequestHandler):
    """Answers every GET with the class's canned status and body."""

    status = 200
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, b"not json"),
        (200, b"[]"),
        (200, json.dumps({"id": "someone-else", "status": "not_found"}).encode()),
        (200, json.dumps({"id": "prq-x", "status": "completed"}).encode()),
        (200, json.dumps({"id": "prq-x", "status": "completed", "usage": {"prompt_tokens": 1}}).encode()),
        (
            200,
            json.dumps(
                {
                    "id": "prq-x",
                    "status": "completed",
                    "usage": {"prompt_tokens": 1, "completion_tokens": True},
                }
            ).encode(),
        ),
        (200, json.dumps({"id": "prq-x", "status": "gone"}).encode()),
        (404, json.dumps({"id": "prq-x", "status": "not_found"}).encode()),
        (503, b""),
    ],
)
def test_malformed_or_non_200_answers_are_unknown(status: int, body: bytes) -> None:
    handler = type("Canned", (_Canned,), {"status": status, "body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        result = SimulatorLookup(f"http://{host!s}:{port}").lookup("prq-x")
    finally:
        server.shutdown()
        server.server_close()
    assert result.status is LookupStatus.UNKNOWN and not result.authoritative


def test_a_server_that_accepts_and_never_answers_is_unknown() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        port = listener.getsockname()[1]
        result = SimulatorLookup(f"http://127.0.0.1:{port}", timeout=0.2).lookup("prq-x")
    finally:
        listener.close()
    assert result.status is LookupStatus.UNKNOWN


# -- billing-export parsing --------------------------------------------------------------------------------

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
    assert [(r.line, r.input_tokens, r.output_tokens) for r in scan.records] == [(2, 10, 20), (3, 1, 2)]
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
    assert [(p.line, p.counted) for p in scan.problems] == [(3, False), (4, False)]
    assert all("conflicting duplicate of line 2" in p.reason for p in scan.problems)
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
