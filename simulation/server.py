"""HTTP/1.1 plumbing of the provider simulator: connections a stop can abort, JSON and SSE out, TCP resets."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

logger = logging.getLogger(__name__)

_MAX_BODY_BYTES: Final = 32 * 1024 * 1024


class TrackingServer(ThreadingHTTPServer):
    """A threading server that knows its open connections, so that a stop can abort them."""

    daemon_threads = True
    # Tests start and stop many simulators; do not wait for TIME_WAIT to free a port.
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[WireHandler]) -> None:
        super().__init__(address, handler)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def track(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(connection)

    def untrack(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(connection)

    def abort_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class WireHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 with the writing and reading helpers the endpoints share (OpenAI-style errors)."""

    protocol_version = "HTTP/1.1"
    # A real provider's server does not wait for the client's (delayed, 40 ms) ACK of the headers before it
    # sends the body: without TCP_NODELAY every answer of the simulator did (Nagle's algorithm), and a
    # zero-delay call took ~50 ms.
    disable_nagle_algorithm = True
    server: TrackingServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError:
            # The client reset the connection between or during requests it never completed; nothing was
            # processed for them, so there is nothing to bill and nothing worth a traceback.
            self.close_connection = True

    def finish(self) -> None:
        self.server.untrack(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("simulator: " + format, *args)

    def _sse(self, event: Mapping[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _bearer(self) -> str | None:
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit() or int(raw) > _MAX_BODY_BYTES:
            return None
        return int(raw)

    def _discard_body(self) -> None:
        length = self._content_length()
        if length is None:
            self.close_connection = True
        else:
            self.rfile.read(length)

    def _read_json(self) -> dict[str, Any] | None:
        length = self._content_length()
        if length is None:
            self.close_connection = True
            self._send_error(411, "invalid_request_error", "length_required", "send a Content-Length")
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self._send_error(400, "invalid_request_error", "invalid_json", "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self._send_error(400, "invalid_request_error", "invalid_json", "the body is not a JSON object")
            return None
        return body

    def _reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), so the client sees ECONNRESET, not EOF."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # rfile holds a reference to the socket that would defer the real close (and so the RST).
        self.rfile.close()
        self.connection.close()

    def _send_error(self, status: int, error_type: str, code: str, message: str) -> None:
        body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        self._send_json(status, body)

    def _send_json(
        self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        self._send_bytes(status, json.dumps(body).encode(), "application/json", headers)

    def _send_bytes(
        self, status: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
