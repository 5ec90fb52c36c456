"""The catalog as each process sees it: an in-memory snapshot, reloaded the moment the catalog version moves.

Admission reads tenants, task classes, pools, model revisions, tokenizers, the active policy and the
service clients' tokens from here instead of a dozen queries a request. ``current()`` costs one statement: it
reads the version (bumped by database triggers in the same transaction as any change, migration 0010) and the
database clock. When the version differs from the snapshot's, the snapshot is rebuilt before it is used, so an
activation, a rollback, a revoked token or a provisioning apply is in force for the very next request, in
every process.

A lifecycle call of the gateway's reads the reservation first, and that read returns the catalog version too
(``ledger.locks``): ``unchecked()`` gives it the snapshot without a statement of its own, as a caller whose
``checked_version`` the read compares before anything is written (``CatalogUnchecked`` when the catalog moved:
the call is then made again, after ``current()``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from django.conf import settings
from django.db import InterfaceError, OperationalError

from budgeting.catalog.errors import NotFound, Unavailable
from budgeting.catalog.models import (
    CURRENT_VERSION_SQL,
    ApiToken,
    Counter,
    ModelPool,
    ModelRevision,
    PolicyAlias,
    Price,
    Provider,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
)
from budgeting.catalog.prices import FrozenPrice, FrozenPriceAt, price_in_force
from budgeting.catalog.tokens import note_use
from budgeting.db.cursor import prepared_cursor, this_connection
from ladder.counting import CountingUnavailable, SegmentCounter, UpperBoundRule
from ladder.counting import ImageFormula as ImageFormulaName
from ladder.families import load_counter
from ladder.policy import Policy, TaskPolicy, parse_policy
from ladder.rungs import ModelSpec

ACTIVE_ALIAS = "production"


class PolicyMissing(Unavailable):
    code = "POLICY_UNAVAILABLE"
    title = "No active policy version"


@dataclass(frozen=True)
class Caller:
    """An authenticated service client: the tenants it may act for, the snapshot it was checked against."""

    client: ServiceClient
    token_id: int
    tenant_ids: frozenset[int]
    snapshot: Snapshot
    db_now: datetime
    """The database clock when the request was authenticated (leases are measured on it)."""
    checked: bool = True
    """False: the catalog version was not read for this request (``unchecked()``); its first statement must
    compare ``snapshot.version`` before anything is written (``checked_version``)."""

    @property
    def checked_version(self) -> int | None:
        """The catalog version a call's first read must find (``CatalogUnchecked`` otherwise), or None when
        the version was read for this request already."""
        return None if self.checked else self.snapshot.version


@dataclass(frozen=True)
class Resolved:
    """Everything the catalog says about one (task class, pool, model revision) under the active policy."""

    task_class: TaskClass
    pool: ModelPool
    model: ModelRevision
    model_spec: ModelSpec
    policy_revision: int
    task_policy: TaskPolicy
    global_cap: int
    fallback_specs: tuple[ModelSpec, ...]
    queue_allowed: bool
    queue_deadline_seconds: int


@dataclass(frozen=True)
class _Token:
    client: ServiceClient
    token_id: int
    tenant_ids: frozenset[int]
    expires_at: datetime | None


# The pools whose provider base URL answers OpenAI's counting API: OpenAI's own, and the simulator's.
_OPENAI_COUNTING_PROVIDERS = frozenset({Provider.OPENAI, Provider.SIMULATOR})


def bound_counter(revision: ModelRevision, pool: ModelPool | None) -> str | None:
    """The counting API that counts what ``revision``'s exact tokenizer can only bound, in ``pool``, or None.

    An OpenAI-family revision counted locally (``counter: local``) renders the tools, response format, tool
    calls and results OpenAI does not publish the framing of as ``Bound`` pieces; a pool that names a
    provider base URL of OpenAI (or the simulator, which answers the same API) counts such a payload through
    ``POST /v1/responses/input_tokens`` (``PROVIDER_COUNT``). Without one the local bound stays.
    """
    if revision.template_family != "openai" or revision.counter != Counter.LOCAL or pool is None:
        return None
    if not pool.provider_base_url.strip() or pool.provider not in _OPENAI_COUNTING_PROVIDERS:
        return None
    return Counter.OPENAI.value


def model_spec(revision: ModelRevision, pool: ModelPool | None = None) -> ModelSpec:
    """The ladder's view of ``revision`` as ``pool`` serves it (without a pool: no counting API for what its
    tokenizer can only bound)."""
    return ModelSpec(
        id=revision.name,
        context_window=revision.context_window,
        max_output=revision.max_output,
        template_family=revision.template_family,
        image_formula=cast(ImageFormulaName, revision.image_formula),
        capabilities=frozenset(revision.capabilities),
        data_residency=revision.data_residency,
        safety_tier=revision.safety_tier,
        tokenizer_digest=revision.tokenizer.digest,
        upper_bound=cast(UpperBoundRule, revision.tokenizer.upper_bound_rule) or None,
        provider_counter=None if revision.counter == "local" else revision.counter,
        bound_counter=bound_counter(revision, pool),
    )


def default_task_policy(task_class: TaskClass) -> TaskPolicy:
    """The policy of a task class the active document does not name: FULL, then queue or reject."""
    doc = {
        "revision": 1,
        "globalMaxInputTokens": task_class.input_cap,
        "taskClasses": {
            task_class.slug: {
                "inputCap": task_class.input_cap,
                "outputCap": task_class.max_output_cap,
                "ladder": ["FULL", "QUEUE_OR_REJECT"],
                "minimumEvidence": {"minItems": 0, "requireMarked": True},
                "compaction": {"fidelityThreshold": 1, "approvedGates": []},
                "essentialTools": [],
                "clarificationWorkflow": None,
                "countingUnavailable": "REJECT",
                "queue": {
                    "allowed": task_class.queue_allowed,
                    "deadlineSeconds": task_class.queue_deadline_seconds,
                },
                "rampPercent": 100,
                "fallbackModels": [],
            }
        },
    }
    return parse_policy(doc).task_classes[task_class.slug]


@dataclass
class Snapshot:
    """One consistent read of the catalog, valid while the catalog version is ``version``."""

    version: int | None
    tokens: dict[str, _Token]
    tenants: dict[str, Tenant]
    task_classes: dict[str, TaskClass]
    pools: dict[str, ModelPool]
    models: dict[str, ModelRevision]
    model_pools: dict[str, frozenset[int]]
    tokenizer_files: dict[str, tuple[str, str]]
    """The file name and tokenizer family of each provisioned digest."""
    policy: Policy | None
    global_cap_floor: int | None
    prices: dict[int, list[FrozenPriceAt]] = field(default_factory=dict)
    """Per model revision id, its price versions by start (a new price bumps the catalog version)."""
    _resolved: dict[tuple[str, str, str], Resolved] = field(default_factory=dict)

    def caller(self, token_hash: str, db_now: datetime, *, checked: bool = True) -> Caller | None:
        """The caller a token stands for, or None (unknown, revoked or expired at ``db_now``). An accepted
        token's use is noted for its "last used" date (in Redis, never a database write). Unchecked (the
        version not read, ``db_now`` estimated), a token expiring within ``_UNCHECKED_EXPIRY_MARGIN`` is None
        too: the caller checks it with the catalog read."""
        token = self.tokens.get(token_hash)
        margin = timedelta(0) if checked else _UNCHECKED_EXPIRY_MARGIN
        if token is None or (token.expires_at is not None and token.expires_at <= db_now + margin):
            return None
        note_use(token.token_id, db_now)
        return Caller(token.client, token.token_id, token.tenant_ids, self, db_now, checked)

    def tenant(self, slug: str, allowed: Iterable[int]) -> Tenant:
        """The tenant a caller names. One it may not act for is NotFound exactly as an unknown one is."""
        tenant = self.tenants.get(slug)
        if tenant is None or tenant.pk not in allowed:
            raise NotFound(f"unknown tenant {slug!r}", code="TENANT_NOT_FOUND")
        return tenant

    def resolve(self, *, task_class: str, pool: str, model_revision: str) -> Resolved:
        """Resolve the request's catalog ids. Raises NotFound (unknown id) or PolicyMissing."""
        key = (task_class, pool, model_revision)
        resolved = self._resolved.get(key)
        if resolved is None:
            resolved = self._resolved[key] = self._resolve(task_class, pool, model_revision)
        return resolved

    def _resolve(self, task_class: str, pool: str, model_revision: str) -> Resolved:
        tc = self.task_classes.get(task_class)
        if tc is None:
            raise NotFound(f"unknown task class {task_class!r}", code="TASK_CLASS_NOT_FOUND")
        mp = self.pools.get(pool)
        if mp is None:
            raise NotFound(f"unknown model pool {pool!r}", code="MODEL_POOL_NOT_FOUND")
        model = self._served(model_revision, mp)
        if model is None:
            raise NotFound(
                f"model revision {model_revision!r} is not served by pool {pool!r}",
                code="MODEL_REVISION_NOT_FOUND",
            )
        if self.policy is None:
            raise PolicyMissing(f"policy alias {ACTIVE_ALIAS!r} does not exist; provision a policy")
        task_policy = self.policy.task_classes.get(tc.slug) or default_task_policy(tc)
        global_cap = self.policy.global_max_input_tokens
        if self.global_cap_floor is not None:
            global_cap = min(global_cap, self.global_cap_floor)
        fallbacks = tuple(
            model_spec(m, mp)
            for name in task_policy.fallback_models
            if (m := self._served(name, mp)) is not None
        )
        return Resolved(
            task_class=tc,
            pool=mp,
            model=model,
            model_spec=model_spec(model, mp),
            policy_revision=self.policy.revision,
            task_policy=task_policy,
            global_cap=global_cap,
            fallback_specs=fallbacks,
            queue_allowed=task_policy.queue.allowed and tc.queue_allowed,
            queue_deadline_seconds=task_policy.queue.deadline_seconds or tc.queue_deadline_seconds,
        )

    def price(self, model: ModelRevision, at: datetime) -> FrozenPrice | None:
        """The model revision's price in force at ``at`` (the database clock of the admission), or None."""
        return price_in_force(self.prices.get(model.pk, []), at)

    def counter_for(self, spec: ModelSpec) -> SegmentCounter:
        """The tokenizer a model spec names, read as its family says (loaded once per process). Raises
        CountingUnavailable when the file is missing or its bytes are not the provisioned digest (a swapped
        file is provisioned anew)."""
        file = self.tokenizer_files.get(spec.tokenizer_digest)
        if file is None:
            raise CountingUnavailable(f"no tokenizer with digest {spec.tokenizer_digest} is provisioned")
        file_name, family = file
        return load_counter(
            family, Path(settings.TOKENIZER_DIR) / file_name, expected_digest=spec.tokenizer_digest
        )

    def load_tokenizers(self) -> list[str]:
        """Load every tokenizer file this catalog provisions, as the first count of each would (a file is read
        once per process); return the names of those loaded. A file that cannot be loaded is left to that
        first count, which answers it as counting unavailable."""
        loaded = []
        for digest, (file_name, family) in self.tokenizer_files.items():
            try:
                load_counter(family, Path(settings.TOKENIZER_DIR) / file_name, expected_digest=digest)
            except CountingUnavailable:
                continue
            loaded.append(file_name)
        return loaded

    def _served(self, name: str, pool: ModelPool) -> ModelRevision | None:
        model = self.models.get(name)
        return model if model is not None and pool.pk in self.model_pools.get(name, ()) else None


def _load(version: int | None) -> Snapshot:
    """Read the catalog. Called after the version was read, so what it reads is at least that new."""
    clients = {c.pk: c for c in ServiceClient.objects.filter(is_active=True)}
    allowed: dict[int, set[int]] = {pk: set() for pk in clients}
    for client_id, tenant_id in ServiceClient.tenants.through.objects.values_list(
        "serviceclient_id", "tenant_id"
    ):
        if client_id in allowed:
            allowed[client_id].add(tenant_id)
    tokens = {
        token_hash: _Token(clients[client_id], token_id, frozenset(allowed[client_id]), expires_at)
        for token_id, token_hash, client_id, expires_at in ApiToken.objects.filter(
            revoked_at__isnull=True
        ).values_list("pk", "token_hash", "client_id", "expires_at")
        if client_id in clients
    }
    model_pools: dict[str, set[int]] = {}
    for name, pool_id in ModelRevision.pools.through.objects.values_list(
        "modelrevision__name", "modelpool_id"
    ):
        model_pools.setdefault(name, set()).add(pool_id)
    alias = PolicyAlias.objects.select_related("version").filter(name=ACTIVE_ALIAS).first()
    prices: dict[int, list[FrozenPriceAt]] = {}
    for price in Price.objects.order_by("model_revision_id", "effective_from"):
        prices.setdefault(price.model_revision_id, []).append((price.effective_from, FrozenPrice.of(price)))
    return Snapshot(
        version=version,
        tokens=tokens,
        tenants={t.slug: t for t in Tenant.objects.all()},
        task_classes={t.slug: t for t in TaskClass.objects.all()},
        pools={p.slug: p for p in ModelPool.objects.all()},
        models={m.name: m for m in ModelRevision.objects.select_related("tokenizer")},
        model_pools={name: frozenset(ids) for name, ids in model_pools.items()},
        tokenizer_files={
            digest: (file_name, family)
            for digest, file_name, family in Tokenizer.objects.values_list("digest", "file_name", "family")
        },
        policy=None if alias is None else _parsed(json.dumps(alias.version.document, sort_keys=True)),
        global_cap_floor=None if alias is None else alias.global_cap_floor,
        prices=prices,
    )


_POLICIES: dict[str, Policy] = {}


def _parsed(document_json: str) -> Policy:
    """Validated policy documents are immutable: each is parsed once per process."""
    policy = _POLICIES.get(document_json)
    if policy is None:
        policy = _POLICIES[document_json] = parse_policy(json.loads(document_json))
    return policy


_LOCK = threading.Lock()
_current: Snapshot | None = None
# When ``_current`` was last found current: the database clock then and this process's monotonic clock.
_checked_at: tuple[datetime, float] | None = None
# An unchecked caller's token must not expire within this of the estimated database clock.
_UNCHECKED_EXPIRY_MARGIN = timedelta(minutes=1)


def _read_version() -> tuple[int | None, datetime]:
    """The catalog version and the database clock: the first statement of every API request.

    It is also the request's connection health check (CONN_HEALTH_CHECKS): Django would first send a
    ``SELECT 1`` of its own on a connection kept from an earlier request, a round trip per request. Here a
    kept connection that fails this read (the server restarted) is closed and the read is tried once on a
    new connection, as Django's check would have done before it.
    """
    db: Any = this_connection()  # the health check's attributes are not in django-stubs
    kept = (
        db.connection is not None
        and db.health_check_enabled
        and not db.health_check_done
        and not db.in_atomic_block
    )
    db.health_check_done = True
    try:
        return _version_and_clock()
    except (OperationalError, InterfaceError):
        if not kept:
            raise
    db.close()
    return _version_and_clock()


def _version_and_clock() -> tuple[int | None, datetime]:
    with prepared_cursor() as cursor:
        cursor.execute(f"SELECT ({CURRENT_VERSION_SQL}), clock_timestamp()")
        version, db_now = cursor.fetchone()
    return version, db_now


def current() -> tuple[Snapshot, datetime]:
    """The snapshot valid now, and the database clock. One statement unless the catalog changed.

    With no version row (an emptied table, as between tests) nothing is cached: every call reads afresh.
    """
    global _current, _checked_at
    version, db_now = _read_version()
    snapshot = _current
    if snapshot is None or version is None or snapshot.version != version:
        with _LOCK:
            snapshot = _current
            if snapshot is None or version is None or snapshot.version != version:
                snapshot = _load(version)
                _current = snapshot if version is not None else None
    _checked_at = (db_now, time.monotonic()) if version is not None else None
    return snapshot, db_now


def unchecked() -> tuple[Snapshot, datetime] | None:
    """The snapshot ``current()`` last found current, without a statement, and the database clock estimated
    from the one it read then; None if there is none. Only for a call whose first statement compares the
    catalog version before anything is written (``Caller.checked_version``)."""
    snapshot, checked_at = _current, _checked_at
    if snapshot is None or snapshot.version is None or checked_at is None:
        return None
    db_now, at = checked_at
    return snapshot, db_now + timedelta(seconds=time.monotonic() - at)
