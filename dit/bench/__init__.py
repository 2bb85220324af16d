"""Benchmarks of what users run: a dataclass per mode (``config``), one ``run`` (``runner``) that returns rows."""

from dit.bench.runner import MODES, Result, run

__all__ = ["MODES", "Result", "run"]
