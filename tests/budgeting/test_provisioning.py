"""Declarative provisioning: idempotent, validated before anything is written, tokens hashed; the command
shows its plan and asks; the run command's demo file goes only into an empty database."""

from __future__ import annotations

import copy
import json
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from budgeting.catalog.models import (
    ApiToken,
    ChangeRecord,
    ModelPool,
    ModelRevision,
    PolicyVersion,
    Tenant,
    Tokenizer,
    hash_token,
)
from budgeting.catalog.tokenizer_assets import pinned_sha256
from budgeting.provisioning.apply import apply_config, is_empty
from budgeting.provisioning.document import read_document
from budgeting.provisioning.source import ProvisioningError, load, load_file
from ledger.models import CapacityAccount

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"


def test_demo_applies_and_applying_twice_changes_nothing():
    first = apply_config(load_file(DEMO))
    assert first.changed
    assert Tenant.objects.count() == 3
    assert Tenant.objects.filter(internal=True).count() == 1
    assert Tenant.objects.filter(rollout_mode="SHADOW").count() == 1
    families = set(ModelRevision.objects.values_list("tokenizer__family", flat=True))
    assert families == {"byte-level-bpe", "byte-level-bpe-nfkc", "o200k_base", "llama3", "mistral-tekken"}
    assert all(t.digest.startswith("sha256:") and len(t.digest) == 71 for t in Tokenizer.objects.all())
    assert CapacityAccount.objects.count() == 6
    second = apply_config(load_file(DEMO))
    assert not second.changed, second.summary()


def test_tokens_are_stored_hashed():
    apply_config(load_file(DEMO))
    token = ApiToken.objects.get()
    assert token.token_hash == hash_token("tb_demo_gateway_eu_0000000000000000")
    assert "tb_demo_gateway_eu_0000000000000000" not in token.token_hash


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda d: d["modelRevisions"][0].update(contextWindow=-1), "modelRevisions[0].contextWindow"),
        (lambda d: d["modelRevisions"][0].update(maxOutput=10**6), "modelRevisions[0].maxOutput"),
        (lambda d: d["modelRevisions"][0].update(tokenizer="nope"), "modelRevisions[0].tokenizer"),
        (lambda d: d["tenants"][0].update(rolloutMode="MAYBE"), "tenants[0].rolloutMode"),
        (lambda d: d["tenants"][0].update(surprise=1), "tenants[0].surprise"),
        (lambda d: d["accounts"][0].update(inputLimit="lots"), "accounts[0].inputLimit"),
        (lambda d: d["taskClasses"][0].update(maxOutputCap=True), "taskClasses[0].maxOutputCap"),
        (lambda d: d["tokenizers"][0].update(file="missing.json"), "tokenizers[0].file"),
        (lambda d: d["tokenizers"][0].update(family="sentencepiece"), "tokenizers[0].family"),
        (lambda d: d["tokenizers"][0].update(sha256="0" * 64), "tokenizers[0].sha256"),
        # A DeepSeek JSON file is not a tiktoken vocabulary.
        (lambda d: d["tokenizers"][0].update(family="o200k_base"), "tokenizers[0].file"),
        (
            lambda d: d["modelRevisions"][0].update(templateFamily="llama3"),
            "modelRevisions[0].templateFamily",
        ),
        (lambda d: d["tenants"].append(dict(d["tenants"][1], name="Acme")), "tenant t-19"),
        (
            lambda d: d["policies"]["versions"][0]["document"]["taskClasses"]["summarize"].update(
                ladder=["TRIM_EVIDENCE"]
            ),
            "policies.versions[0].document",
        ),
    ],
)
def test_an_invalid_file_names_the_field_and_applies_nothing(mutate, path):
    doc = copy.deepcopy(load_file(DEMO))
    mutate(doc)
    with pytest.raises(ProvisioningError) as err:
        apply_config(doc)
    assert err.value.path.startswith(path), err.value.path
    assert not Tenant.objects.exists()
    assert not Tokenizer.objects.exists()
    assert not PolicyVersion.objects.exists()


def test_a_file_whose_digest_is_not_its_pin_is_refused_with_its_path(tmp_path, settings):
    source = Path(settings.TOKENIZER_DIR)
    for name in ("deepseek_v3.json", "claude_legacy.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with (tmp_path / "claude_legacy.json").open("ab") as handle:
        handle.write(b" ")
    doc = load_file(DEMO)
    with pytest.raises(ProvisioningError) as err:
        read_document(doc, now=timezone.now(), tokenizer_dir=tmp_path)
    assert err.value.path == "tokenizers[1].file"
    assert "not the pinned" in str(err.value) and str(tmp_path / "claude_legacy.json") in str(err.value)


def _with_byte_level_copy(tmp_path: Path, source: Path, pre_tokenizer: object | None) -> dict:
    """The demo with its tokenizer files in ``tmp_path``, plus ``other_bpe.json``: DeepSeek-V3's file with
    ``pre_tokenizer`` in place of its own (unchanged for None), the tokenizer of the first model revision."""
    doc = copy.deepcopy(load_file(DEMO))
    for tokenizer in doc["tokenizers"]:
        (tmp_path / tokenizer["file"]).symlink_to(source / tokenizer["file"])
    tokenizer_json = json.loads((source / "deepseek_v3.json").read_bytes())
    if pre_tokenizer is not None:
        tokenizer_json["pre_tokenizer"] = pre_tokenizer
    (tmp_path / "other_bpe.json").write_text(json.dumps(tokenizer_json))
    doc["tokenizers"].append({"name": "other", "family": "byte-level-bpe", "file": "other_bpe.json"})
    doc["modelRevisions"][0]["tokenizer"] = "other"
    return doc


def test_the_deepseek_template_is_refused_for_another_pre_tokenizer_with_its_path(tmp_path, settings):
    """A byte-level BPE file framed by the deepseek template must pre-tokenize as DeepSeek-V3: its cuts are
    proven for that pre-tokenizer alone. The same file with DeepSeek-V3's pre-tokenizer is accepted."""
    assert load_file(DEMO)["modelRevisions"][0]["templateFamily"] == "deepseek"
    source = Path(settings.TOKENIZER_DIR)
    plain = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = _with_byte_level_copy(tmp_path, source, plain)
    with pytest.raises(ProvisioningError) as err:
        read_document(doc, now=timezone.now(), tokenizer_dir=tmp_path)
    assert err.value.path == "modelRevisions[0].templateFamily"
    assert str(tmp_path / "other_bpe.json") in str(err.value) and "DeepSeek-V3" in str(err.value)
    # The same file framed by a template that makes no cut (meta) is accepted.
    doc["modelRevisions"][0]["templateFamily"] = "meta"
    read_document(doc, now=timezone.now(), tokenizer_dir=tmp_path)
    # Negative control: the check reads the file, it does not refuse every file that is not the pinned one.
    same = tmp_path / "same"
    same.mkdir()
    read_document(_with_byte_level_copy(same, source, None), now=timezone.now(), tokenizer_dir=same)


def test_the_deepseek_template_is_refused_for_a_stored_tokenizer_of_another_pre_tokenizer(tmp_path, settings):
    """A tokenizer already in the database is checked from its file too, and nothing is written."""
    source = Path(settings.TOKENIZER_DIR)
    doc = _with_byte_level_copy(tmp_path, source, {"type": "ByteLevel", "add_prefix_space": True})
    doc["modelRevisions"][0]["templateFamily"] = "meta"
    apply_config(doc, tokenizer_dir=tmp_path)
    again = copy.deepcopy(doc)
    again["tokenizers"] = again["tokenizers"][:-1]
    again["modelRevisions"][0]["templateFamily"] = "deepseek"
    with pytest.raises(ProvisioningError) as err:
        apply_config(again, tokenizer_dir=tmp_path)
    assert err.value.path == "modelRevisions[0].templateFamily"
    assert ModelRevision.objects.get(name=doc["modelRevisions"][0]["name"]).template_family == "meta"


def test_a_stated_digest_that_matches_is_accepted():
    doc = copy.deepcopy(load_file(DEMO))
    doc["tokenizers"][0]["sha256"] = pinned_sha256(doc["tokenizers"][0]["file"])
    apply_config(doc)
    assert Tokenizer.objects.get(name=doc["tokenizers"][0]["name"]).digest == "sha256:" + str(
        doc["tokenizers"][0]["sha256"]
    )


def test_command_reports_the_bad_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {slug: t-1, rolloutMode: SOMETIMES}\n")
    with pytest.raises(CommandError, match=r"tenants\[0\]\.rolloutMode"):
        call_command("provision", str(bad))


def test_issue_and_revoke_token():
    apply_config(load_file(DEMO))
    out = StringIO()
    call_command("issue_token", "gateway-us", stdout=out)
    raw = out.getvalue().rsplit(" ", 1)[-1].strip()
    token = ApiToken.objects.get(token_hash=hash_token(raw))
    assert token.client.name == "gateway-us"
    call_command("issue_token", "gateway-us", "--revoke", raw[:8], stdout=StringIO())
    token.refresh_from_db()
    assert token.revoked_at is not None


def provision(*args: str, path: Path = DEMO, stdin=None) -> str:
    out = StringIO()
    options = {"stdout": out} if stdin is None else {"stdout": out, "stdin": stdin}
    call_command("provision", str(path), *args, **options)
    return out.getvalue()


class Terminal(StringIO):
    """Standard input as a person at a terminal types it."""

    def isatty(self) -> bool:
        return True


def edited_demo(tmp_path: Path, edit) -> Path:
    doc = load_file(DEMO)
    edit(doc)
    path = tmp_path / DEMO.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def rename_t20(doc) -> None:
    doc["tenants"][2]["name"] = "Globex"


def test_the_plan_names_each_change_field_by_field_and_a_dry_run_applies_nothing(tmp_path):
    provision("--yes")
    out = provision("--dry-run", path=edited_demo(tmp_path, rename_t20))
    assert '  ~ tenant t-20\n      name: "Globex Support" -> "Globex"\n' in out
    assert "1 to change (1 field)" in out
    assert out.rstrip().endswith("dry run: nothing applied")
    assert Tenant.objects.get(slug="t-20").name == "Globex Support"


def test_the_first_plan_lists_what_it_creates_and_the_second_says_no_changes():
    first = provision("--yes")
    assert '  + tenant t-19: name "Acme Legal", internal false, rolloutMode "ENFORCE"\n' in first
    assert "applied: " in first
    changes = ChangeRecord.objects.count()
    second = provision("--yes")
    assert second.splitlines()[-1].startswith("no changes; ")
    assert ChangeRecord.objects.count() == changes, "a second apply writes nothing"


def test_without_yes_it_asks_on_a_terminal_and_refuses_without_one(tmp_path):
    provision("--yes")
    path = edited_demo(tmp_path, rename_t20)
    out = provision(path=path, stdin=Terminal("n\n"))
    assert "Apply this plan? [y/N] " in out and out.rstrip().endswith("nothing applied")
    assert Tenant.objects.get(slug="t-20").name == "Globex Support"
    with pytest.raises(CommandError, match="pass --yes"):
        provision(path=path, stdin=StringIO())
    assert Tenant.objects.get(slug="t-20").name == "Globex Support"
    provision(path=path, stdin=Terminal("y\n"))
    assert Tenant.objects.get(slug="t-20").name == "Globex"


def test_every_change_is_in_the_change_log_under_the_files_name_and_digest(tmp_path):
    source = load(DEMO).source
    actor = f"provision:demo.yaml@sha256:{source.digest[:12]}"
    provision("--yes")
    entries = ChangeRecord.objects.filter(actor_username=actor)
    assert entries.filter(action="tenant.add").count() == 3
    assert entries.filter(action="capacityaccount.add").count() == 6
    assert entries.filter(action="policy.activate").count() == 1, "the alias moved through its own write path"
    assert all(source.digest in e.reason for e in entries)
    path = edited_demo(tmp_path, rename_t20)
    provision("--yes", path=path)
    edited = load(path).source
    (change,) = ChangeRecord.objects.filter(actor_username=f"provision:demo.yaml@sha256:{edited.digest[:12]}")
    assert (change.action, change.before, change.after) == (
        "tenant.change",
        {"name": "Globex Support"},
        {"name": "Globex"},
    )


def test_the_demo_applies_to_an_empty_database_only(tmp_path):
    assert is_empty()
    ModelPool.objects.create(slug="eu-large", region="eu")
    assert not is_empty(), "any provisioned object makes the database not empty"
    out = provision("--if-empty", "--yes")
    assert "not applied: it is applied only to an empty database" in out
    assert not Tenant.objects.exists()
    ModelPool.objects.all().delete()
    provision("--if-empty", "--yes")
    assert Tenant.objects.count() == 3
    Tenant.objects.filter(slug="t-20").update(name="Globex after a person's edit")
    provision("--if-empty", "--yes", path=edited_demo(tmp_path, rename_t20))
    assert Tenant.objects.get(slug="t-20").name == "Globex after a person's edit"


def test_the_run_command_applies_its_demo_only_to_an_empty_database(monkeypatch, capsys):
    """``./platform run`` prepares the database on every start; only the first start provisions the demo."""
    from django.core import management
    from django.db import connections

    from budgeting.launcher.commands import prepare_database

    real_call_command = management.call_command

    def only_provision(name: str, *args: str, **options: object) -> None:
        if name == "provision":
            real_call_command(name, *args, **options)

    monkeypatch.setattr(management, "call_command", only_provision)
    monkeypatch.setattr(connections, "close_all", lambda: None)
    prepare_database()
    account = CapacityAccount.objects.get(scope="TENANT", tenant__slug="t-19")
    assert account.output_limit == 10_000_000
    CapacityAccount.objects.filter(pk=account.pk).update(output_limit=12_000_000)
    prepare_database()
    account.refresh_from_db()
    assert account.output_limit == 12_000_000
    assert "demo.yaml not applied: it is applied only to an empty database" in capsys.readouterr().out
