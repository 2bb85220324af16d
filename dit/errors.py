"""The one exception type for user mistakes.

Faces catch it, print its message (which names the problem and the fix) without a stack trace, and exit
non-zero. Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in what the user asked for: bad flags, data, checkpoints or configs."""
