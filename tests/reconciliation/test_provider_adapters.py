"""The OpenAI and Anthropic adapters on their official SDKs, answered from recorded documented shapes; what
each adapter can prove, and ``judge``'s rule for "not found". No database."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx2
import pytest

from reconciliation.providers import registry
from reconciliation.providers.anthropic_api import AnthropicBatchesAdapter, AnthropicMessagesAdapter
from reconciliation.providers.base import (
    Capabilities,
    DispatchRecord,
    LookupResult,
    LookupStatus,
    Verdict,
    before_lookup,
    judge,
)
from reconciliation.providers.exports import scan_billing_export
from reconciliation.providers.openai_api import OpenAIAdapter
from reconciliation.providers.records import BucketBillingRecord, CostRecord, ProblemKind
from tests.reconciliation import provider_fixtures as fx

NOW = datetime(2026, 7, 1, 12, tzinfo=UTC)
CHAT_ID = fx.CHAT_COMPLETION["id"]
RESP_ID = "resp_67ccd3a9da748190baa7f1570fe91ac6"
B = f"/v1/messages/batches/{fx.BATCH_ID}"


def openai(routes: dict[str, fx.Route], seen: list[httpx2.Request] | None = None) -> OpenAIAdapter:
    return OpenAIAdapter(
        "https://api.openai.test/v1",
        api_key="sk-x",
        admin_key="sk-admin",
        http_client=fx.mock_client(routes, seen),
    )


def batches(routes: dict[str, fx.Route]) -> AnthropicBatchesAdapter:
    return AnthropicBatchesAdapter(
        "https://api.anthropic.com", api_key="sk-ant", http_client=fx.mock_client(routes)
    )


# -- OpenAI ------------------------------------------------------------------------------------------------


def test_openai_stored_completion_is_completed_with_its_usage():
    seen: list[httpx2.Request] = []
    adapter = openai({f"/v1/chat/completions/{CHAT_ID}": fx.answer(200, fx.CHAT_COMPLETION)}, seen)
    assert adapter.lookup(CHAT_ID) == LookupResult(LookupStatus.COMPLETED, 1117, 46, "stored chat completion")
    assert seen[0].headers["authorization"] == "Bearer sk-x"


def test_openai_not_found_is_only_not_found_and_errors_are_unknown():
    assert openai({}).lookup("chatcmpl-missing").status is LookupStatus.NOT_FOUND
    down = openai({"/v1/chat/completions/chatcmpl-x": fx.answer(500, {"error": {"message": "boom"}})})
    assert down.lookup("chatcmpl-x").status is LookupStatus.UNKNOWN
    other = openai({"/v1/chat/completions/chatcmpl-x": fx.answer(200, fx.CHAT_COMPLETION)})
    assert other.lookup("chatcmpl-x").status is LookupStatus.UNKNOWN, "an answer about another id"


@pytest.mark.parametrize(
    ("status", "usage", "expected"),
    [
        (
            "completed",
            {"input": 328, "output": 52},
            LookupResult(LookupStatus.COMPLETED, 328, 52, "response completed"),
        ),
        (
            "incomplete",
            {"input": 328, "output": 9},
            LookupResult(LookupStatus.COMPLETED, 328, 9, "response incomplete"),
        ),
        ("in_progress", None, LookupResult(LookupStatus.RUNNING, detail="response in_progress")),
        ("failed", None, LookupResult.unknown("response failed without usage")),
        ("cancelled", None, LookupResult.unknown("response cancelled without usage")),
    ],
)
def test_openai_responses_by_id(status, usage, expected):
    adapter = openai({f"/v1/responses/{RESP_ID}": fx.answer(200, fx.response_object(status, usage))})
    assert adapter.lookup(RESP_ID) == expected


def test_openai_usage_and_cost_pages_come_through_the_admin_api():
    seen: list[httpx2.Request] = []
    pages = iter([fx.USAGE_PAGE_1, fx.USAGE_PAGE_2])
    adapter = openai(
        {
            "/v1/organization/usage/completions": lambda request: httpx2.Response(200, json=next(pages)),
            "/v1/organization/costs": fx.answer(200, fx.COSTS_PAGE),
        },
        seen,
    )
    start = datetime(2024, 11, 1, tzinfo=UTC)
    usage = adapter.usage_pages(start, start + timedelta(hours=2))
    assert [page["data"][0]["start_time"] for page in usage] == [1730419200, 1730422800]
    assert seen[1].url.params["page"] == fx.USAGE_PAGE_1["next_page"]
    assert seen[0].headers["authorization"] == "Bearer sk-admin"
    assert set(seen[0].url.params.get_list("group_by[]")) == {"model", "project_id", "api_key_id"}
    assert adapter.cost_pages(start, start + timedelta(days=1)) == [fx.COSTS_PAGE]


def test_openai_usage_pages_parse_into_buckets_with_cached_input():
    scan = scan_billing_export(json.dumps([fx.USAGE_PAGE_1, fx.USAGE_PAGE_2]), "openai-usage")
    assert scan.problems == ()
    first, second = scan.records
    assert first == BucketBillingRecord(
        datetime(2024, 11, 1, tzinfo=UTC),
        datetime(2024, 11, 1, 1, tzinfo=UTC),
        "gpt-4o-mini-2024-07-18",
        1000,
        500,
        api_key_id="key_abc",
        project_id="proj_abc",
        num_model_requests=5,
        cached_input_tokens=800,
    )
    assert isinstance(second, BucketBillingRecord) and second.input_tokens == 20


def test_openai_cost_pages_parse_into_decimal_amounts():
    scan = scan_billing_export(json.dumps(fx.COSTS_PAGE), "openai-costs")
    assert [(r.line_item, r.amount, r.currency) for r in scan.records if isinstance(r, CostRecord)] == [
        ("gpt-4o-mini-2024-07-18, input", Decimal("0.06"), "usd"),
        ("gpt-4o-mini-2024-07-18, output", Decimal("0.12"), "usd"),
    ]


def test_usage_rows_twice_are_counted_once_and_other_amounts_conflict():
    page = fx.USAGE_PAGE_2
    again = json.loads(json.dumps(page))
    scan = scan_billing_export("\n".join(json.dumps(p) for p in (page, again)), "openai-usage")
    assert [p.kind for p in scan.problems] == [ProblemKind.DUPLICATE] and len(scan.records) == 1
    again["data"][0]["results"][0]["output_tokens"] = 11
    scan = scan_billing_export(json.dumps([page, again]), "openai-usage")
    assert [p.kind for p in scan.problems] == [ProblemKind.CONFLICT] and scan.records == ()
    ungrouped = json.loads(json.dumps(page))
    ungrouped["data"][0]["results"][0]["model"] = None
    assert (
        "group the report by model"
        in scan_billing_export(json.dumps(ungrouped), "openai-usage").problems[0].reason
    )


# -- Anthropic ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("custom_id", "expected"),
    [
        ("req-ok", LookupResult(LookupStatus.COMPLETED, 20, 36, "batch request succeeded")),
        ("req-err", LookupResult(LookupStatus.NOT_PROCESSED, detail="batch request errored (not billed)")),
        (
            "req-cancel",
            LookupResult(LookupStatus.NOT_PROCESSED, detail="batch request canceled (not billed)"),
        ),
        (
            "req-expired",
            LookupResult(LookupStatus.NOT_PROCESSED, detail="batch request expired (not billed)"),
        ),
        ("req-other", LookupResult(LookupStatus.NOT_FOUND, detail="no result for req-other in the batch")),
    ],
)
def test_anthropic_batch_results(custom_id, expected):
    adapter = batches({B: fx.answer(200, fx.batch("ended")), f"{B}/results": fx.jsonl(fx.BATCH_RESULTS)})
    assert adapter.lookup(f"{fx.BATCH_ID}/{custom_id}") == expected


def test_anthropic_batch_in_progress_missing_or_malformed_ids():
    running = batches({B: fx.answer(200, fx.batch("in_progress"))})
    assert running.lookup(f"{fx.BATCH_ID}/req-ok").status is LookupStatus.RUNNING
    assert batches({}).lookup(f"{fx.BATCH_ID}/req-ok").status is LookupStatus.NOT_FOUND
    assert batches({}).lookup("msg_01plain").status is LookupStatus.UNKNOWN
    down = batches(
        {B: fx.answer(529, {"type": "error", "error": {"type": "overloaded_error", "message": "x"}})}
    )
    assert down.lookup(f"{fx.BATCH_ID}/req-ok").status is LookupStatus.UNKNOWN


def test_plain_anthropic_messages_cannot_vouch():
    adapter = AnthropicMessagesAdapter(
        "https://api.anthropic.com", api_key="k", http_client=fx.mock_client({})
    )
    assert not adapter.capabilities.lookup and not adapter.knows("msg_01")
    assert adapter.lookup("msg_01").status is LookupStatus.UNKNOWN
    record = DispatchRecord("msg_01", adapter.name, adapter.endpoint, NOW, "")
    judgement = before_lookup(adapter, record)
    assert judgement is not None and judgement.verdict is Verdict.PERSON
    assert "compare with its usage report" in judgement.reason


def test_anthropic_usage_report_through_the_sdk_and_parsed():
    seen: list[httpx2.Request] = []
    client = fx.mock_client(
        {"/v1/organizations/usage_report/messages": fx.answer(200, fx.ANTHROPIC_USAGE_PAGE)}, seen
    )
    adapter = AnthropicMessagesAdapter(
        "https://api.anthropic.com", api_key="k", admin_key="sk-ant-admin", http_client=client
    )
    pages = adapter.usage_pages(datetime(2025, 8, 1, tzinfo=UTC), datetime(2025, 8, 2, tzinfo=UTC))
    assert seen[0].headers["authorization"] == "Bearer sk-ant-admin"
    assert seen[0].url.params["starting_at"] == "2025-08-01T00:00:00Z"
    scan = scan_billing_export(json.dumps(pages), "anthropic-usage")
    assert scan.problems == ()
    [record] = scan.records
    # Two service tiers of one model, workspace and key are one bucket: 1500 + 1500 created + 200 read + 100.
    assert isinstance(record, BucketBillingRecord)
    assert (
        record.input_tokens,
        record.output_tokens,
        record.cached_input_tokens,
        record.cache_creation_tokens,
    ) == (
        3300,
        550,
        200,
        1500,
    )
    assert record.project_id == "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ"


# -- what an adapter can prove -----------------------------------------------------------------------------


VOUCHING = Capabilities(True, True, timedelta(days=30), "request")


@dataclass
class Fake:
    name: str = "fake"
    endpoint: str = "http://provider"
    capabilities: Capabilities = VOUCHING
    known: bool = True

    def knows(self, provider_request_id: str) -> bool:
        return self.known

    def lookup(self, provider_request_id: str) -> LookupResult:
        raise AssertionError("not called")


def record(**changes) -> DispatchRecord:
    base = {
        "provider_request_id": "p-1",
        "adapter": "fake",
        "endpoint": "http://provider",
        "dispatched_at": NOW - timedelta(days=1),
        "request_sent": "",
    }
    return DispatchRecord(**{**base, **changes})


NOT_FOUND = LookupResult(LookupStatus.NOT_FOUND)


@pytest.mark.parametrize(
    ("adapter", "dispatch", "verdict"),
    [
        (Fake(), record(), Verdict.NOT_PROCESSED),
        (Fake(capabilities=Capabilities(True, False, None, "request")), record(), Verdict.WAIT),
        (Fake(capabilities=Capabilities(True, False, None, "bucket")), record(), Verdict.PERSON),
        (Fake(known=False), record(), Verdict.WAIT),
        (Fake(), record(dispatched_at=NOW - timedelta(days=31)), Verdict.WAIT),
        (Fake(), record(dispatched_at=None), Verdict.WAIT),
        (Fake(), record(request_sent="yes"), Verdict.PERSON),
        (Fake(), record(request_sent="unknown"), Verdict.NOT_PROCESSED),
    ],
)
def test_not_found_is_proof_only_when_the_adapter_can_vouch(adapter, dispatch, verdict):
    assert before_lookup(adapter, dispatch) is None
    assert judge(adapter, dispatch, NOT_FOUND, now=NOW).verdict is verdict


def test_no_lookup_counts_unless_it_goes_to_the_endpoint_recorded_at_dispatch():
    assert before_lookup(Fake(), record(endpoint="http://elsewhere")).verdict is Verdict.PERSON
    assert before_lookup(Fake(), record(adapter="openai")).verdict is Verdict.PERSON
    assert before_lookup(Fake(), record(endpoint="")).verdict is Verdict.WAIT


def test_documented_non_processing_and_completion_settle():
    done = LookupResult(LookupStatus.COMPLETED, 5, 6)
    assert judge(Fake(), record(request_sent="yes"), done, now=NOW).verdict is Verdict.COMPLETED
    never = LookupResult(LookupStatus.NOT_PROCESSED, detail="expired")
    assert judge(Fake(), record(request_sent="yes"), never, now=NOW).verdict is Verdict.NOT_PROCESSED
    assert judge(Fake(known=False), record(), never, now=NOW).verdict is Verdict.WAIT
    for status in (LookupStatus.RUNNING, LookupStatus.UNKNOWN):
        assert judge(Fake(), record(), LookupResult(status), now=NOW).verdict is Verdict.WAIT


def test_each_adapter_declares_its_capabilities_and_the_registry_builds_it():
    from budgeting.catalog.models import ProviderAdapter

    assert set(registry.PROVIDER_OF) == set(ProviderAdapter.values)
    built = {
        name: registry.build(registry.PoolProvider(name, "http://provider/", api_key="k"))
        for name in registry.PROVIDER_OF
    }
    assert {name: (a.capabilities.lookup, a.capabilities.vouches_not_found) for name, a in built.items()} == {
        "simulator": (True, True),
        "openai": (True, False),
        "anthropic-batches": (True, False),
        "anthropic-messages": (False, False),
    }
    assert all(a.name == name and a.endpoint == "http://provider" for name, a in built.items())
    assert registry.build(registry.PoolProvider("openai", "")) is None
    with pytest.raises(ValueError):
        registry.build(registry.PoolProvider("carrier-pigeon", "http://x"))
    assert registry.usage_feeds(built["openai"]) == [], "no admin key: the usage import is off"
