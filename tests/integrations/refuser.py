"""A callback the test proxy loads beside ours (copied into its config's folder), as a guardrail of the
gateway team's would be: it refuses, 403, a call whose metadata asks it to (``{"refuseAfterAdmission":
true}``), and rewrites the question of one that gives a new one (``{"rewriteQuestion": "…"}``). Loaded
after ours, a test sees a call fail after our hook sent its admission and before LiteLLM calls the
provider; loaded before ours (``test_litellm_arrival_proxy``), a call refused or changed between its
arrival and our hook."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger


class RefuseAfterAdmission(CustomLogger):
    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        metadata = data.get("metadata") or {}
        if metadata.get("refuseAfterAdmission") is True:
            raise HTTPException(status_code=403, detail="refused by the gateway's own guardrail")
        question = metadata.get("rewriteQuestion")
        if isinstance(question, str):
            data["messages"] = [*data["messages"][:-1], {"role": "user", "content": question}]
        return data


proxy_handler_instance = RefuseAfterAdmission()
