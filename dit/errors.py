"""The one exception type for user mistakes.

Faces catch it, print its message (which names the problem and the fix) without a stack trace, and exit
non-zero. Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in what the user asked for: bad flags, data, checkpoints or configs."""


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency, or say in one line which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{purpose} needs {module.split('.')[0]}, an optional dependency: pip install 'dit-ledger[{extra}]'."
        ) from None
