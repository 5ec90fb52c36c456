"""``manage.py policy``: list, check, validate, activate and roll back policy versions from a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from budgeting.catalog import policies as policy_services
from budgeting.catalog.changes import Actor
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import PolicyAlias, PolicyVersion
from budgeting.catalog.snapshot import ACTIVE_ALIAS


class Command(BaseCommand):
    help = (
        "Policy versions and the alias: list, validate a draft, activate (compare-and-swap on the version "
        "the alias points at now), roll back to the previous validated version."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="versions, where the alias points and the global cap in force")
        check = sub.add_parser(
            "check", help="check a policy document file (JSON or YAML) and list every error with its path"
        )
        check.add_argument("file", type=Path)
        validate = sub.add_parser("validate", help="freeze a draft as VALIDATED")
        validate.add_argument("revision", type=int)
        activate = sub.add_parser("activate", help="point the alias at a validated revision")
        activate.add_argument("revision", type=int)
        activate.add_argument(
            "--expected",
            type=int,
            required=True,
            help="the revision the alias must point at now (compare-and-swap)",
        )
        rollback = sub.add_parser("rollback", help="move the alias back to its previous version")
        rollback.add_argument(
            "--expected",
            type=int,
            required=True,
            help="the revision the alias must point at now (compare-and-swap)",
        )
        for command in (validate, activate, rollback):
            command.add_argument("--reason", required=True)
            command.add_argument("--by", default="cli", help="who is making the change (for the change log)")
        parser.add_argument("--alias", default=ACTIVE_ALIAS)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            getattr(self, f"do_{options['action']}")(options)
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.detail}") from None

    def do_list(self, options: dict[str, Any]) -> None:
        alias = (
            PolicyAlias.objects.select_related("version", "previous").filter(name=options["alias"]).first()
        )
        for version in PolicyVersion.objects.order_by("revision"):
            marks = []
            if alias and alias.version_id == version.pk:
                marks.append(f"<- {alias.name}")
            if alias and alias.previous_id == version.pk:
                marks.append("(previous)")
            self.stdout.write(
                f"r{version.revision:<5} {version.state:<10} {version.note[:50]:<50} {' '.join(marks)}"
            )
        if alias:
            self.stdout.write(f"global cap in force: {policy_services.cap_in_force(alias).explain()}")

    def do_check(self, options: dict[str, Any]) -> None:
        path: Path = options["file"]
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise CommandError(f"{path} is not valid JSON or YAML{where}") from None
        stated = document.get("revision") if isinstance(document, dict) else None
        errors = policy_services.document_errors(document, revision=stated if type(stated) is int else 0)
        for error in errors:
            self.stdout.write(f"{error.path}: {error.message}")
        if errors:
            raise CommandError(f"{path}: {len(errors)} error(s)")
        self.stdout.write(f"{path}: a valid policy document (r{stated})")

    def _version(self, revision: int) -> PolicyVersion:
        version = PolicyVersion.objects.filter(revision=revision).first()
        if version is None:
            raise CommandError(f"no policy version r{revision}")
        return version

    def do_validate(self, options: dict[str, Any]) -> None:
        version = self._version(options["revision"])
        policy_services.validate_version(
            version_id=version.pk,
            reason=options["reason"],
            actor=Actor(None, options["by"]),
            now=timezone.now(),
        )
        self.stdout.write(f"r{version.revision} validated")

    def do_activate(self, options: dict[str, Any]) -> None:
        version = self._version(options["revision"])
        expected = self._version(options["expected"])
        change = policy_services.activate(
            alias_name=options["alias"],
            version_id=version.pk,
            expected_version_id=expected.pk,
            reason=options["reason"],
            actor=Actor(None, options["by"]),
        )
        self._report(change)

    def do_rollback(self, options: dict[str, Any]) -> None:
        expected = self._version(options["expected"])
        change = policy_services.rollback(
            alias_name=options["alias"],
            expected_version_id=expected.pk,
            reason=options["reason"],
            actor=Actor(None, options["by"]),
        )
        self._report(change)

    def _report(self, change: policy_services.AliasChange) -> None:
        plan = change.plan
        self.stdout.write(
            f"{plan.alias}: r{plan.from_revision} -> r{plan.to_revision}; global cap "
            f"{plan.cap_before} -> {plan.cap_after}"
        )
        if plan.clears_caches:
            cleared = (
                "failed (the move stands)" if change.caches_cleared is None else str(change.caches_cleared)
            )
            self.stdout.write(f"length caches cleared: {cleared}")
        for line in plan.diff:
            self.stdout.write(f"  {line.kind:<8} {line.path}: {line.old} -> {line.new}")
