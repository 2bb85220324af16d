"""The quick start (``run.py``; ``python -m dit.quickstart``)."""

from dit.quickstart.run import FACE, main

__all__ = ["FACE", "main"]
