"""One env-driven settings module.

Every knob comes from the environment. When the launcher (``./platform``) starts embedded PostgreSQL and
Redis it writes their URLs to ``var/embedded.env``; that file is read only for variables the environment
does not set, so ``manage.py`` works beside a running platform with no configuration.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured

from budgeting.observability.logging import settings_logging

# Lets typed code subscript Django's generic classes at run time (ModelAdmin[Model], QuerySet[Model]).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TB_VAR_DIR", BASE_DIR / "var"))


def _embedded_env() -> dict[str, str]:
    path = VAR_DIR / "embedded.env"
    if not path.exists():
        return {}
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


_EMBEDDED = _embedded_env()


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, _EMBEDDED.get(name, default))


def env_bool(name: str, default: bool) -> bool:
    raw = env(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false)")


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = env(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be >= {minimum}")
    return value


def database_from_url(url: str) -> dict[str, object]:
    """Translate ``postgres://user:pass@host:port/name?options`` into a Django DATABASES entry."""
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(f"DATABASE_URL must be a postgres:// URL, got scheme {parsed.scheme!r}")
    name = unquote(parsed.path.lstrip("/"))
    if not name:
        raise ImproperlyConfigured("DATABASE_URL names no database (postgres://user@host:port/NAME)")
    options = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    # A database that does not answer fails the request fast (503) instead of holding a worker.
    options.setdefault("connect_timeout", "3")
    # The reserving statement is prepared once per connection (ledger/services/postings.py); Django's own
    # statements bind on the client and are never prepared. Behind a pooler in transaction mode, add
    # ?prepare_threshold=none to DATABASE_URL.
    threshold = options.pop("prepare_threshold", "1")
    prepare_threshold: int | None = None if threshold.lower() == "none" else int(threshold)
    host = unquote(parsed.hostname or "") or options.pop("host", "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "CONN_MAX_AGE": env_int("DB_CONN_MAX_AGE", 60),
        "CONN_HEALTH_CHECKS": True,
        "ATOMIC_REQUESTS": False,
        "OPTIONS": {**options, "prepare_threshold": prepare_threshold},
        "TEST": {"NAME": f"test_{name}"},
    }


DATABASE_URL = env("DATABASE_URL")
if not DATABASE_URL:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set. Export it (postgres://user@host:5432/name) or start the platform with "
        "./platform run, which starts an embedded PostgreSQL."
    )
REDIS_URL = env("REDIS_URL")
if not REDIS_URL:
    raise ImproperlyConfigured(
        "REDIS_URL is not set. Export it (redis://host:6379/0) or start the platform with ./platform run, "
        "which starts an embedded Redis."
    )
if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(f"REDIS_URL must be a redis:// or unix:// URL, got {REDIS_URL!r}")

DEBUG = env_bool("DEBUG", False)
# "production" is a deployment: it must bring its own SECRET_KEY and gets the HTTPS settings below by
# default. "local" (the default) is a checkout: ./platform run, tests and manage.py.
DJANGO_ENV = env("DJANGO_ENV", "local")
if DJANGO_ENV not in {"local", "production"}:
    raise ImproperlyConfigured(f"DJANGO_ENV={DJANGO_ENV!r} must be 'local' or 'production'")
PRODUCTION = DJANGO_ENV == "production"
SECRET_KEY_FILE = VAR_DIR / "secret_key"
SECRET_KEY = env("SECRET_KEY") or ""
if not SECRET_KEY and PRODUCTION:
    raise ImproperlyConfigured(
        "SECRET_KEY is not set: a production configuration (DJANGO_ENV=production) needs its own, e.g. "
        "python -c 'import secrets; print(secrets.token_urlsafe(50))'"
    )
if not SECRET_KEY and SECRET_KEY_FILE.exists():
    # The random key ./platform run generated on its first run, so manage.py signs as the platform does.
    SECRET_KEY = SECRET_KEY_FILE.read_text().strip()
if not SECRET_KEY:
    # Nothing signed with it outlives this process, so nobody can forge it.
    SECRET_KEY = secrets.token_urlsafe(50)
ALLOWED_HOSTS = [h.strip() for h in (env("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver") or "").split(",")]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in (env("CSRF_TRUSTED_ORIGINS", "") or "").split(",") if o.strip()]


def proxy_ssl_header(raw: str | None) -> tuple[str, str] | None:
    """``X-Forwarded-Proto: https`` (the header a trusted TLS proxy sets, and its value) as Django's
    SECURE_PROXY_SSL_HEADER."""
    if not raw:
        return None
    name, sep, value = raw.partition(":")
    if not sep or not name.strip() or not value.strip():
        raise ImproperlyConfigured(
            f"SECURE_PROXY_SSL_HEADER={raw!r} must look like 'X-Forwarded-Proto: https'"
        )
    return "HTTP_" + name.strip().upper().replace("-", "_"), value.strip()


# HTTPS: on by default in production (manage.py check --deploy passes), off for the local http run.
SECURE_PROXY_SSL_HEADER = proxy_ssl_header(env("SECURE_PROXY_SSL_HEADER"))
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", PRODUCTION)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", PRODUCTION)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if PRODUCTION else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", PRODUCTION)

# GET /metrics answers a scrape that carries this bearer token, or comes from one of these networks.
METRICS_TOKEN = env("METRICS_TOKEN") or ""
try:
    METRICS_ALLOWED_NETWORKS = [
        ipaddress.ip_network(part.strip())
        for part in (env("METRICS_ALLOWED_NETWORKS", "") or "").split(",")
        if part.strip()
    ]
except ValueError as error:
    raise ImproperlyConfigured(f"METRICS_ALLOWED_NETWORKS: {error}") from None

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "budgeting",
    "ledger",
    "reconciliation",
    "simulation",
    "axes",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "budgeting.observability.logging.RequestLogMiddleware",
    "budgeting.api.middleware.ApiProblemMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # The gateway's plainly well-formed per-call requests are answered here: the middleware below does
    # nothing for them (budgeting/api/hotpath.py).
    "budgeting.api.hotpath.HotPathMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "axes.middleware.AxesMiddleware",
]

# Admin sign-in: after AXES_FAILURE_LIMIT failed attempts a username, and separately an address, is locked
# out for AXES_COOLOFF_MINUTES (budgeting.backoffice.lockouts; platform admins see and lift lockouts).
AUTHENTICATION_BACKENDS = [
    "budgeting.backoffice.lockouts.LockoutBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "admin/lockout.html"
# Every failed sign-in is kept (the "Access failures" page), not only the running count of a lockout.
AXES_ENABLE_ACCESS_FAILURE_LOG = True
# Our own pages for these records (budgeting.backoffice.lockout_admin): lifting a lockout asks for a reason.
AXES_ENABLE_ADMIN = False

ROOT_URLCONF = "budgeting.urls"
WSGI_APPLICATION = "budgeting.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {"default": database_from_url(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

# Request bodies larger than this are refused with 413 before JSON parsing.
MAX_REQUEST_BYTES = env_int("MAX_REQUEST_BYTES", 4 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["budgeting.api.auth.ServiceTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["budgeting.api.parsers.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["budgeting.api.renderers.FastJSONRenderer"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "budgeting.api.negotiation.RefusalAwareNegotiation",
    "EXCEPTION_HANDLER": "budgeting.api.problems.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Token-budget admission API",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "budgeting.api.openapi.forbid_additional_request_properties",
    ],
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
# Every task's options, once: acked after it ran, given back when its worker dies, stopped when it hangs.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = 120
CELERY_TASK_SOFT_TIME_LIMIT = 100
CELERY_TIMEZONE = "UTC"
CELERY_TASK_ALWAYS_EAGER = False

# Token counts per segment live here; the key carries the tokenizer digest and template revision.
COUNT_CACHE_TTL_SECONDS = env_int("COUNT_CACHE_TTL_SECONDS", 7 * 24 * 3600, minimum=1)
# Tokenizer files: fetched at install time into this folder, never at run time.
TOKENIZER_DIR = Path(env("TOKENIZER_DIR", str(VAR_DIR / "tokenizers")) or "")
LEASE_SECONDS = env_int("LEASE_SECONDS", 120, minimum=1)
# How long a process reuses the list of accounts that apply to (tenant, task class, pool).
ACCOUNT_CACHE_SECONDS = env_int("ACCOUNT_CACHE_SECONDS", 5, minimum=0)
# Segment counts kept in each process in front of Redis (an entry is a key of ~100 bytes and an int).
COUNT_CACHE_LOCAL_ENTRIES = env_int("COUNT_CACHE_LOCAL_ENTRIES", 200_000, minimum=0)
# Segment counts kept in each process by their text (ladder.counting.TextCounts), at most this many characters
# of text held: a warm count looks each segment up there without hashing it into a key or asking Redis.
COUNT_CACHE_LOCAL_CHARS = env_int("COUNT_CACHE_LOCAL_CHARS", 20_000_000, minimum=0)
# Provider counting APIs (budgeting/admission/counters): a count waits at most this long, and this many
# timeouts, 429s or 5xx in a row open the API's circuit for the cooldown (no call, counting unavailable).
COUNTING_API_TIMEOUT_SECONDS = env_int("COUNTING_API_TIMEOUT_MS", 2000, minimum=1) / 1000
COUNTING_BREAKER_FAILURES = env_int("COUNTING_BREAKER_FAILURES", 3, minimum=1)
COUNTING_BREAKER_COOLDOWN_SECONDS = env_int("COUNTING_BREAKER_COOLDOWN_SECONDS", 30, minimum=1)
# Ladder decisions kept in each process for repeats of the same components (admission/decision_memo.py),
# bounded by the memory they take (about five times their requests' JSON); 0 turns the memo off.
DECISION_MEMO_BYTES = env_int("DECISION_MEMO_BYTES", 64 * 1024 * 1024, minimum=0)

# Structured logs: JSON lines in production, key=value lines for a person reading a terminal.
LOG_FORMAT = env("LOG_FORMAT", "json" if PRODUCTION else "console")
if LOG_FORMAT not in {"json", "console"}:
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r} must be 'json' or 'console'")
LOGGING = settings_logging(json_lines=LOG_FORMAT == "json", level=env("LOG_LEVEL", "INFO") or "INFO")

# Capacity alerts (budgeting.observability.alerts): a Slack-compatible webhook for threshold crossings.
ALERT_WEBHOOK_URL = env("ALERT_WEBHOOK_URL") or None
