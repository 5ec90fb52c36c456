"""Django's registry of the ``budgeting`` app's models; each is defined in its room: import it from there."""

from budgeting.admission.models import Manifest
from budgeting.backoffice.models import UsageReport
from budgeting.catalog.models import (
    ApiToken,
    CatalogVersion,
    ChangeRecord,
    ModelPool,
    ModelRevision,
    PolicyAlias,
    PolicyVersion,
    Price,
    ServiceClient,
    TaskClass,
    TemporaryIncrease,
    Tenant,
    Tokenizer,
)
from budgeting.observability.alerts.models import AlertThresholds, ThresholdCrossing
from budgeting.provisioning.models import ProvisionedValue

__all__ = [
    "AlertThresholds",
    "ApiToken",
    "CatalogVersion",
    "ChangeRecord",
    "Manifest",
    "ModelPool",
    "ModelRevision",
    "PolicyAlias",
    "PolicyVersion",
    "Price",
    "ProvisionedValue",
    "ServiceClient",
    "TaskClass",
    "TemporaryIncrease",
    "Tenant",
    "ThresholdCrossing",
    "Tokenizer",
    "UsageReport",
]
