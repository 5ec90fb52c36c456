"""The hook's configuration: our API, failure behaviour and, per LiteLLM model group, how requests map.

Read from the JSON file named by ``TOKEN_BUDGET_LITELLM_CONFIG``; the API token itself is never in the
file but in the environment variable the file names (``tokenEnv``, default ``TOKEN_BUDGET_TOKEN``)::

    {
      "apiUrl": "http://127.0.0.1:8000",
      "failOpen": false,
      "timeoutSeconds": 5,
      "queueWaitSeconds": 0,
      "usageFlushSeconds": 0.1,
      "admitOnArrival": true,
      "tenantByTeam": {"legal-team": "t-19"},
      "modelGroups": {
        "eu-large": {
          "modelPool": "eu-large", "modelRevision": "model@2026-07-01",
          "taskClass": "contract-review", "tenant": "t-19", "maxOutput": 400,
          "deployments": {"small@2026-05-12": "eu-small"},
          "systemBucket": "immutableRules", "outputSafety": ["No legal advice."],
          "authorizationScope": {"permissions": ["contracts:read"]}, "essentialTools": ["search_clauses"]
        }
      }
    }
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

CONFIG_ENV: Final = "TOKEN_BUDGET_LITELLM_CONFIG"
SystemBucket = Literal["immutableRules", "outputSafety"]
_SYSTEM_BUCKETS: Final = ("immutableRules", "outputSafety")


class SettingsError(ValueError):
    """The configuration is missing or does not have the documented shape."""


@dataclass(frozen=True)
class ModelGroup:
    """How requests to one LiteLLM model group map to admissions (see ``mapping``).

    ``task_class``/``tenant``: used when neither the caller's metadata nor the key's team names one.
    ``max_output``: when the request sets no ``max_tokens``/``max_completion_tokens``. ``system_bucket``:
    where system and developer messages go. ``output_safety``: rules added to every request.
    ``authorization_scope``: when the caller sends none. ``essential_tools``: tools no rung may drop.
    ``deployments``: the proxy's model (a ``model_name`` of its ``model_list``) for each model revision an
    admission may answer other than ``model_revision`` (a fallback rung's smaller model); the group itself
    serves ``model_revision``.
    """

    model_pool: str
    model_revision: str
    task_class: str | None = None
    tenant: str | None = None
    max_output: int = 1024
    system_bucket: SystemBucket = "immutableRules"
    output_safety: tuple[str, ...] = ()
    authorization_scope: Mapping[str, Any] = field(default_factory=lambda: {"permissions": []})
    essential_tools: frozenset[str] = frozenset()
    deployments: Mapping[str, str] = field(default_factory=dict)

    def deployment_for(self, group_name: str, model_revision: str) -> str | None:
        """The proxy model that serves ``model_revision`` for this group, or ``None`` if none is."""
        if not model_revision or model_revision == self.model_revision:
            return group_name
        return self.deployments.get(model_revision)


@dataclass(frozen=True)
class HookSettings:
    """``fail_open``: let a call through unadmitted (logged) when admission cannot be decided, instead of
    answering 503. ``timeout_s``: the one deadline of each call to our API, its retries included (a hung
    API is answered 503 within it). ``queue_wait_s``: how long to wait for a queued (202) admission before
    answering 429. ``dispatch_at_admission``: record the dispatch in the admission's call (one call to us
    before the provider call instead of two). ``admit_on_arrival``: send a chat request's admission as it
    arrives at the proxy, before LiteLLM authenticates it, when its credentials were accepted by LiteLLM
    in the last minute (``arrival``; off: from the pre-call hook only). ``unlisted``: what happens to a
    model group that is not configured (``reject``: 400, ``pass``: not admitted, as if the hook were
    absent). The lease is renewed at a third of what each grant or renewal gave, for every call, streamed
    or not, for at most ``max_call_s`` (a call this process lost track of is then left to the reclaimer).
    ``usage_flush_s``: how long a call's final usage waits to be sent with other calls' in one request
    (``reports``; 0: as soon as the event loop is free)."""

    api_url: str
    token: str
    model_groups: Mapping[str, ModelGroup]
    tenant_by_team: Mapping[str, str] = field(default_factory=dict)
    fail_open: bool = False
    timeout_s: float = 5.0
    queue_wait_s: float = 0.0
    dispatch_at_admission: bool = True
    admit_on_arrival: bool = True
    max_call_s: float = 900.0
    usage_flush_s: float = 0.1
    metadata_key: str = "tokenbudget"
    unlisted: Literal["reject", "pass"] = "reject"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HookSettings:
        """Load the file named by ``TOKEN_BUDGET_LITELLM_CONFIG``. Raises ``SettingsError``."""
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_ENV)
        if not path:
            raise SettingsError(f"{CONFIG_ENV} must name the hook's JSON configuration file")
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot read {path}: {exc}") from exc
        return cls.from_document(document, env)

    @classmethod
    def from_document(cls, document: Any, environ: Mapping[str, str]) -> HookSettings:
        """Build settings from the parsed JSON document. Raises ``SettingsError``."""
        doc = _object(document, "the configuration")
        token_env = _string(doc.get("tokenEnv", "TOKEN_BUDGET_TOKEN"), "tokenEnv")
        token = environ.get(token_env)
        if not token:
            raise SettingsError(f"the API token must be in the environment variable {token_env}")
        groups = _object(doc.get("modelGroups"), "modelGroups")
        unlisted = doc.get("unlisted", "reject")
        if unlisted not in ("reject", "pass"):
            raise SettingsError("unlisted must be 'reject' or 'pass'")
        teams = _object(doc.get("tenantByTeam", {}), "tenantByTeam")
        return cls(
            api_url=_string(doc.get("apiUrl"), "apiUrl"),
            token=token,
            model_groups={name: _model_group(value, name) for name, value in groups.items()},
            tenant_by_team={team: _string(tenant, f"tenantByTeam.{team}") for team, tenant in teams.items()},
            fail_open=_boolean(doc.get("failOpen", False), "failOpen"),
            timeout_s=_positive_seconds(doc.get("timeoutSeconds", 5.0), "timeoutSeconds"),
            queue_wait_s=_seconds(doc.get("queueWaitSeconds", 0.0), "queueWaitSeconds"),
            dispatch_at_admission=_boolean(doc.get("dispatchAtAdmission", True), "dispatchAtAdmission"),
            admit_on_arrival=_boolean(doc.get("admitOnArrival", True), "admitOnArrival"),
            max_call_s=_positive_seconds(doc.get("maxCallSeconds", 900.0), "maxCallSeconds"),
            usage_flush_s=_seconds(doc.get("usageFlushSeconds", 0.1), "usageFlushSeconds"),
            metadata_key=_string(doc.get("metadataKey", "tokenbudget"), "metadataKey"),
            unlisted=unlisted,
        )


def _model_group(value: Any, name: str) -> ModelGroup:
    where = f"modelGroups.{name}"
    data = _object(value, where)
    known = {
        "modelPool", "modelRevision", "taskClass", "tenant", "maxOutput", "systemBucket", "outputSafety",
        "authorizationScope", "essentialTools", "deployments",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise SettingsError(f"{where}: unknown settings {unknown}")
    bucket = data.get("systemBucket", "immutableRules")
    if bucket not in _SYSTEM_BUCKETS:
        raise SettingsError(f"{where}.systemBucket must be one of {_SYSTEM_BUCKETS}")
    max_output = data.get("maxOutput", 1024)
    if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
        raise SettingsError(f"{where}.maxOutput must be a positive integer")
    return ModelGroup(
        model_pool=_string(data.get("modelPool"), f"{where}.modelPool"),
        model_revision=_string(data.get("modelRevision"), f"{where}.modelRevision"),
        task_class=_optional_string(data.get("taskClass"), f"{where}.taskClass"),
        tenant=_optional_string(data.get("tenant"), f"{where}.tenant"),
        max_output=max_output,
        system_bucket=bucket,
        output_safety=tuple(_strings(data.get("outputSafety", []), f"{where}.outputSafety")),
        authorization_scope=_object(
            data.get("authorizationScope", {"permissions": []}), f"{where}.authorizationScope"
        ),
        essential_tools=frozenset(_strings(data.get("essentialTools", []), f"{where}.essentialTools")),
        deployments={
            revision: _string(model, f"{where}.deployments.{revision}")
            for revision, model in _object(data.get("deployments", {}), f"{where}.deployments").items()
        },
    )


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SettingsError(f"{where} must be a JSON object")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SettingsError(f"{where} must be a non-empty string")
    return value


def _optional_string(value: Any, where: str) -> str | None:
    return None if value is None else _string(value, where)


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise SettingsError(f"{where} must be a list of strings")
    return [_string(item, f"{where}[{index}]") for index, item in enumerate(value)]


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(f"{where} must be true or false")
    return value


def _seconds(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise SettingsError(f"{where} must be a non-negative number of seconds")
    return float(value)


def _positive_seconds(value: Any, where: str) -> float:
    seconds = _seconds(value, where)
    if seconds == 0:
        raise SettingsError(f"{where} must be more than 0 seconds")
    return seconds
