"""A gateway client that performs the admission protocol (SPEC §5, §8) around one streamed provider call.

The order is the protocol:

1. ``POST /api/v1/admissions`` with an ``Idempotency-Key``; a 201 (or a 200 replay) grants a reservation,
   the exact ``payload`` to send, its ``admittedDigest`` and a lease ``fence``.
2. ``POST …/dispatch {fence, providerRequestId, admittedDigest}`` **before** any byte goes to the provider,
   so a crash after the provider call can always be traced to a recorded dispatch. ``providerRequestId``
   is derived from the reservation id, so every attempt and the reconciler's lookups use the same one.
3. Stream from the provider (OpenAI Chat Completions, ``include_usage``), posting usage deltas
   ``POST …/usage {fence, usageEventId, outputTokens, final: false}`` every N content chunks and renewing
   the lease ``POST …/lease {fence}``; then the final usage ``{inputTokens, outputTokens, final: true}``.
4. On a provider failure ``POST …/fail {fence, reason, requestSent}``; on the caller's cancel
   ``POST …/cancel {fence}``. Usage seen before either is posted first, through ``/usage``.
   ``requestSent`` is ``false`` only with proof of non-processing: the connection was refused before any
   byte, or the provider answered 400/401/403/404/429 (``reason`` ``provider_http_<status>: <type>``), and
   our API then releases the reservation in full; a reset or timeout after the body went out is
   ``"unknown"``; any other answer is ``true``.

Mid-stream deltas are a lower bound of what the provider bills — the larger of the number of content
chunks (each carries at least one token) and the largest cumulative per-chunk usage the provider reported —
so the final delta (provider total minus what was posted) is never negative. Usage values are treated as
cumulative and only their maximum is used, so duplicated or reordered usage chunks cannot double count.

Every call to our API is retried on connection errors and gateway timeouts with the same body, so the
same idempotency key, ``usageEventId`` and fence: the server applies each at most once. A usage event
that could not be delivered is re-sent unchanged before any newer one, never folded into a new id.

``die_after`` makes the client stop dead at a chosen point (raising ``ClientDied`` and making no further
call to our API) so fault tests can leave reservations exactly where a crashed gateway would; ``pause_at``
calls back at a point and carries on when the callback returns, as a gateway frozen by a long GC pause or
a stopped VM would.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Literal, TypeGuard
from urllib.parse import quote, urlsplit

logger = logging.getLogger(__name__)

RequestSent = bool | Literal["unknown"]
DiePoint = Literal["before_dispatch", "dispatch", "after_k_chunks", "before_final_usage"]
PausePoint = Literal["before_dispatch", "dispatch", "before_final_usage"]
CallOutcome = Literal["completed", "usage_unknown", "failed", "cancelled", "unsettled"]

ADMISSIONS_PATH: Final = "/api/v1/admissions"
# Provider answers that document non-processing (OpenAI: invalid request incl. context_length_exceeded,
# authentication, permission, not found, rate limit). 409 is not here: it can mean an earlier attempt with
# the same request id was processed.
NOT_PROCESSED_STATUSES: Final = frozenset({400, 401, 403, 404, 429})
_MIN_RENEW_INTERVAL_S: Final = 0.05
_MAX_SSE_LINE: Final = 1024 * 1024
_MAX_ERROR_BODY: Final = 64 * 1024


# -- errors ------------------------------------------------------------------------------------------------


class GatewayError(Exception):
    """Base of the errors this client raises about our API or the provider."""


class ApiUnavailable(GatewayError):
    """Our API could not be reached (or answered 502/504) after every retry; the outcome is unknown."""

    def __init__(self, method: str, path: str, cause: str) -> None:
        self.method = method
        self.path = path
        self.cause = cause
        super().__init__(f"{method} {path}: our API is unavailable ({cause})")


class ApiError(GatewayError):
    """Our API answered with an error (problem+json); ``code`` is its machine-readable code."""

    def __init__(self, status: int, problem: Mapping[str, Any] | None, path: str) -> None:
        self.status = status
        self.problem: Mapping[str, Any] = problem or {}
        self.code: str | None = (
            self.problem.get("code") if isinstance(self.problem.get("code"), str) else None
        )
        self.path = path
        super().__init__(f"{path}: HTTP {status} {self.code or ''} {self.problem.get('detail', '')}".rstrip())


class StaleFence(ApiError):
    """409 STALE_FENCE: a reclaimer holds a higher fence; this client must stop writing."""


class AdmissionQueued(GatewayError):
    """202: the admission was queued (PROPOSED); ``body`` has the position and the poll URL."""

    def __init__(self, body: Any) -> None:
        self.body = body
        super().__init__(f"admission queued: {body!r}")


class ProtocolViolation(GatewayError):
    """An answer of our API, or the admitted payload, does not match the contract."""


class ProviderCallError(GatewayError):
    """The provider call failed; ``request_sent`` is what may be claimed in ``/fail``.

    ``False`` only with proof that the provider did not process the request: no byte of the body can
    have left this process (connection refused, or the headers could not be sent), or the provider
    answered with a status that documents non-processing (``NOT_PROCESSED_STATUSES``). ``True`` once
    any other answer began; ``"unknown"`` otherwise (a reset or timeout after the body was sent).
    """

    def __init__(self, reason: str, request_sent: RequestSent, status: int | None = None) -> None:
        self.reason = reason
        self.request_sent = request_sent
        self.status = status
        super().__init__(f"provider call failed: {reason} (requestSent={request_sent})")


class ClientDied(Exception):
    """Raised by the ``die_after`` hook: the client stops with no further call to our API."""


# -- ids and retries ---------------------------------------------------------------------------------------


def provider_request_id_for(reservation_id: str) -> str:
    """The provider request id of a reservation: stable, so retries and lookups all use the same one."""
    return f"tbr-{reservation_id}"


def usage_event_id(provider_request_id: str, seq: int) -> str:
    """The id of the ``seq``-th (1-based) usage event of a provider request."""
    if seq < 1:
        raise ValueError("usage event sequence numbers start at 1")
    return f"{provider_request_id}:{seq}"


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a call to our API. Raises ``ValueError`` if unusable."""

    attempts: int = 4
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")

    def backoff(self, retry: int, rand: float) -> float:
        """Seconds to wait before retry number ``retry`` (1-based); ``rand`` in [0, 1) spreads retries."""
        delay = min(self.max_delay_s, self.base_delay_s * 2.0 ** (retry - 1))
        # Jitter only shortens the delay, so max_delay_s stays a real bound.
        return delay * (1 - self.jitter * rand)


def is_retryable_status(status: int, body: Any) -> bool:
    """502/504 from a proxy, and a 503 that carries no problem ``code`` (a load balancer, not our API).

    A 503 with a code (``COUNTING_UNAVAILABLE``) and every 4xx are decisions, not outages.
    """
    if status in (502, 504):
        return True
    return status == 503 and not (isinstance(body, dict) and isinstance(body.get("code"), str))


# -- our API -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiResponse:
    """A successful (2xx) answer of our API; ``headers`` have lower-case names."""

    status: int
    headers: Mapping[str, str]
    body: Any


class ApiClient:
    """JSON over HTTP to our REST API with a bearer token, retrying per ``RetryPolicy``."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rand = rand

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ApiResponse:
        """Send one call, retrying transient failures with the identical body and headers.

        Raises ``StaleFence``/``ApiError`` for an error answer, ``ApiUnavailable`` when retries ran out.
        """
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        sent_headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            sent_headers["Content-Type"] = "application/json"
        sent_headers.update(headers or {})
        cause = "no attempt made"
        for attempt in range(1, self._retry.attempts + 1):
            if attempt > 1:
                self._sleep(self._retry.backoff(attempt - 1, self._rand()))
            try:
                status, answer_headers, raw = self._exchange(method, path, data, sent_headers)
            except (OSError, http.client.HTTPException) as exc:
                # Refused, reset, timed out or a broken exchange: the call may or may not have been applied,
                # and repeating it unchanged is safe because every write is idempotent by its ids.
                cause = f"{type(exc).__name__}: {exc}"
                logger.info("%s %s attempt %d failed: %s", method, path, attempt, cause)
                continue
            parsed = _json_or_none(raw)
            if is_retryable_status(status, parsed):
                cause = f"HTTP {status}"
                continue
            if status >= 400:
                problem = parsed if isinstance(parsed, dict) else None
                error = (
                    StaleFence if problem is not None and problem.get("code") == "STALE_FENCE" else ApiError
                )
                raise error(status, problem, path)
            return ApiResponse(status=status, headers=answer_headers, body=parsed)
        raise ApiUnavailable(method, path, cause)

    def _exchange(
        self, method: str, path: str, data: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.request(method, self._prefix + path, body=data, headers=dict(headers))
            response = connection.getresponse()
            raw = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, raw
        finally:
            connection.close()


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


# -- the provider ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProviderUsage:
    """A usage report of the provider (cumulative for the request so far)."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamChunk:
    """One ``chat.completion.chunk``: its content text, its usage if any, and whether it is the usage chunk
    OpenAI sends last (empty ``choices``) — the only one that states the final total."""

    text: str
    usage: ProviderUsage | None
    is_usage_chunk: bool


class ChatStream:
    """An open streaming response; iterate for chunks, close to abandon it (the provider stops generating)."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self._connection = connection
        self._response = response

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield chunks until ``data: [DONE]``.

        Raises ``ProviderCallError`` (``request_sent=True``) if the stream breaks, ends without ``[DONE]``,
        carries an error object or a chunk that is not JSON.
        """
        data: list[str] = []
        try:
            while True:
                raw = self._response.readline(_MAX_SSE_LINE)
                if not raw:
                    break
                line = raw.decode("utf-8").rstrip("\r\n")
                if line:
                    name, _, value = line.partition(":")
                    if name == "data":
                        data.append(value.removeprefix(" "))
                    continue
                if not data:
                    continue
                event, data = "\n".join(data), []
                if event == "[DONE]":
                    return
                yield _parse_chunk(event)
        except (OSError, http.client.HTTPException, UnicodeDecodeError) as exc:
            raise ProviderCallError(f"stream_interrupted: {type(exc).__name__}", True) from exc
        raise ProviderCallError("stream_truncated: ended without [DONE]", True)

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        self._response.close()
        self._connection.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _parse_chunk(event: str) -> StreamChunk:
    try:
        chunk = json.loads(event)
    except json.JSONDecodeError as exc:
        raise ProviderCallError("malformed_chunk", True) from exc
    if not isinstance(chunk, dict):
        raise ProviderCallError("malformed_chunk", True)
    if chunk.get("error") is not None:
        error = chunk["error"]
        code = error.get("code") or error.get("type") if isinstance(error, dict) else None
        raise ProviderCallError(f"provider_error: {code}", True)
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise ProviderCallError("malformed_chunk: no choices", True)
    text = ""
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str):
            text += content
    return StreamChunk(text=text, usage=_usage_of(chunk.get("usage")), is_usage_chunk=not choices)


def _usage_of(value: Any) -> ProviderUsage | None:
    if not isinstance(value, dict):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if not _is_int(prompt) or not _is_int(completion) or prompt < 0 or completion < 0:
        raise ProviderCallError("malformed_chunk: bad usage", True)
    return ProviderUsage(prompt_tokens=prompt, completion_tokens=completion)


class ChatProvider:
    """An OpenAI-compatible Chat Completions endpoint, called with ``http.client`` so the client knows
    exactly how far a request got (see ``ProviderCallError.request_sent``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = parts.path.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._headers = dict(headers or {})

    def open(self, body: Mapping[str, Any], provider_request_id: str) -> ChatStream:
        """Send the request and return the stream once the provider answered 200.

        Raises ``ProviderCallError`` with ``request_sent`` set as precisely as the failure allows.
        """
        data = json.dumps(body, separators=(",", ":")).encode()
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.connect()
        except OSError as exc:
            connection.close()
            raise ProviderCallError(f"connect_failed: {type(exc).__name__}", False) from exc
        try:
            # Headers and body go out separately: a failure before the body is the only case in which the
            # provider provably holds nothing it could process.
            connection.putrequest("POST", self._path, skip_accept_encoding=True)
            for name, value in {
                "Authorization": f"Bearer {self._api_key}",
                "Content-Type": "application/json",
                "Content-Length": str(len(data)),
                "Accept": "text/event-stream",
                "X-Request-Id": provider_request_id,
                **self._headers,
            }.items():
                connection.putheader(name, value)
            connection.endheaders()
        except OSError as exc:
            connection.close()
            raise ProviderCallError(f"headers_not_sent: {type(exc).__name__}", False) from exc
        try:
            connection.send(data)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            # A reset before or after the provider read the body looks the same from here.
            connection.close()
            raise ProviderCallError(f"no_response: {type(exc).__name__}", "unknown") from exc
        if response.status != 200:
            kind = _error_kind(response)
            connection.close()
            # These answers are documented as "not processed, not billed": the request was refused before
            # any work (bad request, context overflow, auth, unknown model, rate limit). A 5xx or anything
            # else may come after the prompt was processed, so it proves nothing.
            sent: RequestSent = response.status not in NOT_PROCESSED_STATUSES
            raise ProviderCallError(f"provider_http_{response.status}: {kind}", sent, response.status)
        return ChatStream(connection, response)


def _error_kind(response: http.client.HTTPResponse) -> str:
    """``type`` of an OpenAI-style error body, with its ``code`` when that says more; else ``unknown``."""
    try:
        body = json.loads(response.read(_MAX_ERROR_BODY))
    except (OSError, http.client.HTTPException, UnicodeDecodeError, json.JSONDecodeError):
        return "unknown"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "unknown"
    kind, code = error.get("type"), error.get("code")
    parts = [value for value in (kind, code) if isinstance(value, str) and value]
    return "/".join(dict.fromkeys(parts)) or "unknown"


def provider_body(payload: Any, max_output: int, default_model: str | None) -> dict[str, Any]:
    """The streaming Chat Completions body for an admitted payload.

    The payload is sent as admitted, plus ``stream``/``include_usage``; the output limit is capped at the
    reserved output so the provider cannot produce more than was reserved, and ``n`` must be 1 because the
    reservation covers one completion. Raises ``ProtocolViolation`` if the payload is not a chat body.
    """
    if not isinstance(payload, Mapping) or not isinstance(payload.get("messages"), list):
        raise ProtocolViolation("the admitted payload is not a chat body with messages")
    body = dict(payload)
    model = body.get("model") or default_model
    if not isinstance(model, str) or not model:
        raise ProtocolViolation("the admitted payload names no model and no default model is configured")
    if body.get("n", 1) != 1:
        raise ProtocolViolation("the reservation covers one completion; n must be 1")
    body["model"] = model
    limit_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    requested = body.get(limit_key)
    if not isinstance(requested, int) or isinstance(requested, bool) or not 0 < requested <= max_output:
        body[limit_key] = max_output
    body["stream"] = True
    options = body.get("stream_options")
    body["stream_options"] = {**(options if isinstance(options, Mapping) else {}), "include_usage": True}
    return body


# -- the protocol ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """What a 201 (or replayed 200) admission grants."""

    reservation_id: str
    fence: int
    admitted_digest: str
    payload: Any
    max_output: int
    lease_expires_at: datetime
    replayed: bool
    rung: str = "FULL"
    input_tokens: int | None = None

    @classmethod
    def from_response(cls, response: ApiResponse) -> Grant:
        """Read a grant from an admission answer. Raises ``ProtocolViolation`` if fields are missing."""
        body = response.body
        if not isinstance(body, dict):
            raise ProtocolViolation("admission answer is not a JSON object")
        lease, tokens = body.get("lease"), body.get("tokens")
        if not isinstance(lease, dict) or not isinstance(tokens, dict):
            raise ProtocolViolation("admission answer lacks lease or tokens")
        try:
            reservation_id = body["reservationId"]
            fence = lease["fence"]
            admitted_digest = body["admittedDigest"]
            max_output = tokens["maxOutput"]
            expires_at = _parse_time(lease["expiresAt"])
            payload = body["payload"]
        except (KeyError, ValueError) as exc:
            raise ProtocolViolation(f"admission answer lacks a field: {exc}") from exc
        rung, input_tokens = body.get("rung"), tokens.get("input")
        if not isinstance(reservation_id, str | int) or isinstance(reservation_id, bool):
            raise ProtocolViolation("reservationId is not a string")
        if not _is_int(fence) or not isinstance(admitted_digest, str) or not _is_int(max_output):
            raise ProtocolViolation("lease.fence, admittedDigest or tokens.maxOutput has the wrong type")
        return cls(
            reservation_id=str(reservation_id),
            fence=fence,
            admitted_digest=admitted_digest,
            payload=payload,
            max_output=max_output,
            lease_expires_at=expires_at,
            replayed=response.headers.get("idempotent-replayed", "").lower() == "true",
            rung=rung if isinstance(rung, str) and rung else "FULL",
            input_tokens=input_tokens if _is_int(input_tokens) else None,
        )


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True must not pass as one token or fence 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError("timestamp is not a string")
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no offset")
    return moment


@dataclass(frozen=True)
class CallResult:
    """How one call ended.

    ``completed``: the final usage was posted. ``usage_unknown``: the answer arrived without final usage;
    reported through ``/fail`` so the reconciler settles it. ``failed``: the provider call failed;
    ``/fail`` was posted. ``cancelled``: ``/cancel`` was posted. ``unsettled``: the terminal call to our
    API could not be delivered; the lease will expire and the reclaimer reconciles.
    ``output_tokens`` is the sum of the deltas posted (or queued, for ``unsettled``).
    """

    outcome: CallOutcome
    reservation_id: str
    provider_request_id: str
    content: str = ""
    input_tokens: int | None = None
    output_tokens: int = 0
    usage_events: int = 0
    request_sent: RequestSent | None = None
    reason: str | None = None


class GatewayClient:
    """Runs one admitted provider call end to end against our API and an OpenAI-compatible provider.

    ``usage_every_chunks``: post a usage delta every N content chunks. ``lease_renew_interval_s``: renew
    the lease this often; by default a third of the lease's remaining time at admission.

    The lease is renewed between chunks, not from a background thread: a stream stalled for longer than the
    lease loses it, a reclaimer takes over with a higher fence and this client's next write is refused
    (``StaleFence``). Correctness rests on the fence, so the simpler single-threaded client is enough.
    """

    def __init__(
        self,
        api: ApiClient,
        provider: ChatProvider,
        *,
        model: str | None = None,
        usage_every_chunks: int = 8,
        lease_renew_interval_s: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if usage_every_chunks < 1:
            raise ValueError("usage_every_chunks must be positive")
        self._api = api
        self._provider = provider
        self._model = model
        self._usage_every = usage_every_chunks
        self._renew_interval_s = lease_renew_interval_s
        self._monotonic = monotonic
        self._wall_clock = wall_clock

    def admit(self, request: Mapping[str, Any], idempotency_key: str) -> Grant:
        """``POST /api/v1/admissions``. Raises ``AdmissionQueued`` on 202, ``ApiError`` on a rejection,
        ``ApiUnavailable`` and ``ProtocolViolation`` as their names say."""
        response = self._api.request("POST", ADMISSIONS_PATH, request, {"Idempotency-Key": idempotency_key})
        if response.status == 202:
            raise AdmissionQueued(response.body)
        if response.status not in (200, 201):
            raise ProtocolViolation(f"admission answered HTTP {response.status}")
        return Grant.from_response(response)

    def run(
        self,
        request: Mapping[str, Any],
        *,
        idempotency_key: str,
        cancel: threading.Event | None = None,
        die_after: DiePoint | None = None,
        die_after_chunks: int = 0,
        pause_at: Callable[[PausePoint], None] | None = None,
    ) -> CallResult:
        """Admit, dispatch, stream and settle one call; see the module docstring for the protocol.

        Raises what ``admit`` raises, then what ``call`` raises; the keyword arguments are ``call``'s.
        """
        if die_after_chunks < 0:
            raise ValueError("die_after_chunks cannot be negative")
        return self.call(
            self.admit(request, idempotency_key),
            cancel=cancel,
            die_after=die_after,
            die_after_chunks=die_after_chunks,
            pause_at=pause_at,
        )

    def call(
        self,
        grant: Grant,
        *,
        cancel: threading.Event | None = None,
        die_after: DiePoint | None = None,
        die_after_chunks: int = 0,
        pause_at: Callable[[PausePoint], None] | None = None,
    ) -> CallResult:
        """Dispatch, stream and settle the call an admission granted.

        ``cancel`` is checked before dispatch and after every chunk. ``die_after`` raises ``ClientDied`` at
        that point (``after_k_chunks`` after ``die_after_chunks`` content chunks, 0 = as the response
        begins). ``pause_at`` is called at each ``PausePoint`` before the ``die_after`` check there; the
        call goes on when it returns. Raises ``StaleFence`` if the lease was taken over;
        ``ApiError``/``ApiUnavailable`` if dispatch could not be recorded (nothing is then sent to the
        provider, and a best-effort ``/cancel`` is made), or if a later write was refused;
        ``ProtocolViolation`` for a bad payload; ``ValueError`` for a negative ``die_after_chunks``.
        """
        if die_after_chunks < 0:
            raise ValueError("die_after_chunks cannot be negative")
        call = _Call(self, grant)
        # Built before dispatch: a payload we cannot send must not leave a dispatched reservation behind.
        try:
            body = provider_body(grant.payload, grant.max_output, self._model)
        except ProtocolViolation:
            with contextlib.suppress(GatewayError):
                call.post("cancel", {})
            raise
        if pause_at is not None:
            pause_at("before_dispatch")
        if die_after == "before_dispatch":
            raise ClientDied("before_dispatch")
        if cancel is not None and cancel.is_set():
            return call.terminal("cancel", {}, outcome="cancelled", reason="cancelled before dispatch")
        call.dispatch()
        if pause_at is not None:
            pause_at("dispatch")
        if die_after == "dispatch":
            raise ClientDied("after dispatch")
        call.maybe_renew()
        try:
            stream = self._provider.open(body, call.provider_request_id)
        except ProviderCallError as exc:
            return call.fail(exc.request_sent, exc.reason)
        with stream:
            return call.consume(stream, cancel, die_after, die_after_chunks, pause_at)


@dataclass
class _Call:
    """The mutable state of one run: ids, what was reported, the lease clock."""

    client: GatewayClient
    grant: Grant
    provider_request_id: str = field(init=False)
    renew_every_s: float = field(init=False)
    last_renewed: float = field(init=False)
    reported_output: int = 0  # tokens in every usage event created, delivered or still in the outbox
    seq: int = 0
    outbox: list[dict[str, Any]] = field(default_factory=list)
    delivered: int = 0
    content: list[str] = field(default_factory=list)
    input_tokens: int | None = None

    def __post_init__(self) -> None:
        self.provider_request_id = provider_request_id_for(self.grant.reservation_id)
        self.last_renewed = self.client._monotonic()
        self.renew_every_s = self._renew_interval(self.grant.lease_expires_at)

    @property
    def path(self) -> str:
        return f"/api/v1/reservations/{quote(self.grant.reservation_id, safe='')}"

    def post(self, action: str, body: Mapping[str, Any]) -> ApiResponse:
        return self.client._api.request("POST", f"{self.path}/{action}", {"fence": self.grant.fence, **body})

    def dispatch(self) -> None:
        try:
            self.post(
                "dispatch",
                {"providerRequestId": self.provider_request_id, "admittedDigest": self.grant.admitted_digest},
            )
        except StaleFence:
            raise
        except GatewayError:
            # Nothing was sent to the provider, so a full release is right. If this cancel fails too, the
            # lease expires and the reclaimer reaches the same result (the provider lookup finds nothing).
            with contextlib.suppress(GatewayError):
                self.post("cancel", {})
            raise

    def consume(
        self,
        stream: ChatStream,
        cancel: threading.Event | None,
        die_after: DiePoint | None,
        die_after_chunks: int,
        pause_at: Callable[[PausePoint], None] | None,
    ) -> CallResult:
        if die_after == "after_k_chunks" and die_after_chunks == 0:
            raise ClientDied("as the response began")
        chunks = 0
        usage_high = 0
        final: ProviderUsage | None = None
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    self.input_tokens = chunk.usage.prompt_tokens
                    usage_high = max(usage_high, chunk.usage.completion_tokens)
                    if chunk.is_usage_chunk and (
                        final is None or chunk.usage.completion_tokens > final.completion_tokens
                    ):
                        final = chunk.usage
                if chunk.text:
                    chunks += 1
                    self.content.append(chunk.text)
                    if chunks % self.client._usage_every == 0:
                        self.report(max(chunks, usage_high), tolerate_outage=True)
                    if die_after == "after_k_chunks" and chunks == die_after_chunks:
                        raise ClientDied(f"after {chunks} chunks")
                self.maybe_renew()
                if cancel is not None and cancel.is_set():
                    # Closing first stops the provider generating (and billing) more.
                    stream.close()
                    return self.settle_partial(max(chunks, usage_high), "cancel", {}, "cancelled", None)
        except ProviderCallError as exc:
            return self.settle_partial(
                max(chunks, usage_high), "fail", {"reason": exc.reason, "requestSent": True}, "failed", exc
            )
        if final is None:
            return self.settle_partial(
                max(chunks, usage_high),
                "fail",
                {"reason": "missing_final_usage", "requestSent": True},
                "usage_unknown",
                None,
            )
        if pause_at is not None:
            pause_at("before_final_usage")
        if die_after == "before_final_usage":
            raise ClientDied("before final usage")
        if final.completion_tokens < self.reported_output:
            # Cannot happen while mid-stream reports are lower bounds; a provider that under-reports its
            # own total leaves the difference captured, and the server's audit sees the deviation.
            logger.warning(
                "provider total %d below the %d tokens already reported for %s",
                final.completion_tokens,
                self.reported_output,
                self.provider_request_id,
            )
        self.input_tokens = final.prompt_tokens
        try:
            self.report(final.completion_tokens, final=True)
        except ApiUnavailable as exc:
            return self.result("unsettled", reason=str(exc))
        return self.result("completed")

    def report(self, observed: int, *, final: bool = False, tolerate_outage: bool = False) -> None:
        """Queue a delta up to ``observed`` (if any, or always when final) and deliver the outbox in order."""
        delta = max(0, observed - self.reported_output)
        if delta or final:
            self.seq += 1
            event: dict[str, Any] = {
                "usageEventId": usage_event_id(self.provider_request_id, self.seq),
                "outputTokens": delta,
                "final": final,
            }
            if final and self.input_tokens is not None:
                event["inputTokens"] = self.input_tokens
            self.outbox.append(event)
            self.reported_output += delta
        while self.outbox:
            try:
                self.post("usage", self.outbox[0])
            except ApiUnavailable:
                if tolerate_outage:
                    return
                raise
            self.outbox.pop(0)
            self.delivered += 1

    def settle_partial(
        self,
        observed: int,
        action: Literal["fail", "cancel"],
        body: Mapping[str, Any],
        outcome: CallOutcome,
        error: ProviderCallError | None,
    ) -> CallResult:
        try:
            self.report(observed)
        except ApiUnavailable as exc:
            return self.result("unsettled", request_sent=body.get("requestSent"), reason=str(exc))
        reason = error.reason if error is not None else body.get("reason", "cancelled")
        return self.terminal(
            action, body, outcome=outcome, reason=reason, request_sent=body.get("requestSent")
        )

    def fail(self, request_sent: RequestSent, reason: str) -> CallResult:
        return self.terminal(
            "fail",
            {"reason": reason, "requestSent": request_sent},
            outcome="failed",
            reason=reason,
            request_sent=request_sent,
        )

    def terminal(
        self,
        action: Literal["fail", "cancel"],
        body: Mapping[str, Any],
        *,
        outcome: CallOutcome,
        reason: str | None,
        request_sent: RequestSent | None = None,
    ) -> CallResult:
        try:
            self.post(action, body)
        except ApiUnavailable as exc:
            return self.result("unsettled", request_sent=request_sent, reason=f"{reason}; {exc}")
        return self.result(outcome, request_sent=request_sent, reason=reason)

    def maybe_renew(self) -> None:
        if self.client._monotonic() - self.last_renewed < self.renew_every_s:
            return
        try:
            response = self.post("lease", {})
        except ApiUnavailable:
            # Try again after the next chunk; if the lease lapses meanwhile the fence protects the ledger.
            return
        self.last_renewed = self.client._monotonic()
        body = response.body if isinstance(response.body, dict) else {}
        lease = body.get("lease")
        expires_at = (lease if isinstance(lease, dict) else body).get("expiresAt")
        # The renewal's answer shape beyond the fence is not part of the contract; without a new expiry the
        # current interval stays.
        with contextlib.suppress(ValueError):
            self.renew_every_s = self._renew_interval(_parse_time(expires_at))

    def _renew_interval(self, expires_at: datetime) -> float:
        if self.client._renew_interval_s is not None:
            return self.client._renew_interval_s
        remaining = (expires_at - self.client._wall_clock()).total_seconds()
        return max(_MIN_RENEW_INTERVAL_S, remaining / 3)

    def result(
        self, outcome: CallOutcome, *, request_sent: RequestSent | None = None, reason: str | None = None
    ) -> CallResult:
        return CallResult(
            outcome=outcome,
            reservation_id=self.grant.reservation_id,
            provider_request_id=self.provider_request_id,
            content="".join(self.content),
            input_tokens=self.input_tokens,
            output_tokens=self.reported_output,
            usage_events=self.delivered,
            request_sent=request_sent,
            reason=reason,
        )
