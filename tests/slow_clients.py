"""Clients that send a request's headers whole, then its body a byte at a time: what must cost the API
memory, not a worker (issue 22 §3; tests/launcher/test_slow_clients.py and
tests/budgeting/test_gunicorn_worker.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class SlowClients:
    """``count`` connections, each sending ``head(n)`` (a request's headers, ending in its blank line), then
    ``body`` a byte every ``pause`` seconds (the body is long enough to outlast the measurement)."""

    def __init__(
        self, port: int, count: int, head: Callable[[int], bytes], body: bytes, pause: float = 1.0
    ) -> None:
        self.port, self.head, self.body, self.pause = port, head, body, pause
        self.stop = threading.Event()
        self.connected = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self.run, args=(n,), daemon=True) for n in range(count)]

    def run(self, n: int) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(self.head(n))
            self.connected.release()
            for byte in self.body:
                if self.stop.wait(self.pause):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return

    def __enter__(self) -> SlowClients:
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert self.connected.acquire(timeout=30), "a slow client could not connect"
        time.sleep(2 * self.pause)  # every slow client has begun its body
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
