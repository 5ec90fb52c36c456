"""The write path of the ledger: every change of an account or a reservation goes through here.

Each use case owns its ``transaction.atomic(durable=True)`` boundary, locks through ``ledger.locks`` in the
canonical order, applies a django-fsm transition on the freshly locked row, writes one ledger entry per
account balance change, and saves. Domain errors are ``Problem`` subclasses with stable codes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import F, Q, Sum
from django_fsm import TransitionNotAllowed

from budgeting.api.problems import Conflict, NotFound, Problem, Unavailable
from budgeting.catalog.models import ModelPool, ModelRevision, RolloutMode, TaskClass, Tenant
from ledger import locks
from ledger.models import (
    AFTER_DISPATCH,
    CapacityAccount,
    EntryKind,
    Hold,
    LedgerEntry,
    Outcome,
    Period,
    Reservation,
    Scope,
    State,
    TopUp,
    UsageEvent,
)
from ledger.periods import period_start_for

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_ATTEMPTS = 4


class QuotaExceeded(Problem):
    status = 429
    code = "QUOTA_EXCEEDED"
    title = "Not enough capacity on an account"


class StaleFence(Conflict):
    status = 409
    code = "STALE_FENCE"
    title = "The lease fence is not the reservation's current fence"


class InvalidTransition(Conflict):
    status = 409
    code = "INVALID_TRANSITION"
    title = "The reservation's state does not allow this"


class UsageEventConflict(Conflict):
    status = 409
    code = "USAGE_EVENT_CONFLICT"
    title = "This usageEventId was already recorded with different amounts"


class PayloadChanged(Conflict):
    status = 409
    code = "PAYLOAD_CHANGED"
    title = "The dispatched payload is not the admitted one"


class IdempotencyConflict(Conflict):
    status = 409
    code = "IDEMPOTENCY_CONFLICT"
    title = "This Idempotency-Key was used for a different request"


class RequestSent:
    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"


def with_retries(operation: Callable[[], T]) -> T:
    """Run a transaction, retrying deadlocks and serialization failures a bounded number of times.

    Raises Unavailable (503 with Retry-After) when every attempt failed that way.
    """
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return operation()
        except OperationalError as exc:
            sqlstate = getattr(getattr(exc, "__cause__", None), "sqlstate", None)
            if sqlstate not in {"40P01", "40001"}:
                raise
            logger.warning("retrying after %s (attempt %d)", sqlstate, attempt)
            time.sleep(0.005 * attempt)
    raise Unavailable("database contention; retry", code="CONTENTION", headers={"Retry-After": "1"})


# --- accounts ---------------------------------------------------------------------------------------------


def _current_period_start(account: CapacityAccount, now: datetime) -> datetime:
    return period_start_for(account.period, now)


_ACCOUNTS: dict[tuple[int, int, int], tuple[float, list[CapacityAccount]]] = {}
_ACCOUNTS_LOCK = threading.Lock()


def applicable_accounts(
    *, tenant: Tenant, task_class: TaskClass, pool: ModelPool, now: datetime
) -> list[CapacityAccount]:
    """The accounts a request for (tenant, task class, pool) holds on, in lock order.

    Which accounts apply is cached per process for ACCOUNT_CACHE_SECONDS (limits and balances are always read
    inside the reserving UPDATE, so only a newly provisioned account waits that long to take effect).
    A tenant × task-class account that does not exist yet is created from the task class's defaults; many
    threads doing it at once is safe (INSERT … ON CONFLICT DO NOTHING on the partial unique index).
    """
    key = (tenant.pk, task_class.pk, pool.pk)
    with _ACCOUNTS_LOCK:
        cached = _ACCOUNTS.get(key)
    if cached is not None and cached[0] > time.monotonic():
        accounts = cached[1]
    else:
        accounts = _load_accounts(tenant=tenant, task_class=task_class, pool=pool, now=now)
        with _ACCOUNTS_LOCK:
            _ACCOUNTS[key] = (time.monotonic() + settings.ACCOUNT_CACHE_SECONDS, accounts)
    if any(account.period_start < _current_period_start(account, now) for account in accounts):
        for account in accounts:
            roll_over(account_id=account.pk, now=now)
        accounts = _load_accounts(tenant=tenant, task_class=task_class, pool=pool, now=now)
        with _ACCOUNTS_LOCK:
            _ACCOUNTS[key] = (time.monotonic() + settings.ACCOUNT_CACHE_SECONDS, accounts)
    return accounts


def _load_accounts(
    *, tenant: Tenant, task_class: TaskClass, pool: ModelPool, now: datetime
) -> list[CapacityAccount]:
    defaults = task_class.tenant_account_defaults
    if (
        defaults
        and not CapacityAccount.objects.filter(
            scope=Scope.TENANT_TASK, tenant=tenant, task_class=task_class
        ).exists()
    ):
        period = defaults.get("period", Period.MONTH)
        CapacityAccount.objects.bulk_create(
            [
                CapacityAccount(
                    scope=Scope.TENANT_TASK,
                    tenant=tenant,
                    task_class=task_class,
                    period=period,
                    period_start=period_start_for(period, now),
                    input_limit=defaults.get("inputLimit"),
                    output_limit=defaults.get("outputLimit"),
                    concurrency_limit=defaults.get("concurrencyLimit"),
                )
            ],
            ignore_conflicts=True,
        )
    accounts = CapacityAccount.objects.filter(
        Q(scope=Scope.TENANT, tenant=tenant)
        | Q(scope=Scope.TENANT_TASK, tenant=tenant, task_class=task_class)
        | Q(scope=Scope.POOL, pool=pool)
    ).select_related("tenant", "task_class", "pool")
    return sorted(accounts, key=lambda a: a.pk)


def forget_account_cache() -> None:
    """Drop the cached account lists (after provisioning or when an account is created or removed)."""
    with _ACCOUNTS_LOCK:
        _ACCOUNTS.clear()


def roll_over(*, account_id: int, now: datetime) -> bool:
    """Start a new quota period: consumed balances go back to zero through a ROLLOVER entry.

    Outstanding holds (reserved, in flight) carry over. Idempotent: returns False when already rolled.
    """
    with transaction.atomic(durable=not connection.in_atomic_block):
        account = locks.lock_account(account_id)
        start = _current_period_start(account, now)
        if account.period_start >= start:
            return False
        LedgerEntry.objects.create(
            account=account,
            kind=EntryKind.ROLLOVER,
            input_consumed=-account.input_consumed,
            output_consumed=-account.output_consumed,
            period_start=start,
            reason=f"period {account.period_start:%Y-%m-%d} closed",
        )
        CapacityAccount.objects.filter(pk=account.pk).update(
            period_start=start, input_consumed=0, output_consumed=0
        )
        return True


def _shortage(
    account: CapacityAccount, *, input_tokens: int, output_tokens: int, concurrency: int
) -> QuotaExceeded:
    fresh = CapacityAccount.objects.get(pk=account.pk)
    checks = [
        ("input", fresh.input_limit, fresh.input_reserved + fresh.input_consumed, input_tokens),
        ("output", fresh.output_limit, fresh.output_reserved + fresh.output_consumed, output_tokens),
        ("concurrency", fresh.concurrency_limit, fresh.in_flight, concurrency),
    ]
    short = next(
        (
            (dim, limit, used, requested)
            for dim, limit, used, requested in checks
            if limit is not None and requested and used + requested > limit
        ),
        None,
    )
    if short is None:
        # The balance moved between the refused UPDATE and this read: say so rather than name a dimension.
        dimension, requested, available = "contended", input_tokens + output_tokens, 0
    else:
        dimension, limit, used, requested = short
        available = max((limit or 0) - used, 0)
    retry_after = 1 if dimension in {"concurrency", "contended"} else 60
    return QuotaExceeded(
        f"{fresh.label}: {dimension} needs {requested}, {available} available",
        headers={"Retry-After": str(retry_after)},
        account={"id": fresh.pk, "scope": fresh.scope, "label": fresh.label},
        dimension=dimension,
        requested=requested,
        available=available,
    )


def _apply(
    reservation: Reservation,
    account_ids: Sequence[int],
    kind: str,
    *,
    reason: str = "",
    input_reserved: int = 0,
    output_reserved: int = 0,
    input_consumed: int = 0,
    output_consumed: int = 0,
    in_flight: int = 0,
) -> None:
    """Move balances on every held account (ascending pk) and write one entry per account.

    A decrease of consumed tokens (a refund or a downward correction) is limited, per account, to what this
    reservation posted into the account's current period: the rest was consumed in a period that has since
    been closed by a roll-over, stays there, and is not taken from the new period (which must not go
    negative). The entry records what was applied and says when part of the decrease stayed behind.
    """
    if not any((input_reserved, output_reserved, input_consumed, output_consumed, in_flight)):
        return
    # Locked (ascending, after the reservation row): a roll-over cannot slip between this read and the update.
    periods = locks.lock_account_periods(account_ids)
    posted: dict[int, tuple[int, int]] = {}
    if input_consumed < 0 or output_consumed < 0:
        for row in (
            LedgerEntry.objects.filter(reservation=reservation, account_id__in=account_ids)
            .values("account_id", "period_start")
            .annotate(i=Sum("input_consumed"), o=Sum("output_consumed"))
        ):
            if row["period_start"] == periods[row["account_id"]]:
                posted[row["account_id"]] = (row["i"] or 0, row["o"] or 0)
    entries = []
    for account_id in sorted(account_ids):
        in_consumed, out_consumed = input_consumed, output_consumed
        if input_consumed < 0:
            in_consumed = max(input_consumed, -posted.get(account_id, (0, 0))[0])
        if output_consumed < 0:
            out_consumed = max(output_consumed, -posted.get(account_id, (0, 0))[1])
        if not any((input_reserved, output_reserved, in_consumed, out_consumed, in_flight)):
            continue
        CapacityAccount.objects.filter(pk=account_id).update(
            input_reserved=F("input_reserved") + input_reserved,
            output_reserved=F("output_reserved") + output_reserved,
            input_consumed=F("input_consumed") + in_consumed,
            output_consumed=F("output_consumed") + out_consumed,
            in_flight=F("in_flight") + in_flight,
        )
        closed = (in_consumed, out_consumed) != (input_consumed, output_consumed)
        note = " (part of the decrease belongs to a closed period)" if closed else ""
        entries.append(
            LedgerEntry(
                account_id=account_id,
                reservation=reservation,
                kind=kind,
                input_reserved=input_reserved,
                output_reserved=output_reserved,
                input_consumed=in_consumed,
                output_consumed=out_consumed,
                in_flight=in_flight,
                period_start=periods[account_id],
                reason=(reason + note)[:300],
            )
        )
    LedgerEntry.objects.bulk_create(entries)


def _held_account_ids(reservation: Reservation) -> list[int]:
    return sorted(Hold.objects.filter(reservation=reservation).values_list("account_id", flat=True))


# --- admission --------------------------------------------------------------------------------------------


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
            "the same Idempotency-Key was used with a different rendered payload",
            reservationId=str(existing.pk),
        )
    return existing


def _new_reservation(spec: AdmissionSpec, state: str, **fields: Any) -> Reservation:
    return Reservation(
        id=uuid.uuid4(),
        tenant=spec.tenant,
        task_class=spec.task_class,
        model_pool=spec.pool,
        model_revision=spec.model_revision,
        request_id=spec.request_id,
        idempotency_key=spec.idempotency_key,
        rendered_digest=spec.rendered_digest,
        admitted_digest=spec.admitted_digest,
        manifest_id=spec.manifest_id,
        policy_revision=spec.policy_revision,
        rung=spec.rung,
        mode=RolloutMode.ENFORCE,
        state=state,
        input_reserved=spec.input_tokens,
        output_reserved=spec.output_tokens,
        remaining=spec.output_tokens,
        minimum_evidence_ids=list(spec.minimum_evidence_ids),
        **fields,
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


def reserve(
    *, spec: AdmissionSpec, build_body: Callable[[Reservation], dict[str, Any]], now: datetime
) -> Admitted:
    """Hold input, output and one concurrency slot on every applicable account in one transaction.

    Returns the new reservation (RESERVED), or a PROPOSED one when capacity is short and the task class
    queues, or the earlier reservation for the same idempotency key (replayed=True).
    Raises QuotaExceeded (nothing written), IdempotencyConflict, or Unavailable after repeated contention.
    """
    # No look-up of the key first: the unique index answers a retry (IntegrityError below), which keeps the
    # common path of a new key one query shorter.
    accounts = applicable_accounts(tenant=spec.tenant, task_class=spec.task_class, pool=spec.pool, now=now)

    def attempt() -> Reservation:
        with transaction.atomic(durable=True):
            db_now = locks.db_now()
            assert isinstance(db_now, datetime)
            reservation = _new_reservation(
                spec,
                State.RESERVED,
                concurrency_held=True,
                lease_expires_at=db_now + timedelta(seconds=settings.LEASE_SECONDS),
            )
            reservation.response_body = build_body(reservation)
            # The insert comes first: a concurrent retry of the same key waits here on the unique index and
            # then fails, before it touches any account.
            reservation.save(force_insert=True)
            # Inserts first, then the hot rows: the account locks are held only from the one UPDATE below
            # to COMMIT, with no Python work in between.
            Hold.objects.bulk_create(Hold(reservation=reservation, account=a) for a in accounts)
            _entries(
                reservation,
                accounts,
                EntryKind.HOLD,
                input_reserved=spec.input_tokens,
                output_reserved=spec.output_tokens,
                in_flight=1,
            )
            short = locks.reserve_on_accounts(
                [a.pk for a in accounts],
                input_tokens=spec.input_tokens,
                output_tokens=spec.output_tokens,
                concurrency=1,
            )
            if short is not None:
                raise _ShortageSignal(next(a for a in accounts if a.pk == short))
            return reservation

    try:
        return Admitted(with_retries(attempt), replayed=False)
    except IntegrityError as error:
        return _replay_of(spec, error)
    except _ShortageSignal as signal:
        problem = _shortage(
            signal.account, input_tokens=spec.input_tokens, output_tokens=spec.output_tokens, concurrency=1
        )
        if spec.queue:
            return _enqueue(spec, build_body, problem)
        raise problem from None


class _ShortageSignal(Exception):
    def __init__(self, account: CapacityAccount) -> None:
        super().__init__(account.pk)
        self.account = account


def _entries(reservation: Reservation, accounts: Iterable[CapacityAccount], kind: str, **deltas: int) -> None:
    LedgerEntry.objects.bulk_create(
        LedgerEntry(account=a, reservation=reservation, kind=kind, period_start=a.period_start, **deltas)
        for a in accounts
    )


def _enqueue(
    spec: AdmissionSpec, build_body: Callable[[Reservation], dict[str, Any]], problem: QuotaExceeded
) -> Admitted:
    try:
        with transaction.atomic(durable=True):
            db_now = locks.db_now()
            assert isinstance(db_now, datetime)
            reservation = _new_reservation(
                spec,
                State.PROPOSED,
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
    """Try to admit one queued reservation: RESERVED if capacity is there now, REJECTED past its deadline.

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
    with transaction.atomic(durable=True):
        reservation = locks.lock_reservation(reservation_id)
        if reservation is None or reservation.state != State.PROPOSED:
            return None
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        if reservation.queue_deadline is not None and reservation.queue_deadline <= db_now:
            reservation.reject_queued("queue deadline passed")
            reservation.response_body = build_body(reservation)
            reservation.save()
            return reservation
        # The one UPDATE may have held on the other accounts when one is short: undo exactly that.
        savepoint = transaction.savepoint()
        short = locks.reserve_on_accounts(
            [a.pk for a in accounts],
            input_tokens=reservation.input_reserved,
            output_tokens=reservation.output_reserved,
            concurrency=1,
        )
        if short is not None:
            transaction.savepoint_rollback(savepoint)
            return None
        transaction.savepoint_commit(savepoint)
        reservation.admit_from_queue()
        reservation.concurrency_held = True
        reservation.failure_reason = ""
        reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
        reservation.response_body = build_body(reservation)
        reservation.save()
        Hold.objects.bulk_create(Hold(reservation=reservation, account=a) for a in accounts)
        _entries(
            reservation,
            accounts,
            EntryKind.HOLD,
            input_reserved=reservation.input_reserved,
            output_reserved=reservation.output_reserved,
            in_flight=1,
        )
        return reservation


def queue_position(reservation: Reservation) -> int:
    return Reservation.objects.filter(
        state=State.PROPOSED,
        tenant=reservation.tenant,
        task_class=reservation.task_class,
        created_at__lte=reservation.created_at,
    ).count()


# --- lifecycle ----------------------------------------------------------------------------------------------


def _locked(reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int) -> Reservation:
    reservation = locks.lock_reservation(reservation_id, tenant_ids)
    if reservation is None:
        raise NotFound("no such reservation")
    if fence != reservation.fence:
        raise StaleFence(
            f"fence {fence} is {'older than' if fence < reservation.fence else 'not'} the current fence",
            currentFence=reservation.fence,
        )
    return reservation


def _refuse(reservation: Reservation, action: str) -> InvalidTransition:
    return InvalidTransition(
        f"cannot {action} a reservation in state {reservation.state}",
        state=reservation.state,
        outcome=reservation.outcome or None,
    )


def dispatch(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    provider_request_id: str,
    admitted_digest: str,
    now: datetime,
) -> Reservation:
    """Record the dispatch (before the provider call): input is posted as consumed.

    Repeating the same dispatch is a no-op. Raises PayloadChanged for another digest, StaleFence,
    InvalidTransition, NotFound.
    """

    def attempt() -> Reservation:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenant_ids, fence)
            if admitted_digest != reservation.admitted_digest:
                raise PayloadChanged(
                    "admittedDigest differs from the admitted payload's digest",
                    expected=reservation.admitted_digest,
                )
            if reservation.state != State.RESERVED:
                if reservation.provider_request_id == provider_request_id and reservation.dispatched_at:
                    return reservation
                raise _refuse(reservation, "dispatch")
            reservation.dispatch(provider_request_id)
            reservation.dispatched_at = now
            reservation.save()
            n = reservation.input_reserved
            _apply(
                reservation,
                _held_account_ids(reservation),
                EntryKind.POST,
                input_reserved=-n,
                input_consumed=n,
                reason="dispatched",
            )
            return reservation

    try:
        return with_retries(attempt)
    except IntegrityError as error:
        constraint = getattr(getattr(error.__cause__, "diag", None), "constraint_name", None)
        if constraint != "reservation_unique_provider_request_id":
            raise
        raise Conflict(
            f"providerRequestId {provider_request_id!r} already names another call",
            code="PROVIDER_REQUEST_ID_IN_USE",
        ) from None


@dataclass(frozen=True)
class Usage:
    usage_event_id: str
    output_tokens: int
    input_tokens: int | None
    final: bool


def _capture(
    reservation: Reservation,
    account_ids: list[int],
    *,
    usage_event_id: str,
    output_tokens: int,
    input_tokens: int | None,
    final: bool,
) -> UsageEvent:
    if (
        input_tokens is not None
        and reservation.input_reported is not None
        and (input_tokens != reservation.input_reported)
    ):
        # The provider counts the input once; a second, different figure would move money backwards (an
        # input of 0 would refund everything), so it is refused rather than trusted.
        raise UsageEventConflict(
            f"inputTokens {input_tokens} differs from the {reservation.input_reported} already reported",
            code="INPUT_ALREADY_REPORTED",
            recorded={"inputTokens": reservation.input_reported},
        )
    take = min(output_tokens, reservation.remaining)
    over = output_tokens - take
    event = UsageEvent.objects.create(
        reservation=reservation,
        usage_event_id=usage_event_id,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        final=final,
        captured=take,
        overrun=over,
    )
    reservation.captured += take
    reservation.remaining -= take
    reservation.overrun += over
    _apply(
        reservation,
        account_ids,
        EntryKind.POST,
        output_reserved=-take,
        output_consumed=output_tokens,
        reason=f"usage {usage_event_id}" + (f" (overrun {over})" if over else ""),
    )
    if input_tokens is not None and input_tokens != reservation.input_consumed:
        # The provider's own count of the input is authoritative for billing: correct what dispatch posted.
        delta = input_tokens - reservation.input_consumed
        reservation.input_consumed = input_tokens
        _apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            input_consumed=delta,
            reason=f"provider counted {input_tokens} input tokens",
        )
    if input_tokens is not None:
        reservation.input_reported = input_tokens
    return event


def _transition_settle(
    reservation: Reservation,
    transition: Callable[[], None],
    account_ids: list[int],
    *,
    reason: str,
    now: datetime,
    release_input: int = 0,
    refund_input: int = 0,
) -> None:
    """Apply a settling transition (it moves ``remaining`` to ``released``), then release that output
    hold, the concurrency slot and any unposted input hold on every account; refund input when proven
    unprocessed."""
    remaining = reservation.remaining
    transition()
    slot = -1 if reservation.concurrency_held else 0
    reservation.concurrency_held = False
    reservation.settled_at = now
    _apply(
        reservation,
        account_ids,
        EntryKind.RELEASE,
        output_reserved=-remaining,
        in_flight=slot,
        input_reserved=-release_input,
        reason=reason,
    )
    if refund_input:
        _apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            input_consumed=-refund_input,
            reason="provider never processed the request: input refunded",
        )


def record_usage(
    *, reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int, usage: Usage, now: datetime
) -> tuple[Reservation, bool]:
    """Capture one usage delta, idempotent by usageEventId; a final event settles (COMPLETED).

    Returns (reservation, applied); applied is False for an exact replay. Raises UsageEventConflict,
    StaleFence, InvalidTransition, NotFound.
    """

    def attempt() -> tuple[Reservation, bool]:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenant_ids, fence)
            earlier = UsageEvent.objects.filter(
                reservation=reservation, usage_event_id=usage.usage_event_id
            ).first()
            if earlier is not None:
                if (earlier.output_tokens, earlier.input_tokens, earlier.final) != (
                    usage.output_tokens,
                    usage.input_tokens,
                    usage.final,
                ):
                    raise UsageEventConflict(
                        f"usageEventId {usage.usage_event_id!r} was recorded with other amounts",
                        recorded={
                            "outputTokens": earlier.output_tokens,
                            "inputTokens": earlier.input_tokens,
                            "final": earlier.final,
                        },
                    )
                return reservation, False
            if reservation.state not in {State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED}:
                raise _refuse(reservation, "record usage on")
            account_ids = _held_account_ids(reservation)
            _capture(
                reservation,
                account_ids,
                usage_event_id=usage.usage_event_id,
                output_tokens=usage.output_tokens,
                input_tokens=usage.input_tokens,
                final=usage.final,
            )
            if usage.final:
                _transition_settle(
                    reservation, reservation.complete, account_ids, reason="final usage", now=now
                )
            elif reservation.state == State.DISPATCHED:
                reservation.start_running()
            reservation.save()
            return reservation, True

    return with_retries(attempt)


def top_up(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    top_up_id: str,
    output_tokens: int,
    now: datetime,
) -> tuple[Reservation, bool]:
    """Extend the output hold; idempotent by topUpId. Raises QuotaExceeded when an account is short."""

    def attempt() -> tuple[Reservation, bool]:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenant_ids, fence)
            earlier = TopUp.objects.filter(reservation=reservation, top_up_id=top_up_id).first()
            if earlier is not None:
                if earlier.output_tokens != output_tokens:
                    raise Conflict(
                        f"topUpId {top_up_id!r} was recorded with another amount",
                        code="TOP_UP_CONFLICT",
                        recorded=earlier.output_tokens,
                    )
                return reservation, False
            if reservation.state not in {State.RESERVED, State.DISPATCHED, State.RUNNING}:
                raise _refuse(reservation, "top up")
            accounts = list(
                CapacityAccount.objects.filter(pk__in=_held_account_ids(reservation)).order_by("pk")
            )
            short = locks.reserve_on_accounts(
                [a.pk for a in accounts], input_tokens=0, output_tokens=output_tokens, concurrency=0
            )
            if short is not None:
                raise _ShortageSignal(next(a for a in accounts if a.pk == short))
            _entries(reservation, accounts, EntryKind.TOP_UP, output_reserved=output_tokens)
            TopUp.objects.create(reservation=reservation, top_up_id=top_up_id, output_tokens=output_tokens)
            reservation.top_ups += output_tokens
            reservation.remaining += output_tokens
            reservation.save()
            return reservation, True

    try:
        return with_retries(attempt)
    except _ShortageSignal as signal:
        raise _shortage(signal.account, input_tokens=0, output_tokens=output_tokens, concurrency=0) from None


def cancel(*, reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int, now: datetime) -> Reservation:
    """Before dispatch: release everything. After: settle what was consumed, keep the rest held."""

    def attempt() -> Reservation:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenant_ids, fence)
            account_ids = _held_account_ids(reservation)
            if reservation.state == State.RESERVED:
                _transition_settle(
                    reservation,
                    reservation.release_undispatched,
                    account_ids,
                    reason="cancelled before dispatch",
                    now=now,
                    release_input=reservation.input_reserved,
                )
                reservation.failure_reason = "cancelled"
            elif reservation.state in {State.DISPATCHED, State.RUNNING}:
                reservation.settle_partially("cancelled after dispatch")
            elif reservation.state == State.PROPOSED:
                reservation.reject_queued("cancelled while queued")
            elif reservation.failure_reason.startswith("cancelled"):
                return reservation
            else:
                raise _refuse(reservation, "cancel")
            reservation.save()
            return reservation

    return with_retries(attempt)


def fail(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    reason: str,
    request_sent: str,
    usage: Usage | None,
    now: datetime,
) -> Reservation:
    """A provider call failed. Proof of non-processing releases in full; otherwise settle what was incurred.

    ``request_sent`` is RequestSent.NO only with proof (connection refused before any byte was sent).
    """

    def attempt() -> Reservation:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenant_ids, fence)
            account_ids = _held_account_ids(reservation)
            if reservation.state == State.RESERVED:
                _transition_settle(
                    reservation,
                    reservation.release_undispatched,
                    account_ids,
                    reason=f"failed before dispatch: {reason}",
                    now=now,
                    release_input=reservation.input_reserved,
                )
                reservation.failure_reason = f"failed before dispatch: {reason}"
            elif reservation.state == State.DISPATCHED and request_sent == RequestSent.NO and usage is None:
                _transition_settle(
                    reservation,
                    reservation.release_unprocessed,
                    account_ids,
                    reason=f"never processed: {reason}",
                    now=now,
                    refund_input=reservation.input_consumed,
                )
                reservation.failure_reason = f"never processed: {reason}"
            elif reservation.state in {State.DISPATCHED, State.RUNNING}:
                earlier = None
                if usage is not None:
                    earlier = UsageEvent.objects.filter(
                        reservation=reservation, usage_event_id=usage.usage_event_id
                    ).first()
                    if earlier is not None and (earlier.output_tokens, earlier.input_tokens) != (
                        usage.output_tokens,
                        usage.input_tokens,
                    ):
                        raise UsageEventConflict(
                            f"usageEventId {usage.usage_event_id!r} was recorded with other amounts",
                            recorded={
                                "outputTokens": earlier.output_tokens,
                                "inputTokens": earlier.input_tokens,
                            },
                        )
                if usage is not None and earlier is None:
                    _capture(
                        reservation,
                        account_ids,
                        usage_event_id=usage.usage_event_id,
                        output_tokens=usage.output_tokens,
                        input_tokens=usage.input_tokens,
                        final=False,
                    )
                reservation.settle_partially(f"failed ({request_sent} sent): {reason}")
            elif reservation.state in {
                State.PARTIALLY_SETTLED,
                State.SETTLED,
            } and reservation.failure_reason.startswith(("failed", "never processed")):
                return reservation
            else:
                raise _refuse(reservation, "fail")
            reservation.save()
            return reservation

    return with_retries(attempt)


def renew_lease(*, reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int) -> Reservation:
    """Push the lease expiry out by LEASE_SECONDS from the database clock."""
    with transaction.atomic(durable=True):
        reservation = _locked(reservation_id, tenant_ids, fence)
        if reservation.state in {State.SETTLED, State.REJECTED, State.RECONCILING, State.PROPOSED}:
            raise _refuse(reservation, "renew the lease of")
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
        reservation.save(update_fields=["lease_expires_at", "updated_at"])
        return reservation


def record_outcome(
    *, reservation_id: uuid.UUID, tenant_ids: Iterable[int], task_success: bool, cited_evidence_ids: list[str]
) -> Reservation:
    """Store the caller's quality report for the metrics (success, evidence cited)."""
    with transaction.atomic(durable=True):
        reservation = locks.lock_reservation(reservation_id, tenant_ids)
        if reservation is None:
            raise NotFound("no such reservation")
        if reservation.state in {State.PROPOSED, State.REJECTED}:
            raise _refuse(reservation, "report an outcome for")
        reservation.task_success = task_success
        reservation.cited_evidence_ids = cited_evidence_ids
        reservation.save(update_fields=["task_success", "cited_evidence_ids", "updated_at"])
        return reservation


__all__ = [
    "AdmissionSpec",
    "Admitted",
    "IdempotencyConflict",
    "Outcome",
    "PayloadChanged",
    "QuotaExceeded",
    "RequestSent",
    "StaleFence",
    "Usage",
    "UsageEventConflict",
]


# --- reclamation and reconciliation ----------------------------------------------------------------------

RECLAIMABLE = [State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]


@dataclass(frozen=True)
class Claim:
    reservation_id: uuid.UUID
    fence: int
    provider_request_id: str
    pool_id: int


def claim_expired_leases(*, now: datetime, limit: int = 100) -> tuple[list[uuid.UUID], list[Claim]]:
    """Take over reservations whose lease expired, each by raising its fence (database clock, SKIP LOCKED).

    RESERVED with no dispatch record is released in full: the protocol writes the dispatch record before the
    provider call, so its absence proves the call was never sent. Dispatched ones are frozen in RECONCILING
    with nothing released, and returned as claims for a provider lookup. Returns (released ids, claims).
    Safe to run twice at once: a row another reclaimer holds is skipped, a row it already moved is not
    reclaimable any more. One reservation per transaction: releasing touches its accounts, and holding
    several reservations' accounts at once would break the canonical lock order.
    """
    released: list[uuid.UUID] = []
    claims: list[Claim] = []
    failed: list[uuid.UUID] = []
    for _ in range(limit):
        try:
            outcome = with_retries(lambda: _claim_one_expired(now, failed))
        except _ClaimFailed as error:
            # One bad row must not stop every later reclaim (the oldest is picked first): log it, skip it.
            logger.exception("reclaiming reservation %s failed", error.reservation_id)
            failed.append(error.reservation_id)
            continue
        if outcome is None:
            break
        if isinstance(outcome, Claim):
            claims.append(outcome)
        else:
            released.append(outcome)
    return released, claims


class _ClaimFailed(Exception):
    def __init__(self, reservation_id: uuid.UUID) -> None:
        super().__init__(str(reservation_id))
        self.reservation_id = reservation_id


def _claim_one_expired(now: datetime, skip: list[uuid.UUID]) -> Claim | uuid.UUID | None:
    with transaction.atomic(durable=True):
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        expired = locks.lock_expired_leases(RECLAIMABLE, db_now, 1, exclude=skip)
        if not expired:
            return None
        reservation = expired[0]
        try:
            return _take_over(reservation, now, db_now)
        except (TransitionNotAllowed, IntegrityError) as error:
            raise _ClaimFailed(reservation.pk) from error


def _take_over(reservation: Reservation, now: datetime, db_now: datetime) -> Claim | uuid.UUID:
    reservation.fence += 1
    if reservation.state == State.RESERVED and reservation.dispatched_at is None:
        _transition_settle(
            reservation,
            reservation.release_undispatched,
            _held_account_ids(reservation),
            reason="lease expired with no dispatch record",
            now=now,
            release_input=reservation.input_reserved,
        )
        reservation.failure_reason = "lease expired before dispatch"
        reservation.save()
        return reservation.pk
    reservation.freeze_unknown()
    reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
    reservation.save()
    return Claim(
        reservation.pk, reservation.fence, reservation.provider_request_id, reservation.model_pool_id
    )


def claim_reconciling(*, limit: int = 100, min_age_seconds: int = 0) -> list[Claim]:
    """Take the next RECONCILING reservations for a provider lookup by raising their fences (SKIP LOCKED)."""
    with transaction.atomic(durable=True):
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        rows = locks.lock_reconciling(db_now - timedelta(seconds=min_age_seconds), limit)
        claims = []
        for reservation in rows:
            reservation.fence += 1
            reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
            reservation.save(update_fields=["fence", "lease_expires_at", "updated_at"])
            claims.append(
                Claim(
                    reservation.pk,
                    reservation.fence,
                    reservation.provider_request_id,
                    reservation.model_pool_id,
                )
            )
        return claims


class EvidenceKind:
    COMPLETED = "COMPLETED"
    NOT_PROCESSED = "NOT_PROCESSED"


@dataclass(frozen=True)
class Evidence:
    """Authoritative evidence about a dispatched call: the provider's lookup or a billing record."""

    kind: str
    input_tokens: int = 0
    output_tokens: int = 0
    source: str = "provider lookup"


def settle_from_evidence(
    *, reservation_id: uuid.UUID, fence: int | None, evidence: Evidence, now: datetime
) -> Reservation | None:
    """Settle a dispatched reservation from authoritative evidence: post billed usage and release the rest
    (outcome RECONCILED), or release in full with input refunded when it was never processed (RELEASED).

    ``fence`` is the claimer's fence (None for billing imports, which are authoritative whoever holds the
    lease). Returns None when the reservation is already settled or the fence moved on (another reclaimer).
    """

    def attempt() -> Reservation | None:
        with transaction.atomic(durable=True):
            reservation = locks.lock_reservation(reservation_id)
            if reservation is None or (fence is not None and reservation.fence != fence):
                return None
            if reservation.state not in {State.RECONCILING, *AFTER_DISPATCH}:
                return None
            if fence is None and reservation.state != State.RECONCILING:
                # A billing record may settle a dispatched call only once its gateway's lease has run out;
                # checked here, under the row lock, on the database clock.
                db_now = locks.db_now()
                assert isinstance(db_now, datetime)
                if reservation.lease_expires_at is not None and reservation.lease_expires_at > db_now:
                    return None
            account_ids = _held_account_ids(reservation)
            if evidence.kind == EvidenceKind.NOT_PROCESSED:
                if reservation.state not in {State.RECONCILING, State.DISPATCHED}:
                    # Usage already started flowing: "never processed" contradicts our record; keep it held.
                    return None
                transition = (
                    reservation.reconcile_unprocessed
                    if reservation.state == State.RECONCILING
                    else reservation.release_unprocessed
                )
                if reservation.captured or reservation.overrun:
                    # Usage was reported for it, so "never processed" contradicts our own record: keep it.
                    logger.error(
                        "reservation %s: not-processed evidence contradicts captured usage", reservation.pk
                    )
                    return None
                _transition_settle(
                    reservation,
                    transition,
                    account_ids,
                    now=now,
                    reason=f"{evidence.source}: never processed",
                    refund_input=reservation.input_consumed,
                )
            else:
                _post_billed(reservation, account_ids, evidence, now=now)
                _transition_settle(
                    reservation,
                    reservation.reconcile,
                    account_ids,
                    now=now,
                    reason=f"{evidence.source}: settled at billed usage",
                )
            reservation.save()
            return reservation

    return with_retries(attempt)


def _post_billed(
    reservation: Reservation, account_ids: list[int], evidence: Evidence, *, now: datetime
) -> None:
    """Bring captured output and consumed input to what was billed, with correcting entries."""
    recorded = reservation.captured + reservation.overrun
    delta = evidence.output_tokens - recorded
    if delta > 0:
        _capture(
            reservation,
            account_ids,
            usage_event_id=f"reconcile:{evidence.source}:{now.isoformat()}",
            output_tokens=delta,
            input_tokens=None,
            final=False,
        )
    elif delta < 0:
        over_back = min(-delta, reservation.overrun)
        captured_back = -delta - over_back
        reservation.overrun -= over_back
        reservation.captured -= captured_back
        reservation.remaining += captured_back
        _apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            output_consumed=delta,
            output_reserved=captured_back,
            reason=f"{evidence.source}: billed {evidence.output_tokens} output, we had {recorded}",
        )
    if evidence.input_tokens != reservation.input_consumed:
        diff = evidence.input_tokens - reservation.input_consumed
        reservation.input_consumed = evidence.input_tokens
        reservation.input_reported = evidence.input_tokens
        _apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            input_consumed=diff,
            reason=f"{evidence.source}: billed {evidence.input_tokens} input",
        )
