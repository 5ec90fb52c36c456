"""The state a decision walks the ladder with: its fixed request, routes and counting targets, and the walk.

``Walk`` is where the ladder stands (target, state, count) and the one argument of every rung in
``ladder.decide``; ``End`` is where a decision stopped, what its ``Decision`` is built from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from ladder.components import Components, EvidenceItem
from ladder.counting import (
    Count,
    CountCache,
    CountingUnavailable,
    SegmentCounter,
    TextCounts,
    count_stream,
    rendered_digest,
    with_total,
)
from ladder.decision import CandidateCheck, LadderStep, RemovedObject
from ladder.messages import RenderMemo
from ladder.policy import Rung, TaskPolicy
from ladder.rungs import ModelSpec
from ladder.templates import ChatTemplate, get_template

ProviderCount = Callable[[ModelSpec, Mapping[str, object], str], int]
"""Counts a final payload (``ladder.decide``'s, with ``model`` and ``max_tokens``; its rendered digest is the
third argument) through the model's provider counting API. Raises CountingUnavailable when the API cannot
answer (timeout, 429, 5xx, open circuit)."""


@dataclass
class Scale:
    """How a provider counts relative to the local tokenizer the walk counts with: provider / local."""

    ratio: Fraction = Fraction(1)

    def apply(self, count: Count) -> Count:
        """``count`` scaled to the provider's measure (rounded up), buckets and objects apportioned."""
        if self.ratio == 1:
            return count
        scaled = -(-count.total * self.ratio.numerator // self.ratio.denominator)
        return with_total(count, scaled, count.method)


@dataclass(frozen=True)
class Route:
    """A model with its template, the output it grants and the input budget that leaves."""

    model: ModelSpec
    template: ChatTemplate
    max_output: int
    budget: int


@dataclass(frozen=True, eq=False)
class Target:
    """A route with the counter that counts for it.

    ``render_memo`` (shared by every target of one walk: messages do not depend on the template) and
    ``counts`` (this counter's counts under this template) only save work across the walk's recounts;
    ``known``, the process's counts by text, saves it across requests.
    """

    route: Route
    counter: SegmentCounter
    cache: CountCache
    render_memo: RenderMemo = field(default_factory=RenderMemo)
    counts: dict[str, int] = field(default_factory=dict)
    scale: Scale | None = None
    """For a provider-counted model: local counts are scaled by what the provider answered so far."""
    known: TextCounts | None = None

    @property
    def model(self) -> ModelSpec:
        return self.route.model

    @property
    def budget(self) -> int:
        return self.route.budget

    def count(self, components: Components) -> Count:
        local = self.local_count(components)
        if self.scale is None or not provider_counted(self.model, local):
            return local
        return self.scale.apply(local)

    def local_count(self, components: Components) -> Count:
        """The count of the local tokenizer, unscaled."""
        pieces = self.route.template.render(components, self.render_memo)
        return count_stream(
            pieces,
            self.counter,
            self.cache,
            template_revision=self.route.template.revision,
            image_formula=self.route.model.image_formula,
            memo=self.counts,
            known=self.known,
        )


def provider_counted(model: ModelSpec, local: Count) -> bool:
    """Whether the provider counts a payload of ``model`` whose local count is ``local``: always for a
    provider-counted model, and for a model with a ``bound_counter`` when the local count is only a bound."""
    if model.provider_counter is not None:
        return True
    return model.bound_counter is not None and local.method == "UPPER_BOUND"


def final_payload(route: Route, components: Components, memo: RenderMemo | None = None) -> dict[str, object]:
    """The payload a decision answers: the template's, with the model id and the output it grants."""
    payload = dict(route.template.payload(components, memo))
    payload["model"] = route.model.id
    payload["max_tokens"] = route.max_output
    return payload


@dataclass
class Calibration:
    """The provider counts of one decision: each payload counted at most once, and each provider-counted
    model's scale, set by the latest payload the provider counted for it."""

    provider_count: ProviderCount
    scales: dict[str, Scale] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)
    """Provider counts by rendered digest of the payload (in the order they were asked)."""
    states: dict[int, tuple[Components, ModelSpec, str]] = field(default_factory=dict)
    """The payload digest of each state measured, by identity (a state measured twice is digested once)."""

    def scale_for(self, model: ModelSpec) -> Scale | None:
        """The scale of ``model`` (shared by every target of it), or None for a model no provider counts."""
        if model.provider_counter is None and model.bound_counter is None:
            return None
        return self.scales.setdefault(model.id, Scale())

    def measure(self, target: Target, components: Components) -> int:
        """The provider's count of ``components`` on ``target`` (asked once per payload); the model's scale
        becomes provider / local for it. Raises CountingUnavailable."""
        seen = self.states.get(id(components))
        if seen is not None and seen[0] is components and seen[1] is target.model:
            digest = seen[2]
        else:
            payload = final_payload(target.route, components, target.render_memo)
            digest = rendered_digest(payload)
            if digest not in self.counted:
                remote = self.provider_count(target.model, payload, digest)
                if type(remote) is not int or remote < 0:
                    raise ValueError("provider count returned a malformed answer")
                self.counted[digest] = remote
            # The state itself is kept with its digest, so its id cannot be reused by another while here.
            self.states[id(components)] = (components, target.model, digest)
        remote = self.counted[digest]
        local = target.local_count(components).total
        scale = self.scale_for(target.model)
        if scale is not None and local > 0:
            scale.ratio = Fraction(remote, local)
        return remote


@dataclass(frozen=True, eq=False)
class Request:
    """One decision's inputs, fixed while it is made.

    ``base`` is the FULL state: the request with only its permitted evidence and no compaction applied.
    ``refused`` is the evidence the authorization scope does not cover. ``fallbacks`` are in the policy's
    order.
    """

    components: Components
    request_id: str
    model: ModelSpec
    requested_max_output: int
    policy: TaskPolicy
    global_cap: int
    fallbacks: tuple[ModelSpec, ...]
    counter_for: Callable[[ModelSpec], SegmentCounter]
    base: Components
    refused: tuple[EvidenceItem, ...]
    digests_before: dict[str, str]
    calibration: Calibration | None = None
    """Present when a provider counting API is available: provider-counted models are counted by it."""
    known: TextCounts | None = None
    """The process's segment counts by text (``count_stream``), or None."""

    @property
    def route(self) -> Route:
        """The route to the requested model."""
        return self.route_to(self.model)

    def route_to(self, model: ModelSpec) -> Route:
        """Return the route to ``model``; its budget may be zero or negative (then nothing fits)."""
        max_output = min(self.requested_max_output, self.policy.output_cap, model.max_output)
        budget = min(model.context_window - max_output, self.policy.input_cap, self.global_cap)
        return Route(model, get_template(model.template_family), max_output, budget)

    def target(self, model: ModelSpec, cache: CountCache, render_memo: RenderMemo) -> Target:
        """The target counting for ``model``: its exact counter, scaled when the provider counts it.

        Raises CountingUnavailable (the exact counter cannot load, or the model is provider-counted and no
        provider counting is available).
        """
        scale = None
        if model.provider_counter is not None and self.calibration is None:
            raise CountingUnavailable(f"{model.id} is counted by {model.provider_counter}; no counting API")
        if self.calibration is not None:
            scale = self.calibration.scale_for(model)
        return Target(
            self.route_to(model), self.exact_counter(model), cache, render_memo, scale=scale, known=self.known
        )

    def exact_counter(self, model: ModelSpec) -> SegmentCounter:
        """Return the exact counter of ``model``.

        Raises CountingUnavailable, also when the counter found is another file's or only a bound.
        """
        counter = self.counter_for(model)
        if counter.digest != model.tokenizer_digest or counter.method != "EXACT":
            found = f"{counter.digest} ({counter.method})"
            raise CountingUnavailable(f"counter {found} is not the exact counter of {model.tokenizer_digest}")
        return counter


@dataclass
class Walk:
    """The shared state of one decision's walk, the one argument of every rung.

    ``request`` is fixed; ``target``, ``state`` and ``count`` are where the ladder stands, and the rungs move
    them, recording each application in ``steps`` and each object left out in ``removed``.
    """

    request: Request
    target: Target
    state: Components
    count: Count
    tried: list[Rung] = field(default_factory=lambda: ["FULL"])
    steps: list[LadderStep] = field(default_factory=list)
    removed: list[RemovedObject] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the state's count is within the current target's input budget."""
        return self.count.total <= self.target.budget

    def step(
        self,
        rung: Rung,
        before: int,
        reason: str,
        *,
        removed: Sequence[str] = (),
        replaced: Sequence[str] = (),
        added: Sequence[str] = (),
        candidates: Sequence[CandidateCheck] = (),
    ) -> None:
        """Record one application of ``rung``, from ``before`` tokens to the current count."""
        self.steps.append(
            LadderStep(
                rung=rung,
                removed_ids=tuple(removed),
                replaced_ids=tuple(replaced),
                reason=reason,
                tokens_before=before,
                tokens_after=self.count.total,
                model_id=self.target.model.id,
                added_ids=tuple(added),
                candidates=tuple(candidates),
            )
        )

    def end(self) -> End:
        """Where the walk stands now, as a decision ends on it."""
        return End(
            self.target.route,
            self.state,
            self.count,
            self.target.counter.digest,
            self.target.render_memo,
            tuple(self.tried),
            tuple(self.steps),
            tuple(self.removed),
        )


@dataclass(frozen=True)
class End:
    """Where a decision stopped: route and state, their count (None: not counted) and what the walk did."""

    route: Route
    state: Components
    count: Count | None = None
    counter_digest: str | None = None
    memo: RenderMemo | None = None
    tried: tuple[Rung, ...] = ("FULL",)
    steps: tuple[LadderStep, ...] = ()
    removed: tuple[RemovedObject, ...] = ()
