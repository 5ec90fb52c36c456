"""``failOpen`` through a real LiteLLM proxy: with our API down, a call is let through unadmitted (and
logged), whether its group is admitted while LiteLLM routes it (``support``) or before it
(``contract-review``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.models import Reservation
from simulation.provider import Simulator
from tests.integrations.conftest import Ports, RecordingCounter, running_proxy
from tests.integrations.litellm_proxy import LiteLLMProxy
from tests.integrations.test_litellm_proxy import client, evidence

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def open_proxy(
    litellm_venv: Path, ports: Ports, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiteLLMProxy]:
    with running_proxy(
        litellm_venv, ports, tmp_path_factory.mktemp("litellm-open"), failOpen=True, timeoutSeconds=2
    ) as proxy:
        yield proxy


@pytest.mark.parametrize("group", ["support", "contract-review"])
def test_with_our_api_down_a_fail_open_call_goes_through_unadmitted_and_logged(
    open_proxy: LiteLLMProxy, sim: tuple[Simulator, RecordingCounter], group: str
) -> None:
    simulator, counter = sim
    log_before = open_proxy.log.read_text(errors="replace")
    extra = (
        {"metadata": {"tokenbudget": {"evidence": [evidence("e1")]}}} if group == "contract-review" else {}
    )

    answer = client(open_proxy).chat.completions.create(
        model=group,
        messages=[{"role": "user", "content": "Where is my order?"}],
        max_tokens=20,
        extra_body=extra,
    )

    assert answer.choices[0].message.content
    # The caller's own messages went to the provider, as sent: nothing was admitted.
    assert counter.seen == [[{"role": "user", "content": "Where is my order?"}]]
    assert len(simulator.entries()) == 1
    assert not Reservation.objects.exists()
    time.sleep(1)
    logged = open_proxy.log.read_text(errors="replace")[len(log_before) :]
    assert "let through unadmitted (failOpen)" in logged
