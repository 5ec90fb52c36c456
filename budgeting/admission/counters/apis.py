"""The three counting APIs, each behind ``CountingApi.count(model, payload) -> tokens``.

- Anthropic ``POST /v1/messages/count_tokens`` (Claude), through the official ``anthropic`` SDK
  (``messages.count_tokens``); answers ``{"input_tokens": n}``. Anthropic documents the count as an estimate
  and counts per model (newer Claude tokenizers give more tokens for the same text), so the model is the
  target revision's own.
- OpenAI ``POST /v1/responses/input_tokens``, through the official ``openai`` SDK
  (``responses.input_tokens.count``); answers ``{"object": "response.input_tokens", "input_tokens": n}``.
- Google ``models.countTokens`` (``POST /v1beta/models/{model}:countTokens``), in its documented REST shape
  with the standard library: the official ``google-genai`` SDK (3.6) refuses ``system_instruction`` and
  ``tools`` for ``count_tokens`` against the Gemini Developer API (they are for its Vertex mode only), and
  every payload here has system instructions; the REST method takes them inside ``generateContentRequest``.
  Answers ``{"totalTokens": n, ...}``.

Retries are off in the SDKs: a failure is the policy's "counting unavailable" at once, and the circuit
breaker (``breaker``), not a retry loop, decides when to try the API again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from http.client import HTTPException
from typing import Any, Final, Literal, Protocol

import anthropic
import openai

from budgeting.admission.counters.payloads import anthropic_request, gemini_request, openai_request

CounterName = Literal["anthropic", "gemini", "openai"]
COUNTERS: Final[tuple[CounterName, ...]] = ("anthropic", "gemini", "openai")
FailureKind = Literal["timeout", "rate_limited", "server", "unreachable", "refused", "malformed"]
# What a dead or overloaded API answers; the breaker counts these. A refusal (4xx) is about this request.
TRANSIENT: Final = frozenset({"timeout", "rate_limited", "server", "unreachable"})


class CounterError(Exception):
    """A counting API did not count: ``kind`` says why (``TRANSIENT`` kinds count towards the breaker)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class CountingApi(Protocol):
    """One provider's counting API at one endpoint."""

    name: CounterName
    endpoint: str

    def count(self, model: str, payload: Mapping[str, object]) -> int:
        """The provider's input-token count of ``payload`` for ``model``. Raises CounterError."""
        ...


def normalise_endpoint(base_url: str) -> str:
    """The form an endpoint is compared and keyed in (no surrounding space, no trailing slash)."""
    return base_url.strip().rstrip("/")


def _checked(value: object, api: str) -> int:
    # bool is an int subclass, and True must not pass as one token.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CounterError("malformed", f"{api} answered without a token count")
    return value


def _sdk_failure(exc: Exception, status_error: type[Exception], api: str) -> CounterError:
    """The kind of an SDK exception (both SDKs share the shape of their errors)."""
    status = getattr(exc, "status_code", None)
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return CounterError("timeout", f"{api} timed out")
    if isinstance(exc, status_error) and isinstance(status, int):
        if status == 429:
            return CounterError("rate_limited", f"{api} answered 429")
        if status >= 500:
            return CounterError("server", f"{api} answered {status}")
        return CounterError("refused", f"{api} refused the request ({status}): {exc}")
    return CounterError("unreachable", f"{api} is unreachable: {type(exc).__name__}")


class AnthropicCountTokens:
    """Anthropic's ``count_tokens`` through the ``anthropic`` SDK."""

    name: CounterName = "anthropic"

    def __init__(
        self, base_url: str, *, api_key: str | None, timeout: float, http_client: Any = None
    ) -> None:
        self.endpoint = normalise_endpoint(base_url)
        options: dict[str, Any] = {"base_url": self.endpoint, "timeout": timeout, "max_retries": 0}
        if http_client is not None:
            options["http_client"] = http_client
        self._client = anthropic.Anthropic(api_key=api_key or "missing", **options)

    def count(self, model: str, payload: Mapping[str, object]) -> int:
        try:
            answer = self._client.messages.count_tokens(model=model, **anthropic_request(payload))
        except anthropic.AnthropicError as exc:
            raise _sdk_failure(exc, anthropic.APIStatusError, "Anthropic count_tokens") from exc
        return _checked(getattr(answer, "input_tokens", None), "Anthropic count_tokens")


class OpenAIInputTokens:
    """OpenAI's ``responses/input_tokens`` through the ``openai`` SDK."""

    name: CounterName = "openai"

    def __init__(
        self, base_url: str, *, api_key: str | None, timeout: float, http_client: Any = None
    ) -> None:
        self.endpoint = normalise_endpoint(base_url)
        # The SDK's base URL ends in the API version; a pool may name the bare host (as the simulator's does).
        sdk_base = self.endpoint if self.endpoint.endswith("/v1") else self.endpoint + "/v1"
        options: dict[str, Any] = {"base_url": sdk_base, "timeout": timeout, "max_retries": 0}
        if http_client is not None:
            options["http_client"] = http_client
        self._client = openai.OpenAI(api_key=api_key or "missing", **options)

    def count(self, model: str, payload: Mapping[str, object]) -> int:
        try:
            answer = self._client.responses.input_tokens.count(model=model, **openai_request(payload))
        except openai.OpenAIError as exc:
            raise _sdk_failure(exc, openai.APIStatusError, "OpenAI input_tokens") from exc
        return _checked(getattr(answer, "input_tokens", None), "OpenAI input_tokens")


Opener = Callable[[urllib.request.Request, float], Any]


def _open(request: urllib.request.Request, timeout: float) -> Any:
    return urllib.request.urlopen(request, timeout=timeout)


class GeminiCountTokens:
    """Gemini's ``models.countTokens`` in its REST shape (see the module docstring for why not the SDK)."""

    name: CounterName = "gemini"

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float, opener: Opener = _open) -> None:
        self.endpoint = normalise_endpoint(base_url)
        # As the SDKs do: a request without a key still goes out, and the API answers 401 for it.
        self._api_key = api_key or "missing"
        self._timeout = timeout
        self._open = opener

    def count(self, model: str, payload: Mapping[str, object]) -> int:
        url = f"{self.endpoint}/v1beta/models/{urllib.parse.quote(model, safe='')}:countTokens"
        body = json.dumps(gemini_request(payload, model)).encode()
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "x-goog-api-key": self._api_key},
        )
        try:
            with self._open(request, self._timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 429:
                raise CounterError("rate_limited", "Gemini countTokens answered 429") from exc
            if exc.code >= 500:
                raise CounterError("server", f"Gemini countTokens answered {exc.code}") from exc
            raise CounterError("refused", f"Gemini countTokens refused the request ({exc.code})") from exc
        except TimeoutError as exc:
            raise CounterError("timeout", "Gemini countTokens timed out") from exc
        except urllib.error.URLError as exc:
            kind: FailureKind = "timeout" if isinstance(exc.reason, TimeoutError) else "unreachable"
            raise CounterError(kind, f"Gemini countTokens: {exc.reason}") from exc
        except (OSError, HTTPException, ValueError) as exc:
            raise CounterError("unreachable", f"Gemini countTokens: {type(exc).__name__}") from exc
        return _checked(answer.get("totalTokens") if isinstance(answer, dict) else None, "Gemini countTokens")


def build(name: str, base_url: str, *, api_key: str | None, timeout: float) -> CountingApi:
    """The counting API ``name`` at ``base_url``. Raises ValueError for an unknown name."""
    if name == "anthropic":
        return AnthropicCountTokens(base_url, api_key=api_key, timeout=timeout)
    if name == "openai":
        return OpenAIInputTokens(base_url, api_key=api_key, timeout=timeout)
    if name == "gemini":
        return GeminiCountTokens(base_url, api_key=api_key, timeout=timeout)
    raise ValueError(f"unknown counting API {name!r}")
