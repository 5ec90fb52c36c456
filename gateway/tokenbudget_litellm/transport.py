"""Our REST API from inside the proxy's event loop: kept-alive connections, one deadline per call.

The proxy serves every request on one asyncio loop, so a call to us must never block it, and every
microsecond it spends on the loop is a microsecond on some call's path. ``AsyncApi`` is HTTP/1.1 over the
loop's own transports (``asyncio.Protocol``; the proxy's loop may be uvloop's), with h11 (httpx's HTTP/1.1
state machine, so in every LiteLLM install) reading the answers: a request is written to an idle
kept-alive connection with one ``transport.write``, without a turn of the loop. Against aiohttp (the
client this replaced) that took the admission's bytes from about 0.9 ms to a few tens of microseconds after
the hook asked (aiohttp writes a body from a task of its own, so the bytes left only once the loop had
run everything ahead of that task), and each call's CPU on the loop from about 0.25 ms to well under
0.1 ms (``bench/gateway_bench.py``; the figures are in bench/README.md). Connections are kept alive and
reused: a call costs no TCP (or TLS) handshake; one idle longer than ``keepalive_s`` is closed rather than
trusted. At most ``max_connections`` are open at once; a call beyond them waits for one.

Every ``request`` is bounded by ONE overall deadline that covers connecting, its retries and their
back-off: a hung API answers ``ApiUnavailable`` within the deadline, never after attempts × a per-attempt
timeout.

``request`` writes the request before it returns when a kept-alive connection is idle, and returns the
coroutine that awaits the answer: a caller may go on with its request on the wire and await the answer
later (the hook lets LiteLLM route the call while its admission is decided).

Retries and what a status means are those of ``tokenbudget_gateway.transport`` (``RetryPolicy``,
``is_retryable_status``): a call is repeated unchanged, which is safe because every write is idempotent by
its ids.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final, cast

import h11
from tokenbudget_gateway.errors import ApiError, ApiUnavailable, StaleFence
from tokenbudget_gateway.transport import ApiResponse, BaseUrl, RetryPolicy, is_retryable_status

logger = logging.getLogger(__name__)

_USER_AGENT: Final = "tokenbudget-litellm"
# Our API's answers are small JSON documents; a larger one is refused rather than buffered.
_MAX_ANSWER_BYTES: Final = 8 * 1024 * 1024


class _Answer:
    """An exchange's answer as it arrives."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: one exchange at a time; back in its pool when the answer is
    whole and both sides may go on."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self.transport: asyncio.Transport | None = None
        # Counted among the pool's open connections until it is closed or given up.
        self.counted = True
        self.idle_since = 0.0
        self._answer: _Answer | None = None
        self._waiter: asyncio.Future[_Answer] | None = None

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not subclasses of asyncio's).
        self.transport = cast(asyncio.Transport, transport)

    def exchange(self, head: h11.Request, body: bytes | None) -> asyncio.Future[_Answer]:
        """Write the request now (one write, no turn of the loop); the future is its answer."""
        assert self.transport is not None
        out = self._http.send(head) or b""
        if body:
            out += self._http.send(h11.Data(data=body)) or b""
        out += self._http.send(h11.EndOfMessage()) or b""
        self._answer = _Answer()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(out)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (a server's idle timeout notice, say): the next answer could not be
            # told from them.
            self.abandon()
            return
        self._http.receive_data(data)
        self._read_events()

    def eof_received(self) -> bool:
        self._http.receive_data(b"")
        self._read_events()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        self._fail(ConnectionResetError(f"connection lost: {exc}" if exc else "connection closed"))

    def abandon(self) -> None:
        """The exchange was given up (deadline, cancellation): this connection cannot be reused."""
        if self.transport is not None:
            self.transport.abort()

    def _read_events(self) -> None:
        try:
            while self._waiter is not None:
                event = self._http.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                self._on(event)
        except h11.ProtocolError as exc:
            self._fail(exc)
            self.abandon()

    def _on(self, event: Any) -> None:
        answer = self._answer
        assert answer is not None
        if isinstance(event, h11.Response):
            answer.status = event.status_code
            answer.headers = {
                name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers
            }
        elif isinstance(event, h11.Data):
            answer.body += event.data
            if len(answer.body) > _MAX_ANSWER_BYTES:
                raise h11.RemoteProtocolError("answer too large")
        elif isinstance(event, h11.EndOfMessage):
            waiter, self._waiter, self._answer = self._waiter, None, None
            reusable = (
                self._http.our_state is h11.DONE
                and self._http.their_state is h11.DONE
                and not self._http.trailing_data[0]
            )
            if reusable:
                self._http.start_next_cycle()
                self._pool.release(self)
            else:
                self._pool.forget(self)
                if self.transport is not None:
                    self.transport.close()
            if waiter is not None and not waiter.done():
                waiter.set_result(answer)
        elif isinstance(event, h11.ConnectionClosed):
            self._fail(ConnectionResetError("connection closed before the answer"))
        # h11.InformationalResponse (1xx): the final answer follows.

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter, self._answer = self._waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class _Pool:
    """The kept-alive connections to one host: idle ones are taken newest first."""

    def __init__(self, base: BaseUrl, *, max_connections: int, keepalive_s: float) -> None:
        self._base = base
        self._ssl = ssl.create_default_context() if base.https else None
        self._port = base.port or (443 if base.https else 80)
        self._max = max_connections
        self._keepalive_s = keepalive_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_idle(self) -> _Connection | None:
        """An idle connection still fit to use, or None (then ``connect``)."""
        loop = asyncio.get_running_loop()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable and loop.time() - connection.idle_since < self._keepalive_s:
                return connection
            self.forget(connection)
            connection.abandon()
        return None

    async def connect(self) -> _Connection:
        """A new connection, once fewer than ``max_connections`` are open. Raises ``OSError``."""
        while self._open >= self._max:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
            idle = self.take_idle()
            if idle is not None:
                return idle
        self._open += 1
        made: list[_Connection] = []

        def protocol() -> _Connection:
            made.append(_Connection(self))
            return made[-1]

        try:
            _, connection = await asyncio.get_running_loop().create_connection(
                protocol,
                self._base.host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._base.host if self._ssl else None,
            )
        except BaseException:
            if made:
                self.forget(made[-1])
            else:
                self._open -= 1
                self._wake()
            raise
        return connection

    def release(self, connection: _Connection) -> None:
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.append(connection)
        self._wake()

    def forget(self, connection: _Connection) -> None:
        """A connection closed or given up: no longer counted, nor offered."""
        if connection in self._idle:
            self._idle.remove(connection)
        if connection.counted:
            connection.counted = False
            self._open -= 1
            self._wake()

    def _wake(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abandon()


class AsyncApi:
    """JSON over HTTP to our REST API with a bearer token; see the module docstring.

    ``deadline_s`` bounds each ``request`` whole. Raises ``ValueError`` for a base URL that is not http(s).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        deadline_s: float,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        monotonic: Callable[[], float] = time.monotonic,
        max_connections: int = 200,
        keepalive_s: float = 30.0,
    ) -> None:
        self._base = BaseUrl.parse(base_url)
        netloc = self._base.host if self._base.port is None else f"{self._base.host}:{self._base.port}"
        self._headers = [
            ("Host", netloc),
            ("Authorization", f"Bearer {token}"),
            ("Accept", "application/json"),
            ("User-Agent", _USER_AGENT),
        ]
        self.deadline_s = deadline_s
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rand = rand
        self._monotonic = monotonic
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._pool: _Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _connections(self) -> _Pool:
        """The pool of the running loop (created on first use: its connections belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._pool is None or self._loop is not loop:
            self._pool = _Pool(
                self._base, max_connections=self._max_connections, keepalive_s=self._keepalive_s
            )
            self._loop = loop
        return self._pool

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Coroutine[Any, Any, ApiResponse]:
        """One call, retrying transient failures with the identical body, all within the deadline.

        The request is written at once, before this returns, when a kept-alive connection is idle: a
        caller that does not await the answer yet (the hook, while LiteLLM routes the call) goes on with
        its request already on the wire. Otherwise it is sent when the returned coroutine first runs (it
        connects first). Awaiting the coroutine raises ``StaleFence``/``ApiError`` for an error answer,
        ``ApiUnavailable`` when the deadline passed or the retries ran out (``reached`` false when no
        attempt got a connection).
        """
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = h11.Request(
            method=method,
            target=self._base.path + path,
            headers=[
                *self._headers,
                *([("Content-Type", "application/json"), ("Content-Length", str(len(data)))] if data else []),
                *(headers or {}).items(),
            ],
        )
        deadline = self._monotonic() + self.deadline_s
        first = None
        connection = self._connections().take_idle()
        if connection is not None:
            try:
                first = (connection, connection.exchange(head, data))
            except h11.ProtocolError:
                connection.abandon()
        return self._exchange(method, path, head, data, deadline, first)

    async def _exchange(
        self,
        method: str,
        path: str,
        head: h11.Request,
        data: bytes | None,
        deadline: float,
        first: tuple[_Connection, asyncio.Future[_Answer]] | None,
    ) -> ApiResponse:
        cause = "no attempt made"
        reached = False
        for attempt in range(1, self._retry.attempts + 1):
            if attempt > 1:
                pause = self._retry.backoff(attempt - 1, self._rand())
                if self._monotonic() + pause >= deadline:
                    break
                await self._sleep(pause)
            left = deadline - self._monotonic()
            if left <= 0:
                if first is not None:
                    first[0].abandon()
                    reached = True
                break
            connection, answer = first if first is not None else (None, None)
            first = None
            try:
                async with asyncio.timeout(left):
                    if connection is None or answer is None:
                        connection = self._connections().take_idle() or await self._connections().connect()
                        answer = connection.exchange(head, data)
                    got = await answer
            except TimeoutError:
                if connection is not None:
                    connection.abandon()
                # The request may have been sent before the deadline cut it short.
                reached = reached or connection is not None
                cause = f"no answer within the {self.deadline_s:g} s deadline"
                logger.info("%s %s attempt %d: %s", method, path, attempt, cause)
                break
            except asyncio.CancelledError:
                if connection is not None:
                    connection.abandon()
                raise
            except (OSError, h11.ProtocolError) as exc:
                if connection is not None:
                    connection.abandon()
                # Refused, reset or a broken exchange: the call may or may not have been applied, and
                # repeating it unchanged is safe because every write is idempotent by its ids.
                cause = f"{type(exc).__name__}: {exc}"
                # Only a connection that was never made proves nothing was sent.
                reached = reached or connection is not None
                logger.info("%s %s attempt %d failed: %s", method, path, attempt, cause)
                continue
            parsed = _json_or_none(bytes(got.body))
            status = got.status
            if is_retryable_status(status, parsed):
                reached = True
                cause = f"HTTP {status}"
                continue
            if status >= 400:
                problem = parsed if isinstance(parsed, dict) else None
                error = (
                    StaleFence if problem is not None and problem.get("code") == "STALE_FENCE" else ApiError
                )
                raise error(status, problem, path, got.headers.get("retry-after"))
            return ApiResponse(status=status, headers=got.headers, body=parsed)
        raise ApiUnavailable(method, path, cause, reached=reached)

    async def aclose(self) -> None:
        """Close the kept connections."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
