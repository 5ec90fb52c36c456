"""``manage.py simulate``: the end-to-end run against the running platform (``./platform run``).

It starts the provider simulator on loopback, points the model pools' provider at it for the run (and
restores them afterwards) — through the simulator's own adapter, or with ``--adapter openai`` through the
real OpenAI adapter (the official SDK: stored-completion lookups, usage and cost buckets), the simulator
answering in OpenAI's shapes — drives the ``reconciliation.traffic`` fleet through the real HTTP API for
``--duration`` seconds while showing a live status line, waits (bounded) until the platform's Celery worker
and beat have resolved every reservation of the run — enqueueing the reclaim and lookup tasks itself to
speed that up — and prints a summary. It exits non-zero when the ledger audit finds a violation or a leak,
when what was settled differs from what the simulator billed, or when reservations are left unresolved.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.db.models import Count, Q, Sum
from django.utils import timezone

from budgeting.backoffice.formats import count
from budgeting.catalog.models import ModelPool
from budgeting.celery import app as celery_app
from ledger.models import Reservation, State
from ledger.selectors import AuditReport, audit
from reconciliation import billing
from reconciliation.models import BillingImport
from simulation.billing import BillingComparison
from simulation.provider import Simulator
from simulation.traffic import Fleet

DEMO_TOKEN = "tb_demo_gateway_eu_0000000000000000"
PROVIDER_KEY = "sk-simulate"
# The OpenAI adapter fetches usage only with an admin key; the simulator takes any. It lives in this process
# only, so with --adapter openai this command runs the usage import itself.
ADMIN_KEY_ENV = "TB_SIMULATE_ADMIN_KEY"
OPEN = [State.PROPOSED, State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]
SPEED_UP_TASKS = (
    "reconciliation.reclaim_expired_leases",
    "reconciliation.lookup_unknown_outcomes",
    "reconciliation.admit_queued",
)
ENQUEUE_EVERY_S = 5.0
DRAIN_TIMEOUT_S = 120.0
IMPORT_TIMEOUT_S = 30.0


class Command(BaseCommand):
    help = (
        "Drive realistic traffic with faults through the running platform's HTTP API, the gateway client and "
        "the provider simulator; wait for reconciliation; check the ledger audit and settled = billed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        port = os.environ.get("PORT", "8000")
        parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default 60)")
        parser.add_argument("--seed", type=int, default=7)
        parser.add_argument("--api-url", default=f"http://127.0.0.1:{port}", help="our API (./platform run)")
        parser.add_argument("--token", default=DEMO_TOKEN, help="a service client token (default: demo)")
        parser.add_argument("--concurrency", type=int, default=8, help="gateway threads (default 8)")
        parser.add_argument("--fault-rate", type=float, default=0.2, help="share of calls that misbehave")
        parser.add_argument(
            "--settle-timeout",
            type=float,
            default=None,
            help="seconds to wait for reconciliation after the traffic (default: 4 leases + 60, with the "
            "lease the server granted)",
        )
        parser.add_argument(
            "--task-queue",
            default=None,
            help="Celery queue to send the reclaim/lookup/billing tasks to (default: the default queue)",
        )
        parser.add_argument(
            "--adapter",
            choices=["simulator", "openai"],
            default="simulator",
            help="how the platform reads the provider: the simulator's adapter (default) or the real OpenAI "
            "adapter against the simulator's OpenAI-shaped endpoints",
        )
        parser.add_argument(
            "--no-enqueue",
            action="store_true",
            help="leave reconciliation to the beat alone instead of also enqueueing the reclaim/lookup tasks",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        duration: float = options["duration"]
        concurrency: int = options["concurrency"]
        fault_rate: float = options["fault_rate"]
        if duration <= 0 or concurrency < 1 or not 0 <= fault_rate <= 1:
            raise CommandError("need --duration > 0, --concurrency >= 1 and 0 <= --fault-rate <= 1")
        api_url: str = options["api_url"].rstrip("/")
        _require_api(api_url)
        # Words per chunk as real providers send them (a few tokens each), to keep chunks realistic.
        sim = Simulator(seed=options["seed"], max_words_per_chunk=6)
        sim.start()
        adapter: str = options["adapter"]
        previous = _point_pools(sim.base_url, adapter)
        try:
            fleet = Fleet(
                api_url=api_url,
                token=options["token"],
                provider_url=sim.base_url,
                provider_key=PROVIDER_KEY,
                seed=options["seed"],
                concurrency=concurrency,
                fault_rate=fault_rate,
            )
            self.stdout.write(
                f"simulate: run {fleet.run_id}: {duration:g}s of traffic, {concurrency} gateways, fault rate "
                f"{fault_rate:g}, against {api_url}; provider simulator at {sim.base_url}"
            )
            status = StatusLine(self.stdout, fleet, tty=self.stdout.isatty())
            self._traffic(fleet, duration, status)
            # The server's lease decides how long crashed gateways' reservations stay held; this process's
            # settings need not know it.
            lease_s = fleet.longest_lease_s or settings.LEASE_SECONDS
            settle_timeout = options["settle_timeout"] or 4 * lease_s + 60
            self.stdout.write(f"waiting up to {settle_timeout:.0f}s to reconcile (lease ~{lease_s:.0f}s)")
            queue: str | None = options["task_queue"]
            enqueue = not options["no_enqueue"]
            settled = self._settle(fleet, settle_timeout, status, enqueue=enqueue, queue=queue)
            imported = _import_billing(queue, adapter)
            summary = Summary.collect(fleet, sim, imported, vouching=adapter == "simulator")
        finally:
            _restore_pools(previous)
            sim.stop()
        self.stdout.write(summary.render(settled))
        problems = summary.problems()
        if problems:
            raise CommandError("; ".join(problems), returncode=1)

    def _traffic(self, fleet: Fleet, duration: float, status: StatusLine) -> None:
        began = time.monotonic()
        fleet.start()
        try:
            while time.monotonic() - began < duration:
                time.sleep(min(1.0, max(0.0, duration - (time.monotonic() - began))))
                status.show("traffic")
        finally:
            fleet.stop()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not fleet.join(1.0):
            status.show("finishing calls")
            if time.monotonic() > deadline:
                raise CommandError(f"gateway threads still running after {DRAIN_TIMEOUT_S:g}s")
        status.show("traffic done", final=True)

    def _settle(
        self, fleet: Fleet, timeout: float, status: StatusLine, *, enqueue: bool, queue: str | None
    ) -> bool:
        """Wait until no reservation of the run is open or RECONCILING (unless flagged for a person); True if
        that happened in time."""
        deadline = time.monotonic() + timeout
        next_enqueue = 0.0
        while time.monotonic() < deadline:
            counts = run_states(fleet.request_prefix)
            waiting = counts[State.RECONCILING] - needing_a_person(fleet.request_prefix)
            if not sum(counts[state] for state in OPEN) and not waiting:
                status.show("reconciled", final=True)
                return True
            if enqueue and time.monotonic() >= next_enqueue:
                for task in SPEED_UP_TASKS:
                    celery_app.send_task(task, queue=queue)
                next_enqueue = time.monotonic() + ENQUEUE_EVERY_S
            status.show("reconciling")
            time.sleep(1.0)
        status.show("gave up waiting", final=True)
        return False


def _require_api(api_url: str) -> None:
    try:
        with urllib.request.urlopen(f"{api_url}/api/v1/schema", timeout=5) as response:
            response.read()
    except (OSError, urllib.error.URLError) as exc:
        raise CommandError(
            f"nothing answers at {api_url} ({exc}); start the platform with ./platform run"
        ) from None


POOL_PROVIDER_FIELDS = ("provider_base_url", "provider", "adapter", "api_key_env", "admin_key_env")


def _point_pools(base_url: str, adapter: str) -> dict[int, dict[str, Any]]:
    """Point every model pool's provider (lookups, billing) at the simulator through ``adapter``; return the
    old settings.

    A direct update: this is the simulation's own wiring of a demo database, not an operator's change.
    """
    previous = {row["pk"]: row for row in ModelPool.objects.values("pk", *POOL_PROVIDER_FIELDS)}
    if adapter == "openai":
        os.environ[ADMIN_KEY_ENV] = "sk-simulate-admin"
        ModelPool.objects.update(
            provider_base_url=f"{base_url}/v1",
            provider="openai",
            adapter="openai",
            admin_key_env=ADMIN_KEY_ENV,
        )
    else:
        ModelPool.objects.update(provider_base_url=base_url, provider="simulator", adapter="simulator")
    return previous


def _restore_pools(previous: Mapping[int, Mapping[str, Any]]) -> None:
    for pk, row in previous.items():
        ModelPool.objects.filter(pk=pk).update(**{name: row[name] for name in POOL_PROVIDER_FIELDS})


def needing_a_person(prefix: str) -> int:
    """How many reservations of the run the reconciler handed to a person."""
    return (
        Reservation.objects.filter(request_id__startswith=prefix, state=State.RECONCILING)
        .exclude(needs_person="")
        .count()
    )


def run_states(prefix: str) -> Counter[str]:
    """How many reservations of the run are in each state."""
    rows = Reservation.objects.filter(request_id__startswith=prefix).values("state").annotate(n=Count("pk"))
    return Counter({row["state"]: row["n"] for row in rows})


class StatusLine:
    """The live status: redrawn in place on a terminal, a line every few seconds otherwise."""

    EVERY_S = 5.0

    def __init__(self, out: OutputWrapper, fleet: Fleet, *, tty: bool) -> None:
        self._out = out
        self._fleet = fleet
        self._tty = tty
        self._began = time.monotonic()
        self._last = 0.0

    def show(self, phase: str, *, final: bool = False) -> None:
        now = time.monotonic()
        if not (self._tty or final or now - self._last >= self.EVERY_S):
            return
        self._last = now
        n = self._fleet.tally.snapshot()
        states = run_states(self._fleet.request_prefix)
        line = (
            f"[{now - self._began:5.0f}s {phase}] requests {count(n['requests'])} | in flight "
            f"{count(n['in_flight'])} | admitted {count(n['admitted'])} (degraded {count(n['degraded'])}) | "
            f"rejected {count(n['rejected'])} | open {count(sum(states[s] for s in OPEN))} | reconciling "
            f"{count(states[State.RECONCILING])} | settled {count(states[State.SETTLED])}"
        )
        if self._tty:
            self._out.write("\r\033[K" + line, ending="\n" if final else "")
            self._out.flush()
        else:
            self._out.write(line)


@dataclass(frozen=True)
class BillingCheck:
    """The platform's own import of the simulator's billing export, made at the end of the run."""

    imported: bool
    findings: Mapping[str, int]


def _import_billing(queue: str | None, adapter: str) -> BillingCheck:
    """Enqueue the billing-import task and wait (bounded) for the import it creates; with the OpenAI adapter,
    run the usage import here (the admin key is this process's)."""
    started = timezone.now()
    if adapter == "openai":
        billing.fetch_and_import(now=started)
    else:
        celery_app.send_task("reconciliation.import_provider_billing", queue=queue)
    deadline = time.monotonic() + IMPORT_TIMEOUT_S
    while time.monotonic() < deadline:
        done = BillingImport.objects.filter(imported_at__gte=started).order_by("-imported_at").first()
        if done is not None:
            # Findings are written after the import row; give the task a moment to finish them.
            time.sleep(1.0)
            kinds = done.findings.values("kind").annotate(n=Count("pk"))
            return BillingCheck(True, {row["kind"]: row["n"] for row in kinds})
        time.sleep(0.5)
    return BillingCheck(False, {})


@dataclass(frozen=True)
class Summary:
    traffic: Counter[str]
    outcomes: Mapping[tuple[str, str], int]
    open_left: int
    reconciling_left: int
    needs_person: int
    vouching: bool
    overruns: int
    overrun_tokens: int
    audit: AuditReport
    billed: BillingComparison
    billing: BillingCheck
    checked_at: datetime
    provider_counts: int
    """Counting requests the simulator answered (Anthropic count_tokens for the provider-counted model)."""

    @classmethod
    def collect(cls, fleet: Fleet, sim: Simulator, billing: BillingCheck, *, vouching: bool) -> Summary:
        ours = Reservation.objects.filter(request_id__startswith=fleet.request_prefix)
        outcomes = {
            (row["state"], row["outcome"] or ""): row["n"]
            for row in ours.values("state", "outcome").annotate(n=Count("pk"))
        }
        overruns = ours.aggregate(n=Count("pk", filter=Q(overrun__gt=0)), tokens=Sum("overrun"))
        settled = {
            provider_request_id: (input_consumed, captured + overrun)
            for provider_request_id, input_consumed, captured, overrun in ours.filter(state=State.SETTLED)
            .exclude(provider_request_id="")
            .values_list("provider_request_id", "input_consumed", "captured", "overrun")
        }
        now = timezone.now()
        return cls(
            traffic=fleet.tally.snapshot(),
            outcomes=outcomes,
            open_left=ours.filter(state__in=OPEN).count(),
            reconciling_left=ours.filter(state=State.RECONCILING, needs_person="").count(),
            needs_person=needing_a_person(fleet.request_prefix),
            vouching=vouching,
            overruns=overruns["n"] or 0,
            overrun_tokens=overruns["tokens"] or 0,
            audit=audit(now),
            billed=sim.compare(settled),
            billing=billing,
            checked_at=now,
            provider_counts=len(sim.counts()),
        )

    def problems(self) -> list[str]:
        found = []
        if not self.audit.ok:
            audit = self.audit
            found.append(f"ledger audit: {len(audit.violations)} violations, {len(audit.leaks)} leaks")
        if self.billed.mismatches or self.billed.unsettled:
            found.append(
                f"settled != billed: {len(self.billed.mismatches)} mismatches, "
                f"{len(self.billed.unsettled)} billed but not settled"
            )
        if self.open_left or self.reconciling_left:
            found.append(f"{self.open_left} open and {self.reconciling_left} reconciling reservations left")
        if self.vouching and self.needs_person:
            # The simulator vouches for every answer: only contradictory evidence can need a person.
            found.append(f"{self.needs_person} reservations need a person")
        if self.billing.findings.get("MISMATCH"):
            found.append(f"billing import found {self.billing.findings['MISMATCH']} mismatches")
        return found

    def render(self, settled_in_time: bool) -> str:
        t = self.traffic

        def breakdown(prefix: str) -> str:
            parts = sorted((name.removeprefix(prefix), n) for name, n in t.items() if name.startswith(prefix))
            return ", ".join(f"{name} {count(n)}" for name, n in parts) or "none"

        lines = [
            "",
            "traffic",
            f"  requests              {count(t['requests'])}",
            f"  admitted              {count(t['admitted'])}  (degraded {count(t['degraded'])}: "
            f"{breakdown('degraded:')})",
            f"  queued                {count(t['queued'])}  ({breakdown('queue:')})",
            f"  rejected              {count(t['rejected'])}  ({breakdown('rejected:')})",
            f"  shadow (not held)     {count(t['shadow'])}",
            f"  faults injected       {count(sum(n for k, n in t.items() if k.startswith('fault:')))}  "
            f"({breakdown('fault:')})",
            f"  calls ended           {breakdown('outcome:')}",
            "reservations of the run",
        ]
        for (state, outcome), n in sorted(self.outcomes.items()):
            lines.append(f"  {(state + ' ' + outcome).strip():<21} {count(n)}")
        lines += [
            f"  reconciling left      {count(self.reconciling_left)}",
            f"  needs a person        {count(self.needs_person)}"
            + (
                ""
                if self.vouching
                else "  (the adapter cannot vouch for 'not found': expected for unprocessed calls)"
            ),
            f"  other open left       {count(self.open_left)}"
            + ("" if settled_in_time else "  (the settle timeout ran out)"),
            f"  overruns              {count(self.overruns)}  ({count(self.overrun_tokens)} tokens)",
            "ledger audit (whole ledger)",
            f"  {'OK' if self.audit.ok else 'FAILED'}: {count(self.audit.accounts_checked)} accounts, "
            f"{count(self.audit.reservations_checked)} reservations, {count(len(self.audit.violations))} "
            f"violations, {count(len(self.audit.leaks))} leaks",
        ]
        lines += [f"    {line}" for line in (self.audit.violations + self.audit.leaks)[:20]]
        lines.append(
            f"provider counting API: {count(self.provider_counts)} counts answered by the simulator "
            "(countMethod PROVIDER_COUNT; repeated payloads come from the count cache)"
        )
        b = self.billed
        lines += [
            "settled vs the simulator's billing (input/output tokens per provider request)",
            f"  {'OK' if b.ok and not b.unsettled else 'FAILED'}: {count(b.compared)} settled provider "
            f"requests; settled {count(b.settled_input)}/{count(b.settled_output)}, billed "
            f"{count(b.billed_input)}/{count(b.billed_output)}; {count(len(b.mismatches))} mismatches, "
            f"{count(len(b.unsettled))} billed but not settled",
        ]
        lines += [
            f"    {m.request_id}: settled {count(m.settled[0])}/{count(m.settled[1])}, billed "
            f"{count(m.billed[0])}/{count(m.billed[1])}"
            for m in b.mismatches[:20]
        ]
        lines += [f"    billed, not settled: {request_id}" for request_id in b.unsettled[:20]]
        lines.append("billing import of the simulator's export (the platform's own check)")
        if self.billing.imported:
            lines.append(f"  findings: {json.dumps(dict(sorted(self.billing.findings.items())))}")
        else:
            lines.append(f"  no new import within {IMPORT_TIMEOUT_S:g}s (is the Celery worker running?)")
        lines.append(f"checked at {self.checked_at.isoformat(timespec='seconds')}")
        return "\n".join(lines)
