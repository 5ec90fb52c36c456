"""Policy documents: validation (delegated to the pure ``ladder.policy``) and the alias."""

from __future__ import annotations

from typing import Any

from budgeting.provisioning.apply import ProvisioningError
from ladder.policy import PolicyError, parse_policy


def validate_policy_document(document: Any, path: str) -> None:
    """Raise ProvisioningError naming the bad field when the policy document is incoherent."""
    try:
        parse_policy(document)
    except PolicyError as exc:
        raise ProvisioningError(f"{path}.{exc.path}".rstrip("."), exc.message) from None
