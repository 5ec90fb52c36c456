"""A new gunicorn worker loads the tokenizer files the catalog provisions before its first request
(``budgeting.gunicorn_conf.post_worker_init``): the first count of each family then reads no file. Without
it, that first count loads the file inside the request (0.1–0.8 s a file, on every worker after every start).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.db import OperationalError

from budgeting import gunicorn_conf
from budgeting.catalog import snapshot
from budgeting.catalog.models import Tokenizer
from ladder.counting import CountingUnavailable, file_digest
from ladder.families import load_counter
from tests.factories import TokenizerFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the hook closes its connection

SOURCE = "llama3.tokenizer.model"


class Log:
    """What a gunicorn worker's ``log`` was told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, message: str, *args: Any) -> None:
        self.lines.append(("info", message % args))

    def warning(self, message: str, *args: Any) -> None:
        self.lines.append(("warning", message % args))


@pytest.fixture
def fresh_copy(settings: Any, tmp_path: Path) -> Tokenizer:
    """A tokenizer file at a path no process has read (so no earlier test's load is reused), provisioned."""
    source = Path(settings.TOKENIZER_DIR) / SOURCE
    shutil.copyfile(source, tmp_path / SOURCE)
    settings.TOKENIZER_DIR = tmp_path
    digest = file_digest((tmp_path / SOURCE).read_bytes())
    return cast(
        Tokenizer, TokenizerFactory(name="llama3-warm", family="llama3", file_name=SOURCE, digest=digest)
    )


def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path) -> bytes:
        raise OSError(f"{self} read during a request")

    monkeypatch.setattr(Path, "read_bytes", refuse)


def first_count(tokenizer: Tokenizer, tokenizer_dir: Path) -> None:
    load_counter(tokenizer.family, tokenizer_dir / tokenizer.file_name, expected_digest=tokenizer.digest)


def test_a_new_worker_loads_the_catalogs_tokenizers_before_its_first_request(
    fresh_copy: Tokenizer, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = SimpleNamespace(log=Log())
    gunicorn_conf.post_worker_init(worker)
    assert worker.log.lines == [("info", f"tokenizers loaded before the first request: {SOURCE}")]
    no_reads(monkeypatch)
    first_count(fresh_copy, Path(settings.TOKENIZER_DIR))  # reads nothing: loaded already


def test_without_it_the_first_count_reads_the_file(
    fresh_copy: Tokenizer, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the check above sees a first count that loads its file."""
    no_reads(monkeypatch)
    with pytest.raises(CountingUnavailable, match="read during a request"):
        first_count(fresh_copy, Path(settings.TOKENIZER_DIR))


def test_a_catalog_that_cannot_be_read_is_left_to_the_first_request(
    fresh_copy: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down() -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(snapshot, "current", down)
    worker = SimpleNamespace(log=Log())
    gunicorn_conf.post_worker_init(worker)
    assert worker.log.lines == [("warning", "not warmed before its first request: connection refused")]


def test_a_file_that_cannot_be_loaded_is_left_to_its_first_count(
    fresh_copy: Tokenizer, settings: Any
) -> None:
    (Path(settings.TOKENIZER_DIR) / SOURCE).unlink()
    worker = SimpleNamespace(log=Log())
    gunicorn_conf.post_worker_init(worker)
    assert worker.log.lines == [("info", "tokenizers loaded before the first request: none")]
