"""What every face shares: user errors become one clear line and a non-zero exit, not a traceback; a rank's exit."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from dit.io.errors import REFUSED, ReportedByRankZero, UserError


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Call ``main(argv)``: a UserError is ``error: <message>`` and exit 2, a closed pipe exit 141 (as SIGPIPE), an
    OSError the OS refuses on a path a user error; a bar still drawn is closed first."""
    try:
        return int(main(argv) or 0)
    except UserError as e:
        _end_bars()
        if not isinstance(e, ReportedByRankZero):
            print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.filename is None or e.errno not in REFUSED:
            raise
        _end_bars()
        print(f"error: cannot use {e.filename}: {e.strerror}. {REFUSED[e.errno].capitalize()}.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _end_bars()
        print("interrupted", file=sys.stderr)
        return 130


def exit_process(code: int) -> NoReturn:
    """End a face's process with ``code``. One rank of several (``WORLD_SIZE`` > 1) runs the exit handlers, flushes
    and leaves with ``os._exit``, as torch.multiprocessing's workers do: torch keeps the process group's threads
    (gloo's workers) alive until the interpreter's teardown, and a teardown that meets them can abort a rank that
    finished (SIGABRT, which torchrun reports as the job's failure)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()  # logging, multiprocessing's children, weakref finalizers: as a normal exit runs them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream has nothing left to flush
            stream.flush()
    os._exit(code)


def _end_bars() -> None:
    """Close the progress bars still drawn (none where dit.io.progress was never imported: dit-cost stays light)."""
    progress = sys.modules.get("dit.io.progress")
    if progress is not None:
        progress.end_bars()
