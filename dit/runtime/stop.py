"""The stop signals set a flag; the loop that owns it saves and exits at the end of its current step (with
several processes, at the next step where the ranks ask each other: see ``StopFlag``)."""

from __future__ import annotations

import os
import signal
import stat

import torch
import torch.distributed as dist

# Every signal a scheduler or terminal sends before a kill: each saves and exits as SIGTERM does
STOP_SIGNALS = (
    signal.SIGTERM,  # the polite kill: SLURM at the time limit or on scancel, docker stop, Kubernetes, timeout
    signal.SIGINT,  # Ctrl-C
    signal.SIGHUP,  # the terminal went away: an ssh session dropped under a run started without nohup or tmux
    signal.SIGUSR1,  # SLURM's warning before the kill (`#SBATCH --signal=B:USR1@120`), as Lightning uses it
    signal.SIGUSR2,  # the same warning where a site or a job script chose USR2 (Grid Engine's -notify before a kill)
    signal.SIGXCPU,  # a CPU-time limit's soft limit (SLURM, LSF, ulimit -t): the hard limit's SIGKILL follows
)
# Not stops: SIGQUIT (Ctrl-\) quits at once; SIGCONT, SIGTSTP resume and suspend; SIGKILL, SIGSTOP can't be caught

# A stopped run exits 128 + the signal's number (143, 130, ...): "resume me" to a requeue wrapper, not 0, 1 or 2
EXIT_CODES = {s.name: 128 + s.value for s in STOP_SIGNALS}


class EvalStopped(Exception):
    """A stop signal arrived during an in-loop evaluation: its partial scores are dropped, the run saves."""


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader's ``worker_init_fn``: workers leave the stop signals to the main process, which saves."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def close_workers(batches) -> None:
    """Tell a DataLoader iterator's workers (which ignore SIGTERM) to exit now."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # private, but the one way to end them early
    if shutdown is not None:
        shutdown()


def _leave_the_terminal() -> None:
    """SIGHUP: the terminal is gone, so the console goes to /dev/null, as under nohup (log.txt keeps it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(devnull, fd)
            except OSError:  # a closed descriptor: nothing to leave
                pass
    finally:
        os.close(devnull)


class StopFlag:
    """Installs the ``STOP_SIGNALS`` handlers; several processes agree on the stop step in a collective."""

    def __init__(self, world_size: int = 1):
        self.raised: str | None = None
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._old: dict = {}

    def __enter__(self) -> StopFlag:
        self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            if signal.getsignal(s) == self._handle:  # one set since stays (a rank ignoring them as it exits)
                signal.signal(s, h)

    def _handle(self, signum, frame):
        self.raised = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            _leave_the_terminal()

    def should_stop(self, everyone: bool = True) -> bool:
        """Whether to stop now; ``everyone`` (the same on every rank) asks the others, collectively."""
        if self.group is None:
            return self.raised is not None
        if not everyone:
            return False
        # the highest signal number raised on any rank: every rank stops and exits alike, with its name
        flag = torch.tensor([signal.Signals[self.raised].value if self.raised else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        raised = int(flag.item())
        if raised:
            self.raised = signal.Signals(raised).name
        return bool(raised)
