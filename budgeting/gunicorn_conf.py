"""gunicorn settings the launcher passes with ``-c``: multiprocess-safe Prometheus metrics."""

from __future__ import annotations

from typing import Any


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting (prometheus_client multiprocess mode)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
