"""How the LiteLLM hook maps a proxy request to an admission, and puts the admitted payload back (no LiteLLM,
no database: ``tokenbudget_litellm.mapping`` and ``settings`` are standard library only)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenbudget_litellm.mapping import Caller, MappingError, apply_admitted, to_admission
from tokenbudget_litellm.settings import HookSettings, ModelGroup, SettingsError

GROUP = ModelGroup(
    model_pool="eu-large",
    model_revision="model@2026-07-01",
    task_class="contract-review",
    tenant="t-19",
    max_output=300,
    output_safety=("No legal advice.",),
    authorization_scope={"permissions": ["contracts:read"]},
    essential_tools=frozenset({"search_clauses"}),
)
SETTINGS = HookSettings(
    api_url="http://127.0.0.1:1",
    token="t",
    model_groups={"contract-review": GROUP},
    tenant_by_team={"legal": "t-19"},
)
SEARCH = {
    "type": "function",
    "function": {"name": "search_clauses", "description": "Find clauses", "parameters": {"type": "object"}},
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def text(value: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": value}]


def request(**overrides: Any) -> dict[str, Any]:
    return {
        "model": "contract-review",
        "litellm_call_id": "call-1",
        "messages": [
            {"role": "system", "content": "You review contracts."},
            {"role": "user", "content": "Find the cure period."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "search_clauses", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Clause 9: 30 days."},
            {"role": "assistant", "content": "Clause 9 gives 30 days."},
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "And for payment?"},
        ],
        "tools": [SEARCH, WEATHER],
        "metadata": {"tokenbudget": {"evidence": [{"id": "e1"}], "trustedState": [{"id": "s1"}]}},
        **overrides,
    }


def test_a_conversation_maps_to_buckets_as_documented() -> None:
    admission = to_admission(request(max_tokens=120), GROUP, Caller(), SETTINGS)

    body = admission.body
    assert admission.idempotency_key == body["requestId"] == "litellm-call-1"
    assert not admission.callers_key, "a key made up for this call alone: the hook may withdraw it"
    assert (
        body["tenantId"],
        body["taskClass"],
        body["modelPool"],
        body["modelRevision"],
        body["maxOutput"],
    ) == (
        "t-19",
        "contract-review",
        "eu-large",
        "model@2026-07-01",
        120,
    )
    components = body["components"]
    assert components["immutableRules"] == [text("You review contracts."), text("Be brief.")]
    assert components["outputSafety"] == [text("No legal advice.")]
    assert components["authorizationScope"] == {"permissions": ["contracts:read"]}
    assert components["question"] == {"parts": text("And for payment?")}
    assert components["recentTurns"] == [
        {"turn": 1, "role": "user", "parts": text("Find the cure period.")},
        {
            "turn": 2,
            "role": "assistant",
            "toolCalls": [{"id": "c1", "name": "search_clauses", "arguments": "{}"}],
        },
        {"turn": 3, "role": "tool", "toolResults": [{"callId": "c1", "parts": text("Clause 9: 30 days.")}]},
        {"turn": 4, "role": "assistant", "parts": text("Clause 9 gives 30 days.")},
    ]
    assert [(tool["name"], tool["essential"]) for tool in components["tools"]] == [
        ("search_clauses", True),
        ("weather", False),
    ]
    assert components["evidence"] == [{"id": "e1"}]
    assert components["trustedState"] == [{"id": "s1"}]
    assert "outputSchema" not in components


def test_consecutive_tool_results_are_one_turn() -> None:
    calls = [
        {"id": f"c{n}", "type": "function", "function": {"name": "search_clauses", "arguments": "{}"}}
        for n in (1, 2)
    ]
    messages = [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "a"},
        {"role": "tool", "tool_call_id": "c2", "content": "b"},
        {"role": "user", "content": "so?"},
    ]

    turns = to_admission(request(messages=messages), GROUP, Caller(), SETTINGS).body["components"][
        "recentTurns"
    ]

    assert [turn["role"] for turn in turns] == ["assistant", "tool"]
    assert [result["callId"] for result in turns[1]["toolResults"]] == ["c1", "c2"]


def test_the_group_decides_the_system_bucket_and_the_defaults() -> None:
    group = ModelGroup(
        model_pool="eu-large",
        model_revision="m",
        task_class="support-chat",
        tenant="t-20",
        system_bucket="outputSafety",
    )
    plain = {
        "model": "x",
        "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
    }

    body = to_admission(plain, group, Caller(), SETTINGS).body

    assert body["components"]["immutableRules"] == []
    assert body["components"]["outputSafety"] == [text("Be kind.")]
    assert body["components"]["authorizationScope"] == {"permissions": []}
    assert (body["tenantId"], body["taskClass"], body["maxOutput"]) == ("t-20", "support-chat", 1024)


def test_the_callers_metadata_names_tenant_task_class_and_request_id() -> None:
    extra = {
        "tenant": "t-20",
        "taskClass": "summarize",
        "requestId": "req-9",
        "authorizationScope": {"permissions": []},
    }

    admission = to_admission(request(metadata={"tokenbudget": extra}), GROUP, Caller(), SETTINGS)
    body = admission.body

    assert (body["tenantId"], body["taskClass"], body["requestId"]) == ("t-20", "summarize", "req-9")
    assert admission.callers_key, "the caller's own key: the caller may retry with it"
    assert body["components"]["authorizationScope"] == {"permissions": []}


def test_the_keys_team_decides_the_tenant_and_a_caller_cannot_name_another() -> None:
    assert to_admission(request(), GROUP, Caller(team_alias="legal"), SETTINGS).body["tenantId"] == "t-19"
    with pytest.raises(MappingError) as refused:
        to_admission(
            request(metadata={"tokenbudget": {"tenant": "t-20"}}), GROUP, Caller(team_id="legal"), SETTINGS
        )
    assert refused.value.code == "TENANT_NOT_ALLOWED"


def test_a_json_schema_response_format_is_the_output_schema() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}

    body = to_admission(request(response_format=response_format), GROUP, Caller(), SETTINGS).body

    assert body["components"]["outputSchema"] == schema


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "UNSUPPORTED_CONTENT",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "UNSUPPORTED_REQUEST",
        ),
        ({"messages": []}, "UNSUPPORTED_REQUEST"),
        ({"n": 2}, "UNSUPPORTED_REQUEST"),
        ({"max_tokens": 0}, "UNSUPPORTED_REQUEST"),
        ({"tools": [{"type": "retrieval"}]}, "UNSUPPORTED_REQUEST"),
        ({"metadata": {"tokenbudget": "t-19"}}, "BAD_METADATA"),
        ({"messages": [{"role": "user", "content": "q", "name": "ana"}]}, "UNSUPPORTED_REQUEST"),
    ],
    ids=["image", "last-not-user", "empty", "n", "max-tokens", "non-function-tool", "metadata", "name"],
)
def test_what_cannot_be_mapped_is_refused_with_a_code(overrides: dict[str, Any], code: str) -> None:
    with pytest.raises(MappingError) as refused:
        to_admission(request(**overrides), GROUP, Caller(), SETTINGS)
    assert refused.value.code == code


def test_without_a_tenant_or_task_class_the_request_is_refused() -> None:
    bare = ModelGroup(model_pool="eu-large", model_revision="m")
    with pytest.raises(MappingError, match="tenant"):
        to_admission(request(metadata={}), bare, Caller(), SETTINGS)


def test_the_admitted_payload_replaces_messages_and_tools_and_caps_the_output() -> None:
    data = request(max_tokens=900, tool_choice="auto", temperature=0.2)
    payload = {"messages": [{"role": "user", "content": text("q")}], "tools": [SEARCH], "model": "m"}

    apply_admitted(data, payload, 250)

    assert data["messages"] == payload["messages"] and data["tools"] == [SEARCH]
    assert (data["max_tokens"], data["tool_choice"], data["temperature"]) == (250, "auto", 0.2)
    assert data["model"] == "contract-review"


def test_a_payload_without_tools_removes_the_tools_and_the_tool_choice() -> None:
    data = request(max_completion_tokens=10, tool_choice="auto", parallel_tool_calls=True)

    apply_admitted(data, {"messages": [], "response_format": {"type": "json_schema"}}, 250)

    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(data)
    assert data["response_format"] == {"type": "json_schema"}
    assert (data["max_completion_tokens"], "max_tokens" in data) == (10, False)


def test_a_payload_without_messages_is_refused() -> None:
    with pytest.raises(MappingError):
        apply_admitted(request(), {"tools": []}, 10)


def test_settings_read_the_documented_file_and_the_token_from_the_environment() -> None:
    document = {
        "apiUrl": "http://api",
        "failOpen": True,
        "usageFlushSeconds": 0.25,
        "tenantByTeam": {"legal": "t-19"},
        "modelGroups": {
            "g": {
                "modelPool": "p",
                "modelRevision": "r",
                "systemBucket": "outputSafety",
                "essentialTools": ["a"],
                "maxOutput": 7,
            }
        },
    }

    settings = HookSettings.from_document(document, {"TOKEN_BUDGET_TOKEN": "secret"})

    assert (settings.api_url, settings.token, settings.fail_open) == ("http://api", "secret", True)
    assert settings.usage_flush_s == 0.25
    assert (
        HookSettings.from_document(
            {**document, "usageFlushSeconds": 0}, {"TOKEN_BUDGET_TOKEN": "s"}
        ).usage_flush_s
        == 0
    )
    group = settings.model_groups["g"]
    assert (group.system_bucket, group.essential_tools, group.max_output) == (
        "outputSafety",
        frozenset({"a"}),
        7,
    )


@pytest.mark.parametrize(
    "document",
    [
        {"apiUrl": "http://api", "modelGroups": {"g": {"modelPool": "p"}}},
        {"apiUrl": "http://api", "modelGroups": {"g": {"modelPool": "p", "modelRevision": "r", "colour": 1}}},
        {
            "apiUrl": "http://api",
            "modelGroups": {"g": {"modelPool": "p", "modelRevision": "r", "maxOutput": 0}},
        },
        {"apiUrl": "http://api", "modelGroups": {}, "failOpen": "yes"},
        {"modelGroups": {}},
        {"apiUrl": "http://api", "modelGroups": {}, "usageFlushSeconds": -0.1},
    ],
    ids=["no-revision", "unknown-setting", "max-output", "fail-open", "no-api-url", "usage-flush"],
)
def test_settings_refuse_a_malformed_document(document: dict[str, Any]) -> None:
    with pytest.raises(SettingsError):
        HookSettings.from_document(document, {"TOKEN_BUDGET_TOKEN": "secret"})


def test_settings_need_the_token_in_the_environment() -> None:
    with pytest.raises(SettingsError, match="TOKEN_BUDGET_TOKEN"):
        HookSettings.from_document({"apiUrl": "http://api", "modelGroups": {}}, {})
