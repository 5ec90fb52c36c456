"""An OpenAI-compatible provider simulator with scriptable faults and its own billing ledger.

``Simulator`` is the control surface; its parts live beside it: ``endpoints`` (the HTTP endpoints, over the
plumbing in ``server``), ``faults`` (scripts), ``completions`` (token counts and generated words),
``billing`` (the ledger) and ``exports`` (billing exports). It serves, on loopback:

- ``POST /v1/chat/completions`` — the Chat Completions protocol, streaming (SSE ``data: {chunk}`` lines of
  ``chat.completion.chunk`` objects, a final chunk with empty ``choices`` and ``usage`` when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``) and non-streaming;
- ``GET /v1/requests/{id}`` — a lookup: ``{"id", "status": completed|not_found|running|unknown, "usage",
  "model", "billing_status"}``;
- ``GET /v1/billing/export?format=csv|jsonl&granularity=request|bucket&bucket=1h[&start_time=&end_time=]`` —
  per-request rows or per-(api key, project, model, bucket) aggregates of billed requests;
- the counting APIs of Anthropic (``POST /v1/messages/count_tokens``), OpenAI
  (``POST /v1/responses/input_tokens``) and Gemini (``POST /v1beta/models/{model}:countTokens``), in their
  documented shapes (``simulation.counting``), counted with the prompt counter below; ``script_count`` makes
  them slow, hang, or answer 429 or 5xx.

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
of each message's text // 4 + 4 per message), or, for a model in ``model_counters``, from that model's own
(``deepseek_chat_template.deepseek_v3_counter``: DeepSeek-V3's published template and tokenizer).
Completion tokens are words from a generator seeded by ``(seed, request id)``: the count is drawn from
``[max(1, max_tokens // 2), max_tokens]`` unless a script fixes it, and each content chunk carries
1..``max_words_per_chunk`` words (one word = one token).

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

import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType

from simulation.billing import BillingComparison, BillingEntry, BillingLedger
from simulation.completions import PromptCounter, default_prompt_counter
from simulation.endpoints import SimulatorServer
from simulation.exports import ExportFormat, ExportGranularity, render_export
from simulation.faults import CountFault, Fault, FaultScripts, LookupFault, Script

Clock = Callable[[], datetime]


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
        model_counters: Mapping[str, PromptCounter] | None = None,
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
        self.model_counters = dict(model_counters or {})
        self.max_words_per_chunk = max_words_per_chunk
        self.default_max_tokens = default_max_tokens
        self.per_chunk_usage = per_chunk_usage
        self.context_windows = dict(context_windows or {})
        self.ledger = BillingLedger()
        self.faults = FaultScripts()
        self._counts: list[tuple[str, str, int]] = []
        self._count_attempts = 0
        self._counts_lock = threading.Lock()
        self._server: SimulatorServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; return the base URL (``http://host:port``, no ``/v1``).

        Raises ``RuntimeError`` if already started, ``OSError`` if the address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("simulator already started")
        server = SimulatorServer((host, port), self)
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
        planned = Script(
            fault=Fault(fault) if fault is not None else None,
            delay_s=delay_s,
            after_chunks=after_chunks,
            status_code=status_code,
            completion_tokens=completion_tokens,
            chunk_delay_s=chunk_delay_s,
        )
        self.faults.add(planned, count=count, request_id=request_id)

    def script_lookup(
        self, fault: LookupFault | str, *, count: int = 1, request_id: str | None = None, delay_s: float = 0.0
    ) -> None:
        """Misbehave on the next ``count`` lookups. Raises ``ValueError`` for an unknown fault."""
        self.faults.add_lookup(LookupFault(fault), count=count, request_id=request_id, delay_s=delay_s)

    def script_count(self, fault: CountFault | str, *, count: int = 1, delay_s: float = 0.0) -> None:
        """Misbehave on the next ``count`` counting requests (any of the three APIs).

        Raises ``ValueError`` for an unknown fault, a non-positive count or a negative delay.
        """
        self.faults.add_count(CountFault(fault), count=count, delay_s=delay_s)

    def note_count_attempt(self) -> None:
        """Note one counting request as it arrives, whatever its answer (the endpoints call it)."""
        with self._counts_lock:
            self._count_attempts += 1

    @property
    def count_attempts(self) -> int:
        """How many counting requests arrived, answered or not."""
        with self._counts_lock:
            return self._count_attempts

    def record_count(self, api: str, model: str, tokens: int) -> None:
        """Note one answered counting request (the endpoints call it)."""
        with self._counts_lock:
            self._counts.append((api, model, tokens))

    def counts(self) -> list[tuple[str, str, int]]:
        """Every answered counting request, oldest first: (API, model, tokens)."""
        with self._counts_lock:
            return list(self._counts)

    def clear_scripts(self) -> None:
        """Forget every queued script."""
        self.faults.clear()

    def entry(self, request_id: str) -> BillingEntry | None:
        """The ledger row of ``request_id``, if the simulator has seen it."""
        return self.ledger.entry(request_id)

    def entries(self) -> list[BillingEntry]:
        """Every ledger row, oldest first."""
        return self.ledger.entries()

    def compare(self, settled: Mapping[str, tuple[int, int]]) -> BillingComparison:
        """Compare what a client settled with what was billed (see ``BillingLedger.compare``)."""
        return self.ledger.compare(settled)

    def billing_export(
        self,
        fmt: ExportFormat,
        granularity: ExportGranularity = "request",
        bucket: timedelta = timedelta(hours=1),
        start_time: datetime | None = None,
        end_time: datetime | None = None,
    ) -> str:
        """Render the billing export of billed requests started in ``[start_time, end_time)``.

        Raises ``ValueError`` for an unknown format or granularity, or a non-positive bucket.
        """
        return render_export(self.entries(), fmt, granularity, bucket, start_time, end_time)

    def now(self) -> datetime:
        """The clock's time in UTC. Raises ``ValueError`` if the clock returns a naive datetime."""
        moment = self.clock()
        if moment.tzinfo is None:
            raise ValueError("the simulator clock must return timezone-aware datetimes")
        return moment.astimezone(UTC)
