"""gunicorn settings the launcher passes with ``-c``: multiprocess-safe metrics, no control socket, and each
worker's tokenizers loaded before it serves."""

from __future__ import annotations

import os
from typing import Any

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


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting (prometheus_client multiprocess mode)."""
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # unset: single-process metrics, nothing to mark
        multiprocess.mark_process_dead(worker.pid)
