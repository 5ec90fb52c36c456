"""``python -m simulation [--port N] [--deepseek-v3 TOKENIZER_FILE --deepseek-v3-model NAME ...]``: serve
the provider simulator on loopback until interrupted.

``./platform run`` supervises it as the demo's provider: the demo pool ``eu-frontier`` counts through its
counting APIs (Anthropic, Gemini, OpenAI shapes), and the README's LiteLLM example sends its calls here. The
demo's DeepSeek-V3 models are counted as DeepSeek counts them (``--deepseek-v3``: the tokenizer file, and
each such model), so the prompt tokens it reports are those a real DeepSeek endpoint would; any other model
gets the default estimate. ``manage.py simulate`` starts a simulator of its own.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from simulation.completions import PromptCounter
from simulation.deepseek_chat_template import deepseek_v3_counter
from simulation.provider import Simulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--deepseek-v3", type=Path, help="DeepSeek-V3's tokenizer file")
    parser.add_argument(
        "--deepseek-v3-model", action="append", default=[], help="a model counted with it (repeatable)"
    )
    args = parser.parse_args()
    counters: dict[str, PromptCounter] = {}
    if args.deepseek_v3 is not None and args.deepseek_v3_model:
        if args.deepseek_v3.is_file():
            counter = deepseek_v3_counter(args.deepseek_v3)
            counters = dict.fromkeys(args.deepseek_v3_model, counter)
        else:
            missing = f"provider simulator: no {args.deepseek_v3}: every model gets the default estimate"
            print(missing, flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    simulator = Simulator(model_counters=counters)
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
