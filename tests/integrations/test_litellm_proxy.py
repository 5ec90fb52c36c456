"""The LiteLLM hook end to end: the official ``openai`` SDK calls a real LiteLLM proxy that loads our hook and
routes to the provider simulator; our API runs under gunicorn on the test database.

What each test proves is in its name; every one ends with the audit clean (balances equal their entries, no
open reservation, what we settled is what the simulator billed).
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from openai import OpenAI

from budgeting.catalog.changes import SYSTEM as SYSTEM_ACTOR
from ledger.models import CapacityAccount, Reservation, Scope
from ledger.models import State as ReservationState
from ledger.services.limits import set_account_limits
from reconciliation import tasks
from simulation.billing import BillingStatus
from simulation.provider import Simulator
from tests.e2e_faults.harness import assert_clean, expire, point_pools_at, wait_for
from tests.integrations.conftest import Gunicorn, RecordingCounter
from tests.integrations.litellm_proxy import LiteLLMProxy

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CLAUSE = "Clause 7: either party may terminate the agreement with 30 days written notice."
RULES = "You review contracts. Cite the evidence ids you use."


def evidence(item_id: str, text: str = CLAUSE, *, minimum: bool = True) -> dict[str, Any]:
    return {
        "id": item_id,
        "sourceId": f"doc-{item_id}",
        "text": text,
        "score": 0.9,
        "permissions": ["contracts:read"],
        "minimumRetention": minimum,
    }


def client(proxy: LiteLLMProxy) -> OpenAI:
    return OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.master_key, max_retries=0, timeout=60)


def ask(
    proxy: LiteLLMProxy, *, stream: bool, items: list[dict[str, Any]], **kwargs: Any
) -> tuple[str, dict[str, int]]:
    """One chat completion through the proxy; returns the completion id and the usage the client saw."""
    request: dict[str, Any] = {
        "model": "contract-review",
        "messages": [
            {"role": "system", "content": RULES},
            {"role": "user", "content": "Can either party terminate early?"},
        ],
        "max_tokens": 40,
        "extra_body": {"metadata": {"tokenbudget": {"evidence": items}}},
        **kwargs,
    }
    sdk = client(proxy)
    if not stream:
        answer = sdk.chat.completions.create(**request)
        assert answer.usage is not None
        return answer.id, {"prompt": answer.usage.prompt_tokens, "completion": answer.usage.completion_tokens}
    completion_id, usage = "", {}
    for chunk in sdk.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        completion_id = chunk.id
        if chunk.usage is not None:
            usage = {"prompt": chunk.usage.prompt_tokens, "completion": chunk.usage.completion_tokens}
    return completion_id, usage


def admitted_messages(row: Reservation) -> list[dict[str, Any]]:
    """The messages of the payload our API admitted (its first answer, kept on the reservation)."""
    assert isinstance(row.response_body, dict)
    messages = row.response_body["payload"]["messages"]
    assert isinstance(messages, list)
    return messages


def admitted_tokens(row: Reservation) -> int:
    assert isinstance(row.response_body, dict)
    return int(row.response_body["tokens"]["input"])


def reservation_for(provider_request_id: str) -> str:
    """The id of the reservation dispatched under this provider request id (the completion's id)."""
    return str(Reservation.objects.get(provider_request_id=provider_request_id).pk)


def settled(reservation_id: str) -> Reservation:
    """The reservation once a terminal hook has run (the success hook runs after the answer was sent)."""
    wait_for(
        lambda: (
            Reservation.objects.get(pk=reservation_id).state
            in (ReservationState.SETTLED, ReservationState.PARTIALLY_SETTLED)
        ),
        timeout=20,
        what=f"reservation {reservation_id} to settle",
    )
    return Reservation.objects.get(pk=reservation_id)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_call_through_the_proxy_is_admitted_sent_as_admitted_and_settled_at_the_billed_usage(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], stream: bool
) -> None:
    simulator, counter = sim
    started = time.monotonic()

    completion_id, usage = ask(proxy, stream=stream, items=[evidence("e1")])

    reservation_id = reservation_for(completion_id)
    row = settled(reservation_id)
    billed = simulator.entry(completion_id)
    assert billed is not None
    assert (row.state, row.outcome, row.rung) == (ReservationState.SETTLED, "COMPLETED", "FULL")
    assert row.provider_request_id == completion_id
    assert (row.input_consumed, row.captured + row.overrun) == (
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert usage == {"prompt": billed.prompt_tokens, "completion": billed.completion_tokens}
    admitted = admitted_messages(row)
    assert counter.seen == [admitted]
    assert any("No legal advice" in text_of(message) for message in admitted)
    assert_clean(simulator)
    admitted_input = admitted_tokens(row)
    report = (
        f"[litellm {'stream' if stream else 'plain'}] openai SDK chat.completions.create("
        f"model='contract-review', stream={stream}) -> id {completion_id}; reservation {reservation_id} "
        f"{row.state}/{row.outcome} at {row.rung}; admitted input {admitted_input}, output reserved "
        f"{row.output_reserved}; settled input {row.input_consumed}, output captured {row.captured}, "
        f"released "
        f"{row.released}; simulator billed {billed.prompt_tokens}+{billed.completion_tokens}; "
        f"{time.monotonic() - started:.2f} s"
    )
    print(f"\n{report}")


def text_of(message: dict[str, Any]) -> str:
    """A payload message's text: its content is one string (a text-only message of the OpenAI and DeepSeek
    templates), its parts, or null."""
    content = message["content"]
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content)


def test_a_degraded_request_reaches_the_provider_as_the_admitted_payload(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    long_clause = " ".join(
        f"Section {n}: the supplier shall deliver the goods within {n} days." for n in range(900)
    )
    items = [
        evidence("e1"),
        evidence("big-a", long_clause, minimum=False),
        evidence("big-b", long_clause, minimum=False),
    ]

    completion_id, _ = ask(proxy, stream=True, items=items)

    row = settled(reservation_for(completion_id))
    assert row.rung == "DEDUP_EVIDENCE"
    admitted = admitted_messages(row)
    assert counter.seen == [admitted]
    texts = " ".join(text_of(message) for message in admitted)
    assert "[evidence id=big-a" in texts and "[evidence id=big-b" not in texts
    assert_clean(simulator)


@pytest.mark.parametrize("stream", [False, True])
def test_an_over_quota_request_is_refused_429_at_the_client(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], stream: bool
) -> None:
    """``support`` is admitted while LiteLLM routes it: the refusal comes from the deployment hook, and a
    stream's too is an HTTP 429, not an error inside an opened stream."""
    simulator, counter = sim
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant__slug="t-19")
    set_account_limits(
        account_id=account.pk,
        input_limit=account.input_limit,
        output_limit=10,
        concurrency_limit=account.concurrency_limit,
        spend_limit=account.spend_limit,
        expected=(account.input_limit, account.output_limit, account.concurrency_limit, account.spend_limit),
        reason="the tenant's output quota is nearly spent",
        actor=SYSTEM_ACTOR,
    )

    with pytest.raises(openai.RateLimitError) as refused:
        answer = client(proxy).chat.completions.create(
            model="support",
            messages=[{"role": "user", "content": "Where is my order?"}],
            max_tokens=50,
            stream=stream,
        )
        if stream:
            list(answer)

    assert refused.value.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["provider_specific_fields"]["code"] == "QUOTA_EXCEEDED"
    assert error["provider_specific_fields"]["problem"]["status"] == 429
    assert counter.seen == [] and simulator.entries() == []
    assert not Reservation.objects.filter(state=ReservationState.RESERVED).exists()
    assert_clean(simulator)


def after_fault(
    proxy: LiteLLMProxy, simulator: Simulator, fault: str, state: str, raises: type[Exception] | None
) -> Reservation:
    """The one reservation of a plain call the provider answers with ``fault``, once it reached ``state``
    (the client saw ``raises``, or an answer)."""
    simulator.script(fault)
    if raises is None:
        ask(proxy, stream=False, items=[evidence("e1")])
    else:
        with pytest.raises(raises):
            ask(proxy, stream=False, items=[evidence("e1")])
    wait_for(
        lambda: Reservation.objects.filter(state=state).exists(), timeout=20, what=f"the reservation {state}"
    )
    return Reservation.objects.get()


def test_a_provider_that_refuses_the_call_releases_the_reservation_in_full(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    row = after_fault(proxy, simulator, "rate_limited", ReservationState.SETTLED, openai.RateLimitError)
    assert (row.outcome, row.input_consumed, row.captured) == ("RELEASED", 0, 0)
    assert row.failure_reason.startswith("never processed: provider_http_429")
    assert_clean(simulator)


def test_a_reset_connection_is_a_failure_with_the_request_sent_unknown(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    """LiteLLM raises its InternalServerError (an OpenAI SDK APIStatusError with a made-up 500) for a reset
    connection: that is no answer of the provider's. It was posted as sent and answered 500."""
    simulator, _ = sim
    row = after_fault(
        proxy, simulator, "reset_before_read", ReservationState.PARTIALLY_SETTLED, openai.APIError
    )
    assert row.request_sent == "unknown", row.failure_reason
    assert row.failure_reason.startswith("failed (unknown sent)")
    assert row.remaining > 0, "unknown is never released as zero"


def test_an_answer_without_usage_is_a_failure_never_a_completion_of_zero_tokens(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    """The provider answered but reported no usage: LiteLLM fills it in as zeros, which settled the call as
    COMPLETED with 0 tokens and released all it held."""
    simulator, _ = sim
    row = after_fault(proxy, simulator, "omit_usage", ReservationState.PARTIALLY_SETTLED, None)
    assert (row.state, row.outcome) != (ReservationState.SETTLED, "COMPLETED")
    assert "missing_final_usage" in row.failure_reason
    assert row.remaining > 0


def test_a_stream_the_client_abandons_is_cancelled_then_reconciled_from_the_provider(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    point_pools_at(simulator.base_url)
    simulator.script(completion_tokens=40, chunk_delay_s=0.2)
    stream = client(proxy).chat.completions.create(
        model="contract-review",
        messages=[{"role": "user", "content": "Summarise clause 7."}],
        max_tokens=40,
        stream=True,
        extra_body={"metadata": {"tokenbudget": {"evidence": [evidence("e1")]}}},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 2:
            break
    stream.close()

    row = settled(reservation_for(chunk.id))
    assert row.state == ReservationState.PARTIALLY_SETTLED
    assert row.failure_reason.startswith("cancelled") and row.captured >= 2
    wait_for(
        lambda: (
            (entry := simulator.entry(chunk.id)) is not None and entry.status is not BillingStatus.RUNNING
        ),
        timeout=30,
        what="the provider to stop generating",
    )
    expire(str(row.pk))
    assert tasks.reclaim_expired_leases()["settled"] == 1
    row.refresh_from_db()
    assert (row.state, row.outcome) == (ReservationState.SETTLED, "RECONCILED")
    assert_clean(simulator)


def test_with_our_api_down_the_call_is_refused_503_and_never_sent(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    api.stop()

    with pytest.raises(openai.InternalServerError) as refused:
        ask(proxy, stream=False, items=[evidence("e1")])

    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "5"
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["provider_specific_fields"]["code"] == "ADMISSION_UNAVAILABLE"
    assert counter.seen == [] and simulator.entries() == []
