"""The state a decision walks the ladder with: its fixed request, routes and counting targets, and the walk.

``Walk`` is where the ladder stands (target, state, count) and the one argument of every rung in
``ladder.decide``; ``End`` is where a decision stopped, what its ``Decision`` is built from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ladder.components import Components, EvidenceItem
from ladder.counting import Count, CountCache, CountingUnavailable, SegmentCounter, count_stream
from ladder.decision import CandidateCheck, LadderStep, RemovedObject
from ladder.messages import RenderMemo
from ladder.policy import Rung, TaskPolicy
from ladder.rungs import ModelSpec
from ladder.templates import ChatTemplate, get_template


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
    ``counts`` (this counter's counts under this template) only save work across the walk's recounts.
    """

    route: Route
    counter: SegmentCounter
    cache: CountCache
    render_memo: RenderMemo = field(default_factory=RenderMemo)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def model(self) -> ModelSpec:
        return self.route.model

    @property
    def budget(self) -> int:
        return self.route.budget

    def count(self, components: Components) -> Count:
        pieces = self.route.template.render(components, self.render_memo)
        return count_stream(
            pieces,
            self.counter,
            self.cache,
            template_revision=self.route.template.revision,
            image_formula=self.route.model.image_formula,
            memo=self.counts,
        )


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

    @property
    def route(self) -> Route:
        """The route to the requested model."""
        return self.route_to(self.model)

    def route_to(self, model: ModelSpec) -> Route:
        """Return the route to ``model``; its budget may be zero or negative (then nothing fits)."""
        max_output = min(self.requested_max_output, self.policy.output_cap, model.max_output)
        budget = min(model.context_window - max_output, self.policy.input_cap, self.global_cap)
        return Route(model, get_template(model.template_family), max_output, budget)

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
