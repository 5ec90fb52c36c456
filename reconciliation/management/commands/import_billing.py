from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from reconciliation.billing import import_export


class Command(BaseCommand):
    help = "Import a provider billing export (CSV or JSONL; per request or per time bucket). Idempotent."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument("--format", choices=["csv", "jsonl"], help="default: from the file extension")

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        fmt = options["format"] or path.suffix.lstrip(".").lower()
        if fmt not in {"csv", "jsonl"}:
            raise CommandError("cannot tell the format; pass --format csv|jsonl")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from None
        result = import_export(text=text, fmt=fmt, source=path.name, now=timezone.now())
        label = "imported" if result.created else "already imported (nothing changed)"
        self.stdout.write(f"{label}: {json.dumps(result.summary(), sort_keys=True)}")
