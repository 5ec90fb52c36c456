"""Declarative provisioning: apply a JSON/YAML description of the catalog, accounts and policies.

``apply_config`` validates the whole document first, then writes it in one transaction. Objects are matched by
their natural keys and only changed fields are written, so applying the same file twice changes nothing.
Any invalid field raises ``ProvisioningError`` naming it, and nothing is applied.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from budgeting.catalog.models import (
    CAPABILITIES,
    TEMPLATE_FAMILIES,
    ApiToken,
    ImageFormula,
    ModelPool,
    ModelRevision,
    PolicyAlias,
    PolicyState,
    PolicyVersion,
    RolloutMode,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
    hash_token,
)
from budgeting.catalog.tokenizer_assets import sha256_file
from ladder.counting import upper_bound_rule
from ledger.models import CapacityAccount, Period, Scope
from ledger.periods import period_start_for
from ledger.services.accounts import forget_account_cache

T = TypeVar("T")


class ProvisioningError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass
class Report:
    created: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    unchanged: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str, outcome: str) -> None:
        bucket = {"created": self.created, "updated": self.updated, "unchanged": self.unchanged}[outcome]
        bucket[kind] = bucket.get(kind, 0) + 1

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated)

    def summary(self) -> str:
        parts = []
        for label, bucket in (
            ("created", self.created),
            ("updated", self.updated),
            ("unchanged", self.unchanged),
        ):
            if bucket:
                parts.append(f"{label}: " + ", ".join(f"{n} {k}" for k, n in sorted(bucket.items())))
        return "; ".join(parts) or "empty document"


def load_file(path: Path) -> Any:
    """Read a JSON or YAML provisioning file. Raises ProvisioningError for unreadable or malformed files."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProvisioningError(str(path), f"cannot read: {exc.strerror}") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ProvisioningError(str(path), f"not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None


class _Reader:
    """Typed access to one mapping of the document, naming the path of every bad field."""

    def __init__(self, data: Any, path: str, allowed: set[str]) -> None:
        if not isinstance(data, dict):
            raise ProvisioningError(path, "must be a mapping")
        unknown = set(data) - allowed
        if unknown:
            raise ProvisioningError(f"{path}.{sorted(unknown)[0]}", "unknown field")
        self.data = data
        self.path = path

    def get(self, key: str, kind: type[T], default: T | None = None, *, required: bool = False) -> T:
        if key not in self.data or self.data[key] is None:
            if required:
                raise ProvisioningError(f"{self.path}.{key}", "is required")
            return default  # type: ignore[return-value]
        value = self.data[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProvisioningError(f"{self.path}.{key}", f"must be an integer, got {value!r}")
        if not isinstance(value, kind):
            raise ProvisioningError(
                f"{self.path}.{key}", f"must be {kind.__name__}, got {type(value).__name__}"
            )
        return value

    def positive(self, key: str, *, required: bool = True, allow_zero: bool = False) -> int | None:
        value = self.get(key, int, required=required)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise ProvisioningError(f"{self.path}.{key}", f"must be {'>= 0' if allow_zero else '> 0'}")
        return value

    def choice(self, key: str, choices: set[str], default: str | None = None) -> str:
        value = self.get(key, str, default, required=default is None)
        if value not in choices:
            raise ProvisioningError(f"{self.path}.{key}", f"must be one of {sorted(choices)}, got {value!r}")
        return value


def _items(doc: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise ProvisioningError(key, "must be a list")
    return [(f"{key}[{i}]", item) for i, item in enumerate(value)]


def _sync(report: Report, kind: str, model: type[Any], lookup: dict[str, Any], values: dict[str, Any]) -> Any:
    """Create or update one object by natural key, writing only fields that differ."""
    obj = model.objects.filter(**lookup).first()
    if obj is None:
        obj = model.objects.create(**lookup, **values)
        report.note(kind, "created")
        return obj
    changed = [name for name, value in values.items() if getattr(obj, name) != value]
    if changed:
        for name in changed:
            setattr(obj, name, values[name])
        obj.save(update_fields=changed)
        report.note(kind, "updated")
    else:
        report.note(kind, "unchanged")
    return obj


def _sync_m2m(obj: Any, attr: str, wanted: list[Any]) -> bool:
    manager = getattr(obj, attr)
    current = {o.pk for o in manager.all()}
    if current != {o.pk for o in wanted}:
        manager.set(wanted)
        return True
    return False


def _resolve(index: dict[str, T], key: str, path: str, kind: str) -> T:
    if key not in index:
        raise ProvisioningError(path, f"unknown {kind} {key!r}")
    return index[key]


def _account_limits(reader: _Reader) -> dict[str, Any]:
    return {
        "period": reader.choice("period", {p.value for p in Period}, Period.MONTH),
        "input_limit": reader.positive("inputLimit", required=False, allow_zero=True),
        "output_limit": reader.positive("outputLimit", required=False, allow_zero=True),
        "concurrency_limit": reader.positive("concurrencyLimit", required=False, allow_zero=True),
    }


TOP_LEVEL = {
    "tokenizers",
    "modelPools",
    "modelRevisions",
    "taskClasses",
    "tenants",
    "accounts",
    "serviceClients",
    "policies",
}


def apply_config(
    doc: Any, *, tokenizer_dir: Path | None = None, validate_policy: Callable[[Any, str], None] | None = None
) -> Report:
    """Apply a provisioning document in one transaction. Raises ProvisioningError; nothing is applied then."""
    _Reader(doc, "$", TOP_LEVEL)
    tokenizer_dir = tokenizer_dir or Path(settings.TOKENIZER_DIR)
    report = Report()
    with transaction.atomic(durable=True):
        tokenizers: dict[str, Tokenizer] = {t.name: t for t in Tokenizer.objects.all()}
        for path, item in _items(doc, "tokenizers"):
            r = _Reader(item, path, {"name", "family", "source", "file", "nfkc"})
            file_name = r.get("file", str, required=True)
            file_path = tokenizer_dir / file_name
            if not file_path.is_file():
                raise ProvisioningError(
                    f"{path}.file", f"{file_path} does not exist (run ./platform to fetch)"
                )
            name = r.get("name", str, required=True)
            try:
                rule = upper_bound_rule(json.loads(file_path.read_bytes()))
            except ValueError:
                raise ProvisioningError(f"{path}.file", f"{file_path} is not a tokenizer JSON file") from None
            tokenizers[name] = _sync(
                report,
                "tokenizers",
                Tokenizer,
                {"name": name},
                {
                    "upper_bound_rule": rule or "",
                    "family": r.get("family", str, required=True),
                    "source": r.get("source", str, ""),
                    "file_name": file_name,
                    "digest": "sha256:" + sha256_file(file_path),
                    "nfkc": r.get("nfkc", bool, False),
                },
            )

        pools: dict[str, ModelPool] = {p.slug: p for p in ModelPool.objects.all()}
        for path, item in _items(doc, "modelPools"):
            r = _Reader(item, path, {"slug", "region", "providerBaseUrl"})
            slug = r.get("slug", str, required=True)
            pools[slug] = _sync(
                report,
                "model pools",
                ModelPool,
                {"slug": slug},
                {
                    "region": r.get("region", str, required=True),
                    "provider_base_url": r.get("providerBaseUrl", str, ""),
                },
            )

        for path, item in _items(doc, "modelRevisions"):
            r = _Reader(
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
            pool_names = r.get("pools", list, required=True)
            revision = _sync(
                report,
                "model revisions",
                ModelRevision,
                {"name": r.get("name", str, required=True)},
                {
                    "tokenizer": _resolve(
                        tokenizers, r.get("tokenizer", str, required=True), f"{path}.tokenizer", "tokenizer"
                    ),
                    "context_window": window,
                    "max_output": max_output,
                    "template_family": r.choice("templateFamily", TEMPLATE_FAMILIES),
                    "image_formula": r.choice(
                        "imageFormula", {f.value for f in ImageFormula}, ImageFormula.TILES_512
                    ),
                    "capabilities": sorted(capabilities),
                    "data_residency": r.get("dataResidency", str, required=True),
                    "safety_tier": r.positive("safetyTier", required=False) or 1,
                },
            )
            wanted = [_resolve(pools, p, f"{path}.pools", "model pool") for p in pool_names]
            if _sync_m2m(revision, "pools", wanted):
                report.note("model revision pools", "updated")

        task_classes: dict[str, TaskClass] = {t.slug: t for t in TaskClass.objects.all()}
        for path, item in _items(doc, "taskClasses"):
            r = _Reader(
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
            queue = _Reader(r.get("queue", dict, {}), f"{path}.queue", {"allowed", "deadlineSeconds"})
            ramp = r.positive("rampPercent", required=False, allow_zero=True)
            if ramp is not None and ramp > 100:
                raise ProvisioningError(f"{path}.rampPercent", "must be between 0 and 100")
            defaults = r.get("tenantAccountDefaults", dict, None)
            if defaults is not None:
                d = _Reader(
                    defaults,
                    f"{path}.tenantAccountDefaults",
                    {"period", "inputLimit", "outputLimit", "concurrencyLimit"},
                )
                _account_limits(d)
            slug = r.get("slug", str, required=True)
            task_classes[slug] = _sync(
                report,
                "task classes",
                TaskClass,
                {"slug": slug},
                {
                    "description": r.get("description", str, ""),
                    "max_output_cap": r.positive("maxOutputCap"),
                    "input_cap": r.positive("inputCap"),
                    "queue_allowed": queue.get("allowed", bool, False),
                    "queue_deadline_seconds": queue.positive("deadlineSeconds", required=False) or 60,
                    "ramp_percent": 100 if ramp is None else ramp,
                    "tenant_account_defaults": defaults,
                },
            )

        tenants: dict[str, Tenant] = {t.slug: t for t in Tenant.objects.all()}
        for path, item in _items(doc, "tenants"):
            r = _Reader(item, path, {"slug", "name", "internal", "rolloutMode"})
            slug = r.get("slug", str, required=True)
            tenants[slug] = _sync(
                report,
                "tenants",
                Tenant,
                {"slug": slug},
                {
                    "name": r.get("name", str, slug),
                    "internal": r.get("internal", bool, False),
                    "rollout_mode": r.choice(
                        "rolloutMode", {m.value for m in RolloutMode}, RolloutMode.SHADOW
                    ),
                },
            )

        now = timezone.now()
        for path, item in _items(doc, "accounts"):
            r = _Reader(
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
                },
            )
            scope = r.choice("scope", {s.value for s in Scope})
            keys: dict[str, Any] = {"scope": scope, "tenant": None, "task_class": None, "pool": None}
            if scope in {Scope.TENANT, Scope.TENANT_TASK}:
                keys["tenant"] = _resolve(
                    tenants, r.get("tenant", str, required=True), f"{path}.tenant", "tenant"
                )
            if scope == Scope.TENANT_TASK:
                keys["task_class"] = _resolve(
                    task_classes, r.get("taskClass", str, required=True), f"{path}.taskClass", "task class"
                )
            if scope == Scope.POOL:
                keys["pool"] = _resolve(
                    pools, r.get("pool", str, required=True), f"{path}.pool", "model pool"
                )
            limits = _account_limits(r)
            existing = CapacityAccount.objects.filter(**keys).first()
            if existing is None:
                limits["period_start"] = period_start_for(limits["period"], now)
            _sync(report, "accounts", CapacityAccount, keys, limits)

        for path, item in _items(doc, "serviceClients"):
            r = _Reader(item, path, {"name", "tenants", "tokens", "active"})
            client = _sync(
                report,
                "service clients",
                ServiceClient,
                {"name": r.get("name", str, required=True)},
                {"is_active": r.get("active", bool, True)},
            )
            wanted_tenants = [
                _resolve(tenants, t, f"{path}.tenants", "tenant") for t in r.get("tenants", list, [])
            ]
            if _sync_m2m(client, "tenants", wanted_tenants):
                report.note("service client tenants", "updated")
            for i, raw in enumerate(r.get("tokens", list, [])):
                if not isinstance(raw, str) or len(raw) < 16:
                    raise ProvisioningError(
                        f"{path}.tokens[{i}]", "must be a string of at least 16 characters"
                    )
                token_hash = hash_token(raw)
                owner = ApiToken.objects.filter(token_hash=token_hash).first()
                if owner is None:
                    ApiToken.objects.create(client=client, token_hash=token_hash, prefix=raw[:8])
                    report.note("api tokens", "created")
                elif owner.client_id != client.pk:
                    raise ProvisioningError(f"{path}.tokens[{i}]", "belongs to another service client")
                else:
                    report.note("api tokens", "unchanged")

        policies = _Reader(doc.get("policies") or {}, "policies", {"versions", "aliases"})
        versions: dict[int, PolicyVersion] = {v.revision: v for v in PolicyVersion.objects.all()}
        for path, item in _items(policies.data, "versions"):
            path = "policies." + path
            r = _Reader(item, path, {"revision", "document", "note"})
            revision = r.positive("revision")
            assert revision is not None
            document = r.get("document", dict, required=True)
            if document.get("revision") != revision:
                raise ProvisioningError(f"{path}.document.revision", f"must equal {revision}")
            if validate_policy is not None:
                validate_policy(document, f"{path}.document")
            existing_version = versions.get(revision)
            if existing_version is not None and existing_version.state == PolicyState.VALIDATED:
                if existing_version.document != document:
                    raise ProvisioningError(
                        f"{path}.document", f"policy r{revision} is validated and immutable"
                    )
                report.note("policy versions", "unchanged")
                continue
            versions[revision] = _sync(
                report,
                "policy versions",
                PolicyVersion,
                {"revision": revision},
                {
                    "document": document,
                    "note": r.get("note", str, ""),
                    "state": PolicyState.VALIDATED,
                    "validated_at": existing_version.validated_at if existing_version else now,
                },
            )
        for path, item in _items(policies.data, "aliases"):
            path = "policies." + path
            r = _Reader(item, path, {"name", "version"})
            revision = r.positive("version")
            target = versions.get(revision or 0)
            if target is None or target.state != PolicyState.VALIDATED:
                raise ProvisioningError(f"{path}.version", f"no validated policy r{revision}")
            name = r.get("name", str, required=True)
            alias = PolicyAlias.objects.filter(name=name).first()
            if alias is None:
                PolicyAlias.objects.create(name=name, version=target)
                report.note("policy aliases", "created")
            else:
                report.note("policy aliases", "unchanged")
    forget_account_cache()
    return report
