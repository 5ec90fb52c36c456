"""Reads of the catalog for admission: resolve ids, the active policy, the model specs the ladder needs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import cast

from django.conf import settings

from budgeting.catalog.errors import NotFound, Unavailable
from budgeting.catalog.models import ModelPool, ModelRevision, PolicyAlias, TaskClass, Tokenizer
from ladder.counting import CountingUnavailable, TokenizerCounter, UpperBoundRule
from ladder.counting import ImageFormula as ImageFormulaName
from ladder.policy import Policy, TaskPolicy, parse_policy
from ladder.rungs import ModelSpec

ACTIVE_ALIAS = "production"


class PolicyMissing(Unavailable):
    code = "POLICY_UNAVAILABLE"
    title = "No active policy version"


@dataclass(frozen=True)
class Resolved:
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


def model_spec(revision: ModelRevision) -> ModelSpec:
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
    )


def counter_for_spec(spec: ModelSpec) -> TokenizerCounter:
    """Load (once per process) the tokenizer a model spec names. Raises CountingUnavailable when the file is
    missing or its bytes are no longer the provisioned digest (a swapped file must be provisioned anew)."""
    file_name = _tokenizer_files().get(spec.tokenizer_digest)
    if file_name is None:
        file_name = _tokenizer_files(refresh=True).get(spec.tokenizer_digest)
    if file_name is None:
        raise CountingUnavailable(f"no tokenizer with digest {spec.tokenizer_digest} is provisioned")
    return TokenizerCounter.from_file(
        Path(settings.TOKENIZER_DIR) / file_name, expected_digest=spec.tokenizer_digest
    )


_FILES: dict[str, str] = {}


def _tokenizer_files(refresh: bool = False) -> dict[str, str]:
    if refresh or not _FILES:
        _FILES.clear()
        _FILES.update(dict(Tokenizer.objects.values_list("digest", "file_name")))
    return _FILES


@lru_cache(maxsize=32)
def _parsed(revision: int, document_json: str) -> Policy:
    import json

    return parse_policy(json.loads(document_json))


def active_policy() -> tuple[Policy, int | None]:
    """The policy the alias points at (validated documents are immutable, so parsing is cached), and the
    lower global cap a rollback kept."""
    import json

    alias = PolicyAlias.objects.select_related("version").filter(name=ACTIVE_ALIAS).first()
    if alias is None:
        raise PolicyMissing(f"policy alias {ACTIVE_ALIAS!r} does not exist; provision a policy")
    version = alias.version
    return _parsed(version.revision, json.dumps(version.document, sort_keys=True)), alias.global_cap_floor


def default_task_policy(task_class: TaskClass) -> TaskPolicy:
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


def resolve(*, task_class: str, pool: str, model_revision: str) -> Resolved:
    """Resolve the request's catalog ids. Raises NotFound (unknown id) or PolicyMissing."""
    tc = TaskClass.objects.filter(slug=task_class).first()
    if tc is None:
        raise NotFound(f"unknown task class {task_class!r}", code="TASK_CLASS_NOT_FOUND")
    mp = ModelPool.objects.filter(slug=pool).first()
    if mp is None:
        raise NotFound(f"unknown model pool {pool!r}", code="MODEL_POOL_NOT_FOUND")
    model = ModelRevision.objects.select_related("tokenizer").filter(name=model_revision, pools=mp).first()
    if model is None:
        raise NotFound(
            f"model revision {model_revision!r} is not served by pool {pool!r}",
            code="MODEL_REVISION_NOT_FOUND",
        )
    policy, cap_floor = active_policy()
    task_policy = policy.task_classes.get(tc.slug) or default_task_policy(tc)
    global_cap = (
        policy.global_max_input_tokens
        if cap_floor is None
        else min(policy.global_max_input_tokens, cap_floor)
    )
    fallbacks = tuple(
        model_spec(m)
        for name in task_policy.fallback_models
        for m in ModelRevision.objects.select_related("tokenizer").filter(name=name, pools=mp)
    )
    return Resolved(
        task_class=tc,
        pool=mp,
        model=model,
        model_spec=model_spec(model),
        policy_revision=policy.revision,
        task_policy=task_policy,
        global_cap=global_cap,
        fallback_specs=fallbacks,
        queue_allowed=task_policy.queue.allowed and tc.queue_allowed,
        queue_deadline_seconds=task_policy.queue.deadline_seconds or tc.queue_deadline_seconds,
    )
