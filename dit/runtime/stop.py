"""SIGTERM/SIGINT set a flag; the loop that owns it saves and exits at the end of its current step."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

# What a stopped run exits with, as a shell reports a process killed by the signal (128 + its number), so a
# requeue wrapper tells "stopped, resume me" (143, 130) from "finished" (0) and "failed" (1, or 2 for a
# user error).
EXIT_CODES = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}


class EvalStopped(Exception):
    """A stop signal arrived during an in-loop evaluation: its partial scores are dropped, the run saves."""


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader's ``worker_init_fn``: SLURM, ``timeout`` and Ctrl-C signal the whole process group, and a
    worker killed by SIGTERM took the run down with a traceback and no save (4 of 4 tries with 2 workers).
    Workers leave the stop signals to the main process, which saves and stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def close_workers(batches) -> None:
    """Tell a DataLoader iterator's workers to exit now (they ignore SIGTERM, so the loader's fallback,
    ``terminate()``, would not end them): a run that fails keeps its iterator alive in the traceback, and
    the workers held the exit for minutes (200 s in tests/test_faults.py::test_8). torch's own shutdown."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # private, but the one way to end them early
    if shutdown is not None:
        shutdown()


class StopFlag:
    """A context that installs the handlers and restores the old ones on exit.

    With several processes the flag is OR-reduced at every ``should_stop`` over a gloo group on the CPU,
    which costs a few microseconds and never waits on the GPU, so all ranks stop at the same step.
    """

    def __init__(self, world_size: int = 1):
        self.raised: str | None = None
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._old: dict = {}

    def __enter__(self) -> StopFlag:
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame):
        self.raised = signal.Signals(signum).name

    def should_stop(self) -> bool:
        if self.group is None:
            return self.raised is not None
        flag = torch.tensor([1 if self.raised else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and not self.raised:
            self.raised = "SIGTERM"  # another rank's: every rank stops and exits alike
        return bool(flag.item())
