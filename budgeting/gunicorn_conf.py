"""gunicorn settings the launcher passes with ``-c``: multiprocess-safe metrics, no control socket, each
worker's tokenizers loaded before it serves, and gunicorn's own error answers in problem+json."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from gunicorn import util

# The control socket (gunicorn >= 24) sits at one path per user: the launcher's two masters, or two
# platforms on one machine, would fight over it, and nothing here uses it.
control_socket_disable = True


def post_worker_init(worker: Any) -> None:
    """Before a new worker takes its first request: import the URL configuration (and so every view and what
    they import: about 40 ms), read the catalog and load the tokenizer files it provisions. Each is otherwise
    loaded by the first request that needs it, inside it: 0.1–0.2 s for a tiktoken or DeepSeek file, 0.8 s for
    Mistral's tekken, on every worker after every start. Nothing here may keep a worker from serving: what
    fails (the database down at boot, say) is logged and left to the first request, as before."""
    from django.db import connection
    from django.urls import get_resolver

    from budgeting.catalog import snapshot

    try:
        get_resolver().resolve("/api/v1/")
        catalog, _ = snapshot.current()
        loaded = catalog.load_tokenizers()
    except Exception as exc:  # a warm-up: the request that needs it meets the error as it would have
        worker.log.warning("not warmed before its first request: %s", exc)
        return
    finally:
        # Opened on this thread for the read; a threaded worker serves requests on others.
        connection.close()
    worker.log.info("tokenizers loaded before the first request: %s", ", ".join(loaded) or "none")


# gunicorn's own answers, for a request it refuses before the application sees it, by status.
_GUNICORN_PROBLEMS = {
    400: "BAD_REQUEST",
    414: "URI_TOO_LONG",
    431: "HEADERS_TOO_LARGE",
    500: "INTERNAL_ERROR",
}


def on_starting(server: Any) -> None:
    """Before the workers fork: gunicorn's error answers (a request line over ``limit_request_line``: 414,
    headers over its limits: 431, a request it cannot parse: 400) become problem+json with the codes the
    nginx front answers them with, not gunicorn's HTML page. gunicorn has no setting or hook for them: its
    workers call ``gunicorn.util.write_error``, which is replaced here (the front is not always there: it
    needs nginx installed)."""
    util.write_error = _write_problem


def _write_problem(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    code = _GUNICORN_PROBLEMS.get(status_int, "BAD_REQUEST" if status_int < 500 else "INTERNAL_ERROR")
    body = json.dumps(
        {
            "type": f"/problems/{code.lower().replace('_', '-')}",
            "title": reason,
            "status": status_int,
            "code": code,
            "detail": mesg,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/problem+json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting (prometheus_client multiprocess mode)."""
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # unset: single-process metrics, nothing to mark
        multiprocess.mark_process_dead(worker.pid)
