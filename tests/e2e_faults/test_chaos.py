"""The chaos run (issue 11): the real launcher (embedded PostgreSQL and Redis, 3-second leases) under
traffic from the gateway client (``simulation.traffic.Fleet``) against the provider simulator, while the
Celery worker, Celery beat, a gunicorn worker, PostgreSQL and Redis are killed with SIGKILL in turn.

Throughout, every answer of the API is recorded at the gateway client's transport: only 2xx, 4xx
problem+json and 503 problem+json with Retry-After are allowed (never a 500, never HTML). After each fault
the killed process must be back and the API answering 2xx again. After the traffic, the platform's own
worker reconciles (the test only enqueues the tasks sooner than the beat would) and then: nothing is open,
nothing was refunded that the provider processed, no account is overspent, the ledger audit is clean, and
what was settled for each provider request is what the simulator billed.

``pytest -s`` prints, per fault, the requests sent while it lasted, the status classes seen and the time
to recover. The long variant (``-m chaos_long``) runs more gateways, provider faults too, and three rounds.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from tokenbudget_gateway.transport import ApiClient

from simulation.billing import BillingStatus
from simulation.provider import Simulator
from simulation.traffic import Fleet
from tests.launcher.harness import DEMO_TOKEN, Launcher, alive, running_launcher, wait_until

pytestmark = pytest.mark.slow

FAULTS = ("celery worker", "celery beat", "web worker", "postgres", "redis")
# What the launcher calls each process in its log.
NAMES = {
    "celery worker": "celery worker",
    "celery beat": "celery beat",
    "postgres": "embedded PostgreSQL",
    "redis": "embedded Redis",
}
OK, CLIENT_ERROR, UNAVAILABLE = "2xx", "4xx problem+json", "503 problem+json"
RECOVER_SECONDS = 60.0
WEB_WORKERS = 4


@dataclass(frozen=True)
class Chaos:
    gateways: int
    provider_fault_rate: float
    rounds: int
    steady_s: float


@dataclass
class Answers:
    """Every HTTP exchange of the gateways with our API: ``(when, class)``."""

    seen: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, label: str) -> None:
        with self.lock:
            self.seen.append((time.monotonic(), label))

    def between(self, start: float, end: float) -> Counter[str]:
        with self.lock:
            return Counter(label for moment, label in self.seen if start <= moment <= end)

    def ok_after(self, moment: float) -> bool:
        with self.lock:
            return any(label == OK and when > moment for when, label in self.seen)

    def total(self) -> Counter[str]:
        with self.lock:
            return Counter(label for _, label in self.seen)


def classify(status: int, headers: Mapping[str, str]) -> str:
    content_type = headers.get("content-type", "").split(";")[0]
    if 200 <= status < 300:
        return OK
    if content_type == "application/problem+json":
        if status == 503 and headers.get("retry-after"):
            return UNAVAILABLE
        if 400 <= status < 500:
            return CLIENT_ERROR
    return f"{status} {content_type or 'no content type'}"


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> Answers:
    """Record each answer at the gateway client's transport, retries included."""
    seen = Answers()
    exchange = ApiClient._exchange

    def recording(self: ApiClient, *args: Any) -> tuple[int, dict[str, str], bytes]:
        try:
            status, headers, raw = exchange(self, *args)
        except (OSError, http.client.HTTPException) as error:
            seen.add(f"no answer ({type(error).__name__})")
            raise
        seen.add(classify(status, headers))
        return status, headers, raw

    monkeypatch.setattr(ApiClient, "_exchange", recording)
    return seen


def victim(launcher: Launcher, fault: str) -> int:
    if fault == "web worker":
        return launcher.web_workers()[0]
    return launcher.one(fault)


def back(launcher: Launcher, fault: str, killed: int, mark: int) -> bool:
    """The killed process is replaced (by gunicorn for a web worker, by the launcher otherwise)."""
    if fault == "web worker":
        workers = launcher.web_workers()
        return len(workers) == WEB_WORKERS and killed not in workers
    restarted = f"platform: {NAMES[fault]} restarted" in launcher.output()[mark:]
    pids = launcher.children()[fault]
    return restarted and len(pids) == 1 and killed not in pids and alive(pids[0])


@dataclass(frozen=True)
class Figure:
    round: int
    fault: str
    statuses: Counter[str]
    recovered_s: float
    launcher_said: list[str]


def inflict(launcher: Launcher, answers: Answers, fault: str, round_number: int) -> Figure:
    """Kill one process, wait until it is back and the API answers 2xx again; what the clients saw."""
    mark = len(launcher.output())
    killed = victim(launcher, fault)
    killed_at = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: back(launcher, fault, killed, mark), timeout=RECOVER_SECONDS, what=f"{fault} back")
    process_back = time.monotonic()
    wait_until(lambda: answers.ok_after(process_back), timeout=RECOVER_SECONDS, what="a 2xx answer")
    recovered = time.monotonic()
    said = re.findall(r"^platform: .*$", launcher.output()[mark:], re.MULTILINE)
    return Figure(round_number, fault, answers.between(killed_at, recovered), recovered - killed_at, said)


def run_chaos(launcher: Launcher, sim: Simulator, answers: Answers, chaos: Chaos) -> None:
    launcher.probe("point-pools", sim.base_url)
    fleet = Fleet(
        api_url=launcher.base_url,
        token=DEMO_TOKEN,
        provider_url=sim.base_url,
        provider_key="sk-chaos",
        seed=23,
        concurrency=chaos.gateways,
        fault_rate=chaos.provider_fault_rate,
    )
    figures = []
    fleet.start()
    try:
        wait_until(lambda: answers.ok_after(0), timeout=30, what="a first admission")
        for round_number in range(1, chaos.rounds + 1):
            for fault in FAULTS:
                figures.append(inflict(launcher, answers, fault, round_number))
                time.sleep(chaos.steady_s)
    finally:
        fleet.stop()
        assert fleet.join(90), "gateway threads still running"
    traffic = fleet.tally.snapshot()
    ledger = launcher.probe("settle", fleet.request_prefix, "90", timeout=180)
    comparison = sim.compare({pid: (usage[0], usage[1]) for pid, usage in ledger["settled"].items()})

    print(f"\nchaos: {chaos}")
    for figure in figures:
        print(
            f"  round {figure.round} {figure.fault:<13} requests {sum(figure.statuses.values()):>4}  "
            f"recovered in {figure.recovered_s:5.1f}s  statuses {dict(sorted(figure.statuses.items()))}"
        )
        for line in figure.launcher_said:
            print(f"      {line}")
    print(f"  all answers     {dict(sorted(answers.total().items()))}")
    print(f"  gateway tally   {dict(sorted(traffic.items()))}")
    print(
        f"  reservations    {ledger['states']} (reconciled in {ledger['settle_seconds']}s); audit "
        f"{len(ledger['violations'])} violations, {len(ledger['leaks'])} leaks; settled = billed for "
        f"{comparison.compared} provider requests, {len(comparison.mismatches)} mismatches, "
        f"{len(comparison.unsettled)} billed but not settled; billing import findings "
        f"{ledger['billing_findings']}"
    )

    # The API answered only 2xx, 4xx problem+json and 503 problem+json with Retry-After.
    allowed = {OK, CLIENT_ERROR, UNAVAILABLE}
    unexpected = {label: n for label, n in answers.total().items() if label not in allowed}
    lost = {label: n for label, n in unexpected.items() if label.startswith("no answer")}
    assert unexpected == lost, unexpected
    # A connection can only be cut by the death of the worker serving it, never answered badly.
    assert sum(lost.values()) <= chaos.rounds * chaos.gateways, lost
    # Every process is back.
    children = launcher.children()
    assert all(len(children[kind]) == (2 if kind == "gunicorn" else 1) for kind in children), children
    assert len(launcher.web_workers()) == WEB_WORKERS
    # Nothing left open; nothing refunded that the provider processed; no overspend; audit clean.
    assert set(ledger["states"]) <= {"SETTLED", "REJECTED"}, ledger["states"]
    processed = [
        pid
        for pid in ledger["refunded"]
        if (entry := sim.entry(pid)) is not None and entry.status is not BillingStatus.FAILED_UNPROCESSED
    ]
    assert processed == [], processed
    assert ledger["overspent_accounts"] == []
    assert ledger["violations"] == [] and ledger["leaks"] == []
    # Settled = billed.
    assert comparison.mismatches == () and comparison.unsettled == (), comparison
    assert ledger["billing_findings"].get("MISMATCH", 0) == 0
    assert traffic["admitted"] > 0 and comparison.compared > 0


LEASE = {"LEASE_SECONDS": "3", "WEB_CONCURRENCY": str(WEB_WORKERS)}


def test_the_platform_survives_each_process_being_killed_under_traffic(
    answers: Answers, sim: Simulator
) -> None:
    with running_launcher(**LEASE) as launcher:
        chaos = Chaos(gateways=4, provider_fault_rate=0.0, rounds=1, steady_s=1)
        run_chaos(launcher, sim, answers, chaos)


@pytest.mark.chaos_long
def test_the_platform_survives_rounds_of_kills_under_heavier_faulty_traffic(
    answers: Answers, sim: Simulator
) -> None:
    with running_launcher(**LEASE) as launcher:
        chaos = Chaos(gateways=8, provider_fault_rate=0.15, rounds=3, steady_s=10)
        run_chaos(launcher, sim, answers, chaos)
