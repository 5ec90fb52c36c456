"""An OpenAI-compatible provider simulator with scriptable faults and its own billing ledger.

It serves, on loopback:

- ``POST /v1/chat/completions`` — the Chat Completions protocol, streaming (SSE ``data: {chunk}`` lines of
  ``chat.completion.chunk`` objects, a final chunk with empty ``choices`` and ``usage`` when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``) and non-streaming;
- ``GET /v1/requests/{id}`` — a lookup: ``{"id", "status": completed|not_found|running|unknown, "usage",
  "model", "billing_status"}``;
- ``GET /v1/billing/export?format=csv|jsonl&granularity=request|bucket&bucket=1h[&start_time=&end_time=]`` —
  per-request rows or per-(api key, project, model, bucket) aggregates of billed requests.

Provider request id: the ``X-Request-Id`` header, else ``Idempotency-Key``, else a generated ``chatcmpl-…``;
it is the response ``id`` and the ``x-request-id`` response header. An id is processed at most once: a
second request with an id that was already billed or is running is answered 409 ``duplicate_request_id``
and billed nothing; an id whose earlier attempt was never processed may be used again.

Billing rules — what the provider charged, by how the request ended (``BillingStatus`` in the ledger):

========================  =========================================  ==================  =================
fault                     what the client sees                       billed              ledger status
========================  =========================================  ==================  =================
(none), ``delay``         a normal answer (after ``delay_s``)        prompt + all        completed
``reset_before_read``     TCP reset; the body was never read         nothing             failed_unprocessed
``reset_after_read``      TCP reset after the body was read          prompt              cut
``http_5xx_after_read``   a 5xx error after the body was read        prompt              cut
``cut_after_chunks``      k content chunks, then a TCP reset         prompt + produced   cut
``omit_usage``            a full answer without the usage chunk      prompt + all        completed
``duplicate_usage``       the usage chunk twice                      prompt + all        completed
``reorder_usage``         per-chunk usage, adjacent pairs swapped    prompt + all        completed
``bill_without_answer``   the connection closes with no response     prompt + all        completed
``rate_limited``          429 ``rate_limit_exceeded``, body unread   nothing             failed_unprocessed
client disconnects        —                                          prompt + produced   cut
context overflow          400 ``context_length_exceeded``            nothing             failed_unprocessed
========================  =========================================  ==================  =================

"Processed" starts once the body has been read and validated: from then on the prompt is billed whatever
happens. Completion tokens are billed as they are generated, before they are written, so a client that
disconnects is billed for what was produced, not for what it received. ``cut`` and ``completed`` are both
terminal and billed; the lookup reports both as ``completed``. ``failed_unprocessed`` ids are reported as
``not_found`` and are absent from exports.

Tokens: prompt tokens come from a pluggable counter over the request's ``messages`` (default: UTF-8 bytes
of each message's text // 4 + 4 per message). Completion tokens are words from a generator seeded by
``(seed, request id)``: the count is drawn from ``[max(1, max_tokens // 2), max_tokens]`` unless a script
fixes it, and each content chunk carries 1..``max_words_per_chunk`` words (one word = one token).

``delay_s`` is spent after the request was read and registered (a lookup meanwhile says ``running``), except
under ``reset_before_read``, where it is spent before the reset.

Faults are scripted with ``Simulator.script(...)`` for the next ``count`` requests (optionally only those with
a given request id), or per request with the header ``X-Sim-Fault: name[;param=value...]`` (params:
``delay_s``, ``after_chunks``, ``status_code``, ``completion_tokens``, ``chunk_delay_s``), which wins over
queued scripts. Per-chunk usage (cumulative, as vLLM's ``continuous_usage_stats`` does) is on when the
simulator is built with ``per_chunk_usage=True``, when the request sets
``stream_options.continuous_usage_stats``, or under ``reorder_usage``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import logging
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Final, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from reconciliation.providers import BUCKET_FIELDS, REQUEST_FIELDS

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]
PromptCounter = Callable[[Sequence[Mapping[str, Any]]], int]
ExportGranularity = Literal["request", "bucket"]

SYSTEM_FINGERPRINT: Final = "fp_simulator"
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_BUCKET_WIDTH = re.compile(r"([1-9][0-9]*)([smhd])")
_BUCKET_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_REQUEST_ID_LENGTH: Final = 256
_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
_EXPORT_FORMATS: Final[Mapping[str, Literal["csv", "jsonl"]]] = {"csv": "csv", "jsonl": "jsonl"}
_EXPORT_GRANULARITIES: Final[Mapping[str, ExportGranularity]] = {"request": "request", "bucket": "bucket"}
_HEADER_PARAMS: Final = frozenset(
    {"delay_s", "after_chunks", "status_code", "completion_tokens", "chunk_delay_s"}
)
_VOCABULARY: Final = (
    "the", "contract", "clause", "party", "shall", "notice", "term", "review", "liability", "payment",
    "within", "days", "of", "and", "to", "evidence", "section", "agreement", "may", "not", "exceed",
    "limit", "obligation", "under", "this", "renewal", "termination", "breach", "cure", "period",
    "written", "consent",
)  # fmt: skip


class Fault(StrEnum):
    """A scripted misbehaviour; the module docstring says what each one bills."""

    DELAY = "delay"
    RESET_BEFORE_READ = "reset_before_read"
    RESET_AFTER_READ = "reset_after_read"
    HTTP_5XX_AFTER_READ = "http_5xx_after_read"
    CUT_AFTER_CHUNKS = "cut_after_chunks"
    OMIT_USAGE = "omit_usage"
    DUPLICATE_USAGE = "duplicate_usage"
    REORDER_USAGE = "reorder_usage"
    BILL_WITHOUT_ANSWER = "bill_without_answer"
    RATE_LIMITED = "rate_limited"


class LookupFault(StrEnum):
    """A scripted misbehaviour of the lookup endpoint."""

    UNKNOWN = "unknown"  # answer 200 with status "unknown"
    HTTP_500 = "http_500"
    DELAY = "delay"  # sleep delay_s, then answer normally
    RESET = "reset"


class BillingStatus(StrEnum):
    """How a provider request ended, from the provider's billing point of view."""

    RUNNING = "running"
    COMPLETED = "completed"
    CUT = "cut"
    FAILED_UNPROCESSED = "failed_unprocessed"


BILLED_STATUSES: Final = frozenset({BillingStatus.COMPLETED, BillingStatus.CUT})


@dataclass(frozen=True)
class Script:
    """How to answer one request. Raises ``ValueError`` on parameters that cannot apply."""

    fault: Fault | None = None
    delay_s: float = 0.0
    after_chunks: int = 0
    status_code: int = 500
    completion_tokens: int | None = None
    chunk_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.chunk_delay_s < 0:
            raise ValueError("delays cannot be negative")
        if self.fault is Fault.DELAY and self.delay_s <= 0:
            raise ValueError("the delay fault needs delay_s > 0")
        if self.after_chunks < 0:
            raise ValueError("after_chunks cannot be negative")
        if not 500 <= self.status_code <= 599:
            raise ValueError("status_code must be a 5xx")
        if self.completion_tokens is not None and self.completion_tokens < 1:
            raise ValueError("completion_tokens must be positive")


@dataclass(frozen=True)
class BillingEntry:
    """One provider request as the provider's billing ledger sees it (a snapshot)."""

    request_id: str
    model: str
    api_key_id: str
    project_id: str
    prompt_tokens: int
    completion_tokens: int
    status: BillingStatus
    started_at: datetime
    finished_at: datetime | None

    @property
    def billed(self) -> bool:
        """Whether the request appears in billing exports."""
        return self.status in BILLED_STATUSES


@dataclass(frozen=True)
class BillingMismatch:
    """One provider request whose settled ``(input, output)`` differs from what the simulator billed."""

    request_id: str
    settled: tuple[int, int]
    billed: tuple[int, int]


@dataclass(frozen=True)
class BillingComparison:
    """``Simulator.compare``: settled usage next to the simulator's billing ledger."""

    compared: int
    mismatches: tuple[BillingMismatch, ...]
    unsettled: tuple[str, ...]
    settled_input: int
    settled_output: int
    billed_input: int
    billed_output: int

    @property
    def ok(self) -> bool:
        """Every settled request matches its bill (unsettled ones are reported, not judged)."""
        return not self.mismatches


@dataclass
class _Pending:
    script: Script | LookupFault
    remaining: int
    request_id: str | None
    delay_s: float = 0.0


def default_prompt_counter(messages: Sequence[Mapping[str, Any]]) -> int:
    """UTF-8 bytes of each message's text // 4, plus 4 per message for the chat-template overhead."""
    return sum(len(_message_text(message).encode()) // 4 + 4 for message in messages)


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def api_key_id(api_key: str) -> str:
    """The non-secret id under which exports group an API key (keys themselves are never exported)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def parse_bucket_width(text: str) -> timedelta:
    """Parse ``30s``, ``5m``, ``1h`` or ``1d``. Raises ``ValueError`` otherwise."""
    match = _BUCKET_WIDTH.fullmatch(text)
    if match is None:
        raise ValueError(f"bucket must look like 30s, 5m, 1h or 1d, not {text!r}")
    return timedelta(seconds=int(match.group(1)) * _BUCKET_UNITS[match.group(2)])


def format_timestamp(moment: datetime) -> str:
    """ISO-8601 in UTC with a ``Z`` suffix."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Simulator:
    """A loopback OpenAI-compatible provider with scriptable faults and a thread-safe billing ledger.

    ``clock`` must return timezone-aware datetimes; it stamps ledger rows and response ``created`` fields.
    ``context_windows`` maps a model name to its window; a request whose prompt + max tokens exceed it gets
    400 ``context_length_exceeded``.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        clock: Clock | None = None,
        prompt_counter: PromptCounter = default_prompt_counter,
        max_words_per_chunk: int = 3,
        default_max_tokens: int = 256,
        per_chunk_usage: bool = False,
        context_windows: Mapping[str, int] | None = None,
    ) -> None:
        if max_words_per_chunk < 1 or default_max_tokens < 1:
            raise ValueError("max_words_per_chunk and default_max_tokens must be positive")
        self.seed = seed
        self.clock: Clock = clock or (lambda: datetime.now(UTC))
        self.prompt_counter = prompt_counter
        self.max_words_per_chunk = max_words_per_chunk
        self.default_max_tokens = default_max_tokens
        self.per_chunk_usage = per_chunk_usage
        self.context_windows = dict(context_windows or {})
        self._lock = threading.Lock()
        self._ledger: dict[str, BillingEntry] = {}
        self._scripts: list[_Pending] = []
        self._lookup_scripts: list[_Pending] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; return the base URL (``http://host:port``, no ``/v1``).

        Raises ``RuntimeError`` if already started, ``OSError`` if the address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("simulator already started")
        server = _Server((host, port), _Handler, self)
        self._server = server
        # A short poll interval keeps stop() fast; it only bounds how long shutdown() waits for the loop.
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="provider-simulator", daemon=True
        )
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop accepting, abort open connections and join the server thread. Safe to call twice."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        # Keep-alive connections would otherwise go on being served by their handler threads.
        server.abort_connections()
        if thread is not None:
            thread.join()
        self._server = None
        self._thread = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running simulator. Raises ``RuntimeError`` if not started."""
        if self._server is None:
            raise RuntimeError("simulator not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> Simulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- control API -----------------------------------------------------------------------------------

    def script(
        self,
        fault: Fault | str | None = None,
        *,
        count: int = 1,
        request_id: str | None = None,
        delay_s: float = 0.0,
        after_chunks: int = 0,
        status_code: int = 500,
        completion_tokens: int | None = None,
        chunk_delay_s: float = 0.0,
    ) -> None:
        """Answer the next ``count`` chat requests (only those with ``request_id``, if given) this way.

        Scripts for a specific request id win over general ones; general ones apply in FIFO order.
        Raises ``ValueError`` for an unknown fault or impossible parameters.
        """
        if count < 1:
            raise ValueError("count must be positive")
        planned = Script(
            fault=Fault(fault) if fault is not None else None,
            delay_s=delay_s,
            after_chunks=after_chunks,
            status_code=status_code,
            completion_tokens=completion_tokens,
            chunk_delay_s=chunk_delay_s,
        )
        with self._lock:
            self._scripts.append(_Pending(planned, count, request_id))

    def script_lookup(
        self, fault: LookupFault | str, *, count: int = 1, request_id: str | None = None, delay_s: float = 0.0
    ) -> None:
        """Misbehave on the next ``count`` lookups. Raises ``ValueError`` for an unknown fault."""
        if count < 1:
            raise ValueError("count must be positive")
        with self._lock:
            self._lookup_scripts.append(_Pending(LookupFault(fault), count, request_id, delay_s))

    def clear_scripts(self) -> None:
        """Forget every queued script."""
        with self._lock:
            self._scripts.clear()
            self._lookup_scripts.clear()

    def entry(self, request_id: str) -> BillingEntry | None:
        """The ledger row of ``request_id``, if the simulator has seen it."""
        with self._lock:
            return self._ledger.get(request_id)

    def entries(self) -> list[BillingEntry]:
        """Every ledger row, oldest first."""
        with self._lock:
            rows = list(self._ledger.values())
        return sorted(rows, key=lambda row: (row.started_at, row.request_id))

    def compare(self, settled: Mapping[str, tuple[int, int]]) -> BillingComparison:
        """Compare what a client settled, ``{provider request id: (input, output)}``, with what was billed.

        An id the simulator never billed (never seen, or refused unprocessed) was billed ``(0, 0)``. An id
        still running is a mismatch whatever its counts so far: its bill is not final, so nothing settled
        can equal it. Billed ids absent from ``settled`` are listed as ``unsettled`` (still being
        reconciled, or lost).
        """
        rows = {row.request_id: row for row in self.entries()}
        mismatches: list[BillingMismatch] = []
        for request_id, ours in sorted(settled.items()):
            row = rows.get(request_id)
            billed = (row.prompt_tokens, row.completion_tokens) if row is not None else (0, 0)
            running = row is not None and row.status is BillingStatus.RUNNING
            if running or (ours[0], ours[1]) != billed:
                mismatches.append(BillingMismatch(request_id, (ours[0], ours[1]), billed))
        unsettled = tuple(
            sorted(
                request_id
                for request_id, row in rows.items()
                if request_id not in settled and (row.billed or row.status is BillingStatus.RUNNING)
            )
        )
        billed_rows = [row for row in rows.values() if row.billed]
        return BillingComparison(
            compared=len(settled),
            mismatches=tuple(mismatches),
            unsettled=unsettled,
            settled_input=sum(ours[0] for ours in settled.values()),
            settled_output=sum(ours[1] for ours in settled.values()),
            billed_input=sum(row.prompt_tokens for row in billed_rows),
            billed_output=sum(row.completion_tokens for row in billed_rows),
        )

    def billing_export(
        self,
        fmt: Literal["csv", "jsonl"],
        granularity: ExportGranularity = "request",
        bucket: timedelta = timedelta(hours=1),
        start_time: datetime | None = None,
        end_time: datetime | None = None,
    ) -> str:
        """Render the billing export of billed requests started in ``[start_time, end_time)``.

        Raises ``ValueError`` for an unknown format or granularity, or a non-positive bucket.
        """
        if fmt not in ("csv", "jsonl"):
            raise ValueError(f"unknown format {fmt!r}")
        if granularity not in ("request", "bucket"):
            raise ValueError(f"unknown granularity {granularity!r}")
        if bucket <= timedelta(0):
            raise ValueError("bucket must be positive")
        billed = [
            row
            for row in self.entries()
            if row.billed
            and (start_time is None or row.started_at >= start_time)
            and (end_time is None or row.started_at < end_time)
        ]
        if granularity == "request":
            columns: tuple[str, ...] = REQUEST_FIELDS
            rows = [_request_row(row) for row in billed]
        else:
            columns = BUCKET_FIELDS
            rows = _bucket_rows(billed, bucket)
        if fmt == "jsonl":
            return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()

    # -- used by the handler ---------------------------------------------------------------------------

    def _take_script(self, request_id: str | None) -> Script:
        with self._lock:
            pending = _take(self._scripts, request_id)
        if pending is None:
            return Script()
        assert isinstance(pending.script, Script)
        return pending.script

    def _take_lookup_fault(self, request_id: str) -> tuple[LookupFault | None, float]:
        with self._lock:
            pending = _take(self._lookup_scripts, request_id)
        if pending is None:
            return None, 0.0
        assert isinstance(pending.script, LookupFault)
        return pending.script, pending.delay_s

    def _now(self) -> datetime:
        moment = self.clock()
        if moment.tzinfo is None:
            raise ValueError("the simulator clock must return timezone-aware datetimes")
        return moment.astimezone(UTC)

    def _record_unprocessed(self, request_id: str, model: str, key_id: str, project_id: str) -> None:
        now = self._now()
        with self._lock:
            if request_id in self._ledger:
                # Never overwrite what an earlier attempt was billed.
                return
            self._ledger[request_id] = BillingEntry(
                request_id=request_id,
                model=model,
                api_key_id=key_id,
                project_id=project_id,
                prompt_tokens=0,
                completion_tokens=0,
                status=BillingStatus.FAILED_UNPROCESSED,
                started_at=now,
                finished_at=now,
            )

    def _begin(self, request_id: str, model: str, key_id: str, project_id: str, prompt_tokens: int) -> bool:
        """Register a processed request as running; False if the id was already used by a processed one."""
        now = self._now()
        with self._lock:
            existing = self._ledger.get(request_id)
            if existing is not None and existing.status is not BillingStatus.FAILED_UNPROCESSED:
                return False
            self._ledger[request_id] = BillingEntry(
                request_id=request_id,
                model=model,
                api_key_id=key_id,
                project_id=project_id,
                prompt_tokens=prompt_tokens,
                completion_tokens=0,
                status=BillingStatus.RUNNING,
                started_at=now,
                finished_at=None,
            )
            return True

    def _produce(self, request_id: str, tokens: int) -> None:
        with self._lock:
            row = self._ledger[request_id]
            if row.status is BillingStatus.RUNNING:
                self._ledger[request_id] = replace(row, completion_tokens=row.completion_tokens + tokens)

    def _finish(self, request_id: str, status: BillingStatus) -> None:
        now = self._now()
        with self._lock:
            row = self._ledger[request_id]
            if row.status is BillingStatus.RUNNING:
                self._ledger[request_id] = replace(row, status=status, finished_at=now)


def _take(queue: list[_Pending], request_id: str | None) -> _Pending | None:
    chosen = next((p for p in queue if p.request_id is not None and p.request_id == request_id), None)
    if chosen is None:
        chosen = next((p for p in queue if p.request_id is None), None)
    if chosen is None:
        return None
    chosen.remaining -= 1
    if chosen.remaining == 0:
        queue.remove(chosen)
    return chosen


def _request_row(row: BillingEntry) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "model": row.model,
        "api_key_id": row.api_key_id,
        "project_id": row.project_id,
        "input_tokens": row.prompt_tokens,
        "output_tokens": row.completion_tokens,
        "start_time": format_timestamp(row.started_at),
    }


def _bucket_rows(rows: Sequence[BillingEntry], width: timedelta) -> list[dict[str, Any]]:
    totals: dict[tuple[datetime, str, str, str], list[int]] = {}
    for row in rows:
        start = _EPOCH + ((row.started_at - _EPOCH) // width) * width
        key = (start, row.api_key_id, row.project_id, row.model)
        total = totals.setdefault(key, [0, 0, 0])
        total[0] += row.prompt_tokens
        total[1] += row.completion_tokens
        total[2] += 1
    return [
        {
            "bucket_start": format_timestamp(start),
            "bucket_end": format_timestamp(start + width),
            "api_key_id": key_id,
            "project_id": project_id,
            "model": model,
            "input_tokens": prompt,
            "output_tokens": completion,
            "num_model_requests": count,
        }
        for (start, key_id, project_id, model), (prompt, completion, count) in sorted(totals.items())
    ]


@dataclass(frozen=True)
class _Completion:
    """The deterministic answer to one request: its word groups (one group per content chunk)."""

    chunks: tuple[tuple[str, ...], ...]
    finish_reason: str

    @property
    def tokens(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)


def _generate(
    seed: int, request_id: str, max_tokens: int, fixed: int | None, max_per_chunk: int
) -> _Completion:
    rng = random.Random(f"{seed}:{request_id}")
    total = min(fixed, max_tokens) if fixed is not None else rng.randint(max(1, max_tokens // 2), max_tokens)
    chunks: list[tuple[str, ...]] = []
    left = total
    while left:
        size = min(left, rng.randint(1, max_per_chunk))
        chunks.append(tuple(rng.choice(_VOCABULARY) for _ in range(size)))
        left -= size
    return _Completion(tuple(chunks), "length" if total == max_tokens else "stop")


def _chunk_text(words: Sequence[str], first: bool) -> str:
    text = " ".join(words)
    return text if first else " " + text


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Tests start and stop many simulators; do not wait for TIME_WAIT to free a port.
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[_Handler], simulator: Simulator) -> None:
        super().__init__(address, handler)
        self.simulator = simulator
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(connection)

    def untrack(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(connection)

    def abort_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError:
            # The client reset the connection between or during requests it never completed; nothing was
            # processed for them, so there is nothing to bill and nothing worth a traceback.
            self.close_connection = True

    def finish(self) -> None:
        self.server.untrack(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("simulator: " + format, *args)

    @property
    def sim(self) -> Simulator:
        return self.server.simulator

    # -- routing ---------------------------------------------------------------------------------------

    def do_POST(self) -> None:
        if urlsplit(self.path).path == "/v1/chat/completions":
            self._chat_completions()
        else:
            self._discard_body()
            self._send_error(404, "invalid_request_error", "not_found", f"no route POST {self.path}")

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path.startswith("/v1/requests/"):
            self._lookup(unquote(parts.path.removeprefix("/v1/requests/")))
        elif parts.path == "/v1/billing/export":
            self._export(parse_qs(parts.query))
        else:
            self._send_error(404, "invalid_request_error", "not_found", f"no route GET {self.path}")

    # -- chat completions ------------------------------------------------------------------------------

    def _chat_completions(self) -> None:
        api_key = self._bearer()
        if api_key is None:
            self._discard_body()
            self._send_error(401, "invalid_request_error", "invalid_api_key", "missing bearer token")
            return
        request_id = self.headers.get("X-Request-Id") or self.headers.get("Idempotency-Key")
        if request_id is not None and not _valid_request_id(request_id):
            self._discard_body()
            self._send_error(400, "invalid_request_error", "invalid_request_id", "bad X-Request-Id")
            return
        try:
            script = self._script_for(request_id)
        except ValueError as exc:
            self._discard_body()
            self._send_error(400, "invalid_request_error", "invalid_sim_fault", str(exc))
            return
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        key_id = api_key_id(api_key)
        project_id = self.headers.get("OpenAI-Project") or "default"
        if script.fault is Fault.RESET_BEFORE_READ:
            time.sleep(script.delay_s)
            self.sim._record_unprocessed(request_id, "", key_id, project_id)
            self._reset()
            return
        if script.fault is Fault.RATE_LIMITED:
            self._discard_body()
            self.sim._record_unprocessed(request_id, "", key_id, project_id)
            self._send_error(
                429, "requests", "rate_limit_exceeded", "Rate limit reached for requests; try again later."
            )
            return

        body = self._read_json()
        if body is None:
            return
        problem = _validate(body)
        if problem is not None:
            self._send_error(400, "invalid_request_error", "invalid_request", problem)
            return
        model: str = body["model"]
        messages: list[dict[str, Any]] = body["messages"]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or self.sim.default_max_tokens
        prompt_tokens = self.sim.prompt_counter(messages)
        window = self.sim.context_windows.get(model)
        if window is not None and prompt_tokens + max_tokens > window:
            self.sim._record_unprocessed(request_id, model, key_id, project_id)
            self._send_error(
                400,
                "invalid_request_error",
                "context_length_exceeded",
                f"This model's maximum context length is {window} tokens; you requested "
                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).",
            )
            return
        if not self.sim._begin(request_id, model, key_id, project_id, prompt_tokens):
            self._send_error(
                409, "invalid_request_error", "duplicate_request_id", f"{request_id} already used"
            )
            return

        # From here on the request is processed: the prompt is billed whatever happens next. The delay is
        # spent only now, so that a lookup during it says "running": the request is accepted and will be
        # processed even if the client gives up waiting.
        time.sleep(script.delay_s)
        if script.fault is Fault.RESET_AFTER_READ:
            self.sim._finish(request_id, BillingStatus.CUT)
            self._reset()
            return
        if script.fault is Fault.HTTP_5XX_AFTER_READ:
            self.sim._finish(request_id, BillingStatus.CUT)
            self._send_error(script.status_code, "server_error", "server_error", "The server had an error.")
            return
        completion = _generate(
            self.sim.seed, request_id, max_tokens, script.completion_tokens, self.sim.max_words_per_chunk
        )
        if script.fault is Fault.BILL_WITHOUT_ANSWER:
            self.sim._produce(request_id, completion.tokens)
            self.sim._finish(request_id, BillingStatus.COMPLETED)
            self.close_connection = True
            return
        try:
            if body.get("stream") is True:
                self._stream(body, request_id, model, prompt_tokens, completion, script)
            else:
                self._answer(request_id, model, prompt_tokens, completion, script)
        except OSError:
            # The client went away mid-answer; what was generated so far stays billed.
            self.sim._finish(request_id, BillingStatus.CUT)
            self.close_connection = True

    def _script_for(self, request_id: str | None) -> Script:
        header = self.headers.get("X-Sim-Fault")
        if header is None:
            return self.sim._take_script(request_id)
        name, *params = (part.strip() for part in header.split(";"))
        values: dict[str, Any] = {}
        for param in params:
            key, sep, raw = param.partition("=")
            if not sep or key not in _HEADER_PARAMS:
                raise ValueError(f"unknown X-Sim-Fault parameter {param!r}")
            values[key] = float(raw) if key.endswith("_s") else int(raw)
        return Script(fault=Fault(name) if name else None, **values)

    def _answer(
        self, request_id: str, model: str, prompt_tokens: int, completion: _Completion, script: Script
    ) -> None:
        chunks = completion.chunks
        if script.fault is Fault.CUT_AFTER_CHUNKS:
            self.sim._produce(request_id, sum(len(chunk) for chunk in chunks[: script.after_chunks]))
            self.sim._finish(request_id, BillingStatus.CUT)
            self._reset()
            return
        self.sim._produce(request_id, completion.tokens)
        self.sim._finish(request_id, BillingStatus.COMPLETED)
        text = "".join(_chunk_text(chunk, index == 0) for index, chunk in enumerate(chunks))
        answer: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(self.sim._now().timestamp()),
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": completion.finish_reason,
                }
            ],
        }
        if script.fault is not Fault.OMIT_USAGE:
            answer["usage"] = _usage(prompt_tokens, completion.tokens)
        self._send_json(200, answer, {"x-request-id": request_id})

    def _stream(
        self,
        body: Mapping[str, Any],
        request_id: str,
        model: str,
        prompt_tokens: int,
        completion: _Completion,
        script: Script,
    ) -> None:
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage") is True
        per_chunk = (
            self.sim.per_chunk_usage
            or options.get("continuous_usage_stats") is True
            or script.fault is Fault.REORDER_USAGE
        )
        created = int(self.sim._now().timestamp())
        cumulative = _cumulative(completion.chunks)
        if script.fault is Fault.REORDER_USAGE:
            cumulative = _swap_pairs(cumulative)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
            event: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
            }
            if include_usage or per_chunk:
                # OpenAI sends "usage": null on every chunk but the last when include_usage is set.
                event["usage"] = usage
            return event

        def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-request-id", request_id)
        self.end_headers()
        opening_usage = _usage(prompt_tokens, 0) if per_chunk else None
        self._sse(chunk(choice({"role": "assistant", "content": "", "refusal": None}), opening_usage))
        cut_at = script.after_chunks if script.fault is Fault.CUT_AFTER_CHUNKS else None
        for index, words in enumerate(completion.chunks):
            if cut_at is not None and index >= cut_at:
                break
            if script.chunk_delay_s:
                time.sleep(script.chunk_delay_s)
            # Billed when generated, before it is written: a client that is gone still pays for it.
            self.sim._produce(request_id, len(words))
            usage = _usage(prompt_tokens, cumulative[index]) if per_chunk else None
            self._sse(chunk(choice({"content": _chunk_text(words, index == 0)}), usage))
        if cut_at is not None:
            self.sim._finish(request_id, BillingStatus.CUT)
            self._reset()
            return
        self.sim._finish(request_id, BillingStatus.COMPLETED)
        final_usage = _usage(prompt_tokens, completion.tokens)
        self._sse(chunk(choice({}, completion.finish_reason), final_usage if per_chunk else None))
        if include_usage and script.fault is not Fault.OMIT_USAGE:
            repeats = 2 if script.fault is Fault.DUPLICATE_USAGE else 1
            for _ in range(repeats):
                self._sse(chunk([], final_usage))
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _sse(self, event: Mapping[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    # -- lookup and export -----------------------------------------------------------------------------

    def _lookup(self, request_id: str) -> None:
        fault, delay_s = self.sim._take_lookup_fault(request_id)
        if fault is LookupFault.RESET:
            self._reset()
            return
        if fault is LookupFault.HTTP_500:
            self._send_error(500, "server_error", "server_error", "lookup failed")
            return
        if fault is LookupFault.DELAY:
            time.sleep(delay_s)
        row = self.sim.entry(request_id)
        answer: dict[str, Any] = {"id": request_id, "status": "not_found", "usage": None, "model": None}
        if fault is LookupFault.UNKNOWN:
            answer["status"] = "unknown"
        elif row is not None and row.status is not BillingStatus.FAILED_UNPROCESSED:
            answer.update(
                status="running" if row.status is BillingStatus.RUNNING else "completed",
                usage=_usage(row.prompt_tokens, row.completion_tokens),
                model=row.model,
                billing_status=row.status.value,
                created=int(row.started_at.timestamp()),
            )
        self._send_json(200, answer)

    def _export(self, query: Mapping[str, list[str]]) -> None:
        def one(name: str, default: str | None) -> str | None:
            values = query.get(name)
            return values[-1] if values else default

        try:
            fmt = _EXPORT_FORMATS.get(one("format", "csv") or "")
            granularity = _EXPORT_GRANULARITIES.get(one("granularity", "request") or "")
            if fmt is None or granularity is None:
                raise ValueError("format must be csv|jsonl and granularity request|bucket")
            bucket = parse_bucket_width(one("bucket", "1h") or "")
            start = _query_time(one("start_time", None))
            end = _query_time(one("end_time", None))
            text = self.sim.billing_export(fmt, granularity, bucket, start, end)
        except ValueError as exc:
            self._send_error(400, "invalid_request_error", "invalid_export_query", str(exc))
            return
        content_type = "text/csv; charset=utf-8" if fmt == "csv" else "application/x-ndjson"
        self._send_bytes(200, text.encode(), content_type)

    # -- plumbing --------------------------------------------------------------------------------------

    def _bearer(self) -> str | None:
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit() or int(raw) > _MAX_BODY_BYTES:
            return None
        return int(raw)

    def _discard_body(self) -> None:
        length = self._content_length()
        if length is None:
            self.close_connection = True
        else:
            self.rfile.read(length)

    def _read_json(self) -> dict[str, Any] | None:
        length = self._content_length()
        if length is None:
            self.close_connection = True
            self._send_error(411, "invalid_request_error", "length_required", "send a Content-Length")
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self._send_error(400, "invalid_request_error", "invalid_json", "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self._send_error(400, "invalid_request_error", "invalid_json", "the body is not a JSON object")
            return None
        return body

    def _reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), so the client sees ECONNRESET, not EOF."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # rfile holds a reference to the socket that would defer the real close (and so the RST).
        self.rfile.close()
        self.connection.close()

    def _send_error(self, status: int, error_type: str, code: str, message: str) -> None:
        body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        self._send_json(status, body)

    def _send_json(
        self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        self._send_bytes(status, json.dumps(body).encode(), "application/json", headers)

    def _send_bytes(
        self, status: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


def _valid_request_id(value: str) -> bool:
    return 0 < len(value) <= _MAX_REQUEST_ID_LENGTH and value.isprintable() and " " not in value


def _validate(body: Mapping[str, Any]) -> str | None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model is required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty array"
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return "every message needs a role"
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{name} must be a positive integer"
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or body.get("stream") is not True):
        return "stream_options is only allowed with stream: true"
    return None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _cumulative(chunks: Sequence[Sequence[str]]) -> list[int]:
    totals: list[int] = []
    running = 0
    for chunk in chunks:
        running += len(chunk)
        totals.append(running)
    return totals


def _swap_pairs(values: list[int]) -> list[int]:
    swapped = list(values)
    for index in range(0, len(swapped) - 1, 2):
        swapped[index], swapped[index + 1] = swapped[index + 1], swapped[index]
    return swapped


def _query_time(value: str | None) -> datetime | None:
    if value is None:
        return None
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError(f"{value!r} has no UTC offset")
    return parsed.astimezone(UTC)
