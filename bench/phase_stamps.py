"""Stamps for ``bench/gateway_phases.py``: LiteLLM proxy callbacks loaded around the hook under test,
``first`` before it and ``last`` after it. Each of their pre-call and deployment hooks appends
``<call> <phase> <ns>`` to the file ``PHASE_STAMPS`` names (``time.perf_counter_ns``: the machine's
monotonic clock, comparable between processes); ``<call>`` names the call (the proxy's process id and the
call's number), which ``first`` puts in the request's metadata.

It runs inside the proxy, so it imports LiteLLM and the standard library only.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Final

from litellm.integrations.custom_logger import CustomLogger

CALL_KEY: Final = "bench_phase_call"
_OUT = open(os.environ["PHASE_STAMPS"], "a", buffering=1)  # noqa: SIM115  # the proxy's lifetime
_NUMBERS = itertools.count(1)


class Stamp(CustomLogger):
    """Stamps the moment LiteLLM calls this callback's pre-call and deployment hooks."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        now = time.perf_counter_ns()
        metadata = data.setdefault("metadata", {})
        if self.where == "first":
            metadata[CALL_KEY] = f"{os.getpid()}-{next(_NUMBERS)}"
        _OUT.write(f"{metadata.get(CALL_KEY)} pre-{self.where} {now}\n")
        return data

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> None:
        now = time.perf_counter_ns()
        number = None
        for holder in (kwargs.get("metadata"), kwargs.get("litellm_metadata")):
            if isinstance(holder, dict) and CALL_KEY in holder:
                number = holder[CALL_KEY]
        _OUT.write(f"{number} deploy-{self.where} {now}\n")


first = Stamp("first")
last = Stamp("last")
