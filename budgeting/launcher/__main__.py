"""Entry point of ``python -m budgeting.launcher run | test [pytest args]``: dispatch, signals, exit."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Sequence

from budgeting.launcher.commands import run, test
from budgeting.launcher.processes import LaunchError, Stop, note_repeat, raise_stop, say


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else ""
    if command not in {"run", "test"} or (command == "run" and len(args) > 1):
        print("usage: python -m budgeting.launcher run | test [pytest args...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, raise_stop)
    signal.signal(signal.SIGTERM, raise_stop)
    with contextlib.ExitStack() as stack:
        try:
            return run(stack) if command == "run" else test(stack, args[1:])
        except Stop as stop:
            say(f"{stop}: stopping")
            return 0 if command == "run" else 128 + stop.signum
        except LaunchError as error:
            say(str(error))
            return 1
        finally:
            # From here on the stack unwinds; a second Ctrl-C must not cut that short.
            signal.signal(signal.SIGINT, note_repeat)
            signal.signal(signal.SIGTERM, note_repeat)


if __name__ == "__main__":
    sys.exit(main())
