"""What every section of scripts/gpu_validate.py runs on: its context, and running the repository's Python."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Ctx:
    """What a section runs on: the real shapes on the GPU, tiny ones on the CPU in a dry run."""

    def __init__(self, work: Path, dry_run: bool, budget: float):
        import torch

        self.work, self.dry_run, self.budget, self.start = work, dry_run, budget, time.perf_counter()
        work.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cpu" if dry_run else "cuda:0")  # an index: DDP, NCCL and FSDP2 name it
        self.cuda = self.device.type == "cuda"
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def cuda_only(self, part: str, what: str) -> bool:
        """True on CUDA; else records ``part`` as skipped (``what`` needs CUDA)."""
        if not self.cuda:
            self.skipped[part] = f"{what} is CUDA-only: skipped in the CPU dry run"
        return self.cuda


def _python(*argv: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
