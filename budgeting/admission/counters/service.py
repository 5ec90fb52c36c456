"""Provider counts for admissions: the count cache, the circuit breaker and the metrics in front of the APIs.

``provider_count_for(pool, models, cache)`` is the ``ladder.walk.ProviderCount`` of one admission: it counts a
final payload of a provider-counted model revision (or, for an OpenAI model, a payload whose tools or tool
calls its tokenizer can only bound: ``ModelSpec.bound_counter``) through the pool's provider base URL, with
the key from the environment variable the pool names (as the reconciler's lookups do). Counts are cached by
(model revision, counter, payload digest) in the admission's count cache, under the ``tc:`` prefix that a
policy rollback clears, so a provider count has the isolation of a tokenizer count. Any failure, and an
open circuit, is ``CountingUnavailable``: the policy's counting-unavailable rule decides.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from django.conf import settings

from budgeting.admission.counters.apis import TRANSIENT, CounterError, CountingApi, build, normalise_endpoint
from budgeting.admission.counters.breaker import Breaker
from budgeting.admission.counters.payloads import image_tokens_of
from budgeting.catalog.models import ModelPool, ModelRevision
from budgeting.observability import metrics
from ladder.counting import CountCache, CountingUnavailable
from ladder.rungs import ModelSpec
from ladder.walk import ProviderCount

_LOCK = threading.Lock()
# One SDK client per (API, endpoint, key) per process: its connection pool is what keeps a count to one
# round trip. One breaker per (API, endpoint).
_APIS: dict[tuple[str, str, str], CountingApi] = {}
_BREAKERS: dict[tuple[str, str], Breaker] = {}


def cache_key(revision: str, counter: str, provider_model: str, payload_digest: str) -> str:
    """The count cache key of one provider count (``tc:`` so that a policy rollback clears it too)."""
    return f"tc:provider:{counter}:{provider_model}:{revision}:{payload_digest}"


def _api(name: str, endpoint: str, api_key: str | None) -> CountingApi:
    key = (name, endpoint, api_key or "")
    with _LOCK:
        api = _APIS.get(key)
        if api is None:
            api = _APIS[key] = build(
                name, endpoint, api_key=api_key, timeout=settings.COUNTING_API_TIMEOUT_SECONDS
            )
    return api


def breaker(name: str, endpoint: str) -> Breaker:
    """The process's breaker of the counting API ``name`` at ``endpoint``."""
    key = (name, normalise_endpoint(endpoint))
    with _LOCK:
        found = _BREAKERS.get(key)
        if found is None:
            found = _BREAKERS[key] = Breaker(
                f"{name} at {key[1]}",
                failures=settings.COUNTING_BREAKER_FAILURES,
                cooldown=settings.COUNTING_BREAKER_COOLDOWN_SECONDS,
                on_change=lambda _, opened: metrics.set_counting_circuit(name, key[1], opened),
            )
    return found


def reset() -> None:
    """Forget every client and breaker (tests, and a simulator restarted on another port)."""
    with _LOCK:
        _APIS.clear()
        _BREAKERS.clear()


def provider_model(revision: ModelRevision) -> str:
    """The model id the counting API is asked about: the revision's ``provider_model``, else its name up to
    the ``@``."""
    return revision.provider_model or revision.name.partition("@")[0]


def provider_count_for(
    pool: ModelPool, models: Mapping[str, ModelRevision], cache: CountCache
) -> ProviderCount:
    """The provider count of one admission's pool (see the module docstring)."""
    endpoint = normalise_endpoint(pool.provider_base_url)
    api_key = os.environ.get(pool.api_key_env) if pool.api_key_env else None

    def count(spec: ModelSpec, payload: Mapping[str, object], payload_digest: str) -> int:
        name = spec.provider_counter or spec.bound_counter
        revision = models.get(spec.id)
        if name is None or revision is None:
            raise CountingUnavailable(f"{spec.id} has no counting API")
        if not endpoint:
            raise CountingUnavailable(f"pool {pool.slug} names no provider base URL for {name} counting")
        model = provider_model(revision)
        key = cache_key(spec.id, name, model, payload_digest)
        cached = cache.get_many([key])[0]
        if cached is not None:
            metrics.count_provider_count(name, "cached")
            return cached
        gate = breaker(name, endpoint)
        if not gate.allow():
            metrics.count_provider_count(name, "circuit_open")
            raise CountingUnavailable(f"the {name} counting API's circuit is open (it failed recently)")
        try:
            remote = _api(name, endpoint, api_key).count(model, payload)
        except CounterError as exc:
            if exc.kind in TRANSIENT:
                gate.failed(str(exc))
            else:
                gate.succeeded()
            metrics.count_provider_count(name, exc.kind)
            raise CountingUnavailable(str(exc)) from exc
        gate.succeeded()
        metrics.count_provider_count(name, "counted")
        total = remote + image_tokens_of(payload, spec.image_formula)
        cache.set_many({key: total})
        return total

    return count
