"""The start-up's fit check (``Parallelism.fit``): the step's estimated memory (``dit.cost.memory``) against the
device's, before anything is built or written. The GPU is faked (its memory query), so nothing here needs one,
and DiT-XL/2 is never built: the check needs only its config."""

import re
import types

import torch
from helpers import make_image_folder, run_face
from test_train import Pixels, tiny_config

from dit.cost.memory import estimate_training_memory, usable_memory
from dit.io.errors import UserError
from dit.model.layers import attention_kernel
from dit.runtime import Runtime
from dit.train.config import TrainConfig
from dit.train.data import micro_batch
from dit.train.parallel import parallelism

GPU = 80 * 2**30  # an 80 GB GPU (H100, A100)


def _fit_on_fake_gpu(monkeypatch, **flat):
    """What train.py's start-up decides for ``--model DiT-XL/2`` (and ``flat``) on one 80 GB GPU, faked:
    (blocks, why) or the UserError; with the estimate's settings, for the test to check against."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=GPU)
    )
    cfg = TrainConfig.of(model="DiT-XL/2", **flat)
    runtime = Runtime("cpu", cfg.runtime.precision)
    runtime.device = torch.device("cuda", 0)  # the fit check's view; nothing is placed on it
    model_cfg = cfg.model_config(4, cfg.model.image_size // 8)  # the SD VAE's latents
    micro = micro_batch(cfg.optim.global_batch_size, 1, cfg.optim.grad_accum_steps)
    kernel = attention_kernel(cfg.parallel.attention, "cuda", runtime.precision.compute_dtype)
    options = dict(precision=cfg.runtime.precision, gradient_as_bucket_view=True, attention="fused")
    assert kernel not in ("explicit", "math")

    def estimate(blocks):
        return estimate_training_memory(model_cfg, micro, checkpointed_blocks=blocks, **options)

    try:
        decided = parallelism(cfg.parallel, runtime).fit(model_cfg, micro, cfg.optim.grad_accum_steps, kernel)
    except UserError as e:
        decided = e
    return decided, estimate, model_cfg.depth


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def test_the_default_xl2_run_checkpoints_the_fewest_blocks_that_fit_an_80gb_gpu(monkeypatch):
    """The default (auto) picks the fewest blocks that fit and says so in one line; it used to run with none
    and fail at step 1 with CUDA out of memory."""
    (blocks, why), estimate, depth = _fit_on_fake_gpu(monkeypatch)
    usable = usable_memory(GPU)
    assert estimate(0).total > GPU  # the default does not fit without checkpointing
    assert 0 < blocks < depth
    assert estimate(blocks).total <= usable < estimate(blocks - 1).total
    assert "\n" not in why and f"the first {blocks} of {depth} blocks" in why
    assert _gib(estimate(0).total) in why and _gib(usable) in why and "cuda:0's 80.0 GiB" in why


def test_checkpointing_fixed_off_is_refused_in_one_line_on_an_80gb_gpu(monkeypatch):
    error, estimate, _ = _fit_on_fake_gpu(monkeypatch, activation_checkpointing="none")
    line = str(error)
    assert isinstance(error, UserError) and "\n" not in line
    assert f"needs an estimated {_gib(estimate(0).total)}" in line and "cuda:0's 80.0 GiB" in line
    assert "--activation-checkpointing auto (it fits with " in line and "more GPUs" in line
    steps, per_pass = map(int, re.search(r"--grad-accum-steps (\d+) \((\d+) images per pass\)", line).groups())
    assert steps > 1 and steps * per_pass == 256  # the default batch, on one process


def test_a_batch_that_does_not_fit_even_with_every_block_checkpointed_is_refused(monkeypatch):
    error, estimate, depth = _fit_on_fake_gpu(monkeypatch, global_batch_size=2048)
    line = str(error)
    assert isinstance(error, UserError) and "\n" not in line
    assert estimate(depth).total > usable_memory(GPU)
    assert f"{_gib(estimate(depth).total)} per step with {depth} of {depth} blocks" in line
    assert "--activation-checkpointing auto" not in line  # it is auto already
    assert "--grad-accum-steps" in line and "more GPUs" in line


def test_a_cpu_run_over_the_hosts_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dit.runtime.host_memory.host_memory_bytes", lambda: 2 * 2**30 + 2**20, raising=False)
    images = make_image_folder(tmp_path / "images", {"a": 4, "b": 4})
    run = tmp_path / "run"
    argv = ["--data-path", images, "--vae", "none", "--depth", "2", "--hidden-size", "384", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "4", "--max-steps", "1",
            "--precision", "fp32", "--num-workers", "0", "--device", "cpu", "--results-dir", str(run)]  # fmt: skip
    code, out, err = run_face("train.py", argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "GiB usable of the host's 2.0 GiB" in err and "more GPUs" in err
    assert [p.name for p in run.iterdir() if p.name != ".lock"] == []  # no config.yaml, log or checkpoint


def test_a_cpu_run_checkpoints_the_blocks_its_hosts_memory_needs(tmp_path, monkeypatch):
    """On a CPU the host's memory is the limit: a budget between the estimates with one block checkpointed
    and none makes the run recompute one block, and its log says why."""
    from dit.train import Trainer

    cfg = tiny_config(tmp_path, global_batch_size=32, hidden_size=64, memory_reserve_gib=0)
    model_cfg = cfg.model_config(3, 8)

    def estimate(blocks):
        options = dict(checkpointed_blocks=blocks, gradient_as_bucket_view=True)
        return estimate_training_memory(model_cfg, 32, "fp32", **options).total

    assert estimate(1) < estimate(0)
    monkeypatch.setattr("dit.runtime.host_memory.host_memory_bytes", lambda: estimate(1), raising=False)
    trainer = Trainer(cfg, Runtime("cpu"), Pixels())
    trainer.run()
    assert trainer.state.model.num_checkpointed_blocks == 1
    assert "activation checkpointing (auto): the first 1 of 2 blocks" in (tmp_path / "run" / "log.txt").read_text()
