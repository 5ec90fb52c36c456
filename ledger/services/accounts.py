"""Capacity accounts on the hot path: which apply to a request (cached per process), roll-over, shortages."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q

from budgeting.catalog.models import ModelPool, TaskClass, Tenant
from budgeting.catalog.prices import from_micro
from ledger import locks
from ledger.errors import (
    PriceUnavailable,
    QuotaExceeded,
)
from ledger.models import (
    LIMITS,
    CapacityAccount,
    EntryKind,
    Period,
    Scope,
)
from ledger.periods import period_start_for
from ledger.services.postings import post_to_account

logger = logging.getLogger(__name__)


def _current_period_start(account: CapacityAccount, now: datetime) -> datetime:
    return period_start_for(account.period, now)


_ACCOUNTS: dict[tuple[int, int, int], tuple[int | None, float, list[CapacityAccount]]] = {}
_ACCOUNTS_LOCK = threading.Lock()


def applicable_accounts(
    *,
    tenant: Tenant,
    task_class: TaskClass,
    pool: ModelPool,
    now: datetime,
    catalog_version: int | None = None,
    confirm: Callable[[], object] | None = None,
) -> list[CapacityAccount]:
    """The accounts a request for (tenant, task class, pool) holds on, in lock order.

    Which accounts apply is cached per process: while the catalog version is ``catalog_version`` (creating,
    removing or re-scoping an account bumps it), or, without a version, for ACCOUNT_CACHE_SECONDS. Limits and
    balances are never cached: they are read inside the reserving UPDATE.
    A tenant × task-class account that does not exist yet is created from the task class's defaults; many
    threads doing it at once is safe (INSERT … ON CONFLICT DO NOTHING on the partial unique index).
    ``confirm``: for a caller whose catalog snapshot is not confirmed current (``Caller.checked_version``):
    called before anything that may write (the list not cached for ``catalog_version``, a period to roll
    over); it raises CatalogUnchecked when the catalog moved.
    """
    key = (tenant.pk, task_class.pk, pool.pk)
    with _ACCOUNTS_LOCK:
        cached = _ACCOUNTS.get(key)
    if cached is not None and (
        (catalog_version is not None and cached[0] == catalog_version)
        or (catalog_version is None and cached[1] > time.monotonic())
    ):
        accounts = cached[2]
    else:
        if confirm is not None:
            confirm()
        accounts = _remember(
            key, catalog_version, _load_accounts(tenant=tenant, task_class=task_class, pool=pool, now=now)
        )
    if any(account.period_start < _current_period_start(account, now) for account in accounts):
        if confirm is not None:
            confirm()
        for account in accounts:
            roll_over(account_id=account.pk, now=now)
        # The roll-over bumped the catalog version: this list is kept only until the next request reads it.
        accounts = _remember(
            key, None, _load_accounts(tenant=tenant, task_class=task_class, pool=pool, now=now)
        )
    return accounts


def _remember(
    key: tuple[int, int, int], catalog_version: int | None, accounts: list[CapacityAccount]
) -> list[CapacityAccount]:
    with _ACCOUNTS_LOCK:
        _ACCOUNTS[key] = (catalog_version, time.monotonic() + settings.ACCOUNT_CACHE_SECONDS, accounts)
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
        post_to_account(
            account,
            EntryKind.ROLLOVER,
            period_start=start,
            reason=f"period {account.period_start:%Y-%m-%d} closed",
            input_consumed=-account.input_consumed,
            output_consumed=-account.output_consumed,
            spend_consumed=-account.spend_consumed,
        )
        CapacityAccount.objects.filter(pk=account.pk).update(period_start=start)
        return True


def shortage(
    account: CapacityAccount,
    *,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    spend: int = 0,
    currency: str | None = None,
) -> QuotaExceeded:
    """The problem of a refused hold: the first limit of ``LIMITS`` the hold breaks on the account's
    balances now (``Limit.refuses``, the statements' predicate in Python), with what was requested and what
    is available (money in micro-units, and as a decimal amount of the account's currency).

    Raises PriceUnavailable when the account has a spend limit in another currency than the request's price
    (or the request has none): the reserving statement refuses those too (its limit may have been set after
    the account list was cached)."""
    # One read: the label names the account's tenant, task class and pool.
    fresh = CapacityAccount.objects.select_related("tenant", "task_class", "pool").get(pk=account.pk)
    if fresh.spend_limit is not None and currency != fresh.currency:
        raise PriceUnavailable(
            f"{fresh.label} has a spend limit in {fresh.currency} and the model revision has "
            + ("no price in force" if currency is None else f"its price in {currency}"),
            account={"id": fresh.pk, "scope": fresh.scope, "label": fresh.label},
            currency=fresh.currency,
        )
    added = {
        "input_reserved": input_tokens,
        "output_reserved": output_tokens,
        "in_flight": concurrency,
        "spend_reserved": spend,
    }
    short = next((limit for limit in LIMITS if limit.refuses(fresh, added)), None)
    if short is None:
        # The balance moved between the refused UPDATE and this read: say so rather than name a dimension.
        dimension, requested, available = "contended", input_tokens + output_tokens, 0
    else:
        dimension, requested = short.dimension, short.requested(added)
        available = max(getattr(fresh, short.limit) - short.usage(fresh), 0)
    retry_after = 1 if dimension in {"concurrency", "contended"} else 60
    if dimension == "spend":
        money = {
            "currency": fresh.currency,
            "requestedAmount": str(from_micro(requested)),
            "availableAmount": str(from_micro(available)),
        }
        return QuotaExceeded(
            f"{fresh.label}: spend needs {money['requestedAmount']} {fresh.currency}, "
            f"{money['availableAmount']} available",
            retry_after=retry_after,
            account={"id": fresh.pk, "scope": fresh.scope, "label": fresh.label},
            dimension=dimension,
            requested=requested,
            available=available,
            unit="micro-" + fresh.currency,
            **money,
        )
    return QuotaExceeded(
        f"{fresh.label}: {dimension} needs {requested}, {available} available",
        retry_after=retry_after,
        account={"id": fresh.pk, "scope": fresh.scope, "label": fresh.label},
        dimension=dimension,
        requested=requested,
        available=available,
    )


class ShortageSignal(Exception):
    def __init__(self, account: CapacityAccount) -> None:
        super().__init__(account.pk)
        self.account = account


def roll_over_due(*, now: datetime) -> int:
    """Roll every account whose period has ended (a beat task); returns how many this call rolled."""
    rolled = 0
    for account in CapacityAccount.objects.all():
        if account.period_start < _current_period_start(account, now):
            rolled += int(roll_over(account_id=account.pk, now=now))
    return rolled
