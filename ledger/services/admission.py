"""Reserving capacity for an admission in one transaction, queueing when short, admitting the queue."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, transaction

from budgeting.catalog.errors import CatalogUnchecked, Conflict
from budgeting.catalog.models import ModelPool, ModelRevision, RolloutMode, TaskClass, Tenant
from budgeting.catalog.prices import FrozenPrice
from budgeting.db.cursor import db_now as read_db_now
from budgeting.db.cursor import sqlstate_of
from budgeting.db.rows import RecordInsert
from ledger import locks
from ledger.errors import HoldRefused, IdempotencyConflict, PriceUnavailable, QuotaExceeded
from ledger.models import CapacityAccount, Reservation, State, new_reservation_id
from ledger.services.accounts import ShortageSignal, applicable_accounts, shortage
from ledger.services.postings import hold_new_reservation, hold_queued_reservation
from ledger.services.retries import RETRIED_SQLSTATES, with_retries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionSpec:
    tenant: Tenant
    task_class: TaskClass
    pool: ModelPool
    model_revision: ModelRevision
    request_id: str
    idempotency_key: str
    rendered_digest: str
    admitted_digest: str
    input_tokens: int
    output_tokens: int
    policy_revision: int | None
    rung: str
    manifest_id: int | None
    minimum_evidence_ids: tuple[str, ...] = ()
    queue: bool = False
    queue_deadline_seconds: int = 60
    request_body: dict[str, Any] | None = None
    provider_request_id: str = ""
    """When set, the admission also records the dispatch under this id (SPEC §5's dispatch, in the same
    statement): the gateway sends the admitted payload next, with no call to us in between."""
    price: FrozenPrice | None = None
    """The model revision's price in force at admission (the fallback model's for SMALLER_MODEL)."""


@dataclass(frozen=True)
class Admitted:
    reservation: Reservation
    replayed: bool


def find_by_idempotency_key(
    *, tenant: Tenant, idempotency_key: str, rendered_digest: str
) -> Reservation | None:
    """The earlier reservation for this key, or None. Raises IdempotencyConflict if its digest differs."""
    existing = Reservation.objects.filter(tenant=tenant, idempotency_key=idempotency_key).first()
    if existing is None:
        return None
    if existing.rendered_digest != rendered_digest:
        raise IdempotencyConflict(
            "the same Idempotency-Key was used with a different request: its rendered payload, or its "
            "requestId, taskClass, modelPool, modelRevision, maxOutput or dispatch",
            reservationId=str(existing.pk),
        )
    return existing


def _new_reservation(
    spec: AdmissionSpec, state: str, *, manifest_id: int | None, **fields: Any
) -> Reservation:
    price = spec.price
    if price is not None:
        held = price.hold(spec.input_tokens, spec.output_tokens)
        fields.update(
            price_id=price.price_id,
            currency=price.currency,
            input_price=price.input,
            cached_input_price=price.cached_input,
            output_price=price.output,
            spend_reserved=held,
            spend_remaining=held,
        )
    return Reservation(
        id=new_reservation_id(),
        tenant=spec.tenant,
        task_class=spec.task_class,
        model_pool=spec.pool,
        model_revision=spec.model_revision,
        request_id=spec.request_id,
        idempotency_key=spec.idempotency_key,
        rendered_digest=spec.rendered_digest,
        admitted_digest=spec.admitted_digest,
        policy_revision=spec.policy_revision,
        rung=spec.rung,
        mode=RolloutMode.ENFORCE,
        state=state,
        input_reserved=spec.input_tokens,
        output_reserved=spec.output_tokens,
        remaining=spec.output_tokens,
        minimum_evidence_ids=list(spec.minimum_evidence_ids),
        manifest_id=manifest_id,
        **fields,
    )


PROVIDER_ID_CONSTRAINT = "reservation_unique_provider_request_id_per_tenant"


def _constraint(error: IntegrityError) -> str | None:
    return getattr(getattr(error.__cause__, "diag", None), "constraint_name", None)


def provider_request_id_in_use(provider_request_id: str) -> Conflict:
    """The tenant already has a call with this providerRequestId (another tenant's ids are never seen)."""
    return Conflict(
        f"providerRequestId {provider_request_id!r} already names another call of this tenant",
        code="PROVIDER_REQUEST_ID_IN_USE",
    )


def _replay_of(spec: AdmissionSpec, error: IntegrityError) -> Admitted:
    """After an insert was refused: the earlier reservation for this key (or its conflict); any other
    integrity error is raised again."""
    earlier = find_by_idempotency_key(
        tenant=spec.tenant, idempotency_key=spec.idempotency_key, rendered_digest=spec.rendered_digest
    )
    if earlier is None:
        raise error
    return Admitted(earlier, replayed=True)


def require_price(accounts: list[CapacityAccount], price: FrozenPrice | None) -> None:
    """Raises PriceUnavailable when an account has a spend limit and the price is missing or in another
    currency: a money limit never admits a call it cannot price."""
    for account in accounts:
        if account.spend_limit is not None and (price is None or price.currency != account.currency):
            raise PriceUnavailable(
                f"{account.label} has a spend limit in {account.currency} and the model revision has "
                + ("no price in force" if price is None else f"its price in {price.currency}"),
                account={"id": account.pk, "scope": account.scope, "label": account.label},
                currency=account.currency,
            )


def reserve(
    *,
    spec: AdmissionSpec,
    build_body: Callable[[Reservation], dict[str, Any]],
    now: datetime,
    db_now: datetime | None = None,
    catalog_version: int | None = None,
    checked_version: int | None = None,
    confirm: Callable[[], object] | None = None,
    record: Callable[[str], RecordInsert] | None = None,
) -> Admitted:
    """Hold input, output and one concurrency slot on every applicable account, in one transaction.

    ``record(state)``, when given, is the INSERT of the caller's record of this admission (the manifest), run
    in the same transaction — by the reserving statement itself — so it commits with the reservation or not at
    all; the reservation references it.
    ``db_now`` is the database clock the lease is measured from (read now when not given).
    ``checked_version`` and ``confirm``: the caller is unchecked (``Caller.checked_version``). The reserving
    statement requires the catalog at that version; before any other answer — a refusal, the queue, a
    replay, accounts to create or roll over first — ``confirm()`` reads the catalog version (raising
    CatalogUnchecked, nothing written, when it moved: the caller makes the admission again after the catalog
    read). A statement that failed on its connection (a kept one that died) is CatalogUnchecked too: the
    catalog read reconnects; had it been applied, the Idempotency-Key replays it.

    Money is held with the tokens, at ``spec.price`` (frozen on the reservation), on the accounts kept in
    its currency.

    Returns the new reservation (RESERVED, or DISPATCHED with ``spec.provider_request_id``), or a PROPOSED
    one when capacity is short and the task class queues (not dispatched: the gateway dispatches once the
    queue admits it), or the earlier reservation for the same idempotency key (replayed=True, nothing
    written).
    Raises QuotaExceeded (nothing written), PriceUnavailable, IdempotencyConflict, Conflict
    PROVIDER_REQUEST_ID_IN_USE, Contention after repeated deadlocks, or CatalogUnchecked (above).
    """
    # No look-up of the key first: the unique index answers a retry (IntegrityError below), which keeps the
    # common path of a new key one query shorter.
    guard = checked_version

    def confirmed() -> None:
        # The caller is confirmed current: what follows, even this admission's own writes that move the
        # catalog version (an account created), needs no check.
        nonlocal guard
        if confirm is not None:
            confirm()
        guard = None

    accounts = applicable_accounts(
        tenant=spec.tenant,
        task_class=spec.task_class,
        pool=spec.pool,
        now=now,
        catalog_version=catalog_version,
        confirm=None if confirm is None else confirmed,
    )
    try:
        require_price(accounts, spec.price)
    except PriceUnavailable:
        confirmed()
        raise

    def attempt() -> Reservation:
        clock = db_now or read_db_now()
        reservation = _new_reservation(
            spec,
            State.RESERVED,
            manifest_id=spec.manifest_id,
            concurrency_held=True,
            lease_expires_at=clock + timedelta(seconds=settings.LEASE_SECONDS),
        )
        if spec.provider_request_id:
            # The adapter and endpoint the pool names now, as a dispatch records them: only a lookup there can
            # vouch for the call later. The gateway sends only after this statement committed, so a
            # reservation that may have been sent always has its dispatch record.
            reservation.dispatch(spec.provider_request_id)
            reservation.dispatched_at = clock
            reservation.provider_adapter = spec.pool.adapter
            reservation.provider_endpoint = spec.pool.provider_base_url
        reservation.response_body = build_body(reservation)
        try:
            record_id = hold_new_reservation(
                reservation,
                [a.pk for a in accounts],
                None if record is None else record(State.RESERVED),
                catalog_version=guard,
            )
        except (OperationalError, InterfaceError) as error:
            if guard is None or sqlstate_of(error) in RETRIED_SQLSTATES:
                raise
            raise CatalogUnchecked from error
        except HoldRefused as refused:
            raise ShortageSignal(next(a for a in accounts if a.pk in refused.account_ids)) from None
        if record_id is not None:
            reservation.manifest_id = record_id
        return reservation

    try:
        return Admitted(with_retries(attempt), replayed=False)
    except IntegrityError as error:
        confirmed()
        try:
            return _replay_of(spec, error)
        except IntegrityError:
            if _constraint(error) != PROVIDER_ID_CONSTRAINT:
                raise
            raise provider_request_id_in_use(spec.provider_request_id) from None
    except ShortageSignal as signal:
        confirmed()
        problem = shortage(
            signal.account,
            input_tokens=spec.input_tokens,
            output_tokens=spec.output_tokens,
            concurrency=1,
            spend=0 if spec.price is None else spec.price.hold(spec.input_tokens, spec.output_tokens),
            currency=None if spec.price is None else spec.price.currency,
        )
        if spec.queue:
            return _enqueue(spec, build_body, problem, record)
        raise problem from None


def _enqueue(
    spec: AdmissionSpec,
    build_body: Callable[[Reservation], dict[str, Any]],
    problem: QuotaExceeded,
    record: Callable[[str], RecordInsert] | None,
) -> Admitted:
    try:
        with transaction.atomic(durable=True):
            db_now = read_db_now()
            reservation = _new_reservation(
                spec,
                State.PROPOSED,
                manifest_id=record(State.PROPOSED).run() if record is not None else spec.manifest_id,
                queue_deadline=db_now + timedelta(seconds=spec.queue_deadline_seconds),
                request_body=spec.request_body,
                failure_reason=problem.detail,
            )
            reservation.response_body = build_body(reservation)
            reservation.save(force_insert=True)
            return Admitted(reservation, replayed=False)
    except IntegrityError as error:
        return _replay_of(spec, error)


def admit_queued(
    *, reservation_id: uuid.UUID, build_body: Callable[[Reservation], dict[str, Any]], now: datetime
) -> Reservation | None:
    """Try to admit one queued reservation: RESERVED if capacity is there now (held through the same
    statement as a new reservation's hold), REJECTED past its deadline (its output released: it never held
    any).

    Returns the reservation when its state changed, None when it stays queued (or is not queued any more).
    Safe to run concurrently: the row lock and the state guard decide, so a request is admitted at most once.
    """
    proposed = (
        Reservation.objects.filter(pk=reservation_id, state=State.PROPOSED)
        .select_related("tenant", "task_class", "model_pool")
        .first()
    )
    if proposed is None:
        return None
    accounts = applicable_accounts(
        tenant=proposed.tenant, task_class=proposed.task_class, pool=proposed.model_pool, now=now
    )
    try:
        with transaction.atomic(durable=True):
            reservation = locks.lock_reservation(reservation_id)
            if reservation is None or reservation.state != State.PROPOSED:
                return None
            # The database clock, read with the lock: no statement of its own.
            clock: datetime = reservation.db_now  # type: ignore[attr-defined]
            if reservation.queue_deadline is not None and reservation.queue_deadline <= clock:
                reservation.reject_queued("queue deadline passed")
                reservation.response_body = build_body(reservation)
                reservation.save()
                return reservation
            reservation.admit_from_queue()
            reservation.concurrency_held = True
            reservation.failure_reason = ""
            reservation.lease_expires_at = clock + timedelta(seconds=settings.LEASE_SECONDS)
            reservation.response_body = build_body(reservation)
            hold_queued_reservation(reservation, [a.pk for a in accounts])
            return reservation
    except HoldRefused:
        # Still short: the statement wrote nothing and its transaction rolled back; the request stays queued.
        return None


def queue_position(reservation: Reservation) -> int:
    return Reservation.objects.filter(
        state=State.PROPOSED,
        tenant=reservation.tenant,
        task_class=reservation.task_class,
        created_at__lte=reservation.created_at,
    ).count()
