"""The camelCase JSON shapes of the ladder's values: API decision fields, manifest record, request form.

This is the ladder's edge: the core's values carry no wire names, and a change here changes what the API
answers and what manifests record (a manifest is replayed against ``decision_manifest``, so its shape is
compared key by key).
"""

from __future__ import annotations

import json

from ladder.components import DIGESTED, Components, bucket_value, tool_json
from ladder.counting import Count
from ladder.decide import ESTIMATOR_REVISION
from ladder.decision import CandidateCheck, Decision, LadderStep, RemovedObject

# The request's order of the buckets ``components_json`` takes from their digest form unchanged.
_REQUEST_BUCKETS: tuple[str, ...] = (
    "immutableRules",
    "authorizationScope",
    "outputSafety",
    "question",
    "trustedState",
    "evidence",
    "recentTurns",
    "compactions",
)


def components_json(components: Components) -> dict[str, object]:
    """Return the request form of ``components``; ``parse_components`` of it gives back an equal value.

    The ladder-only ``workflow_instruction`` is not part of the request format and is left out.
    """
    data = {name: bucket_value(components, name) for name in _REQUEST_BUCKETS}
    data["question"] = {"parts": data["question"]}
    data["tools"] = [tool_json(tool) for tool in components.tools]
    if components.output_schema_json is not None:
        data["outputSchema"] = json.loads(components.output_schema_json)
    return data


def _candidate_json(candidate: CandidateCheck) -> dict[str, object]:
    return {
        "modelId": candidate.model_id,
        "failed": list(candidate.failed),
        "tokens": candidate.tokens,
        "budget": candidate.budget,
    }


def step_json(step: LadderStep) -> dict[str, object]:
    """Return the JSON form of one ladder step (responses, problems and manifests)."""
    return {
        "rung": step.rung,
        "removedIds": list(step.removed_ids),
        "replacedIds": list(step.replaced_ids),
        "addedIds": list(step.added_ids),
        "reason": step.reason,
        "tokensBefore": step.tokens_before,
        "tokensAfter": step.tokens_after,
        "modelId": step.model_id,
        "candidates": [_candidate_json(candidate) for candidate in step.candidates],
    }


def _removed_json(item: RemovedObject) -> dict[str, object]:
    return {
        "id": item.id,
        "bucket": item.bucket,
        "reason": item.reason,
        "rung": item.rung,
        "detail": item.detail,
    }


def _count_json(count: Count) -> dict[str, object]:
    return {
        "total": count.total,
        "buckets": dict(count.per_bucket),
        "objects": dict(count.per_object),
        "method": count.method,
        "specials": count.specials,
    }


def decision_response(decision: Decision) -> dict[str, object]:
    """Return the decision fields of the admission / count API responses."""
    body: dict[str, object] = {
        "fits": decision.admitted,
        "rung": decision.rung,
        "tokens": {
            "input": None if decision.count is None else decision.count.total,
            "maxOutput": decision.max_output,
            "buckets": decision.buckets(),
        },
        "countMethod": decision.count_method,
        "renderedDigest": decision.rendered_digest,
        "budget": decision.budget,
        "modelRevision": decision.model.id,
        "removed": [_removed_json(item) for item in decision.removed],
        "excluded": [_removed_json(item) for item in decision.excluded],
    }
    if not decision.admitted:
        body.update(
            {
                "code": decision.code,
                "detail": decision.detail,
                "minimumTokensNeeded": decision.minimum_tokens_needed,
                "rungsTried": list(decision.rungs_tried),
                "recommendations": list(decision.recommendations),
            }
        )
    return body


def decision_manifest(decision: Decision) -> dict[str, object]:
    """Return the replayable record of a decision (JSON-able; equal for equal inputs)."""
    per_bucket = decision.buckets()
    model = decision.model
    return {
        "estimatorRevision": ESTIMATOR_REVISION,
        "requestId": decision.request_id,
        "admitted": decision.admitted,
        "code": decision.code,
        "detail": decision.detail,
        "rung": decision.rung,
        "originalModelId": decision.original_model_id,
        "model": {
            "id": model.id,
            "tokenizerDigest": model.tokenizer_digest,
            "templateRevision": decision.template_revision,
            "contextWindow": model.context_window,
            "maxOutput": model.max_output,
        },
        "counterDigest": decision.counter_digest,
        "countMethod": decision.count_method,
        "maxOutput": decision.max_output,
        "budget": decision.budget,
        "tokens": None if decision.count is None else _count_json(decision.count),
        "components": {
            name: {
                "digestBefore": decision.digests_before[name],
                "digestAfter": decision.digests_after[name],
                "tokens": per_bucket.get(name),
            }
            for name in DIGESTED
        },
        "hardBucketChanges": decision.hard_bucket_changes,
        "steps": [step_json(step) for step in decision.steps],
        "removed": [_removed_json(item) for item in decision.removed],
        "excluded": [_removed_json(item) for item in decision.excluded],
        "renderedDigest": decision.rendered_digest,
        "minimumTokensNeeded": decision.minimum_tokens_needed,
        "rungsTried": list(decision.rungs_tried),
        "recommendations": list(decision.recommendations),
        "providerCounts": [{"payloadDigest": digest, "tokens": n} for digest, n in decision.provider_counts],
    }
