"""A LiteLLM proxy request as an admission request, and the admitted payload put back into the request.

How a Chat Completions request maps to our buckets (SPEC §3), per model group (``settings.ModelGroup``):

==============================================  ===========================================================
request                                         admission
==============================================  ===========================================================
``model`` (the model group)                     ``modelPool``, ``modelRevision`` of the group's settings
``system`` and ``developer`` messages           ``immutableRules`` (or ``outputSafety``: ``systemBucket``),
                                                in order, wherever they stand
the last message (must be the user's)           ``question``
the other ``user``/``assistant``/``tool``       ``recentTurns`` numbered from 1; an assistant's
messages                                        ``tool_calls`` are ``toolCalls``; consecutive ``tool``
                                                messages are one ``tool`` turn of ``toolResults``
``tools`` (functions)                           ``tools``; ``essential`` if the group lists the name
``response_format`` of type ``json_schema``     ``outputSchema``
``max_completion_tokens`` / ``max_tokens``      ``maxOutput`` (else the group's ``maxOutput``)
the group's ``outputSafety``                    ``outputSafety`` (after any system messages sent there)
==============================================  ===========================================================

The caller adds what a chat request cannot say in ``metadata.tokenbudget`` (the key is ``metadataKey``):
``tenant``, ``taskClass``, ``requestId``, ``evidence`` (retrieved documents, in the admission's evidence
shape), ``authorizationScope`` (else the group's), ``trustedState`` and ``compactions``. The tenant is
the one the key's team maps to (``tenantByTeam``, by team id or alias) — a caller naming another tenant is
refused — else the caller's, else the group's. The task class is the caller's, else the group's. The
``requestId`` defaults to the proxy's call id (an id of the hook's own for a call admitted on its arrival,
``arrival``) and is also the ``Idempotency-Key``. A ``traceparent``
header on the proxy's request (W3C Trace Context) is sent on the admission, so our spans join its trace.

Only text content is mapped: an image, audio or file part is refused (an image's token cost needs its
size, which a URL does not give). ``n`` must be 1: a reservation covers one completion. A message's
``name`` is refused too, not dropped: the admitted turns carry none.

What the admitted payload says its own way: a ``json_schema`` response format is sent as our API renders
it, ``{"name": "output", "strict": true, "schema": …}`` (the caller's name and strictness are not kept),
and the authorization scope is always a system message of its own (``Authorization scope:
{"permissions":[]}`` when neither the group nor the caller gives one), since it is a hard bucket of every
admission.

After admission the request carries exactly the admitted payload: its ``messages``, its ``tools`` (none
if a rung dropped them all, and then no ``tool_choice``) and its ``response_format`` replace the caller's,
and the output limit is capped at the reserved output. Other parameters (temperature, stop…) are kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from tokenbudget_litellm.settings import HookSettings, ModelGroup

_SYSTEM_ROLES: Final = ("system", "developer")
_CALLER_FIELDS: Final = ("evidence", "trustedState", "compactions")


class MappingError(ValueError):
    """The request cannot be expressed as an admission; ``code`` names why (answered 400)."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


@dataclass(frozen=True)
class Caller:
    """Who sends the request, as the proxy authenticated it: the key's team id and alias."""

    team_id: str | None = None
    team_alias: str | None = None


@dataclass(frozen=True)
class AdmissionRequest:
    """The admission body, its ``Idempotency-Key`` and the caller's ``traceparent`` if it sent one.

    ``callers_key``: the key is the caller's ``requestId`` (a retry of the caller's may send it again),
    not one made up for this call alone.
    """

    body: dict[str, Any]
    idempotency_key: str
    traceparent: str | None = None
    callers_key: bool = False


def caller_metadata(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The caller's ``metadata[key]`` object (the proxy keeps request metadata under ``metadata`` or, on
    some routes, ``litellm_metadata``). Raises ``MappingError`` if it is not an object."""
    for holder in ("metadata", "litellm_metadata"):
        metadata = data.get(holder)
        if isinstance(metadata, Mapping) and key in metadata:
            value = metadata[key]
            if not isinstance(value, dict):
                raise MappingError("BAD_METADATA", f"metadata.{key} must be an object")
            return value
    return {}


def to_admission(
    data: Mapping[str, Any], group: ModelGroup, caller: Caller, settings: HookSettings
) -> AdmissionRequest:
    """Map one Chat Completions request of ``group``. Raises ``MappingError``."""
    extra = caller_metadata(data, settings.metadata_key)
    if data.get("n", 1) not in (1, None):
        raise MappingError("UNSUPPORTED_REQUEST", "a reservation covers one completion; n must be 1")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MappingError("UNSUPPORTED_REQUEST", "messages must be a non-empty list")
    system: list[list[dict[str, Any]]] = []
    conversation: list[Mapping[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise MappingError("UNSUPPORTED_REQUEST", f"messages[{index}] is not an object")
        if message.get("name"):
            # Refused rather than dropped: the provider gets the admitted payload, whose messages carry
            # no speaker name, and the model would never see it.
            raise MappingError(
                "UNSUPPORTED_REQUEST", f"messages[{index}].name is not mapped (admitted turns carry no name)"
            )
        if message.get("role") in _SYSTEM_ROLES:
            system.append(_parts(message.get("content"), f"messages[{index}]"))
        else:
            conversation.append(message)
    if not conversation or conversation[-1].get("role") != "user":
        raise MappingError("UNSUPPORTED_REQUEST", "the last message must be the user's (the question)")
    question = _parts(conversation[-1].get("content"), "the last user message")
    components: dict[str, Any] = {
        "immutableRules": system if group.system_bucket == "immutableRules" else [],
        "authorizationScope": extra.get("authorizationScope", dict(group.authorization_scope)),
        "outputSafety": [
            *(system if group.system_bucket == "outputSafety" else []),
            *([{"type": "text", "text": rule}] for rule in group.output_safety),
        ],
        "question": {"parts": question},
        "recentTurns": _turns(conversation[:-1]),
        "tools": _tools(data.get("tools"), group.essential_tools),
    }
    for name in _CALLER_FIELDS:
        if name in extra:
            components[name] = extra[name]
    schema = _output_schema(data.get("response_format"))
    if schema is not None:
        components["outputSchema"] = schema
    request_id = extra.get("requestId") or f"litellm-{data.get('litellm_call_id') or uuid.uuid4()}"
    body = {
        "requestId": request_id,
        "tenantId": _tenant(extra, group, caller, settings),
        "taskClass": _named(extra.get("taskClass") or group.task_class, "taskClass"),
        "modelPool": group.model_pool,
        "modelRevision": group.model_revision,
        "maxOutput": _max_output(data, group),
        "components": components,
    }
    return AdmissionRequest(
        body=body,
        idempotency_key=str(request_id),
        traceparent=_traceparent(data),
        callers_key=bool(extra.get("requestId")),
    )


def _traceparent(data: Mapping[str, Any]) -> str | None:
    """The ``traceparent`` header of the request the proxy received (its headers, any case)."""
    received = data.get("proxy_server_request")
    headers = received.get("headers") if isinstance(received, Mapping) else None
    if not isinstance(headers, Mapping):
        return None
    for name, value in headers.items():
        if isinstance(name, str) and name.lower() == "traceparent" and isinstance(value, str):
            return value
    return None


def apply_admitted(data: dict[str, Any], payload: Any, max_output: int) -> None:
    """Make ``data`` carry exactly the admitted ``payload``; cap the output limit at ``max_output``.

    Raises ``MappingError`` if the payload is not a chat body (our API broke its contract).
    """
    if not isinstance(payload, Mapping) or not isinstance(payload.get("messages"), list):
        raise MappingError("BAD_ADMITTED_PAYLOAD", "the admitted payload has no messages")
    data["messages"] = payload["messages"]
    if payload.get("tools"):
        data["tools"] = payload["tools"]
    else:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            data.pop(name, None)
    if "response_format" in payload:
        data["response_format"] = payload["response_format"]
    limit_key = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    requested = data.get(limit_key)
    if not isinstance(requested, int) or isinstance(requested, bool) or not 0 < requested <= max_output:
        data[limit_key] = max_output


def _tenant(extra: Mapping[str, Any], group: ModelGroup, caller: Caller, settings: HookSettings) -> str:
    by_team = next(
        (
            settings.tenant_by_team[team]
            for team in (caller.team_id, caller.team_alias)
            if team is not None and team in settings.tenant_by_team
        ),
        None,
    )
    named = extra.get("tenant")
    if by_team is not None and named is not None and named != by_team:
        raise MappingError("TENANT_NOT_ALLOWED", "this key's team acts for another tenant")
    return _named(by_team or named or group.tenant, "tenant")


def _named(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise MappingError(
            "UNMAPPED_REQUEST", f"no {what}: send metadata.tokenbudget.{what} or configure one"
        )
    return value


def _max_output(data: Mapping[str, Any], group: ModelGroup) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = data.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MappingError("UNSUPPORTED_REQUEST", f"{name} must be a positive integer")
            return value
    return group.max_output


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    """Text content as admission parts; anything but text is refused."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MappingError(
                    "UNSUPPORTED_CONTENT", f"{where}: only text parts are mapped, not {kind!r}"
                )
            parts.append({"type": "text", "text": part["text"]})
        return parts
    if content is None:
        return []
    raise MappingError("UNSUPPORTED_CONTENT", f"{where}: content must be a string or a list of parts")


def _turns(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        where = f"{role} message"
        if role == "tool":
            result = {
                "callId": _named(message.get("tool_call_id"), "tool_call_id"),
                "parts": _parts(message.get("content"), where),
            }
            if turns and turns[-1]["role"] == "tool":
                turns[-1]["toolResults"].append(result)
            else:
                turns.append({"turn": len(turns) + 1, "role": "tool", "toolResults": [result]})
        elif role == "assistant":
            turn: dict[str, Any] = {"turn": len(turns) + 1, "role": "assistant"}
            parts = _parts(message.get("content"), where)
            calls = [_tool_call(call) for call in message.get("tool_calls") or []]
            if parts or not calls:
                turn["parts"] = parts or [{"type": "text", "text": ""}]
            if calls:
                turn["toolCalls"] = calls
            turns.append(turn)
        elif role == "user":
            turns.append(
                {"turn": len(turns) + 1, "role": "user", "parts": _parts(message.get("content"), where)}
            )
        else:
            raise MappingError("UNSUPPORTED_REQUEST", f"messages with role {role!r} are not mapped")
    return turns


def _tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise MappingError("UNSUPPORTED_REQUEST", "only function tool calls are mapped")
    return {
        "id": _named(call.get("id"), "tool call id"),
        "name": _named(function.get("name"), "tool call name"),
        "arguments": function.get("arguments") if isinstance(function.get("arguments"), str) else "",
    }


def _tools(tools: Any, essential: frozenset[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise MappingError("UNSUPPORTED_REQUEST", "tools must be a list")
    mapped = []
    for tool in tools:
        function = (
            tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        )
        if not isinstance(function, Mapping):
            raise MappingError("UNSUPPORTED_REQUEST", "only function tools are mapped")
        name = _named(function.get("name"), "tool name")
        mapped.append(
            {
                "name": name,
                "description": function.get("description") or "",
                "parameters": function.get("parameters") or {"type": "object", "properties": {}},
                "essential": name in essential,
            }
        )
    return mapped


def _output_schema(response_format: Any) -> Any:
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
        raise MappingError("UNSUPPORTED_REQUEST", "response_format.json_schema.schema must be an object")
    return spec["schema"]
