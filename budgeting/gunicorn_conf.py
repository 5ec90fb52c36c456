"""gunicorn settings the launcher passes with ``-c``: multiprocess-safe metrics, no control socket."""

from __future__ import annotations

from typing import Any

# The control socket (gunicorn >= 24) sits at one path per user: the launcher's two masters, or two
# platforms on one machine, would fight over it, and nothing here uses it.
control_socket_disable = True


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting (prometheus_client multiprocess mode)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
