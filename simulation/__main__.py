"""``python -m simulation [--port 8100]``: serve the provider simulator on loopback until interrupted, so
that a LiteLLM proxy (the README's example) or any OpenAI-compatible client has a provider to call."""

from __future__ import annotations

import argparse
import signal
import threading

from simulation.provider import Simulator


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m simulation", description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    simulator = Simulator(seed=args.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        f"provider simulator at {simulator.start(port=args.port)}/v1 (any API key); Ctrl-C stops it",
        flush=True,
    )
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        simulator.stop()


if __name__ == "__main__":
    main()
