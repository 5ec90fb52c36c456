"""The usage rows as FOCUS records (FinOps Open Cost and Usage Specification 1.0), for finance tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from budgeting.backoffice.reports.pricing import MILLION, UsageRow

# FOCUS 1.0 column names (FinOps Open Cost and Usage Specification); custom columns carry the x_ prefix the
# specification reserves for them. One row per usage row and token direction (input and output are priced as
# separate SKUs). Costs are list prices with no discounts, so Billed, Effective, List and Contracted agree.
FOCUS_COLUMNS = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_TaskClass",
    "x_ModelPool",
    "x_Rung",
    "x_TokenDirection",
    "x_Requests",
    "x_PriceMissing",
)

PLATFORM_NAME = "Token budget admission platform"


def _month_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, 1, tzinfo=UTC)
    end = datetime(day.year + (day.month == 12), day.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def focus_records(rows: Iterator[UsageRow]) -> Iterator[dict[str, Any]]:
    """The usage rows as FOCUS records (two per row: input tokens and output tokens)."""
    for row in rows:
        billing_start, billing_end = _month_bounds(row.day)
        charge_start = datetime.combine(row.day, time.min, tzinfo=UTC)
        for direction, tokens, unit_price, cost in (
            ("input", row.input_tokens, row.input_price, row.input_cost),
            ("output", row.output_tokens, row.output_price, row.output_cost),
        ):
            amount = str(cost if cost is not None else Decimal("0.000000"))
            price = None if unit_price is None else str(unit_price)
            yield {
                "BilledCost": amount,
                "BillingAccountId": row.tenant,
                "BillingAccountName": row.tenant_name,
                "BillingCurrency": row.currency or "",
                "BillingPeriodStart": _iso(billing_start),
                "BillingPeriodEnd": _iso(billing_end),
                "ChargeCategory": "Usage",
                "ChargeClass": "",
                "ChargeDescription": f"{direction.capitalize()} tokens of {row.model_revision} "
                f"({row.task_class}, rung {row.rung})",
                "ChargeFrequency": "Usage-Based",
                "ChargePeriodStart": _iso(charge_start),
                "ChargePeriodEnd": _iso(charge_start + timedelta(days=1)),
                "ConsumedQuantity": tokens,
                "ConsumedUnit": "Tokens",
                "ContractedCost": amount,
                "ContractedUnitPrice": price or "",
                "EffectiveCost": amount,
                "InvoiceIssuerName": PLATFORM_NAME,
                "ListCost": amount,
                "ListUnitPrice": price or "",
                "PricingCategory": "Standard",
                "PricingQuantity": str(Decimal(tokens) / MILLION),
                "PricingUnit": "1M Tokens",
                "ProviderName": PLATFORM_NAME,
                "PublisherName": PLATFORM_NAME,
                "RegionId": row.region,
                "RegionName": row.region,
                "ResourceId": row.model_revision,
                "ResourceName": row.model_revision,
                "ResourceType": "Model revision",
                "ServiceCategory": "AI and Machine Learning",
                "ServiceName": "LLM inference",
                "SkuId": f"{row.model_revision}:{direction}",
                "SkuPriceId": "" if row.price_id is None else f"price-{row.price_id}:{direction}",
                "SubAccountId": f"{row.tenant}/{row.task_class}",
                "SubAccountName": f"{row.tenant_name} — {row.task_class}",
                "Tags": json.dumps({"taskClass": row.task_class, "modelPool": row.pool, "rung": row.rung}),
                "x_TaskClass": row.task_class,
                "x_ModelPool": row.pool,
                "x_Rung": row.rung,
                "x_TokenDirection": direction,
                "x_Requests": row.requests,
                "x_PriceMissing": "true" if unit_price is None else "false",
            }
