"""``manage.py provision FILE``: show the plan of a provisioning file, then apply it once confirmed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from budgeting.provisioning.apply import PlanChanged, apply_plan, is_empty
from budgeting.provisioning.document import read_document
from budgeting.provisioning.plan import make_plan, render
from budgeting.provisioning.source import ProvisioningError, load


class Command(BaseCommand):
    help = (
        "Show what a JSON/YAML provisioning file (catalog, accounts, policies, service clients) would "
        "change, field by field, then apply it. Values people changed since the file's last apply are kept "
        "unless --force. Applying the same file twice changes nothing."
    )
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument("--dry-run", action="store_true", help="print the plan and apply nothing")
        parser.add_argument("--yes", action="store_true", help="apply without asking (non-interactive use)")
        parser.add_argument(
            "--force",
            action="store_true",
            help="also overwrite values people changed since the file's last apply (the plan names each)",
        )
        parser.add_argument(
            "--if-empty",
            action="store_true",
            help="apply only to a database with nothing provisioned yet (./platform run's demo file)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        try:
            loaded = load(options["file"])
            if options["if_empty"] and not is_empty():
                self.stdout.write(
                    f"{loaded.source.name} not applied: it is applied only to an empty database, and this "
                    "one already holds provisioned objects"
                )
                return
            plan = make_plan(read_document(loaded.document, now=now), loaded.source, force=options["force"])
        except ProvisioningError as exc:
            raise CommandError(f"invalid provisioning file, nothing applied: {exc}") from None
        self.stdout.write("\n".join(render(plan)))
        if not plan.changed:
            return
        if options["dry_run"]:
            self.stdout.write("dry run: nothing applied")
            return
        if not options["yes"] and not self._confirmed(options.get("stdin", sys.stdin)):
            self.stdout.write("nothing applied")
            return
        try:
            applied = apply_plan(plan, now=now)
        except PlanChanged as exc:
            raise CommandError(str(exc)) from None
        except ProvisioningError as exc:
            raise CommandError(f"nothing applied: {exc}") from None
        self.stdout.write(applied.summary())
        if applied.conflicts:
            raise CommandError("some changes were not applied (see above)")

    def _confirmed(self, stdin: Any) -> bool:
        if not stdin.isatty():
            raise CommandError(
                "nothing applied: there is no terminal to ask on; pass --yes to apply (or --dry-run)"
            )
        self.stdout.write("Apply this plan? [y/N] ", ending="")
        self.stdout.flush()
        return stdin.readline().strip().lower() in {"y", "yes"}
