"""The gunicorn worker that serves the API (``gunicorn_conf.worker_class``): aiohttp's HTTP server before the
WSGI application, in each worker process.

gunicorn's own workers read HTTP in Python: its parser, and for ``gthread`` a hand-off of every request to a
thread pool and back. Through the LiteLLM proxy that layer was most of what separated our API's round trip
from the bare admission (bench/gateway_servers.py, bench/README.md). Here aiohttp reads requests with its C
parser (llhttp) in the worker's event loop; once a request's body has arrived whole, the WSGI application
(Django, with every middleware) answers it on the worker's one application thread. So:

- requests run one at a time per worker, as in a sync worker, and Django's connections stay open from one
  request to the next on that thread (``CONN_MAX_AGE``);
- a client that sends slowly costs a coroutine and its buffer, not the worker: the loop reads other requests
  meanwhile (the nginx front is no longer what keeps slow clients from the workers; it still bounds headers
  and request lines, and times out clients that pause);
- what the worker refuses itself answers problem+json, as the API does: a body over ``MAX_REQUEST_BYTES``
  (413 ``BODY_TOO_LARGE``), a request line over ``limit_request_line`` (414 ``URI_TOO_LONG``), a header over
  ``limit_request_field_size`` or more than ``limit_request_fields`` of them (431 ``HEADERS_TOO_LARGE``),
  anything else it cannot parse (400 ``BAD_REQUEST``);
- the environ is what gunicorn's would be: PATH_INFO percent-decoded as latin-1, repeated headers joined by
  commas, and a header whose name holds an underscore dropped (it would alias a dashed one, ``X_Real_IP``
  for ``X-Real-IP``: gunicorn's ``header_map = drop``). A chunked body arrives decoded, with its length.

The heartbeat, the signals and the shutdown are aiohttp's gunicorn worker's, which this extends.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar
from urllib.parse import unquote_to_bytes

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler
from aiohttp.worker import GunicornWebWorker
from django.conf import settings
from multidict import CIMultiDict

from budgeting.api.problems import PROBLEM_CONTENT_TYPE

_REFUSALS: Final = {
    400: ("BAD_REQUEST", "Bad request"),
    413: ("BODY_TOO_LARGE", "Body too large"),
    414: ("URI_TOO_LONG", "Request line too long"),
    431: ("HEADERS_TOO_LARGE", "Headers too large"),
    500: ("INTERNAL_ERROR", "Internal error"),
}
# The environ's own entries that no request header may set.
_NOT_HEADERS: Final = frozenset({"HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH", "HTTP_TRANSFER_ENCODING"})
_HOP_BY_HOP: Final = frozenset({"transfer-encoding", "connection"})

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
_T = TypeVar("_T")


def problem_bytes(status: int, detail: str) -> bytes:
    """A refusal the server answers itself, in the API's problem+json shape."""
    code, title = _REFUSALS.get(status, _REFUSALS[400 if status < 500 else 500])
    body = {"type": f"/problems/{code.lower().replace('_', '-')}", "title": title, "status": status}
    return json.dumps({**body, "code": code, "detail": detail}).encode()


def _refusal(status: int, detail: str) -> web.Response:
    response = web.Response(
        body=problem_bytes(status, detail), status=status, content_type=PROBLEM_CONTENT_TYPE
    )
    response.force_close()
    return response


class ApiWorker(GunicornWebWorker):
    """See the module docstring."""

    async def _run(self) -> None:
        # As GunicornWebWorker._run, with this module's server for any WSGI application rather than an
        # aiohttp application.
        bridge = WsgiBridge(self.wsgi, secure=self.cfg.is_ssl)
        # gunicorn's limits, 0 meaning none.
        line_limit = self.cfg.limit_request_line or sys.maxsize
        access_log = self.log.access_log if self.cfg.accesslog else None
        server = _Server(
            bridge.handle,
            line_limit,
            access_log_class=AccessLogger,
            access_log=access_log,
            access_log_format=self._get_valid_log_format(self.cfg.access_log_format),
            logger=self.log,
            keepalive_timeout=self.cfg.keepalive,
            max_line_size=line_limit,
            max_field_size=self.cfg.limit_request_field_size or sys.maxsize,
            max_headers=self.cfg.limit_request_fields or sys.maxsize,
        )
        runner = web.ServerRunner(server, shutdown_timeout=self.cfg.graceful_timeout / 100 * 95)
        await runner.setup()
        context = self._create_ssl_context(self.cfg) if self.cfg.is_ssl else None
        for sock in self.sockets:
            await web.SockSite(runner, sock, ssl_context=context).start()
        self.booted = True
        while self.alive:
            if not bridge.busy_longer_than(self.timeout):
                self.notify()
            if self.ppid != os.getppid():
                self.alive = False
                self.log.info("Parent changed, shutting down: %s", self)
            else:
                await self._wait_next_notify()
        await runner.cleanup()
        bridge.close()


class _Handler(RequestHandler):
    """aiohttp's connection handler, whose own refusals answer problem+json."""

    line_limit = 0

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # As aiohttp's: part of an answer went out, the connection is broken.
            raise ConnectionError("the answer was being sent when the request failed")
        if isinstance(exc, LineTooLong):
            # The parser names the limit it met: the request line's, or a header's.
            status = 414 if exc.args[1] == self.line_limit else 431
        elif isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc):
            status = 431
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            # A client's request this server could not read: one line, no traceback.
            self.logger.info("refused a request from %s: %s %s", request.remote, status, message or exc)
        return _refusal(status, message or str(exc or ""))


class _Server(web.Server):
    """aiohttp's low-level server, its connections handled by ``_Handler``."""

    def __init__(self, handler: Any, line_limit: int, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.line_limit = line_limit

    def __call__(self) -> RequestHandler:
        connection = _Handler(self, loop=self._loop, **self._kwargs)
        connection.line_limit = self.line_limit
        return connection


class WsgiBridge:
    """A WSGI application answering aiohttp's requests, each on the one application thread once its body has
    arrived whole (see the module docstring)."""

    def __init__(self, application: WSGIApp, *, secure: bool = False) -> None:
        self.application = application
        self.scheme = "https" if secure else "http"
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="wsgi")
        self.busy_since: float | None = None

    def close(self) -> None:
        self.thread.shutdown(wait=True)

    def busy_longer_than(self, seconds: float) -> bool:
        """Whether the application thread has been in one call for over ``seconds`` (0: never). The worker
        then stops its heartbeat, so that gunicorn kills and replaces it after its ``timeout``, as it does a
        sync worker stuck in a request: the loop alone would keep a stuck worker looking alive."""
        since = self.busy_since
        return seconds > 0 and since is not None and time.monotonic() - since > seconds

    async def _on_thread(self, call: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._timed, call, *args)

    def _timed(self, call: Callable[..., _T], *args: Any) -> _T:
        self.busy_since = time.monotonic()
        try:
            return call(*args)
        finally:
            self.busy_since = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        limit = settings.MAX_REQUEST_BYTES
        if request.content_length is not None and request.content_length > limit:
            return _refusal(413, f"body exceeds {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                return _refusal(413, f"body exceeds {limit} bytes")
            chunks.append(chunk)
        environ = self.environ(request, b"".join(chunks))
        status, headers, body = await self._on_thread(self._called, environ)
        code, _, reason = status.partition(" ")
        if isinstance(body, bytes):
            return web.Response(body=body, status=int(code), reason=reason, headers=_kept(headers, False))
        response = web.StreamResponse(status=int(code), reason=reason, headers=_kept(headers, True))
        await response.prepare(request)
        try:
            while (piece := await self._on_thread(_next, body)) is not None:
                await response.write(piece)
        finally:
            await self._on_thread(_close, body)
        await response.write_eof()
        return response

    def _called(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes | Iterator[bytes]]:
        """On the application thread: the application's status, headers and either its whole body (a
        response held in memory: a list, or Django's ``streaming = False``) or an iterator of its chunks."""
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, headers]
            return lambda data: None

        result = self.application(environ, start_response)
        if not isinstance(result, list | tuple) and getattr(result, "streaming", True):
            iterator = iter(result)
            first = next(iterator, None)
            return started[0], started[1], _Chained(first, iterator, result)
        try:
            return started[0], started[1], b"".join(result)
        finally:
            _close(result)

    def environ(self, request: web.BaseRequest, body: bytes) -> dict[str, Any]:
        raw_path, _, query = request.raw_path.partition("?")
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        local = transport.get_extra_info("sockname") if transport is not None else None
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(raw_path).decode("latin-1"),
            "QUERY_STRING": query,
            "RAW_URI": request.raw_path,
            "SERVER_PROTOCOL": f"HTTP/{request.version.major}.{request.version.minor}",
            "SERVER_NAME": str(local[0]) if isinstance(local, tuple) else "localhost",
            "SERVER_PORT": str(local[1]) if isinstance(local, tuple) else "",
            "REMOTE_ADDR": str(peer[0]) if isinstance(peer, tuple) else "",
            "REMOTE_PORT": str(peer[1]) if isinstance(peer, tuple) else "",
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": self.scheme,
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        for name, value in request.headers.items():
            if "_" in name:
                continue
            key = "HTTP_" + name.upper().replace("-", "_")
            if key in _NOT_HEADERS:
                continue
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ


class _Chained:
    """A streamed body: its first chunk, then the rest; closing it closes the application's result."""

    def __init__(self, first: bytes | None, rest: Iterator[bytes], result: Iterable[bytes]) -> None:
        self.first, self.rest, self.result = first, rest, result

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return next(self.rest)

    def close(self) -> None:
        _close(self.result)


def _next(chunks: Iterator[bytes]) -> bytes | None:
    return next(chunks, None)


def _close(result: Any) -> None:
    close = getattr(result, "close", None)
    if close is not None:
        close()


def _kept(headers: list[tuple[str, str]], streamed: bool) -> CIMultiDict[str]:
    """The application's headers, without those the server sets: the length of a body it sends whole, and
    the hop-by-hop framing."""
    dropped = (
        {"transfer-encoding", "connection"}
        if streamed
        else {"content-length", "transfer-encoding", "connection"}
    )
    return CIMultiDict((name, value) for name, value in headers if name.lower() not in dropped)
