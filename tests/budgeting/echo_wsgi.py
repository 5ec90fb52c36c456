"""A WSGI application for tests/budgeting/test_gunicorn_worker.py: it answers with what the server gave it."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

CLOSED = "/tmp/echo-wsgi-closed"  # overridden by the tests' ECHO_CLOSED


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
    path = environ["PATH_INFO"]
    if path == "/fail":
        raise RuntimeError("a bug in the application")
    if path == "/hang":
        time.sleep(120)
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return Streamed()
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    answer = json.dumps(
        {
            "environ": {key: value for key, value in environ.items() if isinstance(value, str)},
            "body": body.decode("latin-1"),
            "pid": os.getpid(),
            "thread": threading.get_ident(),
        }
    ).encode()
    headers = [("Content-Type", "application/json"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]
    start_response("201 Created", headers)
    return [answer]


class Streamed:
    """Three chunks, a moment apart; closing it (the server must) leaves a mark in ``ECHO_CLOSED``."""

    def __iter__(self) -> Iterator[bytes]:
        for n in range(3):
            yield f"chunk {n} on {threading.get_ident()}\n".encode()
            time.sleep(0.3)

    def close(self) -> None:
        with open(os.environ.get("ECHO_CLOSED", CLOSED), "a") as marks:
            marks.write("closed\n")
