"""``python -m simulation [--port N]``: serve the provider simulator on loopback until interrupted.

``./platform run`` supervises it as the demo's provider: the demo pool ``eu-frontier`` counts through its
counting APIs (Anthropic, Gemini, OpenAI shapes). ``manage.py simulate`` starts a simulator of its own.
"""

from __future__ import annotations

import argparse
import signal
import threading

from simulation.provider import Simulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    simulator = Simulator()
    try:
        simulator.start(port=args.port)
    except OSError as exc:
        # Another demo platform's simulator (which answers alike) may hold the port: waiting instead of
        # exiting keeps this platform's supervisor from seeing a crash loop.
        print(f"provider simulator: port {args.port} is unavailable ({exc}); not serving", flush=True)
        stop.wait()
        return
    print(f"provider simulator at {simulator.base_url}", flush=True)
    try:
        stop.wait()
    finally:
        simulator.stop()


if __name__ == "__main__":
    main()
