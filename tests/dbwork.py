"""Deterministic proxies of an operation's database cost: statements, transactions and commits.

Counted on the Django connection of this process: every statement through an execute wrapper, every COMMIT and
ROLLBACK through the connection's own methods. A statement run in autocommit mode is a transaction of its own
(and a commit when it writes), as PostgreSQL counts it. ``sent`` is what the driver (psycopg) was asked to
run, through Django's wrappers or not: a statement there and not in ``statements`` went around them (Django's
own connection health check does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import psycopg
from django.db import connection
from psycopg.conninfo import make_conninfo

WRITES = ("INSERT", "UPDATE", "DELETE", "WITH")


@dataclass
class DbWork:
    statements: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    autocommit_statements: int = 0
    autocommit_writes: int = 0
    explicit_commits: int = 0
    rollbacks: int = 0

    @property
    def commits(self) -> int:
        return self.explicit_commits + self.autocommit_writes

    @property
    def transactions(self) -> int:
        return self.explicit_commits + self.rollbacks + self.autocommit_statements

    def summary(self) -> str:
        listing = "\n".join(f"  {sql[:160]}" for sql in self.statements)
        return (
            f"{len(self.statements)} statements, {self.transactions} transactions, {self.commits} commits:\n"
            f"{listing}"
        )


@contextlib.contextmanager
def count_db_work() -> Iterator[DbWork]:
    work = DbWork()

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        text = sql.lstrip().upper()
        if not text.startswith(("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT")):
            work.statements.append(sql)
        if connection.get_autocommit() and not connection.in_atomic_block:
            work.autocommit_statements += 1
            work.autocommit_writes += text.startswith(WRITES)
        return execute(sql, params, many, context)

    real_commit, real_rollback = connection.commit, connection.rollback
    real_execute, real_executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany

    def execute(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        work.sent.append(str(query))
        return real_execute(cursor, query, *args, **kwargs)

    def executemany(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        work.sent.append(str(query))
        return real_executemany(cursor, query, *args, **kwargs)

    def commit() -> None:
        work.explicit_commits += 1
        real_commit()

    def rollback() -> None:
        work.rollbacks += 1
        real_rollback()

    with (
        connection.execute_wrapper(wrapper),
        mock.patch.object(connection, "commit", commit),
        mock.patch.object(connection, "rollback", rollback),
        mock.patch.object(psycopg.Cursor, "execute", execute),
        mock.patch.object(psycopg.Cursor, "executemany", executemany),
    ):
        yield work


def second_connection(**options: Any) -> psycopg.Connection[Any]:
    """Another connection to the test database as Django's own logs in: ``info.dsn`` leaves the password out,
    which the embedded PostgreSQL of ``./platform test`` (no DATABASE_URL) requires."""
    connection.ensure_connection()
    password = connection.settings_dict["PASSWORD"]
    dsn = connection.connection.info.dsn
    return psycopg.connect(make_conninfo(dsn, **({"password": password} if password else {})), **options)
