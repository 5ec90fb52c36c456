"""The README's LiteLLM example, run as pasted: its proxy config, hook settings and client code are read from
README.md, and only the loopback ports are moved to free ones (the demo's API on 8000 and simulator on 8090,
the proxy's 4000); the environment its shell lines give the proxy is checked and used as written."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ledger.models import Reservation
from ledger.models import State as ReservationState
from simulation.provider import Simulator
from tests.e2e_faults.harness import TOKEN, assert_clean, wait_for
from tests.integrations.conftest import Gunicorn, Ports, RecordingCounter
from tests.integrations.litellm_proxy import ROOT, LiteLLMProxy
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SECTION = "## Use it from a LiteLLM proxy"


def blocks(language: str) -> list[str]:
    """The fenced ``language`` blocks of the README's LiteLLM section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(SECTION) :]
    end = section.find("\n## ", len(SECTION))
    section = section if end < 0 else section[:end]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def is_settled(reservation_id: str) -> bool:
    return Reservation.objects.get(pk=reservation_id).state == ReservationState.SETTLED


def test_the_readme_example_serves_a_plain_and_a_contract_review_call_as_pasted(
    litellm_venv: Path, ports: Ports, api: Gunicorn, sim: tuple[Simulator, RecordingCounter], tmp_path: Path
) -> None:
    simulator, _ = sim
    [shell] = blocks("sh")
    [config_text] = blocks("yaml")
    [settings_text] = blocks("json")
    [client_code] = blocks("python")
    proxy_port = free_port()

    def moved(text: str) -> str:
        return (
            text.replace("127.0.0.1:8000", f"127.0.0.1:{ports.api}")
            .replace("127.0.0.1:8090", f"127.0.0.1:{ports.sim}")
            .replace("127.0.0.1:4000", f"127.0.0.1:{proxy_port}")
        )

    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", shell))
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["TOKEN_BUDGET_TOKEN"] == TOKEN
    assert "gateway/litellm-requirements.txt" in shell and "'./gateway[litellm]'" in shell
    assert "--port 4000" in shell
    proxy = LiteLLMProxy(litellm_venv, tmp_path, proxy_port)
    try:
        proxy.start(
            yaml.safe_load(moved(config_text)),
            json.loads(moved(settings_text)),
            env["TOKEN_BUDGET_TOKEN"],
            master_key=env["LITELLM_MASTER_KEY"],
        )
        ran = subprocess.run(
            [sys.executable, "-c", moved(client_code)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        proxy.stop()

    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{proxy.tail()}"
    lines = dict(line.split(": ", 1) for line in ran.stdout.strip().splitlines())
    support_id = lines["support"].split()[0]
    review_id, rung = lines["contract-review"].split()[:2]
    assert rung == "FULL"
    for reservation_id in (support_id, review_id):
        wait_for(
            functools.partial(is_settled, reservation_id),
            timeout=20,
            what=f"reservation {reservation_id} to settle",
        )
        assert Reservation.objects.get(pk=reservation_id).outcome == "COMPLETED"
        assert reservation_id in proxy.log.read_text(), "the reservation is not in the proxy's log"
    assert_clean(simulator)
