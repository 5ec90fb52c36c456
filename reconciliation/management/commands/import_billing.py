"""``manage.py import_billing FILE``: import a billing export or a provider usage report saved as a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from reconciliation.billing import ExportRefused, import_export
from reconciliation.providers.exports import EXPORT_FORMATS, BillingExportFormat


class Command(BaseCommand):
    help = (
        "Import a provider billing export (CSV or JSONL, per request or per time bucket) or a usage report "
        "saved from a provider's API (openai-usage, openai-costs, anthropic-usage, anthropic-costs). "
        "Idempotent: the same export again, whatever its line endings or byte-order mark, changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument(
            "--format", choices=EXPORT_FORMATS, help="default: csv or jsonl from the extension"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        fmt: BillingExportFormat
        if options["format"]:
            fmt = options["format"]
        elif path.suffix.lower() in (".csv", ".jsonl"):
            fmt = "csv" if path.suffix.lower() == ".csv" else "jsonl"
        else:
            raise CommandError(f"cannot tell the format; pass --format ({'|'.join(EXPORT_FORMATS)})")
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from None
        try:
            result = import_export(text=text, fmt=fmt, source=path.name, now=timezone.now())
        except ExportRefused as refused:
            raise CommandError(refused.detail) from None
        label = "imported" if result.created else "already imported (nothing changed)"
        self.stdout.write(f"{label}: {json.dumps(result.summary(), sort_keys=True)}")
