"""Realistic gateway traffic for the end-to-end run (``manage.py simulate``).

A ``Fleet`` of gateway threads sends admission requests through our real HTTP API and, for each grant, runs
the provider call with the ``GatewayClient`` against the provider simulator. Requests mix the demo
configuration's tenants (one of them in SHADOW) and task classes, and sizes: most fit as sent, some need the
degradation ladder (duplicate evidence, a long history with a compaction artifact, more evidence than the
budget) and some cannot fit at all (the minimum evidence alone exceeds the budget). A share of the calls,
``fault_rate``, misbehaves: the provider cuts the stream, omits or duplicates or reorders usage, resets,
fails with a 5xx, bills without answering or rate-limits; or the gateway dies before or after recording
the dispatch or mid-stream, or its caller cancels mid-stream. Queued admissions are polled like a real
gateway would, until the queue admits or rejects them or the run ends.

Each thread draws from its own ``random.Random(f"{seed}:{thread}")``, so what a thread sends is reproducible;
how the threads interleave is not. Django-free: it talks HTTP only.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from tokenbudget_gateway.client import DiePoint, GatewayClient
from tokenbudget_gateway.errors import (
    ApiError,
    ApiUnavailable,
    ClientDied,
    GatewayError,
    ProtocolViolation,
    StaleFence,
)
from tokenbudget_gateway.protocol import ADMISSIONS_PATH, CallResult, Grant
from tokenbudget_gateway.provider import ChatProvider
from tokenbudget_gateway.transport import ApiClient, RetryPolicy

logger = logging.getLogger(__name__)

MODEL_POOL: Final = "eu-large"
MODEL_REVISION: Final = "model@2026-07-01"
# One request in PROVIDER_COUNTED_SHARE goes to the demo's Claude model, which the simulator's Anthropic
# counting API counts (chosen by a hash of the request id: the seeded draws of every plan stay as they were).
PROVIDER_COUNTED: Final = ("eu-frontier", "claude-sonnet-4-5@2025-09-29")
PROVIDER_COUNTED_SHARE: Final = 8
TENANTS: Final = (("t-19", 6), ("t-internal", 3), ("t-20", 1))
TASK_CLASSES: Final = (("contract-review", 5), ("support-chat", 3), ("summarize", 2))
SIZES: Final = (("small", 80), ("ladder", 14), ("oversize", 6))
MAX_OUTPUT: Final = {"contract-review": (64, 480), "support-chat": (32, 240), "summarize": (64, 400)}
QUEUE_POLL_S: Final = 1.0
QUEUE_PATIENCE_S: Final = 90.0
_WORDS: Final = (
    "the", "contract", "clause", "party", "shall", "notice", "term", "review", "liability", "payment",
    "within", "days", "of", "and", "to", "evidence", "section", "agreement", "may", "not", "exceed", "limit",
    "obligation", "under", "this", "renewal", "termination", "breach", "cure", "period", "written",
    "consent", "indemnity", "warranty", "governing", "law", "jurisdiction", "assignment", "confidentiality",
    "delivery", "invoice", "schedule", "amendment", "waiver", "severability", "customer", "supplier",
    "service", "level", "credit", "refund",
)  # fmt: skip


class FaultKind(StrEnum):
    """One way a call misbehaves: at the provider (a simulator script) or in the gateway itself."""

    CUT_STREAM = "cut_stream"
    OMIT_USAGE = "omit_usage"
    DUPLICATE_USAGE = "duplicate_usage"
    REORDER_USAGE = "reorder_usage"
    RESET_BEFORE_READ = "reset_before_read"
    RESET_AFTER_READ = "reset_after_read"
    HTTP_5XX = "http_5xx"
    BILL_WITHOUT_ANSWER = "bill_without_answer"
    RATE_LIMITED = "rate_limited"
    DIE_BEFORE_DISPATCH = "die_before_dispatch"
    DIE_AFTER_DISPATCH = "die_after_dispatch"
    DIE_MID_STREAM = "die_mid_stream"
    CANCEL_MID_STREAM = "cancel_mid_stream"


# The simulator's X-Sim-Fault header for provider-side faults; "{k}" is the chunk a cut happens after.
_SIM_HEADER: Final[Mapping[FaultKind, str]] = {
    FaultKind.CUT_STREAM: "cut_after_chunks;after_chunks={k}",
    FaultKind.OMIT_USAGE: "omit_usage",
    FaultKind.DUPLICATE_USAGE: "duplicate_usage",
    FaultKind.REORDER_USAGE: "reorder_usage",
    FaultKind.RESET_BEFORE_READ: "reset_before_read",
    FaultKind.RESET_AFTER_READ: "reset_after_read",
    FaultKind.HTTP_5XX: "http_5xx_after_read;status_code=503",
    FaultKind.BILL_WITHOUT_ANSWER: "bill_without_answer",
    FaultKind.RATE_LIMITED: "rate_limited",
    # Slow chunks, so that the caller's cancel lands mid-stream.
    FaultKind.CANCEL_MID_STREAM: ";chunk_delay_s=0.01",
}
_DIE_AT: Final[Mapping[FaultKind, DiePoint]] = {
    FaultKind.DIE_BEFORE_DISPATCH: "before_dispatch",
    FaultKind.DIE_AFTER_DISPATCH: "dispatch",
    FaultKind.DIE_MID_STREAM: "after_k_chunks",
}


@dataclass(frozen=True)
class Plan:
    """One request to send and how its call should misbehave (``fault`` None: not at all)."""

    request_id: str
    tenant: str
    task_class: str
    size: str
    max_output: int
    fault: FaultKind | None
    fault_chunks: int


class Corpus:
    """Passages of seeded filler text, reused across requests as retrieval would (and so the server's
    count cache sees repeats)."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(f"corpus:{seed}")

        def passages(count: int, low: int, high: int) -> tuple[str, ...]:
            return tuple(
                " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)
            )

        self.short = passages(120, 30, 160)
        # ~600-700 tokens: a history of 24 such turns is over support-chat's budget, 8 of them well under.
        self.medium = passages(48, 540, 620)
        # About 1.1 tokens per word with the demo tokenizer: ~1,300-1,650 tokens each.
        self.long = passages(48, 1200, 1500)
        # One of these alone is ~9,000 tokens; three exceed any demo task's input budget.
        self.huge = passages(6, 8200, 8600)


def choose(rng: random.Random, weighted: Sequence[tuple[str, int]]) -> str:
    names, weights = zip(*weighted, strict=True)
    return rng.choices(names, weights=weights)[0]


def plan_request(rng: random.Random, request_id: str, fault_rate: float) -> Plan:
    """Draw one request: tenant, task class, size, requested output and its fault (with ``fault_rate``)."""
    task_class = choose(rng, TASK_CLASSES)
    low, high = MAX_OUTPUT[task_class]
    fault = rng.choice(list(FaultKind)) if rng.random() < fault_rate else None
    return Plan(
        request_id=request_id,
        tenant=choose(rng, TENANTS),
        task_class=task_class,
        size=choose(rng, SIZES),
        max_output=rng.randint(low, high),
        fault=fault,
        fault_chunks=rng.randint(1, 6),
    )


def build_request(plan: Plan, corpus: Corpus, rng: random.Random) -> dict[str, Any]:
    """The admission body of ``plan`` (SPEC §8), with components shaped by its task class and size."""
    components: dict[str, Any] = {
        "immutableRules": ["Answer only from the evidence provided.", "Cite the evidence ids you use."],
        "authorizationScope": {"permissions": ["docs:read"], "tenant": plan.tenant},
        "outputSafety": ["No legal or financial advice beyond the documents."],
        "question": {"text": f"{rng.choice(corpus.short)[:200]}? ({plan.request_id})"},
        "trustedState": [{"id": "tier", "text": "Customer tier: gold", "provenance": "crm"}],
    }
    if plan.task_class == "support-chat":
        components["tools"] = [_tool("lookup_order", essential=False), _tool("open_ticket", essential=False)]
        components["recentTurns"] = _turns(rng, corpus, plan, long=plan.size == "ladder")
        if plan.size == "ladder":
            components["compactions"] = [
                {
                    "id": "cmp-1",
                    "replacesTurns": list(range(1, 17)),
                    "text": "Summary of the first sixteen turns: " + rng.choice(corpus.short),
                    "gateId": "gate-fidelity-v2",
                    "fidelityScore": 0.93,
                    "requestId": plan.request_id,
                }
            ]
        components["evidence"] = _evidence(rng, [rng.choice(corpus.short)], marked=0)
        if plan.size == "oversize":
            components["question"] = {"text": " ".join(rng.sample(corpus.huge, 2))}
    else:
        if plan.task_class == "contract-review":
            components["tools"] = [
                _tool("search_clauses", essential=True),
                _tool("draft_email", essential=False),
            ]
        if plan.size == "small":
            texts = [rng.choice(corpus.short) for _ in range(rng.randint(1, 4))]
            components["evidence"] = _evidence(rng, texts, marked=1)
        elif plan.size == "ladder" and plan.task_class == "contract-review" and rng.random() < 0.5:
            # Every passage retrieved twice (same text, same permissions): DEDUP_EVIDENCE is enough.
            texts = rng.sample(corpus.long, 9)
            components["evidence"] = _evidence(rng, texts + texts, marked=1)
        elif plan.size == "ladder":
            # More distinct evidence than the budget: TRIM_EVIDENCE drops the lowest-ranked.
            components["evidence"] = _evidence(rng, rng.sample(corpus.long, 24), marked=2)
        else:
            # The minimum evidence set alone exceeds the budget: CONTEXT_BUDGET_EXCEEDED.
            components["evidence"] = _evidence(rng, rng.sample(corpus.huge, 4), marked=4)
    pool, model = route(plan.request_id)
    return {
        "requestId": plan.request_id,
        "tenantId": plan.tenant,
        "taskClass": plan.task_class,
        "modelPool": pool,
        "modelRevision": model,
        "maxOutput": plan.max_output,
        "components": components,
    }


def route(request_id: str) -> tuple[str, str]:
    """The (pool, model revision) a request goes to: the provider-counted model for one in
    ``PROVIDER_COUNTED_SHARE``, the demo's main model otherwise."""
    bucket = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big") % PROVIDER_COUNTED_SHARE
    return PROVIDER_COUNTED if bucket == 0 else (MODEL_POOL, MODEL_REVISION)


def _tool(name: str, *, essential: bool) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"{name.replace('_', ' ')} for the caller",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        "essential": essential,
    }


def _evidence(rng: random.Random, texts: Sequence[str], *, marked: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"ev-{index}",
            "sourceId": f"doc-{rng.randint(1, 400)}",
            "text": text,
            "score": round(1.0 - index / (len(texts) + 1), 4),
            "permissions": ["docs:read"],
            "minimumRetention": index < marked,
        }
        for index, text in enumerate(texts)
    ]


def _turns(rng: random.Random, corpus: Corpus, plan: Plan, *, long: bool) -> list[dict[str, Any]]:
    count = 24 if long else rng.randint(0, 4)
    pool = corpus.medium if long else corpus.short
    return [
        {"turn": number, "role": "user" if number % 2 else "assistant", "text": rng.choice(pool)}
        for number in range(1, count + 1)
    ]


class Tally:
    """Thread-safe counters of what the fleet did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)


class Fleet:
    """``concurrency`` gateway threads sending planned requests until ``stop``.

    Counters (``tally.snapshot()``): ``requests``, ``in_flight``, ``admitted``, ``degraded``,
    ``degraded:<rung>``, ``queued``, ``queue:admitted|rejected|abandoned``, ``rejected``,
    ``rejected:<code>``, ``shadow``, ``admission_unavailable``, ``fault:<kind>``,
    ``outcome:<how the call ended>``.
    """

    def __init__(
        self,
        *,
        api_url: str,
        token: str,
        provider_url: str,
        provider_key: str,
        seed: int,
        concurrency: int,
        fault_rate: float,
        usage_every_chunks: int = 16,
        retry: RetryPolicy | None = None,
    ) -> None:
        if concurrency < 1 or not 0 <= fault_rate <= 1:
            raise ValueError("need concurrency >= 1 and 0 <= fault_rate <= 1")
        self.run_id = f"{seed}-{uuid.uuid4().hex[:6]}"
        self.tally = Tally()
        self._api_url = api_url
        self._token = token
        self._provider_url = provider_url.rstrip("/") + "/v1"
        self._provider_key = provider_key
        self._seed = seed
        self._concurrency = concurrency
        self._fault_rate = fault_rate
        self._usage_every = usage_every_chunks
        self._retry = retry or RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=1.0)
        self._corpus = Corpus(seed)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lease_lock = threading.Lock()
        self._lease_s = 0.0

    @property
    def request_prefix(self) -> str:
        """Every requestId of this run starts with it."""
        return f"sim-{self.run_id}-"

    @property
    def longest_lease_s(self) -> float:
        """The longest lease a grant of this run carried (0 before any), as the server set it."""
        with self._lease_lock:
            return self._lease_s

    def start(self) -> None:
        for index in range(self._concurrency):
            thread = threading.Thread(target=self._work, args=(index,), name=f"gateway-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Send no new request; calls already running finish."""
        self._stopping.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for every thread; False if some are still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _work(self, index: int) -> None:
        rng = random.Random(f"{self._seed}:{index}")
        api = ApiClient(self._api_url, self._token, timeout_s=30, retry=self._retry)
        number = 0
        while not self._stopping.is_set():
            number += 1
            plan = plan_request(rng, f"{self.request_prefix}{index}-{number}", self._fault_rate)
            body = build_request(plan, self._corpus, rng)
            self.tally.add("requests")
            self.tally.add("in_flight")
            try:
                self._one(api, plan, body)
            except Exception:
                # A driver bug must not silently stop a gateway thread; count it and go on.
                logger.exception("request %s failed in the driver", plan.request_id)
                self.tally.add("outcome:driver_error")
            finally:
                self.tally.add("in_flight", -1)

    def _one(self, api: ApiClient, plan: Plan, body: dict[str, Any]) -> None:
        key = f"idem-{plan.request_id}"
        grant = self._admit(api, body, key)
        if grant is None:
            return
        self.tally.add("admitted")
        lease_s = (grant.lease_expires_at - datetime.now(UTC)).total_seconds()
        with self._lease_lock:
            self._lease_s = max(self._lease_s, lease_s)
        if grant.rung != "FULL":
            self.tally.add("degraded")
            self.tally.add(f"degraded:{grant.rung}")
        if plan.fault is not None:
            self.tally.add(f"fault:{plan.fault}")
        self.tally.add(f"outcome:{self._call(api, plan, grant)}")

    def _admit(self, api: ApiClient, body: dict[str, Any], key: str) -> Grant | None:
        """Admit (polling the queue if queued); None when rejected, shadowed or never admitted."""
        try:
            response = api.request("POST", ADMISSIONS_PATH, body, {"Idempotency-Key": key})
        except ApiError as exc:
            self.tally.add("rejected")
            self.tally.add(f"rejected:{exc.code or exc.status}")
            return None
        except ApiUnavailable:
            self.tally.add("admission_unavailable")
            return None
        answer = response.body if isinstance(response.body, dict) else {}
        if response.status == 202:
            self.tally.add("queued")
            return self._await_queue(api, body, key, answer)
        if answer.get("mode") == "SHADOW":
            self.tally.add("shadow")
            return None
        return Grant.from_response(response)

    def _await_queue(
        self, api: ApiClient, body: dict[str, Any], key: str, answer: Mapping[str, Any]
    ) -> Grant | None:
        poll = answer.get("poll")
        deadline = time.monotonic() + QUEUE_PATIENCE_S
        while isinstance(poll, str) and not self._stopping.is_set() and time.monotonic() < deadline:
            time.sleep(QUEUE_POLL_S)
            try:
                detail = api.request("GET", poll).body
            except GatewayError:
                continue
            state = detail.get("state") if isinstance(detail, dict) else None
            if state == "REJECTED":
                self.tally.add("queue:rejected")
                return None
            if state != "PROPOSED":
                # Admitted by the queue: the same admission again answers with the grant.
                response = api.request("POST", ADMISSIONS_PATH, body, {"Idempotency-Key": key})
                self.tally.add("queue:admitted")
                return Grant.from_response(response)
        self.tally.add("queue:abandoned")
        return None

    def _call(self, api: ApiClient, plan: Plan, grant: Grant) -> str:
        header = _SIM_HEADER.get(plan.fault) if plan.fault is not None else None
        headers = {"X-Sim-Fault": header.format(k=plan.fault_chunks)} if header is not None else {}
        provider = ChatProvider(self._provider_url, self._provider_key, timeout_s=30, headers=headers)
        gateway = GatewayClient(api, provider, usage_every_chunks=self._usage_every)
        cancel = threading.Event()
        timer = threading.Timer(0.15, cancel.set) if plan.fault is FaultKind.CANCEL_MID_STREAM else None
        if timer is not None:
            timer.start()
        try:
            result: CallResult = gateway.call(
                grant,
                cancel=cancel,
                die_after=_DIE_AT.get(plan.fault) if plan.fault is not None else None,
                die_after_chunks=plan.fault_chunks,
            )
        except ClientDied:
            return "died"
        except StaleFence:
            return "stale_fence"
        except ApiError as exc:
            logger.warning("%s: our API refused a write: %s", plan.request_id, exc)
            return f"refused_{exc.code or exc.status}"
        except ApiUnavailable:
            return "api_unavailable"
        except ProtocolViolation as exc:
            logger.warning("%s: %s", plan.request_id, exc)
            return "protocol_violation"
        finally:
            if timer is not None:
                timer.cancel()
        return result.outcome
