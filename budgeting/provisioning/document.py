"""Reading a provisioning document: check every field and list the objects it wants (``Wanted``).

Nothing here writes. ``read_document`` raises ProvisioningError naming the first bad field, so an invalid file
never gets as far as a plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from budgeting.catalog.models import (
    CAPABILITIES,
    TEMPLATE_FAMILIES,
    ApiToken,
    Counter,
    ImageFormula,
    ModelPool,
    ModelRevision,
    PolicyAlias,
    PolicyState,
    PolicyVersion,
    Provider,
    ProviderAdapter,
    RolloutMode,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
    hash_token,
)
from budgeting.catalog.policies import document_errors
from budgeting.catalog.prices import to_micro
from budgeting.catalog.tokenizer_assets import pinned_sha256
from budgeting.provisioning.prices import CURRENCY, money_amount, read_prices
from budgeting.provisioning.source import ProvisioningError, Reader, items
from budgeting.provisioning.wanted import Wanted, known, wanted
from ladder.families import FAMILIES, TOKENIZER_FAMILIES, checked_by_content
from ladder.seams import is_deepseek_v3
from ledger.models import CapacityAccount, Period, Scope
from ledger.periods import period_start_for

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
"""A pool names the environment variables holding its keys (at most 64 characters), never the keys."""


def _limits(r: Reader) -> list[tuple[str, str, Any]]:
    return [
        ("period", "period", r.choice("period", {p.value for p in Period}, Period.MONTH)),
        ("input_limit", "inputLimit", r.positive("inputLimit", required=False, allow_zero=True)),
        ("output_limit", "outputLimit", r.positive("outputLimit", required=False, allow_zero=True)),
        (
            "concurrency_limit",
            "concurrencyLimit",
            r.positive("concurrencyLimit", required=False, allow_zero=True),
        ),
    ]


def _spend_limit(r: Reader) -> list[tuple[str, str, Any]]:
    """An account's spend limit per period: decimal text (or a YAML number as written) of ``currency``,
    kept in micro-units; absent means no money limit."""
    currency = r.get("currency", str, "USD")
    if not CURRENCY.fullmatch(currency):
        raise ProvisioningError(
            f"{r.path}.currency", f"must be a three-letter ISO code, e.g. USD, got {currency!r}"
        )
    limit = None
    if r.data.get("spendLimit") is not None:
        amount = money_amount(r, "spendLimit")
        limit = to_micro(amount)
    return [("currency", "currency", currency), ("spend_limit", "spendLimit", limit)]


TOP_LEVEL = {
    "tokenizers",
    "modelPools",
    "modelRevisions",
    "taskClasses",
    "tenants",
    "accounts",
    "serviceClients",
    "policies",
    "prices",
}


def read_document(doc: Any, *, now: datetime, tokenizer_dir: Path | None = None) -> list[Wanted]:
    """The objects a provisioning document describes, in an order that creates what is referred to first.

    Raises ProvisioningError naming the first bad field: unknown fields, wrong types, references to objects
    neither in the database nor in the file, an object described twice, an invalid policy, a token of another
    client, or a policy revision whose stored document differs (validated versions are immutable; drafts
    belong to people).
    """
    Reader(doc, "$", TOP_LEVEL)
    out: list[Wanted] = []
    folder = tokenizer_dir or Path(settings.TOKENIZER_DIR)
    out += _tokenizers(doc, folder)
    out += _pools(doc)
    out += _model_revisions(
        doc, _tokenizer_families(out), _tokenizer_files(out, folder), known(ModelPool, out)
    )
    out += read_prices(doc, known(ModelRevision, out))
    out += _task_classes(doc)
    out += _tenants(doc)
    out += _accounts(doc, now, known(Tenant, out), known(TaskClass, out), known(ModelPool, out))
    out += _service_clients(doc, known(Tenant, out))
    out += _policies(doc, now)
    seen = set()
    for w in out:
        identity = (w.model, tuple(sorted(w.lookup.items())))
        if identity in seen:
            raise ProvisioningError(f"{w.kind} {w.label}", "is described twice")
        seen.add(identity)
    return out


def _tokenizers(doc: dict[str, Any], tokenizer_dir: Path) -> list[Wanted]:
    """The tokenizers of the document. Raises ProvisioningError for an unknown family, a missing file, a file
    whose sha256 is not the document's or not the pin of the asset it is named after, or a file that is not
    of its family."""
    out = []
    for path, item in items(doc, "tokenizers"):
        r = Reader(item, path, {"name", "family", "source", "file", "sha256", "nfkc"})
        family = FAMILIES[r.choice("family", set(TOKENIZER_FAMILIES))]
        file_name = r.get("file", str, required=True)
        file_path = tokenizer_dir / file_name
        if not file_path.is_file():
            raise ProvisioningError(f"{path}.file", f"{file_path} does not exist (run ./platform to fetch)")
        name = r.get("name", str, required=True)
        data = file_path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        stated = r.get("sha256", str, "")
        if stated and stated != digest:
            raise ProvisioningError(f"{path}.sha256", f"{file_path} has sha256 {digest}, not {stated}")
        pinned = pinned_sha256(file_name)
        if pinned is not None and pinned != digest:
            raise ProvisioningError(
                f"{path}.file",
                f"{file_path} has sha256 {digest}, not the pinned {pinned} (./platform fetches it again)",
            )
        try:
            rule = family.bound_rule(data)
        except ValueError:
            error = f"{file_path} is not a {family.name} tokenizer file"
            raise ProvisioningError(f"{path}.file", error) from None
        fields = [
            ("family", "family", family.name),
            ("source", "source", r.get("source", str, "")),
            ("file_name", "file", file_name),
            ("digest", "file (digest)", "sha256:" + digest),
            ("upper_bound_rule", "file (upper bound rule)", rule or ""),
            ("nfkc", "nfkc", r.get("nfkc", bool, False)),
        ]
        out.append(wanted("tokenizer", name, Tokenizer, {"name": name}, fields))
    return out


def _tokenizer_families(named_in_file: list[Wanted]) -> dict[str, str]:
    """The family of every tokenizer a model revision may name: the file's own, else the database's."""
    families = dict(Tokenizer.objects.values_list("name", "family"))
    for w in named_in_file:
        if w.model is Tokenizer:
            families[w.lookup["name"]] = next(f.value for f in w.fields if f.name == "family")
    return families


def _tokenizer_files(named_in_file: list[Wanted], tokenizer_dir: Path) -> dict[str, Path]:
    """The file of every tokenizer a model revision may name: the file's own, else the database's."""
    files = {name: tokenizer_dir / file for name, file in Tokenizer.objects.values_list("name", "file_name")}
    for w in named_in_file:
        if w.model is Tokenizer:
            files[w.lookup["name"]] = tokenizer_dir / next(f.value for f in w.fields if f.name == "file_name")
    return files


def _check_deepseek_framing(file_path: Path, path: str) -> None:
    """Refuse the deepseek template for a tokenizer that is not DeepSeek-V3's: the template cuts texts only
    where DeepSeek-V3's pre-tokenizer must split them (``ladder.seams``), proven for that pre-tokenizer
    without a normaliser alone; another byte-level BPE may merge across those cuts and count more."""
    try:
        framed = checked_by_content("deepseek-v3 pre-tokenizer", file_path.read_bytes(), _is_deepseek_v3_file)
    except (OSError, ValueError):
        raise ProvisioningError(path, f"{file_path} cannot be read as a tokenizers JSON file") from None
    if not framed:
        raise ProvisioningError(
            path,
            f"{file_path} does not pre-tokenize as DeepSeek-V3 (its pre_tokenizer or normalizer differs): "
            "the deepseek template's cuts are proven for DeepSeek-V3's pre-tokenizer alone",
        )


def _is_deepseek_v3_file(data: bytes) -> bool:
    return is_deepseek_v3(json.loads(data))


def _pools(doc: dict[str, Any]) -> list[Wanted]:
    out = []
    for path, item in items(doc, "modelPools"):
        r = Reader(
            item,
            path,
            {
                "slug",
                "region",
                "providerBaseUrl",
                "provider",
                "adapter",
                "apiKeyEnv",
                "adminKeyEnv",
                "maxCallSeconds",
            },
        )
        slug = r.get("slug", str, required=True)
        provider = r.choice("provider", set(Provider.values), Provider.SIMULATOR)
        own = sorted(a for a in ProviderAdapter.values if _provider_of(a) == provider)
        adapter = r.choice("adapter", set(ProviderAdapter.values), own[0] if len(own) == 1 else None)
        if adapter not in own:
            raise ProvisioningError(
                f"{path}.adapter",
                f"{adapter!r} is not an adapter of provider {provider!r} (its adapters: {own})",
            )
        fields = [
            ("region", "region", r.get("region", str, required=True)),
            ("provider_base_url", "providerBaseUrl", r.get("providerBaseUrl", str, "")),
            ("provider", "provider", provider),
            ("adapter", "adapter", adapter),
            ("api_key_env", "apiKeyEnv", _env_name(r, "apiKeyEnv")),
            ("admin_key_env", "adminKeyEnv", _env_name(r, "adminKeyEnv")),
            ("max_call_seconds", "maxCallSeconds", r.positive("maxCallSeconds", required=False) or 600),
        ]
        out.append(wanted("model pool", slug, ModelPool, {"slug": slug}, fields))
    return out


def _provider_of(adapter: str) -> str:
    # An adapter's name starts with its provider's, as the pool's check constraint pairs them. The registry in
    # reconciliation.providers says the same, but provisioning imports no reconciliation (ARCHITECTURE.md) and
    # need not load two provider SDKs to read a file.
    return adapter.split("-")[0]


def _env_name(r: Reader, key: str) -> str:
    value = r.get(key, str, "")
    if value and not ENV_NAME.fullmatch(value):
        raise ProvisioningError(
            f"{r.path}.{key}",
            "must be the name of an environment variable (letters, digits and _, at most 64 characters), "
            "never the key itself",
        )
    return value


def _model_revisions(
    doc: dict[str, Any], tokenizers: dict[str, str], files: dict[str, Path], pools: set[Any]
) -> list[Wanted]:
    out = []
    for path, item in items(doc, "modelRevisions"):
        r = Reader(
            item,
            path,
            {
                "name",
                "tokenizer",
                "pools",
                "contextWindow",
                "maxOutput",
                "templateFamily",
                "imageFormula",
                "capabilities",
                "dataResidency",
                "safetyTier",
                "counter",
                "providerModel",
            },
        )
        window = r.positive("contextWindow")
        max_output = r.positive("maxOutput")
        assert window is not None and max_output is not None
        if max_output >= window:
            raise ProvisioningError(f"{path}.maxOutput", "must be below contextWindow")
        capabilities = r.get("capabilities", list, [])
        bad = [c for c in capabilities if c not in CAPABILITIES]
        if bad:
            raise ProvisioningError(f"{path}.capabilities", f"unknown capability {bad[0]!r}")
        name = r.get("name", str, required=True)
        tokenizer = r.ref("tokenizer", set(tokenizers), "tokenizer")
        template_family = r.choice("templateFamily", TEMPLATE_FAMILIES)
        family = FAMILIES.get(tokenizers[tokenizer])
        if family is None:
            error = f"unknown tokenizer family {tokenizers[tokenizer]!r}"
            raise ProvisioningError(f"{path}.tokenizer", error)
        if template_family not in family.templates:
            raise ProvisioningError(
                f"{path}.templateFamily",
                f"the {family.name} tokenizer {tokenizer!r} is framed by {sorted(family.templates)}, "
                f"not {template_family!r}",
            )
        if template_family == "deepseek":
            _check_deepseek_framing(files[tokenizer], f"{path}.templateFamily")
        fields = [
            ("tokenizer", "tokenizer", tokenizer),
            ("pools", "pools", r.refs("pools", pools, "model pool", required=True)),
            ("context_window", "contextWindow", window),
            ("max_output", "maxOutput", max_output),
            ("template_family", "templateFamily", template_family),
            (
                "image_formula",
                "imageFormula",
                r.choice("imageFormula", {f.value for f in ImageFormula}, ImageFormula.TILES_512),
            ),
            ("capabilities", "capabilities", sorted(capabilities)),
            ("data_residency", "dataResidency", r.get("dataResidency", str, required=True)),
            ("safety_tier", "safetyTier", r.positive("safetyTier", required=False) or 1),
            ("counter", "counter", r.choice("counter", {c.value for c in Counter}, Counter.LOCAL)),
            ("provider_model", "providerModel", r.get("providerModel", str, "")),
        ]
        out.append(wanted("model revision", name, ModelRevision, {"name": name}, fields))
    return out


def _task_classes(doc: dict[str, Any]) -> list[Wanted]:
    out = []
    for path, item in items(doc, "taskClasses"):
        r = Reader(
            item,
            path,
            {
                "slug",
                "description",
                "maxOutputCap",
                "inputCap",
                "queue",
                "rampPercent",
                "tenantAccountDefaults",
            },
        )
        queue = Reader(r.get("queue", dict, {}), f"{path}.queue", {"allowed", "deadlineSeconds"})
        ramp = r.positive("rampPercent", required=False, allow_zero=True)
        if ramp is not None and ramp > 100:
            raise ProvisioningError(f"{path}.rampPercent", "must be between 0 and 100")
        defaults = r.get("tenantAccountDefaults", dict, None)
        if defaults is not None:
            _limits(
                Reader(
                    defaults,
                    f"{path}.tenantAccountDefaults",
                    {"period", "inputLimit", "outputLimit", "concurrencyLimit"},
                )
            )
        slug = r.get("slug", str, required=True)
        fields = [
            ("description", "description", r.get("description", str, "")),
            ("max_output_cap", "maxOutputCap", r.positive("maxOutputCap")),
            ("input_cap", "inputCap", r.positive("inputCap")),
            ("queue_allowed", "queue.allowed", queue.get("allowed", bool, False)),
            (
                "queue_deadline_seconds",
                "queue.deadlineSeconds",
                queue.positive("deadlineSeconds", required=False) or 60,
            ),
            ("ramp_percent", "rampPercent", 100 if ramp is None else ramp),
            ("tenant_account_defaults", "tenantAccountDefaults", defaults),
        ]
        out.append(wanted("task class", slug, TaskClass, {"slug": slug}, fields))
    return out


def _tenants(doc: dict[str, Any]) -> list[Wanted]:
    out = []
    for path, item in items(doc, "tenants"):
        r = Reader(item, path, {"slug", "name", "internal", "rolloutMode"})
        slug = r.get("slug", str, required=True)
        fields = [
            ("name", "name", r.get("name", str, slug)),
            ("internal", "internal", r.get("internal", bool, False)),
            (
                "rollout_mode",
                "rolloutMode",
                r.choice("rolloutMode", {m.value for m in RolloutMode}, RolloutMode.SHADOW),
            ),
        ]
        out.append(wanted("tenant", slug, Tenant, {"slug": slug}, fields))
    return out


def _accounts(
    doc: dict[str, Any], now: datetime, tenants: set[Any], task_classes: set[Any], pools: set[Any]
) -> list[Wanted]:
    out = []
    for path, item in items(doc, "accounts"):
        r = Reader(
            item,
            path,
            {
                "scope",
                "tenant",
                "taskClass",
                "pool",
                "period",
                "inputLimit",
                "outputLimit",
                "concurrencyLimit",
                "spendLimit",
                "currency",
            },
        )
        scope = r.choice("scope", {s.value for s in Scope})
        lookup: dict[str, Any] = {"scope": scope, "tenant": None, "task_class": None, "pool": None}
        if scope in {Scope.TENANT, Scope.TENANT_TASK}:
            lookup["tenant"] = r.ref("tenant", tenants, "tenant")
        if scope == Scope.TENANT_TASK:
            lookup["task_class"] = r.ref("taskClass", task_classes, "task class")
        if scope == Scope.POOL:
            lookup["pool"] = r.ref("pool", pools, "model pool")
        fields = [*_limits(r), *_spend_limit(r)]
        label = " ".join([scope, *(str(v) for k, v in lookup.items() if k != "scope" and v is not None)])
        on_create = {"period_start": period_start_for(fields[0][2], now)}
        out.append(wanted("account", label, CapacityAccount, lookup, fields, on_create))
    return out


def _service_clients(doc: dict[str, Any], tenants: set[Any]) -> list[Wanted]:
    out = []
    for path, item in items(doc, "serviceClients"):
        r = Reader(item, path, {"name", "tenants", "tokens", "active"})
        name = r.get("name", str, required=True)
        fields = [
            ("is_active", "active", r.get("active", bool, True)),
            ("tenants", "tenants", r.refs("tenants", tenants, "tenant")),
        ]
        out.append(wanted("service client", name, ServiceClient, {"name": name}, fields))
        for i, raw in enumerate(r.get("tokens", list, [])):
            if not isinstance(raw, str) or len(raw) < 16:
                raise ProvisioningError(f"{path}.tokens[{i}]", "must be a string of at least 16 characters")
            token_hash = hash_token(raw)
            if ApiToken.objects.filter(token_hash=token_hash).exclude(client__name=name).exists():
                raise ProvisioningError(f"{path}.tokens[{i}]", "belongs to another service client")
            out.append(
                wanted(
                    "api token",
                    f"{raw[:8]}… of {name}",
                    ApiToken,
                    {"token_hash": token_hash},
                    [],
                    {"client": name, "prefix": raw[:8]},
                )
            )
    return out


def _policies(doc: dict[str, Any], now: datetime) -> list[Wanted]:
    policies = Reader(doc.get("policies") or {}, "policies", {"versions", "aliases"})
    stored = {v.revision: v for v in PolicyVersion.objects.all()}
    out = []
    for path, item in items(policies.data, "versions"):
        path = "policies." + path
        r = Reader(item, path, {"revision", "document", "note"})
        revision = r.positive("revision")
        assert revision is not None
        document = r.get("document", dict, required=True)
        errors = document_errors(document, revision=revision)
        if errors:
            inner = "" if errors[0].path == "(document)" else f".{errors[0].path}"
            raise ProvisioningError(f"{path}.document{inner}", errors[0].message)
        existing = stored.get(revision)
        if existing is not None and existing.state != PolicyState.VALIDATED:
            raise ProvisioningError(
                f"{path}.revision",
                f"policy r{revision} is a draft: validate it in the admin, or use a new revision",
            )
        if existing is not None and existing.document != document:
            raise ProvisioningError(f"{path}.document", f"policy r{revision} is validated and immutable")
        out.append(
            wanted(
                "policy version",
                f"r{revision}",
                PolicyVersion,
                {"revision": revision},
                [("document", "document", document), ("note", "note", r.get("note", str, ""))],
                {"state": PolicyState.VALIDATED, "validated_at": now},
            )
        )
    in_file = {w.lookup["revision"] for w in out}
    validated = {rev for rev, v in stored.items() if v.state == PolicyState.VALIDATED} | in_file
    for path, item in items(policies.data, "aliases"):
        path = "policies." + path
        r = Reader(item, path, {"name", "version"})
        revision = r.positive("version")
        if revision not in validated:
            raise ProvisioningError(f"{path}.version", f"no validated policy r{revision}")
        name = r.get("name", str, required=True)
        out.append(
            wanted("policy alias", name, PolicyAlias, {"name": name}, [("version", "version", revision)])
        )
    return out
