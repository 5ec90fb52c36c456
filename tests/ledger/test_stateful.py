"""A Hypothesis state machine drives random sequences of admissions and lifecycle calls against the real
database and a pure Python model of the ledger, and checks after every step that the two agree, that balances
equal the sum of their entries, that the conservation equation holds and that no account is overspent — in
tokens and in money: every admission is priced, the tenant account has a spend limit, and the model holds,
posts and releases money as SPEC §5 says (at prices that make every figure round)."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from budgeting.catalog.errors import Conflict
from budgeting.catalog.models import Price
from budgeting.catalog.prices import FrozenPrice, cost
from ledger.errors import InvalidTransition, QuotaExceeded, StaleFence, UsageEventConflict
from ledger.models import CapacityAccount, Reservation
from ledger.selectors import audit
from ledger.services import lifecycle
from tests.ledger.helpers import admit, catalog, now, pool_account, spec, tenant_account

INPUT_LIMIT = 3000
OUTPUT_LIMIT = 2000
CONCURRENCY = 3
OUT = 100
SPEND_LIMIT = 1200  # micro-dollars: binds beside the token limits
IN_PRICE, OUT_PRICE = 333_333, 1_777_777  # micro-dollars per million tokens: every cost rounds up


@dataclass
class Model:
    """What one reservation should be, by the rules of SPEC §5."""

    key: str
    input: int
    state: str = "RESERVED"
    consumed: int = 0
    output: int = OUT
    top_ups: int = 0
    captured: int = 0
    remaining: int = OUT
    released: int = 0
    overrun: int = 0
    held: bool = True
    dispatched: bool = False
    reason: str = ""
    # The requestSent a repeat of the failure must say to be answered as one ("" for any: before dispatch).
    failed_as: str = ""
    events: dict[str, tuple[int, bool]] = field(default_factory=dict)
    top_up_ids: dict[str, int] = field(default_factory=dict)
    s_reserved: int = 0
    s_captured: int = 0
    s_remaining: int = 0
    s_released: int = 0
    s_overrun: int = 0

    def post_money(self) -> None:
        """Bring the money posted to what the consumed tokens cost, from the hold (beyond it, an overrun)."""
        target = cost(self.consumed, IN_PRICE) + cost(self.captured + self.overrun, OUT_PRICE)
        delta = target - self.s_captured - self.s_overrun
        if delta > 0:
            take = min(delta, self.s_remaining)
            self.s_captured += take
            self.s_remaining -= take
            self.s_overrun += delta - take
        elif delta < 0:
            from_overrun = min(-delta, self.s_overrun)
            self.s_overrun -= from_overrun
            self.s_captured -= -delta - from_overrun
            if self.state == "SETTLED":
                self.s_released += -delta - from_overrun
            else:
                self.s_remaining += -delta - from_overrun

    def release_money(self) -> None:
        self.s_released += self.s_remaining
        self.s_remaining = 0


class LedgerMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        # Examples share the database (ledger rows cannot be deleted); each gets its own tenant and pool.
        self.cat = catalog(tenant_slug=f"t-{uuid.uuid4().hex[:8]}", pool_slug=f"p-{uuid.uuid4().hex[:8]}")
        self.tenant = tenant_account(
            self.cat,
            input_limit=INPUT_LIMIT,
            output_limit=OUTPUT_LIMIT,
            concurrency_limit=CONCURRENCY,
            spend_limit=SPEND_LIMIT,
        )
        self.pool = pool_account(self.cat)
        self.price = FrozenPrice.of(
            Price.objects.create(
                model_revision=self.cat.model,
                effective_from=datetime(2026, 1, 1, tzinfo=UTC),
                input_per_million=Decimal(IN_PRICE) / 1_000_000,
                output_per_million=Decimal(OUT_PRICE) / 1_000_000,
            )
        )
        self.models: dict[uuid.UUID, Model] = {}
        self.ids = [self.cat.tenant.pk]

    # --- the model's view of the tenant account -----------------------------------------------------------

    def expected(self) -> tuple[int, int, int, int, int, int, int]:
        ms = self.models.values()
        return (
            sum(m.input for m in ms if m.state == "RESERVED"),
            sum(m.remaining for m in ms),
            sum(m.consumed for m in ms),
            sum(m.captured + m.overrun for m in ms),
            sum(1 for m in ms if m.held),
            sum(m.s_remaining for m in ms),
            sum(m.s_captured + m.s_overrun for m in ms),
        )

    def spec(self, key: str, size: int):
        return dataclasses.replace(
            spec(self.cat, key=key, input_tokens=size, output_tokens=OUT), price=self.price
        )

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs), None
        except (InvalidTransition, QuotaExceeded, StaleFence, Conflict) as exc:
            return None, exc

    # --- rules --------------------------------------------------------------------------------------------

    @rule(target=reservations, size=st.integers(1, 1500))
    def admit(self, size):
        e = self.expected()
        hold = cost(size, IN_PRICE) + cost(OUT, OUT_PRICE)
        fits = (
            e[0] + e[2] + size <= INPUT_LIMIT
            and e[1] + e[3] + OUT <= OUTPUT_LIMIT
            and e[4] + 1 <= CONCURRENCY
            and e[5] + e[6] + hold <= SPEND_LIMIT
        )
        key = uuid.uuid4().hex
        result, err = self._call(admit, self.spec(key, size))
        assert (err is None) == fits, (err, e, size)
        if result is None:
            return uuid.uuid4()
        self.models[result.reservation.pk] = Model(key=key, input=size, s_reserved=hold, s_remaining=hold)
        return result.reservation.pk

    @rule(rid=reservations)
    def replay_admission(self, rid):
        model = self.models.get(rid)
        if model is None:
            return
        result = admit(self.spec(model.key, model.input))
        assert result.replayed and result.reservation.pk == rid

    @rule(rid=reservations)
    def dispatch(self, rid):
        model = self.models.get(rid)
        if model is None:
            return
        r = Reservation.objects.get(pk=rid)
        _, err = self._call(
            lifecycle.dispatch,
            reservation_id=rid,
            tenant_ids=self.ids,
            fence=1,
            provider_request_id=f"p-{rid}",
            admitted_digest=r.admitted_digest,
            now=now(),
        )
        if model.state == "RESERVED":
            assert err is None
            model.state, model.consumed, model.dispatched = "DISPATCHED", model.input, True
            model.post_money()
        elif model.dispatched:
            assert err is None, "repeating the same dispatch is a no-op"
        else:
            assert isinstance(err, InvalidTransition)

    @rule(rid=reservations, n=st.integers(0, 150), final=st.booleans(), event=st.integers(0, 3))
    def usage(self, rid, n, final, event):
        model = self.models.get(rid)
        if model is None:
            return
        event_id = f"ev-{event}"
        _, err = self._call(
            lifecycle.record_usage,
            reservation_id=rid,
            tenant_ids=self.ids,
            fence=1,
            usage=lifecycle.Usage(event_id, n, None, final),
            now=now(),
        )
        if event_id in model.events:
            if model.events[event_id] == (n, final):
                assert err is None, "an exact replay is a no-op"
            else:
                assert isinstance(err, UsageEventConflict)
            return
        if model.state not in {"DISPATCHED", "RUNNING", "PARTIALLY_SETTLED"}:
            assert isinstance(err, InvalidTransition)
            return
        assert err is None
        model.events[event_id] = (n, final)
        take = min(n, model.remaining)
        model.captured += take
        model.remaining -= take
        model.overrun += n - take
        model.post_money()
        if final:
            model.released += model.remaining
            model.remaining = 0
            model.state, model.held = "SETTLED", False
            model.release_money()
        elif model.state == "DISPATCHED":
            model.state = "RUNNING"

    @rule(rid=reservations, n=st.integers(1, 400), tid=st.integers(0, 1))
    def top_up(self, rid, n, tid):
        model = self.models.get(rid)
        if model is None:
            return
        top_up_id = f"t-{tid}"
        e = self.expected()
        _, err = self._call(
            lifecycle.top_up,
            reservation_id=rid,
            tenant_ids=self.ids,
            fence=1,
            top_up_id=top_up_id,
            output_tokens=n,
            now=now(),
        )
        if top_up_id in model.top_up_ids:
            assert (err is None) == (model.top_up_ids[top_up_id] == n)
            return
        if model.state not in {"RESERVED", "DISPATCHED", "RUNNING"}:
            assert isinstance(err, InvalidTransition)
            return
        extra = cost(OUT + model.top_ups + n, OUT_PRICE) - cost(OUT + model.top_ups, OUT_PRICE)
        if e[1] + e[3] + n > OUTPUT_LIMIT or e[5] + e[6] + extra > SPEND_LIMIT:
            assert isinstance(err, QuotaExceeded)
            return
        assert err is None
        model.top_up_ids[top_up_id] = n
        model.top_ups += n
        model.remaining += n
        model.s_reserved += extra
        model.s_remaining += extra

    @rule(rid=reservations)
    def cancel(self, rid):
        model = self.models.get(rid)
        if model is None:
            return
        _, err = self._call(lifecycle.cancel, reservation_id=rid, tenant_ids=self.ids, fence=1, now=now())
        if model.state == "RESERVED":
            assert err is None
            model.released += model.remaining
            model.remaining, model.state, model.held, model.reason = 0, "SETTLED", False, "cancelled"
            model.release_money()
        elif model.state in {"DISPATCHED", "RUNNING"}:
            assert err is None
            # The gateway closed the call: its concurrency slot is freed now, its tokens stay held.
            model.state, model.reason, model.held = "PARTIALLY_SETTLED", "cancelled", False
        elif model.reason == "cancelled":
            assert err is None
        else:
            assert isinstance(err, InvalidTransition)

    @rule(rid=reservations, sent=st.sampled_from(["yes", "no", "unknown"]))
    def fail(self, rid, sent):
        model = self.models.get(rid)
        if model is None:
            return
        _, err = self._call(
            lifecycle.fail,
            reservation_id=rid,
            tenant_ids=self.ids,
            fence=1,
            reason="boom",
            request_sent=sent,
            usage=None,
            now=now(),
        )
        if model.state == "RESERVED":
            assert err is None
            model.released += model.remaining
            model.remaining, model.state, model.held, model.reason = 0, "SETTLED", False, "failed"
            model.release_money()
        elif model.state == "DISPATCHED" and sent == "no":
            assert err is None
            model.released += model.remaining
            model.remaining, model.state, model.held, model.reason = 0, "SETTLED", False, "released"
            model.release_money()
            model.consumed = 0
            model.post_money()  # the input's money is refunded
            model.failed_as = sent
        elif model.state in {"DISPATCHED", "RUNNING"}:
            assert err is None
            model.state, model.reason, model.failed_as = "PARTIALLY_SETTLED", "failed", sent
            # The provider answered: the call ended and its slot goes; sent-or-not unknown may still run.
            model.held = model.held and sent != "yes"
        elif model.reason in {"failed", "released"} and model.failed_as in {"", sent}:
            assert err is None  # a repeat of the same report
        elif model.reason in {"failed", "released"}:
            assert isinstance(err, InvalidTransition), "another report of the failure is refused"
        else:
            assert isinstance(err, InvalidTransition)

    @rule(rid=reservations)
    def stale_fence_write(self, rid):
        if rid not in self.models:
            return
        _, err = self._call(lifecycle.cancel, reservation_id=rid, tenant_ids=self.ids, fence=2, now=now())
        assert isinstance(err, StaleFence)

    @rule(rid=consumes(reservations))
    def forget(self, rid):
        """Let the bundle shrink so long runs keep exercising fresh reservations."""

    # --- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def database_agrees_with_the_model(self):
        account = CapacityAccount.objects.get(pk=self.tenant.pk)
        actual = (
            account.input_reserved,
            account.output_reserved,
            account.input_consumed,
            account.output_consumed,
            account.in_flight,
            account.spend_reserved,
            account.spend_consumed,
        )
        assert actual == self.expected()
        assert account.input_reserved + account.input_consumed <= INPUT_LIMIT
        assert account.in_flight <= CONCURRENCY
        # Money held never exceeds the limit: only overruns (posted anyway, as tokens are) may pass it.
        assert (
            account.spend_reserved + account.spend_consumed - sum(m.s_overrun for m in self.models.values())
            <= SPEND_LIMIT
        )
        pool = CapacityAccount.objects.get(pk=self.pool.pk)
        assert (pool.spend_reserved, pool.spend_consumed) == (account.spend_reserved, account.spend_consumed)
        for rid, model in self.models.items():
            r = Reservation.objects.get(pk=rid)
            assert (r.state, r.captured, r.remaining, r.released, r.overrun, r.top_ups) == (
                model.state,
                model.captured,
                model.remaining,
                model.released,
                model.overrun,
                model.top_ups,
            )
            assert (
                r.spend_reserved,
                r.spend_captured,
                r.spend_remaining,
                r.spend_released,
                r.spend_overrun,
            ) == (
                model.s_reserved,
                model.s_captured,
                model.s_remaining,
                model.s_released,
                model.s_overrun,
            )

    @invariant()
    def ledger_invariants_hold(self):
        report = audit(account_ids=[self.tenant.pk, self.pool.pk], reservation_ids=list(self.models))
        assert report.ok, report.violations + report.leaks


@pytest.mark.django_db(transaction=True)
def test_ledger_state_machine():
    LedgerMachine.TestCase.settings = settings(
        max_examples=20,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    LedgerMachine.TestCase().runTest()
