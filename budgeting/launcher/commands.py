"""The launcher's two commands: ``run`` serves the demo platform, ``test`` runs pytest.

* ``run`` migrates, provisions the demo file, makes sure an admin superuser exists, collects static files,
  then supervises nginx (the buffering front, ``front``, when installed) before gunicorn (two masters
  serving one socket), a Celery worker, Celery beat and the embedded
  servers until Ctrl-C or SIGTERM: what dies is restarted (``supervisor``), a crash loop stops everything.
  It is the demo platform: unless the environment says otherwise, leases last ``DEMO_LEASE_SECONDS`` (so a
  crashed gateway's reservation is reclaimed within seconds, e.g. during ``manage.py simulate``), gunicorn
  runs several workers, their latency metrics are merged through ``PROMETHEUS_MULTIPROC_DIR``, and the
  Django secret key and the metrics scrape token are generated once and kept in ``var/``.
* ``test`` runs pytest with the given arguments and exits with pytest's exit code.

``run`` keeps its embedded data in ``var/pg`` and ``var/redis``; ``test`` uses ``var/test-pg`` and
``var/test-redis`` so the suite can run beside a running platform. While ``run`` is up, ``var/embedded.env``
holds the URLs so that ``manage.py`` works in another shell.

Django is imported only once the URLs are known: the settings module refuses to load without them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from budgeting.launcher import front
from budgeting.launcher.embedded import provide_services
from budgeting.launcher.processes import (
    BASE_DIR,
    CHILD_GRACE_SECONDS,
    LOOPBACK,
    LaunchError,
    Stop,
    free_port,
    generated_secret,
    http_answers,
    listen,
    note_repeat,
    say,
    stop_children,
    var_dir,
    write_private,
)
from budgeting.launcher.supervisor import Program, RestartPolicy, Supervisor

DEMO_FILE = BASE_DIR / "budgeting" / "demo" / "demo.yaml"
ADMIN_USERNAME = "admin"
HTTP_READY_SECONDS = 60.0
DEMO_LEASE_SECONDS = 15
# Where the demo file's eu-frontier pool expects the provider simulator; with another SIMULATOR_PORT, change
# the pool's provider base URL too.
DEMO_SIMULATOR_PORT = 8090
# The demo file's DeepSeek-V3 models: the simulator counts their prompts as DeepSeek does.
DEMO_DEEPSEEK_V3_MODELS = ("model@2026-07-01", "small@2026-05-12")
MAX_WEB_WORKERS = 4
SECRET_KEY_FILE = "secret_key"
METRICS_TOKEN_FILE = "metrics_token"


def prepare_database() -> None:
    """Migrate, provision the demo file, make sure an admin exists and collect static files.

    Raises LaunchError when a management command reports an error.
    """
    import django
    from django.core.exceptions import ImproperlyConfigured

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")
    try:
        django.setup()
    except ImproperlyConfigured as error:
        raise LaunchError(f"the settings refuse to load: {error}") from error
    from django.core.management import CommandError, call_command
    from django.db import connections

    try:
        call_command("migrate", interactive=False)
        say(f"provisioning {DEMO_FILE.relative_to(BASE_DIR)}")
        call_command("provision", str(DEMO_FILE), "--if-empty", "--yes")
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
    run's scrapes. A production configuration (``DJANGO_ENV=production``) gets no generated secret key: its
    operator provides one, and the settings refuse to load without it.
    """
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LEASE_SECONDS", str(DEMO_LEASE_SECONDS))
    os.environ.setdefault("WEB_CONCURRENCY", str(min(MAX_WEB_WORKERS, 2 * (os.cpu_count() or 1))))
    if "SECRET_KEY" not in os.environ and os.environ.get("DJANGO_ENV") != "production":
        os.environ["SECRET_KEY"] = generated_secret(root / SECRET_KEY_FILE)
    if "METRICS_TOKEN" not in os.environ:
        os.environ["METRICS_TOKEN"] = generated_secret(root / METRICS_TOKEN_FILE)
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        metrics_dir = root / "prometheus"
        metrics_dir.mkdir(parents=True, exist_ok=True)
        for stale in metrics_dir.glob("*.db"):
            stale.unlink()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)


def programs(api_socket: int, root: Path) -> list[Program]:
    """gunicorn, the provider simulator, the Celery worker and Celery beat.

    Two gunicorn masters serve the API's socket (the file descriptor ``api_socket``, see ``listen``) once
    there are two workers to share, so that the API keeps answering while one master is being restarted.
    """
    raw_workers = os.environ["WEB_CONCURRENCY"]
    if not raw_workers.isdigit() or int(raw_workers) < 1:
        raise LaunchError(f"WEB_CONCURRENCY={raw_workers!r} is not a positive number of workers")
    workers = int(raw_workers)
    masters = 2 if workers >= 2 else 1
    python = sys.executable
    web = [
        Program(
            f"gunicorn {index + 1}" if masters > 1 else "gunicorn",
            [python, "-m", "gunicorn", "budgeting.wsgi:application", "--bind", f"fd://{api_socket}",
             "--config", "python:budgeting.gunicorn_conf",
             "--workers", str(workers // masters + (index < workers % masters)),
             "--graceful-timeout", "20", "--access-logfile", "-"],
            pass_fds=[api_socket],
        )
        for index in range(masters)
    ]  # fmt: skip
    # The demo's provider (the pool eu-frontier counts through its counting APIs): a separate process, so
    # that production code never imports the simulator.
    tokenizers = Path(os.environ.get("TOKENIZER_DIR") or root / "tokenizers")
    simulator = Program(
        "provider simulator",
        [python, "-m", "simulation", "--port", os.environ.get("SIMULATOR_PORT", str(DEMO_SIMULATOR_PORT)),
         "--deepseek-v3", str(tokenizers / "deepseek_v3.json"),
         *(arg for model in DEMO_DEEPSEEK_V3_MODELS for arg in ("--deepseek-v3-model", model))],
    )  # fmt: skip
    return [
        *web,
        simulator,
        Program("celery worker", [python, "-m", "celery", "-A", "budgeting", "worker", "--loglevel", "INFO"]),
        Program(
            "celery beat",
            [python, "-m", "celery", "-A", "budgeting", "beat", "--loglevel", "INFO",
             "--schedule", str(root / "celerybeat-schedule")],
        ),
    ]  # fmt: skip


def metrics_access(root: Path) -> str:
    """How to scrape: the generated token is shown (it is the demo's); an operator's own is only named."""
    token = os.environ["METRICS_TOKEN"]
    kept = root / METRICS_TOKEN_FILE
    if kept.exists() and kept.read_text().strip() == token:
        return f"Authorization: Bearer {token}, kept in {kept}"
    return "Authorization: Bearer $METRICS_TOKEN"


def run(stack: contextlib.ExitStack) -> int:
    """Serve and supervise until a signal arrives (exit 0); raise LaunchError on a crash loop."""
    began = time.monotonic()
    raw_port = os.environ.get("PORT", "8000")
    if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
        raise LaunchError(f"PORT={raw_port!r} is not a TCP port number")
    port = int(raw_port)
    root = var_dir()
    nginx = front.nginx_binary()
    if nginx is None:
        say(
            "nginx is not installed: gunicorn serves the port itself, and a client that sends its request "
            "slowly holds a web worker meanwhile (apt-get install nginx puts the buffering front before it)"
        )
        api_socket = stack.enter_context(listen(port))
    else:
        # The public port is nginx's; checked free now so that a taken port is said as plainly as before.
        listen(port).close()
        api_socket = stack.enter_context(listen(free_port()))
        os.environ["TB_BEHIND_FRONT"] = "1"
    demo_environment(root)
    apps = programs(api_socket.fileno(), root)
    upstream = int(api_socket.getsockname()[1])
    if nginx is not None:
        conf = front.prepare(root / "nginx", port, upstream)
        apps.insert(0, Program("front (nginx)", front.argv(nginx, conf)))
    services = provide_services(stack, prefix="", durable=True)
    if services.postgres or services.redis:
        env_file = root / "embedded.env"
        write_private(
            env_file, "".join(f"{key}={os.environ[key]}\n" for key in ("DATABASE_URL", "REDIS_URL"))
        )
        stack.callback(env_file.unlink, missing_ok=True)
    prepare_database()

    stack.callback(lambda: stop_children([app.child for app in apps if app.child is not None]))
    for app in apps:
        app.start()
    units = [*apps, *services.supervised()]
    deadline = time.monotonic() + HTTP_READY_SECONDS
    while not http_answers(port):
        # Before the platform is up a death is a configuration error, not something to retry.
        failed = next(((unit.name, reason) for unit in units if (reason := unit.exit_reason())), None)
        if failed is not None or time.monotonic() > deadline:
            why = " ".join(failed) if failed else f"nothing answers on port {port}"
            raise LaunchError(f"the platform did not come up: {why}")
        time.sleep(0.2)
    policy = RestartPolicy()
    masters = sum(app.name.startswith("gunicorn") for app in apps)
    base = f"http://{LOOPBACK}:{port}"
    lines = [
        f"up in {time.monotonic() - began:.1f}s",
        f"API             {base}/api/v1/",
        f"Admin           {base}/admin/",
        f"OpenAPI schema  {base}/api/v1/schema",
        f"Metrics         {base}/metrics  ({metrics_access(root)})",
        f"Leases          {os.environ['LEASE_SECONDS']}s (LEASE_SECONDS)",
        f"Provider        http://{LOOPBACK}:{os.environ.get('SIMULATOR_PORT', DEMO_SIMULATOR_PORT)} "
        "(the simulator: pool eu-frontier counts through its counting APIs)",
        f"Web workers     {os.environ['WEB_CONCURRENCY']} (WEB_CONCURRENCY), {masters} gunicorn master(s)",
        f"Front           nginx on port {port}, buffering requests, before gunicorn on {LOOPBACK}:{upstream}"
        if nginx is not None
        else f"Front           none: gunicorn on port {port} (nginx is not installed)",
        *services.describe(),
        f"Restarts        whatever dies, with backoff; {policy.crash_loop_deaths} deaths of one process "
        f"within {policy.crash_loop_window_s:g}s stop everything",
        "Ctrl-C stops everything.",
    ]
    say("\n  ".join(lines))

    supervisor = Supervisor(units, policy)
    while True:
        supervisor.check()
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
