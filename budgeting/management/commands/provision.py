from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from budgeting.provisioning.policy_documents import validate_policy_document
from budgeting.provisioning.apply import ProvisioningError, apply_config, load_file


class Command(BaseCommand):
    help = "Apply a JSON/YAML provisioning file (catalog, accounts, policies, service clients). Idempotent."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = apply_config(load_file(options["file"]), validate_policy=validate_policy_document)
        except ProvisioningError as exc:
            raise CommandError(f"invalid provisioning file, nothing applied: {exc}") from None
        self.stdout.write(("applied: " if report.changed else "no changes: ") + report.summary())
