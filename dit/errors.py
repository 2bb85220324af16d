"""The one exception type for user mistakes.

Faces catch it, print its message (which names the problem and the fix) without a stack trace, and exit
non-zero. Anything else that escapes is a bug and keeps its traceback.
"""

import errno

# What to do about a path the OS refuses (a full disk, a read-only folder, a name too long): a fault of the
# request, whichever write met it first. dit.atomic's writes and the CLI's printer both say it with these.
REFUSED = {
    errno.ENOSPC: "free space on that disk or write elsewhere",
    errno.EDQUOT: "free space on that disk or write elsewhere",
    errno.EACCES: "make the folder writable or write elsewhere",
    errno.EPERM: "make the folder writable or write elsewhere",
    errno.EROFS: "make the folder writable or write elsewhere",
    errno.ENAMETOOLONG: "pass a shorter name",
}


class UserError(ValueError):
    """A mistake in what the user asked for: bad flags, data, checkpoints or configs."""


def unwrap_worker_error(e: UserError) -> UserError:
    """A UserError raised in a DataLoader worker comes back with the worker's whole traceback as its message;
    the user's line is the last one. One line again, as from the main process."""
    text = str(e)
    if "Original Traceback" not in text:
        return e
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return UserError(last.split("UserError: ", 1)[-1])


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency, or say in one line which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{purpose} needs {module.split('.')[0]}, an optional dependency: pip install 'dit-ledger[{extra}]'."
        ) from None
