"""An in-process memo of ladder decisions: a repeat of the same components costs a hash, not a ladder walk.

A decision is a pure function of the components, the envelope fields the ladder reads (model revision, pool,
task class, ``maxOutput``, and the ``requestId`` when compactions are offered: their gate checks it) and the
catalog snapshot (policy, models, tokenizers), whose version moves on any change. The memo keys on exactly
those, so a hit is the decision the ladder would make again, with exact counts. Not kept: decisions counted
with an upper bound (they depend on a tokenizer being unavailable right now) and anything decided while the
catalog has no version (nothing is cached then). A hit is used only while the exact counter of its model still
loads: a tokenizer file that went missing is noticed as it would be without the memo.

The key is the SHA-256 of the sorted-key JSON of those inputs (``orjson``: one C pass over the body). The memo
is bounded in memory (``DECISION_MEMO_BYTES``) and drops the least recently used. An entry is weighed at
``OBJECTS_PER_JSON_BYTE`` times its JSON: the parsed components, the FULL payload and the decision's state
held about 4.8 times the JSON's size in Python objects (tracemalloc, ten 185 KB requests).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from django.conf import settings

from ladder.components import Components
from ladder.decision import Decision

if TYPE_CHECKING:
    from budgeting.admission.request import AdmissionRequest


@dataclass(frozen=True)
class Prepared:
    """What the ladder made of one set of inputs: the parsed components, the FULL payload and its digest,
    and the decision (its ``request_id`` is the first request's; callers put their own in)."""

    components: Components
    full_payload: dict[str, object]
    full_digest: str
    decision: Decision


OBJECTS_PER_JSON_BYTE = 5


def memo_key(request: AdmissionRequest, catalog_version: int) -> tuple[str, int] | None:
    """The memo key of a request and its weight (the memory its entry is counted for), or None when it cannot
    be keyed."""
    inputs = {
        "catalogVersion": catalog_version,
        "components": request.components,
        "maxOutput": request.max_output,
        "modelPool": request.model_pool,
        "modelRevision": request.model_revision,
        "taskClass": request.task_class,
        "gatedRequestId": request.request_id if request.components.get("compactions") else None,
    }
    try:
        encoded = orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return None
    return hashlib.sha256(encoded).hexdigest(), len(encoded) * OBJECTS_PER_JSON_BYTE


def memoizable(decision: Decision) -> bool:
    """Whether a decision may be served again: not when it was counted with an upper bound."""
    return decision.count_method != "UPPER_BOUND"


class DecisionMemo:
    """A byte-bounded LRU of ``Prepared`` by memo key, shared by the threads of one process."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Prepared, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Prepared | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, prepared: Prepared, weight: int) -> None:
        if weight > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (prepared, weight)
            self._bytes += weight
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


_memo: DecisionMemo | None = None
_memo_lock = threading.Lock()


def decision_memo() -> DecisionMemo:
    """The process's memo (sized by ``DECISION_MEMO_BYTES``; 0 turns it off)."""
    global _memo
    if _memo is None:
        with _memo_lock:
            if _memo is None:
                _memo = DecisionMemo(settings.DECISION_MEMO_BYTES)
    return _memo
