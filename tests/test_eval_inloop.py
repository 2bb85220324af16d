"""Evaluation during training: records at the asked steps against the compute so far, the same images every
time, kept out of the MFU windows, and the same scores on 2 processes as on 1."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_train import tiny_config

from dit.data.digits import DigitDataset, load_mnist_5k
from dit.eval.digit_nets import load_digit_classifier
from dit.eval.reference import digits_reference, save_stats
from dit.train import train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits_ref(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ref") / "digits_ref.npz"
    save_stats(str(path), digits_reference(load_digit_classifier()))
    return str(path)


def digits(n=64):
    return torch.utils.data.Subset(DigitDataset(28), range(0, 5000, 5000 // n))


def eval_config(tmp_path, ref, **kw):
    base = dict(
        image_size=28, patch_size=4, num_classes=10, global_batch_size=16, max_steps=4, log_every=2,
        mfu_warmup_steps=0, eval_every=2, eval_ref=ref, eval_num_samples=70, eval_num_sampling_steps=2,
        eval_batch_size=35,
    )  # fmt: skip
    return tiny_config(tmp_path, **{**base, **kw})


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_evaluations_are_records_against_the_compute_so_far(tmp_path, digits_ref):
    train(eval_config(tmp_path, digits_ref, max_steps=5), digits())
    rows = records(tmp_path / "run")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 5]  # every 2 steps, and at the end
    trains = {r["step"]: r for r in rows if r["kind"] == "train"}
    for r in evals:
        assert np.isfinite(r["fid"]) and r["fid"] > 0 and r["num_images"] == 70
        assert (
            np.isfinite(r["fd_judge"])
            and r["fd_judge"] > 0
            and 0 < r["eval_judge_pflops"] < r["eval_feature_pflops"]
        )
        assert set(r["intervals"]) == {"fid", "fd_judge"}
        assert 1 <= r["inception_score"] <= 10 and 0 <= r["class_accuracy"] <= 1
        assert 0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1
        assert r["eval_sampling_pflops"] > 0 and r["eval_feature_pflops"] > 0 and r["eval_seconds"] > 0
        if r["step"] in trains:
            assert r["total_model_pflops"] == pytest.approx(trains[r["step"]]["total_model_pflops"])
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "evaluation every 2 steps: 70 EMA samples" in log and "eval: step=2 fid=" in log


def test_a_flow_run_is_evaluated_with_its_ode_sampler(tmp_path, digits_ref):
    train(eval_config(tmp_path, digits_ref, objective="flow"), digits())
    evals = [r for r in records(tmp_path / "run") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and all(np.isfinite(r["fid"]) for r in evals)
    assert evals[0]["eval_sampler"] == "ode heun 2 steps, 4 evaluations"
    from dit.checkpoint import latest_checkpoint, load_checkpoint
    from dit.cost.analytic import sampling_flops_per_image
    from dit.model.config import DiTConfig

    model = DiTConfig(**load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))["model_config"])
    heun = sampling_flops_per_image(model, 4, evals[0]["eval_guidance_scale"]).total  # 2 steps x 2 evaluations
    assert evals[0]["eval_sampling_pflops"] == pytest.approx(70 * heun / 1e15)


def test_the_same_weights_score_the_same(tmp_path, digits_ref):
    from dit.eval.inloop import InLoopEval
    from dit.model.config import model_config
    from dit.model.dit import DiT
    from dit.runtime import Runtime

    cfg = eval_config(tmp_path, digits_ref)
    model = DiT.from_config(model_config("DiT-S/4", input_size=28, in_channels=3, num_classes=10, depth=1,
                                         hidden_size=32, num_heads=2))  # fmt: skip
    torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)  # not the zero output of a fresh DiT
    evaluation = InLoopEval(
        cfg.eval, cfg.eval_sampling, seed=cfg.optim.seed, image_size=cfg.model.image_size,
        objective=cfg.objective.build(model.config),
        runtime=Runtime("cpu"), model=model, vae=None, vae_spec=None,
    )  # fmt: skip
    first, second = evaluation.run(model), evaluation.run(model)
    assert first["fid"] == second["fid"] and first["class_accuracy"] == second["class_accuracy"]


def test_evaluation_time_stays_out_of_the_mfu_window(tmp_path, digits_ref, monkeypatch):
    """Each evaluation takes 1,000 s on the clock every timer reads (not a sleep raced against the steps' own time,
    which a loaded machine stretches): the window of steps 3-4 holds none of it."""
    from dit.eval.inloop import InLoopEval

    real_run, real_clock, skipped = InLoopEval.run, time.perf_counter, []

    def slow(self, ema, stop=None):
        skipped.append(1000.0)
        return real_run(self, ema, stop)

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + sum(skipped))
    monkeypatch.setattr(InLoopEval, "run", slow)
    train(eval_config(tmp_path, digits_ref, max_steps=4), digits())
    window = next(r for r in records(tmp_path / "run") if r["kind"] == "train" and r["step"] == 4)
    assert skipped and window["window_s"] < 1000.0  # the evaluation after step 2 was paused out


def test_bad_eval_settings_fail_at_start(tmp_path, digits_ref):
    from dit.io.errors import UserError

    with pytest.raises(UserError, match="--eval-ref"):
        eval_config(tmp_path, None)
    with pytest.raises(UserError, match="at least 65"):
        train(eval_config(tmp_path, digits_ref, eval_num_samples=20), digits())
    # the sampler's own checks name train.py's flags, not sample.py's
    with pytest.raises(UserError, match=r"^--eval-num-sampling-steps 2000 exceeds the diffusion's 1000 steps"):
        train(eval_config(tmp_path, digits_ref, eval_num_sampling_steps=2000), digits())
    assert not (tmp_path / "run" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.slow
def test_two_processes_score_as_one(tmp_path, digits_ref):
    images, labels = load_mnist_5k()
    for i in range(0, 5000, 5000 // 32):
        folder = tmp_path / "digits" / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(folder / f"{i}.png")
    argv = ["train.py", "--data-path", str(tmp_path / "digits"), "--vae", "none", "--model", "DiT-S/4", "--depth", "1",
            "--hidden-size", "32", "--num-heads", "2", "--image-size", "28", "--num-classes", "10",
            "--global-batch-size", "16", "--max-steps", "2", "--precision", "fp32", "--num-workers", "0",
            "--log-every", "1", "--peak-tflops", "0.05", "--eval-every", "2", "--eval-ref", digits_ref,
            "--eval-num-samples", "70", "--eval-sampling-steps", "2", "--eval-batch-size", "10"]  # fmt: skip
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=300)
    one = subprocess.run([sys.executable, *argv, "--results-dir", str(tmp_path / "one")], **env_run)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two = subprocess.run([*torchrun, *argv, "--results-dir", str(tmp_path / "two")], **env_run)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = ([r for r in records(tmp_path / d) if r["kind"] == "eval"] for d in ("one", "two"))
    assert len(a) == len(b) == 1
    for key in ("fid", "inception_score", "precision", "recall", "class_accuracy"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-3, abs=1e-4), key


def test_a_stop_during_an_evaluation_drops_it_and_saves(tmp_path, digits_ref, monkeypatch):
    """SIGTERM while the evaluation samples: the flag is asked between batches, the partial evaluation is
    dropped, the step is saved, the run reports the stop (the whole evaluation used to run first)."""
    import os
    import signal

    import dit.eval.inloop as inloop
    from dit.checkpoint import latest_checkpoint, load_checkpoint

    calls, real = [], inloop.generate

    def generate_then_signal(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        return real(*a, **kw)

    monkeypatch.setattr(inloop, "generate", generate_then_signal)
    result = train(eval_config(tmp_path, digits_ref, max_steps=4), digits())
    assert result["signal"] == "SIGTERM" and result["step"] == 2
    assert len(calls) == 1, "the second of the two batches was not sampled"
    assert not [r for r in records(tmp_path / "run") if r["kind"] == "eval"]
    assert load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))["step"] == 2
    assert "evaluation at step 2 dropped: SIGTERM" in (tmp_path / "run" / "log.txt").read_text()
