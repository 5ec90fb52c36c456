"""The decision memo: a repeat of the same components is answered without walking the ladder again, and never
when anything the decision depends on changed (the catalog, a gated compaction's requestId, a tokenizer)."""

from __future__ import annotations

import pytest

from budgeting.admission import orchestrator
from budgeting.admission.decision_memo import DecisionMemo, decision_memo
from budgeting.catalog.models import PolicyAlias
from budgeting.catalog.snapshot import Snapshot
from ladder.counting import CountingUnavailable
from tests.api import test_admissions

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ladder_walks(monkeypatch):
    """How many times the ladder really ran."""
    walks: list[str] = []
    real = orchestrator.decide

    def counted(*args, **kwargs):
        walks.append(kwargs["request_id"])
        return real(*args, **kwargs)

    monkeypatch.setattr(orchestrator, "decide", counted)
    return walks


def request_body(**overrides):
    """The admissions tests' body without its tool: counted EXACT, so that a decision may be memoized (one
    counted with an upper bound, as DeepSeek's tools are, is never served again)."""
    body = test_admissions.request_body(**overrides)
    body["components"].pop("tools")
    return body


def count(demo_api, **overrides):
    res = demo_api.post("/api/v1/admissions:count", request_body(**overrides), format="json")
    assert res.status_code == 200, res.content[:300]
    return res.json()


def test_the_same_components_under_another_request_id_are_answered_from_the_memo(demo_api, ladder_walks):
    first = count(demo_api, requestId="memo-1")
    assert first["countMethod"] == "EXACT"
    second = count(demo_api, requestId="memo-2")
    assert ladder_walks == ["memo-1"]
    assert second["requestId"] == "memo-2"
    assert {**second, "requestId": "memo-1"} == first


def test_an_admission_after_a_count_reuses_the_decision_and_reserves_it(demo_api, ladder_walks):
    counted = count(demo_api, requestId="memo-3")
    res = demo_api.post(
        "/api/v1/admissions", request_body(requestId="memo-4"), format="json", HTTP_IDEMPOTENCY_KEY="memo-4"
    )
    assert res.status_code == 201, res.content[:300]
    assert ladder_walks == ["memo-3"]
    admitted = res.json()
    assert admitted["requestId"] == "memo-4"
    assert admitted["tokens"] == counted["tokens"]
    assert admitted["admittedDigest"] == counted["admittedDigest"]


def test_changed_components_walk_the_ladder_again(demo_api, ladder_walks):
    count(demo_api, requestId="memo-5")
    body = request_body(requestId="memo-6")
    body["components"]["question"]["text"] += " And clause 8?"
    res = demo_api.post("/api/v1/admissions:count", body, format="json")
    assert res.status_code == 200
    assert ladder_walks == ["memo-5", "memo-6"]


def test_a_catalog_change_is_in_force_for_the_next_request(demo_api, ladder_walks):
    before = count(demo_api, requestId="memo-7")
    PolicyAlias.objects.update(global_cap_floor=10)  # a lower global cap: the ladder must trim now
    after = count(demo_api, requestId="memo-8")
    assert ladder_walks == ["memo-7", "memo-8"]
    assert after["tokens"]["input"] < before["tokens"]["input"]


def test_a_tokenizer_that_no_longer_loads_is_noticed_on_a_repeat(demo_api, ladder_walks, monkeypatch):
    count(demo_api, requestId="memo-9")

    def unavailable(self, spec):
        raise CountingUnavailable("the tokenizer file is gone")

    monkeypatch.setattr(Snapshot, "counter_for", unavailable)
    res = demo_api.post("/api/v1/admissions:count", request_body(requestId="memo-10"), format="json")
    assert ladder_walks == ["memo-9", "memo-10"]
    assert res.status_code in (200, 503)
    assert res.json().get("countMethod") != "EXACT"


def test_offered_compactions_key_the_memo_by_request_id_too(demo_api, ladder_walks):
    """A compaction's gate checks that it was made for this requestId: the decision depends on it."""
    body = request_body(requestId="memo-11")
    body["components"]["compactions"] = [
        {
            "id": "c1",
            "replacesTurns": [1],
            "text": "The customer asked about clause 7.",
            "gateId": "gate-1",
            "fidelityScore": 0.99,
            "requestId": "memo-11",
        }
    ]
    body["components"]["recentTurns"] = [{"turn": 1, "role": "user", "text": "What about clause 7?"}]
    for request_id in ("memo-11", "memo-12"):
        res = demo_api.post("/api/v1/admissions:count", {**body, "requestId": request_id}, format="json")
        assert res.status_code == 200, res.content[:300]
    assert ladder_walks == ["memo-11", "memo-12"]


def test_the_memo_drops_the_least_recently_used_beyond_its_size():
    memo = DecisionMemo(max_bytes=100)
    entry = object()
    memo.put("a", entry, 40)
    memo.put("b", entry, 40)
    assert memo.get("a") is entry  # a is now the most recently used
    memo.put("c", entry, 40)
    assert memo.get("b") is None
    assert memo.get("a") is entry and memo.get("c") is entry
    memo.put("huge", entry, 101)
    assert memo.get("huge") is None and len(memo) == 2
    assert decision_memo() is decision_memo()


def test_with_the_memo_off_nothing_is_keyed_and_every_request_walks_the_ladder(
    demo_api, ladder_walks, monkeypatch
):
    keyed: list[object] = []
    monkeypatch.setattr(decision_memo(), "max_bytes", 0)
    monkeypatch.setattr(orchestrator, "memo_key", lambda *args: keyed.append(args))
    count(demo_api, requestId="memo-13")
    count(demo_api, requestId="memo-14")
    assert ladder_walks == ["memo-13", "memo-14"]
    assert keyed == []
