"""The provider simulator's endpoints: chat completions (streamed or not), request lookup, billing export.

What each endpoint answers and bills is in ``simulation.provider``'s docstring.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

from simulation import counting, provider_shapes
from simulation.billing import BillingEntry, BillingStatus, api_key_id
from simulation.completions import Completion, chunk_text, cumulative, generate, swap_pairs, usage_object
from simulation.exports import EXPORT_FORMATS, EXPORT_GRANULARITIES, parse_bucket_width, parse_query_time
from simulation.faults import CountFault, Fault, LookupFault, Script, script_from_header
from simulation.server import TrackingServer, WireHandler

if TYPE_CHECKING:
    from simulation.provider import Simulator

SYSTEM_FINGERPRINT: Final = "fp_simulator"
Report = Callable[[Sequence[BillingEntry], Mapping[str, list[str]]], dict[str, Any]]
REPORTS: Final[Mapping[str, Report]] = {
    "/v1/organization/usage/completions": provider_shapes.openai_usage,
    "/v1/organization/costs": provider_shapes.openai_costs,
    "/v1/organizations/usage_report/messages": provider_shapes.anthropic_usage,
    "/v1/organizations/cost_report": provider_shapes.anthropic_costs,
}
_MAX_REQUEST_ID_LENGTH: Final = 256
_GEMINI_PREFIX: Final = "/v1beta/models/"
_GEMINI_SUFFIX: Final = ":countTokens"
_COUNT_TEXTS: Final[Mapping[str, Callable[[Mapping[str, Any]], list[str]]]] = {
    "anthropic": counting.anthropic_texts,
    "openai": counting.openai_texts,
    "gemini": counting.gemini_texts,
}
_GEMINI_STATUS: Final = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
}
_ANTHROPIC_TYPE: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class SimulatorServer(TrackingServer):
    """The loopback server of one ``Simulator``."""

    def __init__(self, address: tuple[str, int], simulator: Simulator) -> None:
        super().__init__(address, ProviderHandler)
        self.simulator = simulator


class ProviderHandler(WireHandler):
    """Routes a request to its endpoint and answers as the simulator's scripts say."""

    server: SimulatorServer

    @property
    def sim(self) -> Simulator:
        return self.server.simulator

    # -- routing ---------------------------------------------------------------------------------------

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path == "/v1/chat/completions":
            self._chat_completions()
        elif path == "/v1/messages/count_tokens":
            self._count("anthropic", None)
        elif path == "/v1/responses/input_tokens":
            self._count("openai", None)
        elif path.startswith(_GEMINI_PREFIX) and path.endswith(_GEMINI_SUFFIX):
            self._count("gemini", unquote(path[len(_GEMINI_PREFIX) : -len(_GEMINI_SUFFIX)]))
        else:
            self._discard_body()
            self._send_error(404, "invalid_request_error", "not_found", f"no route POST {self.path}")

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        report = REPORTS.get(parts.path)
        if parts.path.startswith("/v1/requests/"):
            self._lookup(unquote(parts.path.removeprefix("/v1/requests/")))
        elif parts.path.startswith("/v1/chat/completions/"):
            self._stored_completion(unquote(parts.path.removeprefix("/v1/chat/completions/")))
        elif parts.path == "/v1/billing/export":
            self._export(parse_qs(parts.query))
        elif report is not None:
            self._report(report, parse_qs(parts.query))
        else:
            self._send_error(404, "invalid_request_error", "not_found", f"no route GET {self.path}")

    # -- counting APIs ---------------------------------------------------------------------------------

    def _count_key(self, api: str) -> str | None:
        if api == "anthropic":
            # The SDK sends the key as a bearer token; Anthropic's documented header is x-api-key.
            return (self.headers.get("x-api-key") or "").strip() or self._bearer()
        if api == "gemini":
            return (self.headers.get("x-goog-api-key") or "").strip() or None
        return self._bearer()

    def _count_error(self, api: str, status: int, message: str) -> None:
        """An error in the counting API's own documented shape."""
        if api == "anthropic":
            kind = _ANTHROPIC_TYPE.get(status, "api_error")
            self._send_json(status, {"type": "error", "error": {"type": kind, "message": message}})
        elif api == "gemini":
            status_name = _GEMINI_STATUS.get(status, "INTERNAL")
            self._send_json(status, {"error": {"code": status, "message": message, "status": status_name}})
        else:
            kind = "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid"
            self._send_error(
                status, "invalid_request_error" if status < 500 else "server_error", kind, message
            )

    def _count(self, api: str, model: str | None) -> None:
        """One counting request (``simulation.counting`` says what is counted), faults first."""
        self.sim.note_count_attempt()
        if self._count_key(api) is None:
            self._discard_body()
            self._count_error(api, 401, "missing API key")
            return
        fault, delay_s = self.sim.faults.take_count()
        if fault is CountFault.HANG:
            self._discard_body()
            time.sleep(delay_s)
            self._reset()
            return
        body = self._read_json()
        if body is None:
            return
        if fault is CountFault.RATE_LIMITED:
            self._count_error(api, 429, "rate limited")
            return
        if fault is CountFault.HTTP_5XX:
            self._count_error(api, 529 if api == "anthropic" else 500, "the counting service failed")
            return
        if fault is CountFault.DELAY:
            time.sleep(delay_s)
        try:
            texts = _COUNT_TEXTS[api](body)
        except (counting.Invalid, AttributeError) as exc:
            self._count_error(api, 400, str(exc))
            return
        tokens = self.sim.prompt_counter([{"content": text} for text in texts])
        self.sim.record_count(api, model or str(body.get("model")), tokens)
        if api == "anthropic":
            self._send_json(200, {"input_tokens": tokens})
        elif api == "gemini":
            details = [{"modality": "TEXT", "tokenCount": tokens}]
            self._send_json(200, {"totalTokens": tokens, "promptTokensDetails": details})
        else:
            self._send_json(200, {"object": "response.input_tokens", "input_tokens": tokens})

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
            self.sim.ledger.record_unprocessed(request_id, "", key_id, project_id, now=self.sim.now())
            self._reset()
            return
        if script.fault is Fault.RATE_LIMITED:
            self._discard_body()
            self.sim.ledger.record_unprocessed(request_id, "", key_id, project_id, now=self.sim.now())
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
        prompt_tokens = self.sim.model_counters.get(model, self.sim.prompt_counter)(messages)
        window = self.sim.context_windows.get(model)
        if window is not None and prompt_tokens + max_tokens > window:
            self.sim.ledger.record_unprocessed(request_id, model, key_id, project_id, now=self.sim.now())
            self._send_error(
                400,
                "invalid_request_error",
                "context_length_exceeded",
                f"This model's maximum context length is {window} tokens; you requested "
                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).",
            )
            return
        if not self.sim.ledger.begin(
            request_id, model, key_id, project_id, prompt_tokens, now=self.sim.now()
        ):
            self._send_error(
                409, "invalid_request_error", "duplicate_request_id", f"{request_id} already used"
            )
            return

        # From here on the request is processed: the prompt is billed whatever happens next. The delay is
        # spent only now, so that a lookup during it says "running": the request is accepted and will be
        # processed even if the client gives up waiting.
        time.sleep(script.delay_s)
        if script.fault is Fault.RESET_AFTER_READ:
            self.sim.ledger.finish(request_id, BillingStatus.CUT, now=self.sim.now())
            self._reset()
            return
        if script.fault is Fault.HTTP_5XX_AFTER_READ:
            self.sim.ledger.finish(request_id, BillingStatus.CUT, now=self.sim.now())
            self._send_error(script.status_code, "server_error", "server_error", "The server had an error.")
            return
        completion = generate(
            self.sim.seed, request_id, max_tokens, script.completion_tokens, self.sim.max_words_per_chunk
        )
        if script.fault is Fault.BILL_WITHOUT_ANSWER:
            self.sim.ledger.produce(request_id, completion.tokens)
            self.sim.ledger.finish(request_id, BillingStatus.COMPLETED, now=self.sim.now())
            self.close_connection = True
            return
        try:
            if body.get("stream") is True:
                self._stream(body, request_id, model, prompt_tokens, completion, script)
            else:
                self._answer(request_id, model, prompt_tokens, completion, script)
        except OSError:
            # The client went away mid-answer; what was generated so far stays billed.
            self.sim.ledger.finish(request_id, BillingStatus.CUT, now=self.sim.now())
            self.close_connection = True

    def _script_for(self, request_id: str | None) -> Script:
        header = self.headers.get("X-Sim-Fault")
        if header is None:
            return self.sim.faults.take(request_id)
        return script_from_header(header)

    def _answer(
        self, request_id: str, model: str, prompt_tokens: int, completion: Completion, script: Script
    ) -> None:
        chunks = completion.chunks
        if script.fault is Fault.CUT_AFTER_CHUNKS:
            self.sim.ledger.produce(request_id, sum(len(chunk) for chunk in chunks[: script.after_chunks]))
            self.sim.ledger.finish(request_id, BillingStatus.CUT, now=self.sim.now())
            self._reset()
            return
        self.sim.ledger.produce(request_id, completion.tokens)
        self.sim.ledger.finish(request_id, BillingStatus.COMPLETED, now=self.sim.now())
        text = "".join(chunk_text(chunk, index == 0) for index, chunk in enumerate(chunks))
        answer: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(self.sim.now().timestamp()),
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
            answer["usage"] = usage_object(prompt_tokens, completion.tokens)
        self._send_json(200, answer, {"x-request-id": request_id})

    def _stream(
        self,
        body: Mapping[str, Any],
        request_id: str,
        model: str,
        prompt_tokens: int,
        completion: Completion,
        script: Script,
    ) -> None:
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage") is True
        per_chunk = (
            self.sim.per_chunk_usage
            or options.get("continuous_usage_stats") is True
            or script.fault is Fault.REORDER_USAGE
        )
        created = int(self.sim.now().timestamp())
        so_far = cumulative(completion.chunks)
        if script.fault is Fault.REORDER_USAGE:
            so_far = swap_pairs(so_far)

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
        opening_usage = usage_object(prompt_tokens, 0) if per_chunk else None
        self._sse(chunk(choice({"role": "assistant", "content": "", "refusal": None}), opening_usage))
        cut_at = script.after_chunks if script.fault is Fault.CUT_AFTER_CHUNKS else None
        for index, words in enumerate(completion.chunks):
            if cut_at is not None and index >= cut_at:
                break
            if script.chunk_delay_s:
                time.sleep(script.chunk_delay_s)
            # Billed when generated, before it is written: a client that is gone still pays for it.
            self.sim.ledger.produce(request_id, len(words))
            usage = usage_object(prompt_tokens, so_far[index]) if per_chunk else None
            self._sse(chunk(choice({"content": chunk_text(words, index == 0)}), usage))
        if cut_at is not None:
            self.sim.ledger.finish(request_id, BillingStatus.CUT, now=self.sim.now())
            self._reset()
            return
        self.sim.ledger.finish(request_id, BillingStatus.COMPLETED, now=self.sim.now())
        final_usage = usage_object(prompt_tokens, completion.tokens)
        self._sse(chunk(choice({}, completion.finish_reason), final_usage if per_chunk else None))
        if include_usage and script.fault is not Fault.OMIT_USAGE:
            repeats = 2 if script.fault is Fault.DUPLICATE_USAGE else 1
            for _ in range(repeats):
                self._sse(chunk([], final_usage))
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    # -- lookup and export -----------------------------------------------------------------------------

    def _lookup(self, request_id: str) -> None:
        fault, delay_s = self.sim.faults.take_lookup(request_id)
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
                usage=usage_object(row.prompt_tokens, row.completion_tokens),
                model=row.model,
                billing_status=row.status.value,
                created=int(row.started_at.timestamp()),
            )
        self._send_json(200, answer)

    def _stored_completion(self, request_id: str) -> None:
        """OpenAI's retrieval of a stored chat completion: every finished, billed request is stored."""
        if self._bearer() is None:
            self._send_error(401, "invalid_request_error", "invalid_api_key", "missing bearer token")
            return
        row = self.sim.entry(request_id)
        if row is None or not row.billed:
            message = f"No chat completion found with id '{request_id}'."
            self._send_json(
                404,
                {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
            )
            return
        self._send_json(200, provider_shapes.stored_completion(row))

    def _report(self, report: Report, query: Mapping[str, list[str]]) -> None:
        """A provider's usage or cost report; it needs the organization's admin key (any key, here)."""
        if self._bearer() is None and not self.headers.get("x-api-key"):
            self._send_error(401, "invalid_request_error", "invalid_api_key", "an admin key is required")
            return
        try:
            page = report(self.sim.entries(), query)
        except ValueError as exc:
            self._send_error(400, "invalid_request_error", "invalid_report_query", str(exc))
            return
        self._send_json(200, page)

    def _export(self, query: Mapping[str, list[str]]) -> None:
        def one(name: str, default: str | None) -> str | None:
            values = query.get(name)
            return values[-1] if values else default

        try:
            fmt = EXPORT_FORMATS.get(one("format", "csv") or "")
            granularity = EXPORT_GRANULARITIES.get(one("granularity", "request") or "")
            if fmt is None or granularity is None:
                raise ValueError("format must be csv|jsonl and granularity request|bucket")
            bucket = parse_bucket_width(one("bucket", "1h") or "")
            start = parse_query_time(one("start_time", None))
            end = parse_query_time(one("end_time", None))
            text = self.sim.billing_export(fmt, granularity, bucket, start, end)
        except ValueError as exc:
            self._send_error(400, "invalid_request_error", "invalid_export_query", str(exc))
            return
        content_type = "text/csv; charset=utf-8" if fmt == "csv" else "application/x-ndjson"
        self._send_bytes(200, text.encode(), content_type)


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
