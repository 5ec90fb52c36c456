"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free loopback port below the kernel's range for outgoing connections' local ports.

    A test chooses a port, then a server binds it, often seconds later (the launcher after its embedded
    servers, the LiteLLM proxy after 10-60 s, the simulator and our API again at every test of a module). A
    port of that range (what binding port 0 gives) can be given in between to any connection the machine
    opens: a CI run saw ``Address already in use`` for the simulator's port while the suite's other parts ran
    beside it. Below the range, only a listener that asks for the port can take it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free loopback port below the ephemeral range")
