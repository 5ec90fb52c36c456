from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from budgeting.admission.replay import ReplayError, find_manifest, replay_manifest

# Exit codes: 0 the replay reproduces the record, 1 it does not, 2 nothing to replay (bad arguments).
MISMATCH_EXIT = 1
USAGE_EXIT = 2


class Command(BaseCommand):
    help = (
        "Replay a recorded admission decision under its recorded policy, model and tokenizer, explain it, "
        "and list every difference (exit code 1 when the replay differs)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("manifest_id", nargs="?", type=int, help="The manifest to replay.")
        parser.add_argument(
            "--request-id", help="Replay the latest manifest of this request (with --tenant)."
        )
        parser.add_argument("--tenant", help="The tenant slug of --request-id.")

    def handle(self, *args: Any, **options: Any) -> None:
        manifest_id: int | None = options["manifest_id"]
        request_id: str | None = options["request_id"]
        tenant: str | None = options["tenant"]
        try:
            if manifest_id is not None:
                if request_id or tenant:
                    raise CommandError(
                        "give a manifest id or --request-id with --tenant, not both", returncode=USAGE_EXIT
                    )
            elif request_id and tenant:
                manifest_id = find_manifest(request_id=request_id, tenant=tenant).pk
            else:
                raise CommandError("give a manifest id, or --request-id R --tenant T", returncode=USAGE_EXIT)
            result = replay_manifest(manifest_id)
        except ReplayError as exc:
            raise CommandError(str(exc), returncode=USAGE_EXIT) from None
        for line in result.lines:
            self.stdout.write(line)
        for difference in result.differences:
            self.stdout.write(f"MISMATCH: {difference}")
        if not result.matches:
            raise CommandError(
                f"manifest {manifest_id}: the replay differs from the record "
                f"({len(result.differences)} differences)",
                returncode=MISMATCH_EXIT,
            )
        self.stdout.write(f"OK: manifest {manifest_id} replays to the recorded decision.")
