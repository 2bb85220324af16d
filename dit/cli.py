"""What every face shares: user errors become one clear line and a non-zero exit, not a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dit.errors import UserError


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Call ``main(argv)``; a UserError prints ``error: <message>`` to stderr and returns exit code 2.

    A reader that closes the pipe early (``dit-cost peaks | head``) ends the output, not the program with a
    traceback: the rest goes to /dev/null (the recipe of Python's signal documentation) and the exit is
    141, as a shell reports a process ended by SIGPIPE."""
    try:
        return int(main(argv) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
