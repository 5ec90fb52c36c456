"""The LiteLLM proxy hook: every call to a configured model group is admitted, dispatched and settled.

Load it from the proxy's config (its settings: ``tokenbudget_litellm.settings``)::

    litellm_settings:
      callbacks: tokenbudget_litellm.hook.proxy_handler_instance

One call, hook by hook:

- ``async_pre_call_hook``: the request is mapped (``mapping``) and admitted. The request then carries the
  admitted payload and, in its metadata under ``tokenbudget_ticket``, the reservation id, fence and
  provider request id; router retries are turned off (a reservation covers one provider call). A refusal
  of our API reaches the proxy's client with its status (429, 422, 503…), our problem (its ``code`` in
  ``error.provider_specific_fields``) and ``Retry-After``. If admission cannot be decided (our API is
  unreachable, or this hook fails) the call is refused 503 ``ADMISSION_UNAVAILABLE``, or let through
  unadmitted and logged when ``failOpen`` is set. Shadow tenants' calls go unchanged.
- ``async_pre_call_deployment_hook``: right before the provider call, the dispatch is recorded and the
  provider request id is sent as ``X-Request-Id``. A second attempt for the same reservation (a retry or a
  fallback) is refused, and a dispatch that cannot be recorded stops the call (after a best-effort cancel).
- ``async_post_call_streaming_iterator_hook``: counts the content chunks a stream delivers (each is at
  least one token), renews the lease while it runs, and if the proxy's client goes away posts the chunks
  seen as usage and ``cancel`` (SPEC §5: settled so far, the rest stays held for reconciliation).
- ``async_log_success_event``: the provider's usage (streamed or not) is posted as the final usage, keyed
  by the provider's request id; an answer from LiteLLM's cache is reported as never sent.
- ``async_post_call_failure_hook`` / ``async_log_failure_event``: before dispatch the reservation is
  cancelled (released in full); after it, ``fail`` with what ``calls.request_sent_of`` can prove, the
  chunks seen posted as incurred usage. A timeout is ``"unknown"``.

Each reservation is settled once, by whichever of these hooks gets there first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from tokenbudget_gateway.errors import GatewayError
from tokenbudget_gateway.transport import ApiClient

from tokenbudget_litellm.calls import Calls, Refusal, Ticket, failure_reason, request_sent_of
from tokenbudget_litellm.mapping import Caller, MappingError, apply_admitted, to_admission
from tokenbudget_litellm.settings import HookSettings

logger = logging.getLogger(__name__)

TICKET_KEY: Final = "tokenbudget_ticket"
_CHAT_CALLS: Final = frozenset({"completion", "acompletion"})
_UNAVAILABLE_RETRY_AFTER: Final = "5"


@dataclass
class _CallState:
    """What this process knows of an admitted call until it is settled."""

    dispatched: bool = False
    chunks: int = 0
    renewed_at: float = field(default_factory=time.monotonic)


class TokenBudgetHook(CustomLogger):
    """Admission, dispatch and settlement of the proxy's calls; see the module docstring."""

    def __init__(self, settings: HookSettings, calls: Calls | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.calls = calls or Calls(
            ApiClient(settings.api_url, settings.token, timeout_s=settings.timeout_s),
            queue_wait_s=settings.queue_wait_s,
        )
        self._states: dict[str, _CallState] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        group = self.settings.model_groups.get(str(data.get("model")))
        if group is None:
            if self.settings.unlisted == "pass":
                return data
            raise _http_error(
                Refusal.of(400, "UNLISTED_MODEL_GROUP", f"no admission for {data.get('model')!r}")
            )
        if call_type not in _CHAT_CALLS:
            raise _http_error(Refusal.of(400, "UNSUPPORTED_CALL", f"{call_type} calls are not admitted"))
        caller = Caller(
            team_id=getattr(user_api_key_dict, "team_id", None),
            team_alias=getattr(user_api_key_dict, "team_alias", None),
        )
        try:
            request = to_admission(data, group, caller, self.settings)
            admitted = await asyncio.to_thread(self.calls.admit, request)
        except MappingError as exc:
            raise _http_error(Refusal.of(400, exc.code, exc.detail)) from exc
        except Refusal as exc:
            raise _http_error(exc) from exc
        except Exception as exc:
            return self._undecided(data, exc)
        if admitted.ticket is None:
            return data
        ticket = admitted.ticket
        try:
            apply_admitted(data, admitted.payload, ticket.max_output)
        except MappingError as exc:
            await self._cancel(ticket)
            return self._undecided(data, exc)
        metadata = data.get("metadata")
        if not isinstance(metadata, dict):
            metadata = data["metadata"] = {}
        metadata[TICKET_KEY] = ticket.to_metadata()
        data["num_retries"] = 0
        data.pop("fallbacks", None)
        self._states[ticket.reservation_id] = _CallState()
        logger.info(
            "admitted %s at %s as reservation %s", data.get("model"), ticket.rung, ticket.reservation_id
        )
        return data

    async def async_pre_call_deployment_hook(
        self, kwargs: dict[str, Any], call_type: Any
    ) -> dict[str, Any] | None:
        ticket = _ticket(kwargs.get("metadata"), kwargs.get("litellm_metadata"))
        if ticket is None:
            return None
        state = self._states.get(ticket.reservation_id)
        if state is None or state.dispatched:
            raise _http_error(
                Refusal.of(
                    409, "ALREADY_DISPATCHED", "a reservation covers one provider call; retries are off"
                )
            )
        try:
            await asyncio.to_thread(self.calls.dispatch, ticket)
        except GatewayError as exc:
            # Nothing was sent to the provider: releasing in full is right.
            await self._cancel(ticket)
            logger.warning("dispatch of %s not recorded; the call is stopped: %s", ticket.reservation_id, exc)
            raise _http_error(
                Refusal.of(
                    503,
                    "ADMISSION_UNAVAILABLE",
                    "the dispatch could not be recorded",
                    _UNAVAILABLE_RETRY_AFTER,
                )
            ) from exc
        state.dispatched = True
        kwargs["extra_headers"] = {
            **(kwargs.get("extra_headers") or {}),
            "X-Request-Id": ticket.provider_request_id,
        }
        return kwargs

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        ticket = _ticket(request_data.get("metadata"), request_data.get("litellm_metadata"))
        state = self._states.get(ticket.reservation_id) if ticket is not None else None
        try:
            async for item in response:
                if ticket is not None and state is not None:
                    state.chunks += _has_content(item)
                    await self._maybe_renew(ticket, state)
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            if ticket is not None:
                self._in_background(self._settle_cancelled(ticket))
            raise

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        params = kwargs.get("litellm_params") or {}
        ticket = _ticket(params.get("metadata"), params.get("litellm_metadata"))
        state = self._take(ticket)
        if ticket is None or state is None:
            return
        try:
            if kwargs.get("cache_hit"):
                await asyncio.to_thread(
                    self.calls.fail, ticket, request_sent=False, reason="answered from LiteLLM's cache"
                )
                return
            usage = getattr(response_obj, "usage", None)
            prompt = getattr(usage, "prompt_tokens", None)
            completion = getattr(usage, "completion_tokens", None)
            if not isinstance(prompt, int) or not isinstance(completion, int):
                await asyncio.to_thread(
                    self.calls.fail,
                    ticket,
                    request_sent=True,
                    reason="missing_final_usage",
                    output_seen=state.chunks,
                )
                return
            provider_id = getattr(response_obj, "id", None)
            if provider_id != ticket.provider_request_id:
                logger.warning("provider answered %s as %r", ticket.provider_request_id, provider_id)
            await asyncio.to_thread(
                self.calls.complete,
                ticket,
                input_tokens=prompt,
                output_tokens=completion,
                provider_id=provider_id if isinstance(provider_id, str) else None,
            )
        except GatewayError:
            # The answer is already the client's; the lease expires and the reclaimer settles it from the
            # provider's records.
            logger.exception("usage of reservation %s not posted", ticket.reservation_id)

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        params = kwargs.get("litellm_params") or {}
        error = kwargs.get("exception")
        await self._settle_failed(
            _ticket(params.get("metadata"), params.get("litellm_metadata")),
            error if isinstance(error, BaseException) else RuntimeError(str(error)),
        )

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        await self._settle_failed(
            _ticket(request_data.get("metadata"), request_data.get("litellm_metadata")), original_exception
        )

    def _undecided(self, data: dict[str, Any], error: BaseException) -> dict[str, Any]:
        """Admission could not be decided: refuse (fail closed) or, if configured, let the call through."""
        if self.settings.fail_open:
            logger.error(
                "admission undecided, call let through unadmitted (failOpen): %r", error, exc_info=error
            )
            return data
        logger.error("admission undecided, call refused: %r", error, exc_info=error)
        raise _http_error(
            Refusal.of(
                503, "ADMISSION_UNAVAILABLE", "admission could not be decided", _UNAVAILABLE_RETRY_AFTER
            )
        ) from error

    async def _settle_failed(self, ticket: Ticket | None, error: BaseException) -> None:
        state = self._take(ticket)
        if ticket is None or state is None:
            return
        try:
            if not state.dispatched:
                await asyncio.to_thread(self.calls.cancel, ticket)
                return
            await asyncio.to_thread(
                self.calls.fail,
                ticket,
                request_sent=request_sent_of(error, state.chunks),
                reason=failure_reason(error),
                output_seen=state.chunks,
            )
        except GatewayError:
            logger.exception(
                "failure of reservation %s not posted; the reclaimer will settle it", ticket.reservation_id
            )

    async def _settle_cancelled(self, ticket: Ticket) -> None:
        state = self._take(ticket)
        if state is None:
            return
        try:
            await asyncio.to_thread(self.calls.cancel, ticket, output_seen=state.chunks)
        except GatewayError:
            logger.exception("cancel of reservation %s not posted", ticket.reservation_id)

    async def _cancel(self, ticket: Ticket) -> None:
        self._take(ticket)
        try:
            await asyncio.to_thread(self.calls.cancel, ticket)
        except GatewayError:
            logger.warning(
                "cancel of reservation %s not posted; its lease will expire", ticket.reservation_id
            )

    async def _maybe_renew(self, ticket: Ticket, state: _CallState) -> None:
        if time.monotonic() - state.renewed_at < self.settings.lease_renew_s:
            return
        state.renewed_at = time.monotonic()
        try:
            await asyncio.to_thread(self.calls.renew, ticket)
        except GatewayError:
            # The fence protects the ledger if the lease lapses; try again after the next interval.
            logger.warning("lease of reservation %s not renewed", ticket.reservation_id)

    def _take(self, ticket: Ticket | None) -> _CallState | None:
        """The call's state, removed: only the first hook to settle a reservation does."""
        return None if ticket is None else self._states.pop(ticket.reservation_id, None)

    def _in_background(self, work: Any) -> None:
        # The stream's task is being torn down; the settlement must outlive it.
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


def _http_error(refusal: Refusal) -> HTTPException:
    """The proxy answers an ``HTTPException`` with its status and headers (anything else is a 500)."""
    detail = {
        "message": f"{refusal.code}: {refusal.problem.get('detail', '')}",
        "code": refusal.code,
        "problem": refusal.problem,
    }
    headers = {"Retry-After": refusal.retry_after} if refusal.retry_after else None
    return HTTPException(status_code=refusal.status, detail=detail, headers=headers)


proxy_handler_instance = TokenBudgetHook(HookSettings.from_env())
