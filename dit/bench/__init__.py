"""Benchmarks of what users run, over the public step API: one dataclass per mode (``dit.bench.config``),
one ``run`` (``dit.bench.runner``) that returns rows, so ``scripts/benchmark.py`` only parses, prints and writes JSON."""

from dit.bench.runner import MODES, Result, run

__all__ = ["MODES", "Result", "run"]
