"""The stop signals: which ones stop a run, the loader workers' side, and how often the ranks ask each other."""

import os
import signal

import pytest
from test_train import Pixels, tiny_config

import dit.runtime.stop as stop_module
from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.runtime import Runtime
from dit.runtime.stop import EXIT_CODES, StopFlag, ignore_stop_signals
from dit.train.trainer import Trainer

# "you are about to be killed" from a scheduler or a terminal; SIGQUIT (Ctrl-\) stays an immediate quit
STOPS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU]


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_every_stop_signal_sets_the_flag_and_exits_as_the_shell_reports_it(sig, monkeypatch):
    left = []  # SIGHUP leaves the terminal (tests/test_train_cli.py::test_a_dropped_terminal_saves), not pytest's
    monkeypatch.setattr(stop_module, "_leave_the_terminal", lambda: left.append(1))
    quit_before = signal.getsignal(signal.SIGQUIT)  # SIG_IGN in a job a shell started in the background
    with StopFlag() as flag:
        assert signal.getsignal(sig) == flag._handle
        assert signal.getsignal(signal.SIGQUIT) == quit_before  # left alone: Ctrl-\ quits at once, unsaved
        os.kill(os.getpid(), sig)  # the handler only sets the flag
        assert flag.raised == sig.name and flag.should_stop()
        assert len(left) == (sig == signal.SIGHUP)
    assert signal.getsignal(sig) != flag._handle  # the old handler is back
    assert EXIT_CODES[sig.name] == 128 + sig.value  # 129 for SIGHUP, 138 for SIGUSR1 on Linux


def test_loader_workers_ignore_every_stop_signal():
    saved = {s: signal.getsignal(s) for s in STOPS}
    try:
        ignore_stop_signals()
        for s in STOPS:
            assert signal.getsignal(s) == signal.SIG_IGN, s.name
            os.kill(os.getpid(), s)  # and this process lives on
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def several_processes(flag: StopFlag, monkeypatch, others: int = 0) -> list:
    """``flag`` as one rank of several: its group's all-reduce (MAX) meets the other ranks' ``others`` (a
    signal number, 0 for none); returns the list its calls are counted in."""
    flag.group, calls, real = object(), [], stop_module.dist.all_reduce

    def all_reduce(tensor, op=None, group=None):
        if group is not flag.group:
            return real(tensor, op=op, group=group)
        calls.append(1)
        tensor.clamp_(min=others)

    monkeypatch.setattr(stop_module.dist, "all_reduce", all_reduce)
    return calls


def test_another_ranks_signal_stops_this_rank_under_its_name(monkeypatch):
    flag = StopFlag()
    calls = several_processes(flag, monkeypatch, others=signal.SIGHUP.value)
    assert not flag.should_stop(everyone=False) and not calls  # no collective between the asking steps
    assert flag.should_stop(everyone=True) and flag.raised == "SIGHUP" and len(calls) == 1


def train_signalled_after(tmp_path, monkeypatch, flag: StopFlag, step: int, sig=signal.SIGUSR1, **kw) -> dict:
    """A tiny run in this process that gets ``sig`` at the end of step ``step``."""
    real = Trainer.train_step

    def train_step(self, batches, log_step):
        grad_norm = real(self, batches, log_step)
        if self.state.step == step:
            os.kill(os.getpid(), sig)
        return grad_norm

    monkeypatch.setattr(Trainer, "train_step", train_step)
    cfg = tiny_config(tmp_path, **kw)
    os.makedirs(cfg.checkpoint.results_dir, exist_ok=True)
    with Runtime.of(cfg.runtime) as runtime, flag:
        return Trainer(cfg, runtime, Pixels()).run(flag)


def test_several_processes_ask_each_other_at_log_and_checkpoint_steps_only(tmp_path, monkeypatch):
    """The stop flag's collective (a host barrier over all ranks) ran every step: now only at log and
    checkpoint steps, so a signal after step 5 stops every rank at step 6, the next log step, saved there."""
    flag, log_every, ckpt_every = StopFlag(), 3, 4
    calls = several_processes(flag, monkeypatch)
    result = train_signalled_after(tmp_path, monkeypatch, flag, 5, max_steps=12, log_every=log_every,
                                   ckpt_every=ckpt_every)  # fmt: skip
    asked = [s for s in range(1, 7) if s % log_every == 0 or s % ckpt_every == 0]
    assert result["signal"] == "SIGUSR1" and result["step"] == asked[-1] == 6
    assert len(calls) == len(asked)  # 3 collectives in 6 steps
    assert load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))["step"] == 6


def test_one_process_stops_at_the_step_the_signal_came(tmp_path, monkeypatch):
    """Alone, the flag is read at every step (free): a signal after step 5 (no log step) stops and saves there."""
    result = train_signalled_after(tmp_path, monkeypatch, StopFlag(), 5, signal.SIGUSR2, max_steps=12, log_every=3)
    assert result["signal"] == "SIGUSR2" and result["step"] == 5
    assert load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))["step"] == 5
