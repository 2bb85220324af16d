"""The one exception type for user mistakes: faces print its message (the problem and the fix) without a traceback
and exit non-zero; anything else is a bug and keeps its traceback."""

import errno
import importlib

from dit import __version__

# The key under which every versioned file we write records its writer, named when a newer file is refused
WRITER_KEY = "dit_ledger_version"

# What to do about a path the OS refuses (a full disk, a read-only folder, a name too long), for every writer
REFUSED = {
    **dict.fromkeys((errno.ENOSPC, errno.EDQUOT), "free space on that disk or write elsewhere"),
    **dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), "make the folder writable or write elsewhere"),
    errno.ENAMETOOLONG: "pass a shorter name",
}


class UserError(ValueError):
    """A mistake in what the user asked for: bad flags, data, checkpoints or configs."""


class ReportedByRankZero(UserError):
    """A user error every rank meets at once: rank 0 raises the line, the others this, without it."""


def unwrap_worker_error(e: UserError) -> UserError:
    """A DataLoader worker's UserError (its message the worker's whole traceback) as its last line again."""
    text = str(e)
    if "Original Traceback" not in text:
        return e
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return UserError(last.split("UserError: ", 1)[-1])


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency, or say in one line which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{purpose} needs {module.split('.')[0]}, an optional dependency: pip install 'dit-ledger[{extra}]'."
        ) from None


def refuse_newer_format(path, what: str, found, newest, writer=None) -> None:
    """Every reader's check of a versioned file: refuse one whose format ``found`` is newer than ``newest``, naming
    the version that wrote it (``writer``); both are versions or ``name/N`` tags; older and other formats pass."""

    def number(tag) -> int | None:
        if isinstance(tag, int) and not isinstance(tag, bool):
            return tag
        if isinstance(tag, str) and isinstance(newest, str):
            name, _, n = tag.rpartition("/")
            if name == newest.rpartition("/")[0] and n.isdigit():
                return int(n)
        return None

    version, top = number(found), number(newest)
    if version is None or version <= top:
        return
    by = f"dit-ledger {writer}" if isinstance(writer, str) and writer else "a newer dit-ledger"
    raise UserError(
        f"{path} is a {what} of format {version}, written by {by}; this dit-ledger ({__version__}) reads formats up "
        f"to {top}: upgrade dit-ledger to read it (git pull in its clone)."
    )
