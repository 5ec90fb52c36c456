"""The provider simulator's adapter: ``GET /v1/requests/{id}`` lookups by the id the gateway sent.

The simulator records every request id before it reads the body (a refused one as never processed), its
lookup is strongly consistent and it forgets nothing while it runs, so its "not found" can be vouched for.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Final

from reconciliation.providers.base import (
    Capabilities,
    LookupResult,
    LookupStatus,
    is_count,
    normalise_endpoint,
)

# The simulator accepts these as ``X-Request-Id`` (its documented rule); any other id it never saw.
_MAX_ID_LENGTH: Final = 256


class SimulatorLookup:
    """``ProviderAdapter`` over the simulator's lookup.

    Mapping: ``completed`` → COMPLETED (billed usage); ``not_found`` → NOT_FOUND; ``running`` → RUNNING;
    anything else — ``unknown``, any non-200 status, connection errors, timeouts, a body that is not the
    expected JSON or names another id — → UNKNOWN.
    """

    name = "simulator"
    capabilities = Capabilities(lookup=True, vouches_not_found=True, retention=None, billing="request")

    def __init__(self, base_url: str, timeout: float = 5.0, *, api_key: str | None = None) -> None:
        self.endpoint = normalise_endpoint(base_url)
        self._timeout = timeout
        self._api_key = api_key

    def knows(self, provider_request_id: str) -> bool:
        value = provider_request_id
        return 0 < len(value) <= _MAX_ID_LENGTH and value.isprintable() and " " not in value

    def lookup(self, provider_request_id: str) -> LookupResult:
        """Look up ``provider_request_id``; every failure to get a well-formed answer is UNKNOWN."""
        url = f"{self.endpoint}/v1/requests/{urllib.parse.quote(provider_request_id, safe='')}"
        request = urllib.request.Request(url, method="GET", headers={"Accept": "application/json"})
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                status = response.status
                raw = response.read()
        except urllib.error.HTTPError as exc:
            return LookupResult.unknown(f"lookup answered HTTP {exc.code}")
        except (urllib.error.URLError, OSError, HTTPException) as exc:
            # URLError wraps refused/reset connections; socket timeouts and resets while reading the body
            # surface as OSError or HTTPException. None of them says anything about the request.
            return LookupResult.unknown(f"lookup failed: {type(exc).__name__}: {exc}")
        if status != 200:
            return LookupResult.unknown(f"lookup answered HTTP {status}")
        return interpret_lookup(provider_request_id, raw)


def interpret_lookup(provider_request_id: str, raw: bytes) -> LookupResult:
    """Read one lookup body of the simulator."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return LookupResult.unknown("lookup body is not JSON")
    if not isinstance(body, dict):
        return LookupResult.unknown("lookup body is not an object")
    if body.get("id") != provider_request_id:
        # A proxy or cache answering for another id must not settle this one.
        return LookupResult.unknown(f"lookup answered for id {body.get('id')!r}")
    status = body.get("status")
    if status == "completed":
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return LookupResult.unknown("completed lookup without usage")
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not is_count(prompt) or not is_count(completion):
            return LookupResult.unknown("completed lookup with malformed usage")
        return LookupResult(
            status=LookupStatus.COMPLETED,
            input_tokens=prompt,
            output_tokens=completion,
            detail=str(body.get("billing_status", "")),
        )
    if status == "not_found":
        return LookupResult(status=LookupStatus.NOT_FOUND, detail="not_found")
    if status == "running":
        return LookupResult(status=LookupStatus.RUNNING, detail="running")
    return LookupResult.unknown(f"lookup status {status!r}")
