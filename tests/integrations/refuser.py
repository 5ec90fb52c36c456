"""A callback the test proxy loads after ours (copied into its config's folder): it refuses, 403, a call whose
metadata asks it to (``{"refuseAfterAdmission": true}``), as a guardrail of the gateway team's would, so a
test sees a call fail after our hook sent its admission and before LiteLLM calls the provider."""

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
        return data


proxy_handler_instance = RefuseAfterAdmission()
