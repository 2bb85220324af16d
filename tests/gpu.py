"""The ``cuda`` marker's plugin (loaded by conftest.py): the tests that check what train.py runs on a GPU.

``@pytest.mark.cuda(seconds=G, dry_seconds=C)`` marks a test that needs a CUDA device; without one it is
skipped, unless ``DIT_GPU_DRY_RUN=1`` (``scripts/gpu_validate.sh --dry-run``): then it runs on the CPU with tiny
shapes, its CUDA-only parts recorded as skipped. Each marked test runs under its limit, G seconds on the device,
C in the dry run: past it the test fails and the next one runs; a test stuck in C code past the limit and
``KILL_AFTER`` ends the process with every thread's traceback. With ``DIT_GPU_RESULTS=FILE`` each marked test's
outcome, seconds and figures are rewritten to FILE as it ends (what ``gpu_validate.sh`` brings back).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRY_RUN = os.environ.get("DIT_GPU_DRY_RUN") == "1"
KILL_AFTER = 10  # seconds past a test's limit before a test stuck where no signal reaches is killed
_results: dict[str, dict] = {}


class Ctx:
    """What a marked test runs on: the real shapes on the GPU, tiny ones on the CPU in the dry run; the figures
    it records, the parts it could not run here, and the checks that did not hold (all listed before it fails)."""

    def __init__(self, work: Path):
        import torch

        self.work = work
        self.device = torch.device("cpu" if DRY_RUN else "cuda:0")  # an index: DDP, NCCL and FSDP2 name it
        self.cuda = self.device.type == "cuda"
        self.figures: dict = {}
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []

    def cuda_only(self, part: str, what: str) -> bool:
        """True on CUDA; else records ``part`` as skipped (``what`` needs CUDA)."""
        if not self.cuda:
            self.skipped[part] = f"{what} is CUDA-only: skipped in the CPU dry run"
        return self.cuda


@pytest.fixture
def ctx(tmp_path, record_property) -> Ctx:
    context = Ctx(tmp_path)
    record_property("figures", context.figures)  # filled as the test runs: the results file reads it after
    record_property("skipped_parts", context.skipped)
    return context


def python(*argv: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """The repository's Python (a script, ``-m dit.cost``) in its own process, the repository first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def limit(item) -> float | None:
    marker = item.get_closest_marker("cuda")
    return None if marker is None else marker.kwargs["dry_seconds" if DRY_RUN else "seconds"]


@pytest.hookimpl(tryfirst=True)  # before the fixtures: a process group needs the device
def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") is not None and not DRY_RUN:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (DIT_GPU_DRY_RUN=1 runs it on the CPU, as gpu_validate.sh --dry-run)")


def _over(seconds: float):
    def handler(signum, frame):
        pytest.fail(f"over its {seconds:g} s limit", pytrace=True)

    return handler


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    seconds = limit(item)
    if seconds is None:
        return (yield)
    # to the process's stderr, the runner's log (pytest --capture=sys leaves it as it is)
    faulthandler.dump_traceback_later(seconds + KILL_AFTER, exit=True, file=sys.__stderr__)
    previous = signal.signal(signal.SIGALRM, _over(seconds))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    path = os.environ.get("DIT_GPU_RESULTS")
    if not path or "cuda" not in report.keywords or (report.when != "call" and report.outcome == "passed"):
        return
    record = _results.setdefault(report.nodeid, {"test": report.nodeid, "outcome": report.outcome, "seconds": 0.0})
    record["seconds"] += report.duration
    if report.outcome != "passed":
        record.update(outcome=report.outcome, phase=report.when, error=tail(report.longreprtext, 30))
    record.update({k: v for k, v in report.user_properties if v})
    _write(Path(path), complete=False)


def pytest_sessionfinish(session):
    if os.environ.get("DIT_GPU_RESULTS"):
        _write(Path(os.environ["DIT_GPU_RESULTS"]), complete=True)


def _write(path: Path, complete: bool) -> None:
    from dit.io.atomic import atomic_write_bytes

    record = {"dry_run": DRY_RUN, "complete": complete, "tests": list(_results.values())}
    atomic_write_bytes(path, (json.dumps(record, indent=2, default=str) + "\n").encode())
