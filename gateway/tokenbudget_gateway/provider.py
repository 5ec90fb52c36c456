"""The provider side: one streamed OpenAI Chat Completions call over ``http.client``, its SSE chunks parsed.

Sending with ``http.client`` step by step tells exactly how far a request got, which is what ``/fail`` may
claim in ``requestSent`` (see ``ProviderCallError``).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from tokenbudget_gateway.errors import ProtocolViolation, ProviderCallError, RequestSent
from tokenbudget_gateway.protocol import is_int
from tokenbudget_gateway.transport import BaseUrl

# Provider answers that document non-processing (OpenAI: invalid request incl. context_length_exceeded,
# authentication, permission, not found, rate limit). 409 is not here: it can mean an earlier attempt with
# the same request id was processed.
NOT_PROCESSED_STATUSES: Final = frozenset({400, 401, 403, 404, 429})
_MAX_SSE_LINE: Final = 1024 * 1024
_MAX_ERROR_BODY: Final = 64 * 1024


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
    if not is_int(prompt) or not is_int(completion) or prompt < 0 or completion < 0:
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
        self._base = BaseUrl.parse(base_url)
        self._path = self._base.path + "/chat/completions"
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._headers = dict(headers or {})

    def open(self, body: Mapping[str, Any], provider_request_id: str) -> ChatStream:
        """Send the request and return the stream once the provider answered 200.

        Raises ``ProviderCallError`` with ``request_sent`` set as precisely as the failure allows.
        """
        data = json.dumps(body, separators=(",", ":")).encode()
        connection = self._base.connection(self._timeout_s)
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
