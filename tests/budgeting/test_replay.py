"""Replaying manifests: the recorded decision is reproduced from the recorded inputs (policy version, model,
tokenizer) whatever is active now; tampering and tokenizer swaps are reported; the capacity held is named."""

from __future__ import annotations

import hashlib
import json
import shutil
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from budgeting.admission.models import Manifest
from budgeting.admission.replay import ReplayError, replay_manifest
from budgeting.catalog.models import ModelRevision, Tokenizer
from ledger.models import Reservation
from tests.budgeting.test_ladder_api import (
    DEGRADING_RUNGS,
    FIXTURE_POLICY,
    PRIMARY,
    activate_policy,
    admit,
    base_components,
    demo_api,
    envelope,
    fixture_components,
    manifest_of,
    post,
    publish_policy,
    rung_components,
    use_small_primary_window,
)
from tests.ladder.fixtures import FIXTURES

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(redis_db: Any) -> APIClient:
    return demo_api()


def run_replay(*args: str) -> tuple[int, str]:
    """Run ``manage.py replay``; return (exit code, stdout)."""
    out = StringIO()
    try:
        call_command("replay", *args, stdout=out)
    except CommandError as exc:
        out.write(f"\nERROR: {exc}\n")
        return exc.returncode, out.getvalue()
    return 0, out.getvalue()


def assert_replays(manifest: Manifest) -> None:
    result = replay_manifest(manifest.pk)
    assert result.differences == [], (manifest.request_id, result.differences)
    assert result.matches


# ------------------------------------------------------------------------------------ reproduces decisions


def test_replay_reproduces_every_fixture_decision_under_its_recorded_policy(api: APIClient) -> None:
    manifests: list[Manifest] = []
    publish_policy(900, **FIXTURE_POLICY)
    for index, name in enumerate(FIXTURES):
        activate_policy(900)
        full_id = f"req-{name}-full"
        full = admit(api, envelope(fixture_components(name, full_id), request_id=full_id))
        assert full.status_code == 201, (name, full.json())
        manifests.append(manifest_of(full))
        tokens = full.json()["tokens"]["input"]
        # 70 % of the FULL count: degraded through one or more rungs (or rejected if the minimum needs more).
        publish_policy(1000 + index, inputCap=tokens * 7 // 10, **FIXTURE_POLICY)
        tight_id = f"req-{name}-tight"
        tight = admit(api, envelope(fixture_components(name, tight_id), request_id=tight_id))
        assert tight.status_code in (201, 422), (name, tight.json())
        manifests.append(manifest_of(tight))
        if index % 3 == 0:
            # 5 %: not even the hard buckets and the minimum evidence set fit.
            publish_policy(2000 + index, inputCap=max(1, tokens // 20), **FIXTURE_POLICY)
            rid = f"req-{name}-reject"
            rejected = admit(api, envelope(fixture_components(name, rid), request_id=rid))
            assert rejected.status_code == 422, (name, rejected.json())
            manifests.append(manifest_of(rejected))
        if index % 3 == 1:
            rid = f"req-{name}-shadow"
            shadow = admit(api, envelope(fixture_components(name, rid), request_id=rid, tenant="t-20"))
            assert shadow.status_code == 200, (name, shadow.json())
            assert shadow.json()["mode"] == "SHADOW"
            manifests.append(manifest_of(shadow))

    decisions = {m.decision for m in manifests}
    assert {"ADMITTED", "DEGRADED", "CONTEXT_BUDGET_EXCEEDED"} <= decisions
    assert any(m.mode == "SHADOW" for m in manifests)
    multi_step = [m for m in manifests if m.decision == "DEGRADED" and len(m.record["steps"]) >= 2]
    assert len(multi_step) >= 3, [(m.request_id, m.rung) for m in manifests]
    assert len({m.rung for m in manifests if m.decision == "DEGRADED"}) >= 2

    activate_policy(18)  # the replay must use each manifest's recorded revision, not the active one
    for manifest in manifests:
        assert_replays(manifest)
    code, out = run_replay(str(multi_step[0].pk))
    assert code == 0, out
    assert "OK:" in out and "MISMATCH" not in out
    code, out = run_replay("--request-id", multi_step[0].request_id, "--tenant", "t-19")
    assert code == 0, out


@pytest.mark.parametrize("rung", ["FULL", *DEGRADING_RUNGS, "QUEUE_OR_REJECT"])
def test_replay_reproduces_each_rung_of_the_demo_policy(api: APIClient, rung: str) -> None:
    if rung == "SMALLER_MODEL":
        use_small_primary_window()
    rid = f"req-{rung.lower()}"
    res = admit(api, envelope(rung_components(rung, rid), request_id=rid))
    assert res.status_code in (201, 422), res.json()
    manifest = manifest_of(res)
    assert manifest.rung == rung
    result = replay_manifest(manifest.pk)
    assert result.matches, result.differences
    text = "\n".join(result.lines)
    for step in manifest.record["steps"]:
        assert f"{step['rung']} on " in text
        for removed in step["removedIds"]:
            assert removed in text
    if rung == "FULL":
        assert "Admitted at FULL" in text
    elif rung == "QUEUE_OR_REJECT":
        assert "Rejected (CONTEXT_BUDGET_EXCEEDED)" in text
        assert "nothing was held" in text
    else:
        assert f"Admitted degraded at rung {rung}" in text


def test_replay_of_decisions_made_while_counting_was_unavailable(
    api: APIClient, settings: Any, tmp_path: Path
) -> None:
    original = settings.TOKENIZER_DIR
    settings.TOKENIZER_DIR = tmp_path
    rejected = admit(api, envelope(base_components(), request_id="req-cu-reject"))
    assert rejected.status_code == 503, rejected.json()
    bounded = admit(
        api, envelope(base_components(), request_id="req-cu-bound", task_class="support-chat", max_output=800)
    )
    assert bounded.status_code == 201, bounded.json()
    assert bounded.json()["countMethod"] == "UPPER_BOUND"
    settings.TOKENIZER_DIR = original  # counting is back: the replay still reproduces what was decided then
    for res in (rejected, bounded):
        assert_replays(manifest_of(res))


# ---------------------------------------------------------------------------------------------- mismatches


def test_a_tampered_record_is_a_mismatch_with_exit_code_1(api: APIClient) -> None:
    rid = "req-dedup_evidence"
    res = admit(api, envelope(rung_components("DEDUP_EVIDENCE", rid), request_id=rid))
    assert res.status_code == 201, res.json()
    manifest = manifest_of(res)
    assert run_replay(str(manifest.pk))[0] == 0

    record = manifest.record
    record["rung"] = "TRIM_EVIDENCE"
    record["steps"][0]["removedIds"] = ["d2", "d9"]
    Manifest.objects.filter(pk=manifest.pk).update(record=record)
    result = replay_manifest(manifest.pk)
    assert not result.matches
    assert "rung: recorded 'TRIM_EVIDENCE', replayed 'DEDUP_EVIDENCE'" in result.differences
    assert any(d.startswith("steps[0].removedIds:") and "d9" in d for d in result.differences)
    code, out = run_replay(str(manifest.pk))
    assert code == 1
    mismatches = [line for line in out.splitlines() if line.startswith("MISMATCH: ")]
    assert len(mismatches) == len(result.differences) == 2
    assert "ERROR: manifest" in out and "differs" in out

    Manifest.objects.filter(pk=manifest.pk).update(rendered_digest="sha256:" + "0" * 64)
    code, out = run_replay("--request-id", rid, "--tenant", "t-19")
    assert code == 1
    assert "MISMATCH: manifest rendered digest: recorded 'sha256:0000" in out


def test_a_tampered_request_is_a_mismatch(api: APIClient) -> None:
    rid = "req-trim"
    res = admit(api, envelope(rung_components("TRIM_EVIDENCE", rid), request_id=rid))
    manifest = manifest_of(res)
    request = manifest.request
    request["components"]["evidence"] = request["components"]["evidence"][:3]
    Manifest.objects.filter(pk=manifest.pk).update(request=request)
    result = replay_manifest(manifest.pk)
    assert not result.matches
    assert any(d.startswith("rung: recorded 'TRIM_EVIDENCE'") for d in result.differences)


def test_unknown_manifest_and_bad_arguments(api: APIClient) -> None:
    with pytest.raises(ReplayError):
        replay_manifest(987654)
    assert run_replay("987654")[0] == 2
    assert run_replay("--request-id", "nope", "--tenant", "t-19")[0] == 2
    assert run_replay()[0] == 2


def _copy_tokenizers(settings: Any, tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizers"
    folder.mkdir()
    for tokenizer in Tokenizer.objects.all():
        shutil.copy(Path(settings.TOKENIZER_DIR) / tokenizer.file_name, folder / tokenizer.file_name)
    settings.TOKENIZER_DIR = folder
    return folder


def _modified_copy(source: Path, target: Path, *, drop: int) -> str:
    """A tokenizer file that counts differently (``drop`` merges fewer) and so has another digest."""
    document = json.loads(source.read_text(encoding="utf-8"))
    document["model"]["merges"] = document["model"]["merges"][drop:]
    data = json.dumps(document).encode()
    target.write_bytes(data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_a_tokenizer_hot_swap_is_reported_as_a_digest_difference(
    api: APIClient, settings: Any, tmp_path: Path
) -> None:
    folder = _copy_tokenizers(settings, tmp_path)
    res = admit(api, envelope(rung_components("TRIM_EVIDENCE", "req-swap"), request_id="req-swap"))
    assert res.status_code == 201, res.json()
    manifest = manifest_of(res)
    old = Tokenizer.objects.get(name="deepseek-v3")
    assert manifest.tokenizer_digest == old.digest
    assert_replays(manifest)

    # Provision a modified copy as a new tokenizer and point the model at it (the old file stays).
    new_digest = _modified_copy(folder / old.file_name, folder / "deepseek_v3_b.json", drop=1)
    assert new_digest != old.digest
    swapped = Tokenizer.objects.create(
        name="deepseek-v3-b",
        family=old.family,
        source="test: one merge fewer",
        file_name="deepseek_v3_b.json",
        digest=new_digest,
        upper_bound_rule=old.upper_bound_rule,
    )
    ModelRevision.objects.filter(name=PRIMARY).update(tokenizer=swapped)
    after = post(
        api, "/api/v1/admissions:count", envelope(rung_components("TRIM_EVIDENCE", "x"), request_id="x")
    )
    assert after.json()["tokenizerDigest"] == new_digest, "new admissions count with the new file"

    result = replay_manifest(manifest.pk)
    assert not result.matches
    expected = (
        f"tokenizer of {PRIMARY}: recorded {old.digest}, provisioned now {new_digest}; counts under another "
        "tokenizer cannot be replayed exactly"
    )
    assert result.differences == [expected], "the old file is still there: the decision itself is reproduced"
    code, out = run_replay(str(manifest.pk))
    assert code == 1
    assert f"MISMATCH: {expected}" in out

    # An in-place swap (the admin's: same row, same file name, new bytes): the recorded file is gone.
    _modified_copy(folder / old.file_name, folder / old.file_name, drop=2)
    replaced = "sha256:" + hashlib.sha256((folder / old.file_name).read_bytes()).hexdigest()
    Tokenizer.objects.filter(pk=old.pk).update(digest=replaced)
    ModelRevision.objects.filter(name=PRIMARY).update(tokenizer=old)
    result = replay_manifest(manifest.pk)
    assert not result.matches
    assert any(f"recorded {old.digest}, provisioned now {replaced}" in d for d in result.differences)
    assert any(
        f"the recorded tokenizer {old.digest} of {PRIMARY} cannot be loaded now" in d
        for d in result.differences
    )
    assert "Replay not run" in result.lines[-1]


# ------------------------------------------------------------------------------------------------ capacity


def test_the_lines_name_the_resources_held_and_released(api: APIClient) -> None:
    res = admit(api, envelope(rung_components("DEDUP_EVIDENCE", "req-life"), request_id="req-life"))
    assert res.status_code == 201, res.json()
    body = res.json()
    manifest = manifest_of(res)
    held = "\n".join(replay_manifest(manifest.pk).lines)
    tokens = body["tokens"]["input"]
    for account in ("tenant t-19", "tenant t-19 × contract-review", "pool eu-large"):
        assert f"HOLD on {account}: input reserved +{tokens}, output reserved +1600, in flight +1" in held
    assert "Still held: tenant t-19 (input " in held

    reservation = Reservation.objects.get(pk=body["reservationId"])
    url = f"/api/v1/reservations/{reservation.pk}"
    dispatched = post(
        api,
        f"{url}/dispatch",
        {"fence": 1, "providerRequestId": "prov-1", "admittedDigest": reservation.admitted_digest},
    )
    assert dispatched.status_code == 200, dispatched.json()
    usage = {"fence": 1, "usageEventId": "u1", "outputTokens": 100, "final": True, "inputTokens": tokens + 5}
    settled = post(api, f"{url}/usage", usage)
    assert settled.json()["state"] == "SETTLED", settled.json()

    result = replay_manifest(manifest.pk)
    assert result.matches, result.differences
    text = "\n".join(result.lines)
    assert "state SETTLED, outcome COMPLETED" in text
    assert f"POST on pool eu-large: input reserved -{tokens}, input consumed +{tokens} (dispatched)" in text
    assert "POST on tenant t-19: output reserved -100, output consumed +100 (usage u1)" in text
    assert "CORRECTION on tenant t-19: input consumed +5 (provider counted" in text
    assert "RELEASE on tenant t-19: output reserved -1500, in flight -1" in text
    assert "Held on: pool eu-large; tenant t-19; tenant t-19 × contract-review." in text
    assert "Released on: pool eu-large; tenant t-19; tenant t-19 × contract-review." in text
    assert "Still held: nothing." in text


def test_shadow_and_rejected_manifests_say_nothing_was_held(api: APIClient) -> None:
    shadow = admit(api, envelope(base_components(), request_id="req-sh", tenant="t-20"))
    assert shadow.status_code == 200, shadow.json()
    lines = replay_manifest(manifest_of(shadow).pk).lines
    assert "Capacity: shadow mode, the decision was recorded and nothing was held or released." in lines
    rejected = admit(api, envelope(rung_components("QUEUE_OR_REJECT", "req-rj"), request_id="req-rj"))
    assert "Capacity: rejected, so nothing was held." in replay_manifest(manifest_of(rejected).pk).lines
