"""The buffering front of ``./platform run``: nginx in front of gunicorn, so that slow clients cost memory.

gunicorn's sync workers read a request's body themselves: thirty clients sending a body a byte a second held
every worker, and every other request waited. nginx reads each request whole (headers and body, in memory up
to ``BODY_BUFFER``, in a temporary file beyond it) and only then hands it to gunicorn over loopback, where it
arrives at once; it also bounds what a request may be (``MAX_REQUEST_BYTES`` for a body: 413; headers: 431,
a request line: 414, all problem+json like the API's own answers, gunicorn's too) and how long a client may
take to send it.

nginx is a Debian package (``apt-get install nginx``), not a PyPI one: when it is not installed the launcher
says so and gunicorn serves the port itself, as before. In production put the same front (this
configuration, or the load balancer's equivalent: request buffering on, the same limits) before gunicorn.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
from pathlib import Path
from typing import Any

from budgeting.launcher.processes import LOOPBACK

# Bodies up to this size stay in nginx's memory; larger ones (up to MAX_REQUEST_BYTES) go to a temporary file.
BODY_BUFFER = "256k"
# A request's line and headers: 8 KiB for the first buffer, at most 4 × 16 KiB in all.
HEADER_BUFFER, LARGE_HEADER_BUFFERS = "8k", "4 16k"
# How long a client may pause while sending its headers or body, and nginx waits for gunicorn's answer.
CLIENT_TIMEOUT_S, UPSTREAM_TIMEOUT_S = 30, 120
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # budgeting.settings.MAX_REQUEST_BYTES


def nginx_binary() -> str | None:
    """The nginx to run: ``NGINX`` if set (empty turns the front off), else the one installed, or None."""
    if "NGINX" in os.environ:
        return os.environ["NGINX"] or None
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(path, os.X_OK)), None
    )


def _problem(status: int, code: str, title: str, detail: str) -> str:
    slug = code.lower().replace("_", "-")
    body = (
        f'{{"type": "/problems/{slug}", "title": "{title}", "status": {status}, "code": "{code}", '
        f'"detail": "{detail}"}}'
    )
    return body.replace("'", "\\'")


def configuration(prefix: Path, port: int, upstream_port: int) -> str:
    """nginx.conf for a front on ``LOOPBACK:port`` before gunicorn on ``LOOPBACK:upstream_port``, with its
    pid and temporary files under ``prefix``."""
    limit = int(os.environ.get("MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES))
    too_large = _problem(413, "BODY_TOO_LARGE", "Payload Too Large", f"body exceeds {limit} bytes")
    headers = _problem(431, "HEADERS_TOO_LARGE", "Request Header Fields Too Large", "headers are too large")
    uri = _problem(414, "URI_TOO_LONG", "URI Too Long", "the request line is too long")
    timeout = _problem(408, "REQUEST_TIMEOUT", "Request Timeout", "the request was not sent in time")
    down = _problem(503, "SERVICE_UNAVAILABLE", "Service Unavailable", "the API is restarting; retry shortly")
    # nginx's workers drop root's privileges; their temporary files must be theirs.
    user = ""
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        user = f"user {nobody.pw_name} {grp.getgrgid(nobody.pw_gid).gr_name};"
    temp = {name: prefix / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return f"""
daemon off;
master_process on;
worker_processes 1;
{user}
pid {prefix / "nginx.pid"};
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    server_tokens off;
    client_body_temp_path {temp["body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    client_max_body_size {limit};
    client_body_buffer_size {BODY_BUFFER};
    client_header_buffer_size {HEADER_BUFFER};
    large_client_header_buffers {LARGE_HEADER_BUFFERS};
    client_header_timeout {CLIENT_TIMEOUT_S}s;
    client_body_timeout {CLIENT_TIMEOUT_S}s;
    send_timeout {UPSTREAM_TIMEOUT_S}s;
    keepalive_timeout 75s;
    server {{
        listen {LOOPBACK}:{port} backlog=2048;
        location / {{
            proxy_pass http://{LOOPBACK}:{upstream_port};
            proxy_request_buffering on;
            proxy_buffering on;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_read_timeout {UPSTREAM_TIMEOUT_S}s;
            # gunicorn's own limits (a 4 KiB request line, 8 KiB a header) are below the front's and answer
            # HTML: its 414 and 431 are answered as the front's own (the statuses with an error_page below;
            # the API's 413 is the same problem as the front's).
            proxy_intercept_errors on;
        }}
        error_page 413 @too_large;
        error_page 494 =431 @headers;
        error_page 431 @headers;
        # Past the front's own line buffer the request has no URI to reach a named location with.
        error_page 414 /__front/uri-too-long;
        error_page 408 @timeout;
        error_page 502 504 =503 @down;
        location @too_large {{ default_type application/problem+json; return 413 '{too_large}'; }}
        location @headers {{ default_type application/problem+json; return 431 '{headers}'; }}
        location = /__front/uri-too-long {{
            internal;
            default_type application/problem+json;
            return 414 '{uri}';
        }}
        location @timeout {{ default_type application/problem+json; return 408 '{timeout}'; }}
        location @down {{
            default_type application/problem+json;
            add_header Retry-After 1 always;
            return 503 '{down}';
        }}
    }}
}}
"""


def prepare(prefix: Path, port: int, upstream_port: int) -> Path:
    """Write the configuration and make its folders (owned by nginx's workers when run as root); its path."""
    prefix.mkdir(parents=True, exist_ok=True)
    for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        folder = prefix / name
        folder.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    path = prefix / "nginx.conf"
    path.write_text(configuration(prefix, port, upstream_port))
    return path


def argv(binary: str, conf: Path) -> list[str]:
    """nginx in the foreground on ``conf``, its early errors on stderr (not in a log file of its own)."""
    return [binary, "-p", str(conf.parent), "-c", str(conf), "-e", "stderr"]


def client_address_from_front(application: Any) -> Any:
    """The WSGI application seeing the client's address (``X-Real-IP``, which the front overwrites) rather
    than the front's, for what reads ``REMOTE_ADDR``: admin sign-in lockouts, the metrics' networks, logs.
    Only a request from loopback (the front) is trusted with the header."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        real = environ.get("HTTP_X_REAL_IP")
        if real and environ.get("REMOTE_ADDR") == LOOPBACK:
            environ["REMOTE_ADDR"] = real
        return application(environ, start_response)

    return wrapped
