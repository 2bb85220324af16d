"""The quick start: a class-conditional pixel-space DiT on MNIST digits, trained and sampled on a CPU
(``run.py``; ``python -m dit.quickstart``)."""

from dit.quickstart.run import FACE, main

__all__ = ["FACE", "main"]
