"""The admission asked for as a request arrives, through a real LiteLLM proxy: the official ``openai`` SDK
calls the proxy, whose hook calls our API under gunicorn on the test database. The proxy here loads the
``refuser`` guardrail BEFORE our hook, so a call can be refused or changed between its arrival and our
pre-call hook.

What each test proves is in its name.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ledger.models import CapacityAccount, Reservation
from ledger.models import State as ReservationState
from simulation.provider import Simulator
from tests.e2e_faults.harness import assert_clean, wait_for
from tests.integrations.conftest import MODEL_GROUPS, Gunicorn, Ports, RecordingCounter, running_proxy
from tests.integrations.litellm_proxy import LiteLLMProxy
from tests.integrations.test_litellm_gateway_path import logged_since
from tests.integrations.test_litellm_proxy import admitted_messages, client, settled

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# A group of its own for the call a guardrail changes: the hook then admits that group's calls in its pre-call
# hook for a while, which must not change what the other tests see.
REWRITTEN = "support-rewritten"
QUESTION = "Where is my order?"


@pytest.fixture(scope="module")
def proxy(
    litellm_venv: Path, ports: Ports, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiteLLMProxy]:
    with running_proxy(
        litellm_venv,
        ports,
        tmp_path_factory.mktemp("litellm-arrival"),
        model_groups={**MODEL_GROUPS, REWRITTEN: MODEL_GROUPS["support"]},
        refuser_first=True,
    ) as proxy:
        yield proxy


def call(
    proxy: LiteLLMProxy, model: str = "support", headers: dict[str, str] | None = None, **metadata: Any
) -> Any:
    """One plain chat completion; the raw answer (its headers, ``parse()`` for the completion)."""
    return client(proxy).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=20,
        extra_body={"metadata": metadata} if metadata else {},
        extra_headers=headers,
    )


def known_key(proxy: LiteLLMProxy) -> None:
    """A call LiteLLM authenticates, after which its key is admitted on arrival."""
    settled(call(proxy).headers["x-tokenbudget-reservation-id"])


def nothing_held() -> bool:
    return all(
        account.in_flight == account.input_reserved == account.output_reserved == 0
        for account in CapacityAccount.objects.all()
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "x-litellm-call-id": "call-of-the-callers",
        },
    ],
    ids=["plain", "the caller's trace and call id"],
)
def test_a_known_keys_call_is_admitted_on_arrival_and_settled_as_any_other(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], headers: dict[str, str]
) -> None:
    simulator, counter = sim
    known_key(proxy)
    counter.seen.clear()
    log_before = proxy.log.read_text(errors="replace")

    raw = call(proxy, headers=headers)

    reservation_id = raw.headers["x-tokenbudget-reservation-id"]
    call_id = raw.headers["x-litellm-call-id"]
    assert call_id == headers.get("x-litellm-call-id", call_id)
    [admitted] = [line for line in logged_since(proxy, log_before) if "admitted support" in line]
    assert f"as reservation {reservation_id}" in admitted
    assert admitted.endswith(f", LiteLLM call {call_id}, asked on arrival"), admitted
    row = settled(reservation_id)
    assert (row.state, row.outcome) == (ReservationState.SETTLED, "COMPLETED")
    # Asked before LiteLLM named the call: the admission's requestId is one of its own.
    assert row.request_id.startswith("litellm-") and call_id not in row.request_id
    assert counter.seen == [admitted_messages(row)]
    billed = simulator.entry(raw.parse().id)
    assert billed is not None and (row.input_consumed, row.captured + row.overrun) == (
        billed.prompt_tokens,
        billed.completion_tokens,
    )
    assert Reservation.objects.count() == 2, "one reservation a call"
    assert_clean(simulator)


def test_a_key_litellm_refuses_asks_our_api_for_nothing(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, _ = sim
    known_key(proxy)
    stranger = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-not-a-key", max_retries=0, timeout=60)

    # LiteLLM without a database refuses a key that is not its master key 400 ("No connected db").
    with pytest.raises((openai.AuthenticationError, openai.BadRequestError)):
        stranger.chat.completions.create(
            model="support", messages=[{"role": "user", "content": QUESTION}], max_tokens=20
        )

    time.sleep(1)
    assert Reservation.objects.count() == 1, "only the known key's call was admitted"
    assert len(simulator.entries()) == 1


def test_a_call_refused_before_our_hook_has_its_early_admission_released_in_full(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    known_key(proxy)
    counter.seen.clear()

    with pytest.raises(openai.PermissionDeniedError):
        call(proxy, refuseAfterAdmission=True)

    wait_for(
        lambda: Reservation.objects.filter(state=ReservationState.SETTLED).count() == 2,
        timeout=10,
        what="the early admission's release",
    )
    refused = Reservation.objects.exclude(outcome="COMPLETED").get()
    assert (refused.outcome, refused.input_consumed, refused.captured, refused.concurrency_held) == (
        "RELEASED",
        0,
        0,
        False,
    )
    assert refused.failure_reason.startswith("never processed"), refused.failure_reason
    assert nothing_held()
    assert counter.seen == [] and len(simulator.entries()) == 1
    # LiteLLM's refusal made the request's digest unknown: its next call waits for LiteLLM's acceptance.
    log_before = proxy.log.read_text(errors="replace")
    settled(call(proxy).headers["x-tokenbudget-reservation-id"])
    [admitted] = [line for line in logged_since(proxy, log_before) if "admitted support" in line]
    assert not admitted.endswith("asked on arrival"), admitted


def test_a_call_a_guardrail_changed_before_our_hook_is_admitted_as_changed(
    proxy: LiteLLMProxy, api: Gunicorn, sim: tuple[Simulator, RecordingCounter]
) -> None:
    simulator, counter = sim
    settled(call(proxy, REWRITTEN).headers["x-tokenbudget-reservation-id"])
    counter.seen.clear()
    log_before = proxy.log.read_text(errors="replace")

    raw = call(proxy, REWRITTEN, rewriteQuestion="Can I change my delivery address?")

    row = settled(raw.headers["x-tokenbudget-reservation-id"])
    assert (row.state, row.outcome) == (ReservationState.SETTLED, "COMPLETED")
    assert row.request_id == f"litellm-{raw.headers['x-litellm-call-id']}"
    assert counter.seen == [admitted_messages(row)]
    assert "Can I change my delivery address?" in str(admitted_messages(row))
    wait_for(
        lambda: Reservation.objects.filter(state=ReservationState.SETTLED).count() == 3,
        timeout=10,
        what="the early admission's release",
    )
    early = Reservation.objects.get(outcome="RELEASED")
    assert QUESTION in str(admitted_messages(early)) and early.input_consumed == 0
    logged = logged_since(proxy, log_before)
    assert any("differs from the call LiteLLM handed over" in line for line in logged), logged
    assert not any(line.endswith("asked on arrival") for line in logged), "admitted in the pre-call hook"
    # The group's next call is admitted in the pre-call hook: no early admission to release.
    before = Reservation.objects.count()
    settled(call(proxy, REWRITTEN).headers["x-tokenbudget-reservation-id"])
    assert Reservation.objects.count() == before + 1
    assert nothing_held()
    assert_clean(simulator)
