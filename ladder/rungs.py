"""The pure parts of the rungs: which objects a rung may remove, replace or switch, and in what order.

Nothing here counts tokens; ``ladder.decide`` applies these choices, re-renders and recounts after each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ladder.components import Compaction, Components, EvidenceItem, ImagePart, Parts, Tool, Turn
from ladder.counting import IMAGE_FORMULAS, UPPER_BOUND_RULES, ImageFormula, UpperBoundRule
from ladder.policy import CompactionGate, MinimumEvidence
from ladder.templates import TEMPLATE_FAMILIES

CAPABILITIES: frozenset[str] = frozenset({"tools", "json_schema", "vision"})


@dataclass(frozen=True)
class ModelSpec:
    """A model revision as the ladder needs it.

    ``upper_bound`` names the approved bound of its tokenizer (``ladder.counting.upper_bound_rule``), or is
    None when there is none, in which case a policy's ``UPPER_BOUND`` fallback cannot be used for this model.
    """

    id: str
    context_window: int
    max_output: int
    template_family: str
    image_formula: ImageFormula
    capabilities: frozenset[str]
    data_residency: str
    safety_tier: int
    tokenizer_digest: str
    upper_bound: UpperBoundRule | None = None
    provider_counter: str | None = None
    """The provider counting API that counts this model's final payload (``anthropic``, ``gemini``,
    ``openai``), or None when its local tokenizer is exact. With one, ``tokenizer_digest`` names the local
    tokenizer the ladder walks with, calibrated on the provider's counts."""
    bound_counter: str | None = None
    """For a model whose local tokenizer is exact: the provider counting API that counts a final payload
    whose rendering holds ``Bound`` pieces (framing its vendor does not publish: OpenAI's tools, response
    format, tool calls and results), or None, and such a payload is counted ``UPPER_BOUND``. The walk counts
    with the local bound; the payload it ends on is counted by the API."""

    def __post_init__(self) -> None:
        """Raises ValueError for non-positive sizes, an unknown family, formula, capability or bound rule."""
        if self.context_window <= 0 or self.max_output <= 0:
            raise ValueError(f"model {self.id}: context_window and max_output must be positive")
        if self.template_family not in TEMPLATE_FAMILIES:
            raise ValueError(f"model {self.id}: unknown template family {self.template_family!r}")
        if self.image_formula not in IMAGE_FORMULAS:
            raise ValueError(f"model {self.id}: unknown image formula {self.image_formula!r}")
        if not self.capabilities <= CAPABILITIES:
            raise ValueError(
                f"model {self.id}: unknown capabilities {sorted(self.capabilities - CAPABILITIES)}"
            )
        if self.upper_bound is not None and self.upper_bound not in UPPER_BOUND_RULES:
            raise ValueError(f"model {self.id}: unknown upper-bound rule {self.upper_bound!r}")


# ---------------------------------------------------------------------------------------------- authorization


def exclude_not_permitted(
    evidence: Sequence[EvidenceItem], granted: frozenset[str]
) -> tuple[tuple[EvidenceItem, ...], tuple[EvidenceItem, ...]]:
    """Split evidence into (permitted, not permitted): an item needs every one of its permissions granted."""
    permitted = tuple(item for item in evidence if item.permissions <= granted)
    refused = tuple(item for item in evidence if not item.permissions <= granted)
    return permitted, refused


# -------------------------------------------------------------------------------------------------- evidence


def _ranked(evidence: Sequence[EvidenceItem]) -> list[tuple[int, EvidenceItem]]:
    """Best first: higher score, then earlier position."""
    return sorted(enumerate(evidence), key=lambda entry: (-entry[1].score, entry[0]))


def dedup_evidence(
    evidence: Sequence[EvidenceItem],
) -> tuple[tuple[EvidenceItem, ...], tuple[tuple[EvidenceItem, str], ...]]:
    """Return (kept, removed) where removed pairs each dropped copy with the id of the copy kept.

    Copies are items with the same content parts and the same permission set; the best-ranked copy is kept.
    A ``minimumRetention`` copy is never removed, even when it duplicates a better-ranked one. The parts are
    compared as they are (frozen values, equal exactly when their JSON is): a digest of each item's JSON cost
    about 10 µs an item, 2 ms of a 200-item count here.
    """
    keeper: dict[tuple[Parts, frozenset[str]], str] = {}
    removed: dict[str, str] = {}
    for _, item in _ranked(evidence):
        group = (item.parts, item.permissions)
        if group not in keeper:
            keeper[group] = item.id
        elif not item.minimum_retention:
            removed[item.id] = keeper[group]
    kept = tuple(item for item in evidence if item.id not in removed)
    dropped = tuple((item, removed[item.id]) for item in evidence if item.id in removed)
    return kept, dropped


def minimum_evidence_ids(evidence: Sequence[EvidenceItem], rule: MinimumEvidence) -> frozenset[str]:
    """Return the minimum evidence set: each ``minimumRetention`` item, topped up to ``min_items`` by rank."""
    chosen = {item.id for item in evidence if item.minimum_retention}
    for _, item in _ranked(evidence):
        if len(chosen) >= rule.min_items:
            break
        chosen.add(item.id)
    return frozenset(chosen)


def trim_order(evidence: Sequence[EvidenceItem], minimum: frozenset[str]) -> tuple[EvidenceItem, ...]:
    """Return the items TRIM_EVIDENCE may drop, in the order it drops them.

    Lowest score first, and among equal scores the later item first. Items of the minimum set are never in
    it, whatever their score.
    """
    return tuple(item for _, item in reversed(_ranked(evidence)) if item.id not in minimum)


# --------------------------------------------------------------------------------------------------- history

OTHER_REQUEST = "OTHER_REQUEST"
GATE_NOT_APPROVED = "GATE_NOT_APPROVED"
BELOW_FIDELITY_THRESHOLD = "BELOW_FIDELITY_THRESHOLD"
TURNS_NOT_PRESENT = "TURNS_NOT_PRESENT"
SPLITS_TOOL_CALL = "SPLITS_TOOL_CALL"


def compaction_order(compactions: Sequence[Compaction]) -> tuple[Compaction, ...]:
    """Oldest history first: by the first turn replaced, then by position in the request."""
    ordered = sorted(enumerate(compactions), key=lambda entry: (entry[1].replaces_turns[0], entry[0]))
    return tuple(compaction for _, compaction in ordered)


def splits_tool_unit(turns: Sequence[Turn], replaced: frozenset[int]) -> bool:
    """True if replacing ``replaced`` keeps a tool call without its result, or a result without its call."""
    call_turn: dict[str, int] = {}
    for turn in turns:
        for call in turn.tool_calls:
            call_turn[call.id] = turn.turn
    for turn in turns:
        for result in turn.tool_results:
            origin = call_turn.get(result.call_id)
            if origin is None or (origin in replaced) != (turn.turn in replaced):
                return True
    return False


def compaction_refusal(
    compaction: Compaction, turns: Sequence[Turn], *, request_id: str, gate: CompactionGate
) -> str | None:
    """Return why ``compaction`` may not replace turns now, or None if it may.

    It must be bound to this request, come from an approved gate with a fidelity score at or above the
    threshold, replace turns that are all still present, and not split a tool call from its result.
    """
    if compaction.request_id != request_id:
        return OTHER_REQUEST
    if compaction.gate_id not in gate.approved_gates:
        return GATE_NOT_APPROVED
    if compaction.fidelity_score < gate.fidelity_threshold:
        return BELOW_FIDELITY_THRESHOLD
    present = {turn.turn for turn in turns}
    if not set(compaction.replaces_turns) <= present:
        return TURNS_NOT_PRESENT
    if splits_tool_unit(turns, frozenset(compaction.replaces_turns)):
        return SPLITS_TOOL_CALL
    return None


def apply_compaction(components: Components, compaction: Compaction) -> Components:
    """Return ``components`` with the turns of ``compaction`` replaced by it."""
    replaced = set(compaction.replaces_turns)
    turns = tuple(turn for turn in components.recent_turns if turn.turn not in replaced)
    return replace(components, recent_turns=turns, compactions=(*components.compactions, compaction))


# ----------------------------------------------------------------------------------------------------- tools


def essential_tool_names(tools: Sequence[Tool], policy_essential: frozenset[str]) -> frozenset[str]:
    """Tools marked essential by the request or named essential by the policy."""
    return frozenset(tool.name for tool in tools if tool.essential) | policy_essential


# ------------------------------------------------------------------------------------------------ fallbacks


def _has_image(parts: Parts) -> bool:
    return any(isinstance(part, ImagePart) for part in parts)


def required_capabilities(components: Components) -> frozenset[str]:
    """Return the capabilities a model needs for these components.

    ``tools`` (tool definitions, or tool calls in history), ``json_schema`` (an output schema) and ``vision``
    (any image part).
    """
    needs: set[str] = set()
    if components.tools or any(turn.tool_calls or turn.tool_results for turn in components.recent_turns):
        needs.add("tools")
    if components.output_schema_json is not None:
        needs.add("json_schema")
    groups: list[Parts] = [*components.immutable_rules, *components.output_safety, components.question]
    groups.extend(item.parts for item in components.evidence)
    groups.extend(compaction.parts for compaction in components.compactions)
    for turn in components.recent_turns:
        groups.append(turn.parts)
        groups.extend(result.parts for result in turn.tool_results)
    if any(_has_image(parts) for parts in groups):
        needs.add("vision")
    return frozenset(needs)


def incompatibilities(
    original: ModelSpec, candidate: ModelSpec, components: Components, max_output: int
) -> tuple[str, ...]:
    """Return every dimension in which ``candidate`` cannot stand in for ``original`` (empty: compatible).

    Dimensions: ``capabilities:tools`` / ``capabilities:vision`` (needed by the components), ``outputSchema``
    (a schema needs structured output), ``dataResidency`` (must be equal), ``safetyTier`` (must not be lower),
    ``maxOutput`` (the output already granted must still fit).
    """
    needs = required_capabilities(components)
    failed: list[str] = []
    for capability in ("tools", "vision"):
        if capability in needs and capability not in candidate.capabilities:
            failed.append(f"capabilities:{capability}")
    if "json_schema" in needs and "json_schema" not in candidate.capabilities:
        failed.append("outputSchema")
    if candidate.data_residency != original.data_residency:
        failed.append("dataResidency")
    if candidate.safety_tier < original.safety_tier:
        failed.append("safetyTier")
    if candidate.max_output < max_output:
        failed.append("maxOutput")
    return tuple(failed)
