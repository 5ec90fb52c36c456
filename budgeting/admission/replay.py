"""Replay a recorded admission decision (SPEC §7): re-run the pure ladder on the manifest's inputs, compare.

The replay uses what was recorded, not what is active now: the stored request, the recorded policy version,
the recorded requested model and tokenizer digest, the global cap the recorded budget implies. Counts go to a
private in-memory cache, so a replay never reads or writes Redis. What the catalog can no longer reproduce
(a tokenizer swapped since, a template revision changed, a policy version gone) is a difference too: counts
under another tokenizer or template cannot be replayed exactly.

The explanation lines describe the recorded decision (why it was admitted or rejected, the rung, what each
step removed) and the capacity it held and released (the ledger entries of the manifest's reservations).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from budgeting.admission.models import Manifest
from budgeting.admission.orchestrator import LIMITS, decision_label
from budgeting.admission.replay_report import explain, header, mapping, resources
from budgeting.admission.request import AdmissionRequest, MalformedRequest
from budgeting.catalog import snapshot as catalog
from budgeting.catalog.models import ModelPool, ModelRevision, PolicyVersion, Tokenizer
from ladder.components import ComponentError, Components
from ladder.counting import CountingUnavailable, MemoryCountCache, SegmentCounter, UpperBoundRule
from ladder.decide import decide
from ladder.decision import COUNTING_UNAVAILABLE, Decision
from ladder.messages import TemplateError
from ladder.parser import parse_components
from ladder.policy import PolicyError, TaskPolicy, parse_policy
from ladder.rungs import ModelSpec
from ladder.templates import get_template
from ladder.walk import ProviderCount
from ladder.wire import decision_manifest

# A tampered or damaged record can differ everywhere; the first ones are enough to see what happened.
MAX_DIFFERENCES = 40
_VALUE_CHARS = 160
AMOUNT_FIELDS: tuple[tuple[str, str], ...] = (
    ("input_reserved", "input reserved"),
    ("output_reserved", "output reserved"),
    ("input_consumed", "input consumed"),
    ("output_consumed", "output consumed"),
    ("in_flight", "in flight"),
)


class ReplayError(Exception):
    """The manifest does not exist (or the lookup named none)."""


@dataclass(frozen=True)
class ReplayResult:
    """``matches``: the replay reached the recorded decision and nothing prevents an exact replay.

    ``lines`` explain the recorded decision and the capacity it held; ``differences`` list every mismatch.
    """

    matches: bool
    lines: list[str]
    differences: list[str]


def find_manifest(*, request_id: str, tenant: str) -> Manifest:
    """The latest manifest of a request of a tenant (by slug). Raises ReplayError when there is none."""
    manifest = (
        Manifest.objects.filter(request_id=request_id, tenant__slug=tenant)
        .order_by("-created_at", "-pk")
        .first()
    )
    if manifest is None:
        raise ReplayError(f"no manifest for request {request_id!r} of tenant {tenant!r}")
    return manifest


def replay_manifest(manifest_id: int) -> ReplayResult:
    """Replay manifest ``manifest_id``. Raises ReplayError when it does not exist."""
    manifest = (
        Manifest.objects.select_related("tenant", "task_class", "model_pool", "model_revision__tokenizer")
        .filter(pk=manifest_id)
        .first()
    )
    if manifest is None:
        raise ReplayError(f"no manifest {manifest_id}")
    record = mapping(manifest.record)
    lines = [*header(manifest, record), *explain(record), *resources(manifest, record)]
    differences: list[str] = []
    inputs = _inputs(manifest, record, differences)
    decision: Decision | None = None
    if inputs is not None:
        try:
            decision = decide(
                inputs.components,
                request_id=inputs.request_id,
                model=inputs.model,
                requested_max_output=inputs.max_output,
                task_policy=inputs.task_policy,
                global_cap=inputs.global_cap,
                fallback_models=inputs.fallbacks,
                counter_for=inputs.counter_for,
                cache=MemoryCountCache(),  # private: a replay never reads or writes Redis
                provider_count=_recorded_provider_counts(record),
            )
        except (ValueError, TemplateError) as exc:
            differences.append(f"the ladder refused the recorded inputs: {exc}")
    if inputs is not None and decision is not None:
        found = list(_compare(manifest, record, decision, ignore_detail=inputs.counting_was_unavailable))
        differences.extend(found)
        label = decision_label(decision)
        lines.append(
            f"Replay (policy r{manifest.policy_revision}, model {inputs.model.id}, tokenizer "
            f"{inputs.model.tokenizer_digest}, global cap {inputs.global_cap}, in-memory count cache): "
            + (
                f"same decision, {label} at rung {decision.rung}, rendered digest {decision.rendered_digest}."
                if not found
                else f"{label} at rung {decision.rung}, unlike the record ({len(found)} differences)."
            )
        )
    else:
        lines.append("Replay not run: the recorded inputs cannot be reproduced (see the differences).")
    if len(differences) > MAX_DIFFERENCES:
        rest = len(differences) - MAX_DIFFERENCES
        differences = [*differences[:MAX_DIFFERENCES], f"... and {rest} more differences"]
    return ReplayResult(matches=not differences, lines=lines, differences=differences)


# ------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class _Inputs:
    components: Components
    request_id: str
    model: ModelSpec
    max_output: int
    task_policy: TaskPolicy
    global_cap: int
    fallbacks: tuple[ModelSpec, ...]
    counter_for: Callable[[ModelSpec], SegmentCounter]
    counting_was_unavailable: bool


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _inputs(manifest: Manifest, record: dict[str, Any], differences: list[str]) -> _Inputs | None:
    """Rebuild the ladder's inputs as recorded; append to ``differences`` what cannot be reproduced."""
    locked = mapping(record.get("lockedRevisions"))
    final = mapping(record.get("model"))

    try:
        request = AdmissionRequest.from_wire(manifest.request)
    except MalformedRequest as exc:
        differences.append(f"stored request: no longer a valid admission request: {exc}")
        return None
    try:
        components = parse_components(request.components, limits=LIMITS)
    except ComponentError as exc:
        differences.append(f"stored request: components no longer parse: {exc.path}: {exc.message}")
        return None
    for field, recorded, stored in (
        ("requestId", manifest.request_id, request.request_id),
        ("tenantId", manifest.tenant.slug, request.tenant_id),
        ("taskClass", manifest.task_class.slug, request.task_class),
        ("modelPool", manifest.model_pool.slug, request.model_pool),
    ):
        if recorded != stored:
            differences.append(f"stored request: {field} is {stored!r}, the manifest says {recorded!r}")

    found_policy = _task_policy(manifest, differences)
    if found_policy is None:
        return None
    task_policy, policy_cap = found_policy

    requested_name = str(locked.get("requestedModel") or request.model_revision)
    if requested_name != request.model_revision:
        differences.append(
            f"requested model: recorded {requested_name}, the stored request asks {request.model_revision}"
        )
    final_id = str(final.get("id") or locked.get("model") or manifest.model_revision.name)
    digests = _recorded_digests(manifest, locked, final, differences)
    revisions = {
        revision.name: revision
        for revision in ModelRevision.objects.select_related("tokenizer").filter(
            name__in=[requested_name, final_id, *task_policy.fallback_models]
        )
    }
    requested = revisions.get(requested_name)
    if requested is None:
        differences.append(f"requested model {requested_name} no longer exists in the catalog")
        return None
    pool = manifest.model_pool
    model = _spec(requested, pool, digests.get(requested_name), final if requested_name == final_id else {})
    pool_models = set(manifest.model_pool.revisions.values_list("name", flat=True))
    fallbacks = tuple(
        _spec(revisions[name], pool, digests.get(name), final if name == final_id else {})
        for name in task_policy.fallback_models
        if name in revisions and name in pool_models
    )
    for name, digest in digests.items():
        revision = revisions.get(name)
        if revision is not None and revision.tokenizer.digest != digest:
            differences.append(
                f"tokenizer of {name}: recorded {digest}, provisioned now {revision.tokenizer.digest}; "
                "counts under another tokenizer cannot be replayed exactly"
            )
    recorded_template = final.get("templateRevision") or locked.get("templateRevision")
    final_revision = revisions.get(final_id)
    if recorded_template and final_revision is not None:
        try:
            current_template = get_template(final_revision.template_family).revision
        except TemplateError:
            current_template = f"unknown family {final_revision.template_family!r}"
        if current_template != recorded_template:
            differences.append(
                f"template of {final_id}: recorded {recorded_template}, now {current_template}; "
                "the rendering cannot be replayed exactly"
            )

    counter_digest = record.get("counterDigest")
    unavailable = record.get("code") == COUNTING_UNAVAILABLE or (
        isinstance(counter_digest, str) and counter_digest.startswith("upper-bound:")
    )
    current_catalog, _ = catalog.current()
    counter_for: Callable[[ModelSpec], SegmentCounter] = current_catalog.counter_for
    if unavailable:
        counter_for = _unavailable
    elif counter_digest is not None:
        counted_with = (
            model
            if final_id == requested_name
            else next((spec for spec in fallbacks if spec.id == final_id), model)
        )
        try:
            current_catalog.counter_for(counted_with)
        except CountingUnavailable as exc:
            differences.append(
                f"the recorded tokenizer {counted_with.tokenizer_digest} of {counted_with.id} cannot be "
                f"loaded now ({exc}); counts under another tokenizer cannot be replayed exactly"
            )
            return None

    return _Inputs(
        components=components,
        request_id=request.request_id,
        model=model,
        max_output=request.max_output,
        task_policy=task_policy,
        global_cap=_global_cap(record, locked, final, task_policy, policy_cap),
        fallbacks=fallbacks,
        counter_for=counter_for,
        counting_was_unavailable=unavailable,
    )


def _recorded_provider_counts(record: dict[str, Any]) -> ProviderCount:
    """The provider counts the decision recorded, by payload digest: a replay never calls a counting API, and
    a payload it would count that the record does not have is counting unavailable (a difference)."""
    counts: dict[str, int] = {}
    for item in record.get("providerCounts") or ():
        digest, tokens = mapping(item).get("payloadDigest"), _int(mapping(item).get("tokens"))
        if isinstance(digest, str) and tokens is not None:
            counts[digest] = tokens

    def count(spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
        if digest not in counts:
            raise CountingUnavailable(f"no provider count of payload {digest} is on record")
        return counts[digest]

    return count


def _unavailable(spec: ModelSpec) -> SegmentCounter:
    raise CountingUnavailable(f"counting was unavailable when {spec.id} was admitted (replayed as such)")


def _task_policy(manifest: Manifest, differences: list[str]) -> tuple[TaskPolicy, int] | None:
    """The recorded policy version's task policy (the default one when the version omits the task class)
    and its global cap."""
    if manifest.policy_revision is None:
        differences.append("the manifest records no policy revision")
        return None
    version = PolicyVersion.objects.filter(revision=manifest.policy_revision).first()
    if version is None:
        differences.append(f"policy revision {manifest.policy_revision} no longer exists")
        return None
    try:
        policy = parse_policy(version.document)
    except PolicyError as exc:
        differences.append(f"policy revision {manifest.policy_revision} no longer parses: {exc}")
        return None
    task_policy = policy.task_classes.get(manifest.task_class.slug)
    return task_policy or catalog.default_task_policy(manifest.task_class), policy.global_max_input_tokens


def _recorded_digests(
    manifest: Manifest, locked: dict[str, Any], final: dict[str, Any], differences: list[str]
) -> dict[str, str]:
    """Tokenizer digest by model id, as recorded (only the model that answered has one on record)."""
    final_id = final.get("id") or locked.get("model")
    seen = {
        "manifest column": manifest.tokenizer_digest,
        "lockedRevisions.tokenizerDigest": locked.get("tokenizerDigest"),
        "model.tokenizerDigest": final.get("tokenizerDigest"),
    }
    values = {value for value in seen.values() if value}
    if len(values) > 1:
        differences.append(
            "recorded tokenizer digests disagree: " + ", ".join(f"{k} {v}" for k, v in seen.items() if v)
        )
    digest = final.get("tokenizerDigest") or locked.get("tokenizerDigest") or manifest.tokenizer_digest
    return {str(final_id): str(digest)} if final_id and digest else {}


def _spec(
    revision: ModelRevision, pool: ModelPool, digest: str | None, recorded: Mapping[str, Any]
) -> ModelSpec:
    """The model as the ladder saw it in ``pool``: its recorded tokenizer digest, window and output cap when
    on record."""
    spec = catalog.model_spec(revision, pool)
    if digest and digest != spec.tokenizer_digest:
        tokenizer = Tokenizer.objects.filter(digest=digest).first()
        rule = tokenizer.upper_bound_rule if tokenizer is not None else revision.tokenizer.upper_bound_rule
        spec = replace(spec, tokenizer_digest=digest, upper_bound=cast(UpperBoundRule, rule) or None)
    window, max_output = _int(recorded.get("contextWindow")), _int(recorded.get("maxOutput"))
    if window is not None and max_output is not None and window > 0 and max_output > 0:
        spec = replace(spec, context_window=window, max_output=max_output)
    return spec


def _global_cap(
    record: dict[str, Any],
    locked: dict[str, Any],
    final: dict[str, Any],
    task_policy: TaskPolicy,
    policy_cap: int,
) -> int:
    """The global per-request cap in force at admission.

    Taken from ``lockedRevisions.globalCap`` when recorded. Otherwise it is the recorded policy's cap, lowered
    to the recorded budget when that budget is below both the model's room (window - output) and the task's
    input cap: then only the global cap (a rollback floor) can have set it.
    """
    recorded = _int(locked.get("globalCap"))
    if recorded is not None and recorded > 0:
        return recorded
    cap = policy_cap
    budget = _int(record.get("budget"))
    window, max_output = _int(final.get("contextWindow")), _int(record.get("maxOutput"))
    if budget is not None and window is not None and max_output is not None:
        room = min(window - max_output, task_policy.input_cap)
        if 0 < budget < room:
            cap = min(cap, budget)
    return cap


# ------------------------------------------------------------------------------------------------ compare


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 1] + "…"


def _diff(path: str, recorded: object, replayed: object) -> Iterator[str]:
    if isinstance(recorded, Mapping) and isinstance(replayed, Mapping):
        for key in sorted(set(recorded) | set(replayed), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in recorded:
                yield f"{sub}: not recorded, replayed {_show(replayed[key])}"
            elif key not in replayed:
                yield f"{sub}: recorded {_show(recorded[key])}, absent from the replay"
            else:
                yield from _diff(sub, recorded[key], replayed[key])
        return
    if (
        isinstance(recorded, list)
        and isinstance(replayed, list)
        and len(recorded) == len(replayed)
        and all(isinstance(item, Mapping) for item in [*recorded, *replayed])
    ):
        for index, (a, b) in enumerate(zip(recorded, replayed, strict=True)):
            yield from _diff(f"{path}[{index}]", a, b)
        return
    if recorded != replayed or type(recorded) is not type(replayed):
        yield f"{path}: recorded {_show(recorded)}, replayed {_show(replayed)}"


def _compare(
    manifest: Manifest, record: dict[str, Any], decision: Decision, *, ignore_detail: bool
) -> Iterator[str]:
    """Every difference between the manifest (columns and record) and the replayed decision."""
    count = decision.count
    columns: tuple[tuple[str, object, object], ...] = (
        ("decision", manifest.decision, decision_label(decision)),
        ("rung", manifest.rung, decision.rung),
        ("model revision", manifest.model_revision.name, decision.model.id),
        ("tokenizer digest", manifest.tokenizer_digest, decision.model.tokenizer_digest),
        ("rendered digest", manifest.rendered_digest, decision.rendered_digest),
        ("input tokens", manifest.input_tokens, 0 if count is None else count.total),
        ("count method", manifest.count_method, decision.count_method or ""),
    )
    for name, recorded, replayed in columns:
        if recorded != replayed:
            yield f"manifest {name}: recorded {_show(recorded)}, replayed {_show(replayed)}"
    recorded_record = {key: value for key, value in record.items() if key != "lockedRevisions"}
    replayed_record = decision_manifest(decision)
    if ignore_detail:
        # Why counting was unavailable (a missing file, a timeout) is the environment's, not the ladder's.
        recorded_record.pop("detail", None)
        replayed_record.pop("detail", None)
    yield from _diff("", recorded_record, replayed_record)


# ---------------------------------------------------------------------------------------------- explanation
