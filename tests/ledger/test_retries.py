"""Deadlocks and serialization failures are retried a bounded number of times, then answered 503."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from budgeting.api.problems import problem_headers, status_of
from budgeting.catalog.errors import Unavailable
from ledger.services import retries


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def failing(times: int, sqlstate: str):
    calls = {"n": 0}

    def operation() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise OperationalError("simulated") from _PgError(sqlstate)
        return "done"

    return operation, calls


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"])
def test_a_transient_conflict_is_retried(sqlstate):
    operation, calls = failing(2, sqlstate)
    assert retries.with_retries(operation) == "done"
    assert calls["n"] == 3


def test_persistent_contention_is_503_with_retry_after():
    operation, calls = failing(99, "40P01")
    with pytest.raises(Unavailable) as err:
        retries.with_retries(operation)
    assert (status_of(err.value), err.value.code, problem_headers(err.value)["Retry-After"]) == (
        503,
        "CONTENTION",
        "1",
    )
    assert calls["n"] == retries.MAX_ATTEMPTS


def test_other_database_errors_are_not_retried():
    operation, calls = failing(1, "08006")
    with pytest.raises(OperationalError):
        retries.with_retries(operation)
    assert calls["n"] == 1
