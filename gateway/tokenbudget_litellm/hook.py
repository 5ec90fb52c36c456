"""The LiteLLM proxy hook: every call to a configured model group is admitted, dispatched and settled.

Load it from the proxy's config (its settings: ``tokenbudget_litellm.settings``)::

    litellm_settings:
      callbacks: tokenbudget_litellm.hook.proxy_handler_instance

Every call to our API is a coroutine on the proxy's event loop over kept-alive connections
(``transport.AsyncApi``), bounded by one deadline (``timeoutSeconds``). One call, hook by hook:

- Before any hook (``arrival``, ``admitOnArrival``): a chat request like one LiteLLM accepted in the last
  minute has its admission sent as it reaches the proxy's routes, mapped as the caller LiteLLM found then,
  while LiteLLM authenticates and prepares it; the pre-call hook adopts it only if it is the admission the
  call needs then (else it is released and the call admitted there), and one that no hook took is released
  once the proxy has answered, as is an admission a pre-call hook left in flight that no deployment hook
  took (LiteLLM ran its pre-call logic again, for a fallback of its own).
- ``async_pre_call_hook``: the request is mapped (``mapping``) and its admission sent (or the one sent on
  its arrival adopted); the admission also
  records the dispatch under a provider request id the hook chose (``dispatchAtAdmission``), so it is the
  one call to us before the provider call. Router retries and fallbacks are turned off (a reservation
  covers one provider call). For a group whose admission cannot change where the call goes (no
  ``deployments``) the hook returns as soon as the admission is on the wire, and LiteLLM routes the call
  (a millisecond or two of the proxy's own work) while our API decides; the admission is awaited in the
  next hook. For a group with ``deployments`` the call is routed only once admitted, to the proxy model
  that serves the admitted model revision (a fallback rung's smaller model has its own deployment).
- ``async_pre_call_deployment_hook``: right before the provider call, the call is admitted (the admission
  awaited where it was left in flight). It then carries the admitted payload, asks a stream for its usage
  (``stream_options.include_usage``) and carries, in its metadata under ``tokenbudget_ticket``, the
  reservation id, fence and provider request id; the lease is kept from then on (below); the provider
  request id is sent as ``X-Request-Id`` (and the dispatch recorded, where the admission could not: a
  queued admission). A second attempt for the same reservation (a retry or a fallback) is refused. A
  refusal of our API reaches the proxy's client with its status (429, 422, 503…; an unknown tenant, task
  class or pool 400), our problem (its ``code`` in ``error.provider_specific_fields``) and
  ``Retry-After``, and is logged in one line. If admission cannot be decided (our API unreachable or not
  answering within the deadline, or this hook fails) the call is refused 503 ``ADMISSION_UNAVAILABLE``, or
  let through unadmitted and logged when ``failOpen`` is set. An admission given up on that way may still
  be granted by our API: it is withdrawn in the background (``Calls.withdraw``: asked again with the same
  key, then released in full) unless its key is the caller's own ``requestId``, which the caller may retry
  with, or no attempt got a connection (nothing reached our API). A call that fails or is given up while
  its admission is in flight has what it is granted released in full. Shadow tenants' calls go unchanged
  (but for the retries turned off).
- ``async_post_call_response_headers_hook``: the answer carries ``x-tokenbudget-reservation-id``,
  ``x-tokenbudget-rung`` and ``x-tokenbudget-model-revision``.
- ``async_post_call_streaming_iterator_hook``: counts the content chunks a stream delivers (each is at
  least one token) and keeps the provider's usage chunk (passed on only to a client that asked for it). If
  the proxy's client goes away the provider stream is closed and what is known is settled: the provider's
  usage if it came, else the chunks seen as incurred usage, then ``cancel``, which frees the concurrency
  slot (the provider connection is closed) while the output still unknown stays held for reconciliation
  (SPEC §5).
- ``async_log_success_event``: the provider's usage (streamed or not) is the final usage, keyed by the
  provider's request id, sent with the other calls' final usages of the next ``usageFlushSeconds`` in one
  request (``reports``); an answer from LiteLLM's cache is reported as never sent.
- ``async_post_call_failure_hook`` / ``async_log_failure_event``: before the provider call the
  reservation is released in full (``cancel``, or ``fail`` with ``requestSent: false`` once the dispatch
  is recorded); after it, ``fail`` with what ``calls.request_sent_of`` can prove, the chunks seen posted as
  incurred usage. A timeout is ``"unknown"``.

The lease: from the admission until the call is settled, a task renews it at a third of what the grant (or
the last renewal) gave, whether the call streams or not, so a running call keeps its lease through two
lost renewals. It stops after ``maxCallSeconds`` so a call this process lost track of is reclaimed. A call
whose lease was nonetheless taken over (``STALE_FENCE``: the reclaimer holds a higher fence) goes on for
its client, but the reclaimer's fence is the rule: this hook's later writes are refused, and the call is
settled from the provider's records (the reconciler's lookup or the billing import), never from the hook.

Each reservation is settled once, by whichever of these hooks gets there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from tokenbudget_gateway.errors import GatewayError, StaleFence

from tokenbudget_litellm.arrival import ARRIVAL, AdmitOnArrival, Arrival, KnownCallers, install
from tokenbudget_litellm.calls import (
    Admitted,
    Calls,
    Refusal,
    Ticket,
    failure_reason,
    may_have_reached_our_api,
    request_sent_of,
)
from tokenbudget_litellm.mapping import (
    AdmissionRequest,
    Caller,
    MappingError,
    apply_admitted,
    to_admission,
)
from tokenbudget_litellm.settings import HookSettings, ModelGroup
from tokenbudget_litellm.transport import AsyncApi

logger = logging.getLogger(__name__)

TICKET_KEY: Final = "tokenbudget_ticket"
_ADMISSION_KEY: Final = "tokenbudget_admission"
_CHAT_CALLS: Final = frozenset({"completion", "acompletion"})
_UNAVAILABLE_RETRY_AFTER: Final = "5"
_PROXY_LOGGER: Final = "LiteLLM Proxy"
# A lease renewal never waits less than this, whatever a (skewed) clock says is left.
_MIN_RENEW_S: Final = 0.2
# How long credentials LiteLLM accepted are admitted on arrival (``arrival``), and how long a group whose
# early admission differed from the call is not.
_KNOWN_CALLER_S: Final = 60.0


@dataclass
class _CallState:
    """What this process knows of an admitted call until it is settled."""

    sent: bool = False
    chunks: int = 0
    usage: Any = None
    wants_usage: bool = False
    keeper: asyncio.Task[None] | None = None


class _Admission:
    """An admission asked for a call (its ``task`` started at once)."""

    def __init__(
        self,
        admit: Coroutine[Any, Any, Admitted],
        name: str,
        group: ModelGroup,
        request: AdmissionRequest,
        *,
        on_arrival: bool = False,
    ) -> None:
        self.task = asyncio.get_running_loop().create_task(admit)
        self.name = name
        self.group = group
        self.request = request
        self.on_arrival = on_arrival
        """Asked for as the request arrived, before LiteLLM's own work on it (``arrival``)."""


class _Refused(HTTPException):
    """A call this hook refused: LiteLLM answers its status and headers (anything else is a 500)."""


class _OneLinePerRefusal(logging.Filter):
    """Drops the proxy's own log record of a call this hook refused (the hook logged it in one line). The
    proxy may log a copy of the exception, so it is known by its detail: our problem under ``problem``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        raised = record.exc_info[1] if record.exc_info else None
        return not any(_is_refusal(value) for value in (*args, raised))


def _is_refusal(value: object) -> bool:
    detail = getattr(value, "detail", None)
    return (
        isinstance(value, HTTPException) and isinstance(detail, dict) and {"code", "problem"} <= detail.keys()
    )


class TokenBudgetHook(CustomLogger):
    """Admission, dispatch and settlement of the proxy's calls; see the module docstring."""

    def __init__(self, settings: HookSettings, calls: Calls | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.calls = calls or Calls(
            AsyncApi(settings.api_url, settings.token, deadline_s=settings.timeout_s),
            queue_wait_s=settings.queue_wait_s,
            dispatch_at_admission=settings.dispatch_at_admission,
            usage_flush_s=settings.usage_flush_s,
        )
        self._states: dict[str, _CallState] = {}
        self._admissions: dict[str, _Admission] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._callers = KnownCallers(ttl_s=_KNOWN_CALLER_S)
        self._admitted_late: dict[str, float] = {}
        if settings.admit_on_arrival:
            install(
                lambda app: AdmitOnArrival(
                    app, callers=self._callers, begin=self._admit_on_arrival, end=self._arrival_ended
                )
            )
        # First: LiteLLM's own filter on that logger formats the record's arguments away.
        logging.getLogger(_PROXY_LOGGER).filters.insert(0, _OneLinePerRefusal())
        if not logger.handlers and not logging.getLogger().handlers:
            # The proxy configures only its own loggers: without this our INFO lines (the reservation of
            # each call) would not reach its log.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        arrival = ARRIVAL.get()
        try:
            return await self._pre_call(user_api_key_dict, data, call_type, arrival)
        finally:
            left = arrival.take() if arrival is not None else None
            if left is not None:
                self._not_early(left, "was not taken (the call went on unadmitted, or was refused)")

    async def _pre_call(
        self, user_api_key_dict: Any, data: dict[str, Any], call_type: str, arrival: Arrival[Any] | None
    ) -> dict[str, Any]:
        name = str(data.get("model"))
        group = self.settings.model_groups.get(name)
        if group is None:
            if self.settings.unlisted == "pass":
                return data
            raise _refused(Refusal.of(400, "UNLISTED_MODEL_GROUP", f"no admission for {name!r}"), name)
        if call_type not in _CHAT_CALLS:
            raise _refused(Refusal.of(400, "UNSUPPORTED_CALL", f"{call_type} calls are not admitted"), name)
        caller = Caller(
            team_id=getattr(user_api_key_dict, "team_id", None),
            team_alias=getattr(user_api_key_dict, "team_alias", None),
        )
        try:
            request = to_admission(data, group, caller, self.settings)
        except MappingError as exc:
            raise _refused(Refusal.of(400, exc.code, exc.detail), name) from exc
        except Exception as exc:
            return self._undecided(data, exc)
        early = None
        if arrival is not None:
            self._callers.remember(arrival.credentials, caller)
            early = self._early_admission(name, request, arrival)
        data["num_retries"] = 0
        data.pop("fallbacks", None)
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        if group.deployments:
            # A rung may move the call to another deployment: LiteLLM routes it once it is admitted.
            ticket = await self._admitted_call(
                data, metadata, early or _Admission(self.calls.admit(request), name, group, request)
            )
            if ticket is not None:
                data["model"] = group.deployment_for(name, ticket.model_revision)
            return data
        admission = early or await self._on_the_wire(name, group, request)
        metadata[_ADMISSION_KEY] = key = uuid.uuid4().hex
        self._admissions[key] = admission
        if arrival is not None:
            arrival.in_flight.append(key)
        return data

    async def async_pre_call_deployment_hook(
        self, kwargs: dict[str, Any], call_type: Any
    ) -> dict[str, Any] | None:
        ticket = _ticket(kwargs.get("metadata"), kwargs.get("litellm_metadata"))
        if ticket is None:
            metadata, admission = self._admission_of(kwargs.get("metadata"), kwargs.get("litellm_metadata"))
            if admission is None:
                if metadata:
                    # The call's admission was taken by an earlier attempt: this is a second one.
                    raise _already_dispatched(str(metadata[_ADMISSION_KEY]))
                return None
            ticket = await self._admitted_call(kwargs, metadata, admission)
            if ticket is None:
                return kwargs
        state = self._states.get(ticket.reservation_id)
        if state is None or state.sent:
            raise _already_dispatched(ticket.reservation_id)
        if not ticket.dispatched:
            try:
                await self.calls.dispatch(ticket)
            except GatewayError as exc:
                # Nothing was sent to the provider: releasing in full is right.
                await self._release(ticket, state, "the dispatch could not be recorded")
                raise _refused(
                    Refusal.of(
                        503,
                        "ADMISSION_UNAVAILABLE",
                        f"the dispatch could not be recorded: {exc}",
                        _UNAVAILABLE_RETRY_AFTER,
                    ),
                    ticket.reservation_id,
                ) from exc
        state.sent = True
        kwargs["extra_headers"] = {
            **(kwargs.get("extra_headers") or {}),
            "X-Request-Id": ticket.provider_request_id,
        }
        return kwargs

    async def async_post_call_response_headers_hook(
        self,
        data: dict[str, Any],
        user_api_key_dict: Any,
        response: object,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, object] | None = None,
    ) -> dict[str, str] | None:
        ticket = _ticket(data.get("metadata"), data.get("litellm_metadata"))
        if ticket is None:
            return None
        return {
            "x-tokenbudget-reservation-id": ticket.reservation_id,
            "x-tokenbudget-rung": ticket.rung,
            "x-tokenbudget-model-revision": ticket.model_revision,
        }

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        ticket = _ticket(request_data.get("metadata"), request_data.get("litellm_metadata"))
        state = self._states.get(ticket.reservation_id) if ticket is not None else None
        try:
            async for item in response:
                if state is not None:
                    state.chunks += _has_content(item)
                    usage = getattr(item, "usage", None)
                    if usage is not None and not getattr(item, "choices", None):
                        state.usage = usage
                        if not state.wants_usage:
                            continue
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            if ticket is not None:
                # The client is gone: close the provider's stream now (it stops generating and billing),
                # and settle in a task that outlives this one.
                self._in_background(self._abandoned(ticket, response))
            raise

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        params = kwargs.get("litellm_params") or {}
        ticket = _ticket(params.get("metadata"), params.get("litellm_metadata"))
        if ticket is None:
            # Answered without a provider call of ours (from LiteLLM's cache, say) while the admission was
            # in flight: release what it grants.
            self._drop_in_flight(params.get("metadata"), params.get("litellm_metadata"))
            return
        state = self._take(ticket)
        if state is None:
            return
        try:
            if kwargs.get("cache_hit"):
                await self.calls.fail(ticket, request_sent=False, reason="answered from LiteLLM's cache")
                return
            await self._settle_with_usage(ticket, state, getattr(response_obj, "usage", None), response_obj)
        except GatewayError as exc:
            # The answer is already the client's; the lease expires and the reclaimer settles it from the
            # provider's records.
            logger.warning("usage of reservation %s not posted: %s", ticket.reservation_id, exc)

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        params = kwargs.get("litellm_params") or {}
        error = kwargs.get("exception")
        await self._settle_failed(
            params.get("metadata"),
            params.get("litellm_metadata"),
            error=error if isinstance(error, BaseException) else RuntimeError(str(error)),
        )

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        await self._settle_failed(
            request_data.get("metadata"), request_data.get("litellm_metadata"), error=original_exception
        )

    async def _admitted_call(
        self, data: dict[str, Any], metadata: dict[str, Any], admission: _Admission
    ) -> Ticket | None:
        """Wait for ``admission`` and make ``data`` (the proxy's request, or LiteLLM's call to the
        deployment) carry what was admitted; the call's ticket goes in ``metadata`` and its lease is kept
        from now on. ``None``: the call goes on as it is (a shadow tenant's, or let through unadmitted with
        ``failOpen``). Raises what the proxy answers the client with: our refusal, or 503."""
        name, group, request = admission.name, admission.group, admission.request
        try:
            admitted = await asyncio.shield(admission.task)
        except asyncio.CancelledError:
            # The proxy gave up on the call (its client went away): the admission may still be granted.
            self._in_background(self._dropped(admission))
            raise
        except Refusal as exc:
            raise _refused(exc, name) from exc
        except Exception as exc:
            self._in_background(self._withdraw(request, exc))
            self._undecided(data, exc)
            return None
        if admitted.ticket is None:
            return None
        ticket = admitted.ticket
        deployment = group.deployment_for(name, ticket.model_revision)
        try:
            if deployment is None:
                raise MappingError(
                    "MODEL_REVISION_NOT_DEPLOYED",
                    f"admitted on {ticket.model_revision!r}: not in modelGroups.{name}.deployments",
                )
            apply_admitted(data, admitted.payload, ticket.max_output)
        except MappingError as exc:
            await self._release(ticket, _CallState(), str(exc))
            self._undecided(data, exc)
            return None
        state = _CallState()
        if data.get("stream"):
            options = data.get("stream_options")
            options = dict(options) if isinstance(options, Mapping) else {}
            state.wants_usage = options.get("include_usage") is True
            data["stream_options"] = {**options, "include_usage": True}
        metadata[TICKET_KEY] = ticket.to_metadata()
        self._states[ticket.reservation_id] = state
        state.keeper = asyncio.get_running_loop().create_task(self._keep_lease(ticket))
        logger.info(
            "admitted %s at %s on %s (sent to %s) as reservation %s, provider request %s, LiteLLM call %s%s",
            name,
            ticket.rung,
            ticket.model_revision or group.model_revision,
            deployment,
            ticket.reservation_id,
            ticket.provider_request_id,
            data.get("litellm_call_id"),
            ", asked on arrival" if admission.on_arrival else "",
        )
        return ticket

    async def _admit_on_arrival(self, data: dict[str, Any], caller: Caller) -> _Admission | None:
        """The admission of a request as it arrived (``arrival``), once it is on the wire; ``None`` if it is
        not one to admit early (its group unlisted or admitted late, or its mapping refused: the pre-call
        hook answers that)."""
        name = data.get("model")
        if not isinstance(name, str) or self._admitted_late.get(name, 0.0) > time.monotonic():
            return None
        group = self.settings.model_groups.get(name)
        if group is None:
            return None
        try:
            request = to_admission(data, group, caller, self.settings)
        except MappingError:
            return None
        if request.callers_key:
            # The caller's own requestId: were the call to change before the pre-call hook, its admission
            # would be a second request under the caller's key (a conflict), so it is asked for there.
            return None
        return await self._on_the_wire(name, group, request, on_arrival=True)

    async def _on_the_wire(
        self, name: str, group: ModelGroup, request: AdmissionRequest, *, on_arrival: bool = False
    ) -> _Admission:
        """``request``'s admission, started and returned once it is on the wire (the caller goes on while our
        API decides); released when it arrives if the caller is cancelled meanwhile."""
        sent = asyncio.Event()
        admission = _Admission(
            self.calls.admit(request, sent=sent), name, group, request, on_arrival=on_arrival
        )
        try:
            await sent.wait()
        except asyncio.CancelledError:
            self._in_background(self._dropped(admission))
            raise
        return admission

    def _early_admission(
        self, name: str, request: AdmissionRequest, arrival: Arrival[Any]
    ) -> _Admission | None:
        """The admission started on this call's arrival, if it is the one the call needs now that LiteLLM has
        handed it over (its ``requestId`` aside: the early one's is its own); one that differs is released."""
        early = arrival.take()
        if early is None:
            return None
        if (
            isinstance(early, _Admission)
            and early.name == name
            and not request.callers_key
            and early.request.traceparent == request.traceparent
            and {**early.request.body, "requestId": None} == {**request.body, "requestId": None}
        ):
            return early
        self._not_early(early, "differs from the call LiteLLM handed over")
        return None

    def _not_early(self, early: Any, why: str) -> None:
        """Release an early admission the pre-call hook did not adopt; its group is not admitted early for a
        while (what made it differ would again)."""
        if not isinstance(early, _Admission):
            return
        logger.info(
            "the admission of %s asked on arrival %s: released; the group's calls are admitted from the "
            "pre-call hook for %g s",
            early.name,
            why,
            _KNOWN_CALLER_S,
        )
        self._admitted_late[early.name] = time.monotonic() + _KNOWN_CALLER_S
        self._in_background(self._dropped(early))

    def _arrival_ended(self, arrival: Arrival[Any]) -> None:
        """The proxy has answered a request: an early admission no pre-call hook came to is released (LiteLLM
        refused the call first: the request's digest is forgotten until LiteLLM accepts it again), and so is
        an admission a pre-call hook left in flight that no deployment hook took."""
        early = arrival.take()
        if isinstance(early, _Admission):
            self._callers.forget(arrival.credentials)
            self._in_background(self._dropped(early))
        for key in arrival.in_flight:
            admission = self._admissions.pop(key, None)
            if admission is not None:
                self._in_background(self._dropped(admission))

    def _admission_of(self, *holders: Any) -> tuple[dict[str, Any], _Admission | None]:
        """The admission in flight for a call, taken (only one hook waits for it), and the metadata that
        named it (``None`` for the admission if another hook took it); ``({}, None)`` if none did."""
        for metadata in holders:
            if isinstance(metadata, dict) and _ADMISSION_KEY in metadata:
                return metadata, self._admissions.pop(metadata[_ADMISSION_KEY], None)
        return {}, None

    def _drop_in_flight(self, *holders: Any) -> None:
        """The call ended without reaching the provider: the admission it left in flight, if any, has what
        it grants released when it arrives."""
        _, admission = self._admission_of(*holders)
        if admission is not None:
            self._in_background(self._dropped(admission))

    async def _dropped(self, admission: _Admission) -> None:
        """A call given up before it was sent, its admission still in flight: release what it grants."""
        try:
            admitted = await admission.task
        except Refusal:
            return
        except Exception as exc:
            await self._withdraw(admission.request, exc)
            return
        if admitted.ticket is not None:
            await self._release(admitted.ticket, _CallState(), "the call was given up before it was sent")

    def _undecided(self, data: dict[str, Any], error: BaseException) -> dict[str, Any]:
        """Admission could not be decided: refuse (fail closed) or, if configured, let the call through."""
        # A failure of ours to reach the API is one line; anything else is a bug and keeps its traceback.
        trace = None if isinstance(error, GatewayError | MappingError) else error
        if self.settings.fail_open:
            logger.error(
                "admission undecided, call let through unadmitted (failOpen): %s", error, exc_info=trace
            )
            return data
        logger.error("admission undecided, call refused 503: %s", error, exc_info=trace)
        raise _Refused(
            **_http_error(
                Refusal.of(
                    503, "ADMISSION_UNAVAILABLE", "admission could not be decided", _UNAVAILABLE_RETRY_AFTER
                )
            )
        ) from error

    async def _settle_with_usage(self, ticket: Ticket, state: _CallState, usage: Any, answer: Any) -> None:
        prompt = getattr(usage, "prompt_tokens", None)
        completion = getattr(usage, "completion_tokens", None)
        # LiteLLM fills an answer's missing usage in as zeros, and no call has no input: that is no usage.
        if not isinstance(prompt, int) or not isinstance(completion, int) or prompt <= 0:
            await self.calls.fail(
                ticket, request_sent=True, reason="missing_final_usage", output_seen=state.chunks
            )
            return
        provider_id = getattr(answer, "id", None)
        if answer is not None and provider_id != ticket.provider_request_id:
            logger.warning("provider answered %s as %r", ticket.provider_request_id, provider_id)
        self.calls.complete(
            ticket,
            input_tokens=prompt,
            output_tokens=completion,
            provider_id=provider_id if isinstance(provider_id, str) else None,
        )

    async def _settle_failed(self, *metadata: Any, error: BaseException) -> None:
        """A failed call: the reservation of its ticket is settled; an admission still in flight (the call
        failed while LiteLLM routed it) is released when it arrives."""
        ticket = _ticket(*metadata)
        if ticket is None:
            self._drop_in_flight(*metadata)
            return
        state = self._take(ticket)
        if state is None:
            return
        try:
            if not state.sent:
                await self._release(
                    ticket, state, f"failed before the provider call: {failure_reason(error)}"
                )
                return
            await self.calls.fail(
                ticket,
                request_sent=request_sent_of(error, state.chunks),
                reason=failure_reason(error),
                output_seen=state.chunks,
            )
        except GatewayError as exc:
            logger.warning(
                "failure of reservation %s not posted; the reclaimer will settle it: %s",
                ticket.reservation_id,
                exc,
            )

    async def _abandoned(self, ticket: Ticket, response: Any) -> None:
        """The client went away mid-stream: close the provider's stream, then settle what is known."""
        close = getattr(response, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
        state = self._take(ticket)
        if state is None:
            return
        try:
            if state.usage is not None:
                await self._settle_with_usage(ticket, state, state.usage, None)
            else:
                await self.calls.cancel(ticket, output_seen=state.chunks)
        except GatewayError as exc:
            logger.warning("cancel of reservation %s not posted: %s", ticket.reservation_id, exc)

    async def _withdraw(self, request: AdmissionRequest, error: BaseException) -> None:
        """Our API may still grant an admission given up on after ``error``: release it rather than leave
        it held until its lease expires. Not when its key is the caller's own ``requestId`` (the caller's to
        retry with), nor when no attempt got a connection (nothing reached our API)."""
        if request.callers_key or not may_have_reached_our_api(error):
            return
        try:
            withdrawn = await self.calls.withdraw(request)
        except Exception as exc:
            logger.warning(
                "admission %s given up and not withdrawn; its lease will expire: %s",
                request.idempotency_key,
                exc,
                exc_info=None if isinstance(exc, GatewayError) else exc,
            )
            return
        if withdrawn is not None:
            logger.info("withdrew reservation %s: the admission was given up, nothing was sent", withdrawn)

    async def _release(self, ticket: Ticket, state: _CallState, reason: str) -> None:
        """Nothing was sent to the provider: release in full (``fail`` once the dispatch is recorded)."""
        self._take(ticket)
        try:
            if ticket.dispatched or state.sent:
                await self.calls.fail(ticket, request_sent=False, reason=reason)
            else:
                await self.calls.cancel(ticket)
        except GatewayError as exc:
            logger.warning(
                "release of reservation %s not posted; its lease will expire: %s", ticket.reservation_id, exc
            )

    async def _keep_lease(self, ticket: Ticket) -> None:
        """Renew the lease at a third of what it has left until cancelled (the call is settled) or
        ``maxCallSeconds`` passed; see the module docstring."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        expires = started + ticket.lease_s
        while loop.time() - started < self.settings.max_call_s:
            await asyncio.sleep(max(_MIN_RENEW_S, (expires - loop.time()) / 3))
            try:
                left = await self.calls.renew(ticket)
            except StaleFence:
                logger.warning(
                    "lease of reservation %s taken over by the reclaimer: the call is settled from the "
                    "provider's records, this hook's reports are refused",
                    ticket.reservation_id,
                )
                return
            except GatewayError as exc:
                # Try again at a third of what is left of the lease; the fence protects the ledger if it
                # lapses.
                logger.warning("lease of reservation %s not renewed: %s", ticket.reservation_id, exc)
                continue
            expires = loop.time() + (left if left is not None and left > 0 else ticket.lease_s)

    def _take(self, ticket: Ticket | None) -> _CallState | None:
        """The call's state, removed and its lease no longer kept: only the first hook to settle a
        reservation does."""
        state = None if ticket is None else self._states.pop(ticket.reservation_id, None)
        if state is not None and state.keeper is not None:
            state.keeper.cancel()
        return state

    def _in_background(self, work: Any) -> None:
        # Work that must outlive the task that starts it: the settlement of a stream whose task is being torn
        # down, the withdrawal of an admission the refused call no longer waits for.
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _ticket(*holders: Any) -> Ticket | None:
    for metadata in holders:
        if isinstance(metadata, Mapping) and TICKET_KEY in metadata:
            return Ticket.from_metadata(metadata[TICKET_KEY])
    return None


def _has_content(chunk: Any) -> int:
    """1 if a stream chunk carries content text (at least one token), else 0."""
    for choice in getattr(chunk, "choices", None) or ():
        delta = getattr(choice, "delta", None)
        if getattr(delta, "content", None):
            return 1
    return 0


def _http_error(refusal: Refusal) -> dict[str, Any]:
    """The ``HTTPException`` arguments of a refusal: its status, our problem, ``Retry-After``."""
    detail = {
        "message": f"{refusal.code}: {refusal.problem.get('detail', '')}",
        "code": refusal.code,
        "problem": refusal.problem,
    }
    headers = {"Retry-After": refusal.retry_after} if refusal.retry_after else None
    return {"status_code": refusal.status, "detail": detail, "headers": headers}


def _already_dispatched(subject: str) -> _Refused:
    """A second attempt at a call whose reservation covered its one provider call."""
    return _refused(
        Refusal.of(409, "ALREADY_DISPATCHED", "a reservation covers one provider call; retries are off"),
        subject,
    )


def _refused(refusal: Refusal, subject: str) -> _Refused:
    """Log the refusal in one line and make the exception the proxy answers it with."""
    logger.warning(
        "refused %s: %s %s: %s", subject, refusal.status, refusal.code, refusal.problem.get("detail", "")
    )
    return _Refused(**_http_error(refusal))


proxy_handler_instance = TokenBudgetHook(HookSettings.from_env())
