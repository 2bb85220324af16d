"""The trainer: exact resume, metrics and their MFU, the non-finite guard, bad input."""

import json
import math
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from dit.cost.analytic import training_flops_per_image
from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.train import TrainConfig, train

METRIC_KEYS = {
    "step",
    "epoch",
    "loss",
    "grad_norm",
    "lr",
    "steps_per_sec",
    "images_per_sec",
    "images_per_sec_per_device",
    "tokens_per_sec_per_device",
    "model_tflops_per_device",
    "measured_tflops_per_device",
    "peak_tflops",
    "peak_source",
    "mfu",
    "hfu",
    "host_data_wait_frac",
    "max_memory_gib",
    "max_memory_reserved_gib",
    "alloc_retries",
    "loss_scale",
}


class Pixels(torch.utils.data.Dataset):
    """Random 3x8x8 images in [-1, 1] with 4 classes; ``nan_items`` return NaN images."""

    def __init__(self, n=32, nan_items=()):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 3, 8, 8, generator=g) * 2 - 1
        self.y = torch.arange(n) % 4
        self.nan_items = set(nan_items)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:  # augmentation randomness, seeded per item by the trainer
            x = x.flip(-1)
        if i in self.nan_items:
            x = torch.full_like(x, float("nan"))
        return x, int(self.y[i])


def tiny_config(tmp_path, **kw):
    base = dict(
        model="DiT-S/2",
        depth=2,
        hidden_size=32,
        num_heads=2,
        image_size=8,
        num_classes=4,
        vae="none",
        global_batch_size=8,
        max_steps=6,
        lr=1e-3,
        precision="fp32",
        num_workers=0,
        log_every=2,
        ckpt_every=1000,
        results_dir=str(tmp_path / "run"),
        peak_tflops=0.05,
    )
    base.update(kw)
    return TrainConfig.of(**base)


def test_a_resume_that_changes_the_weight_decay_trains_with_the_new_one(tmp_path):
    """--allow-changes weight_decay: the optimizer's restored groups held the old decay, and the resumed run
    trained bit for bit as if nothing had changed."""
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    runs = {}
    for wd in (0.0, 0.5):
        folder = tmp_path / f"wd{wd}"
        shutil.copytree(tmp_path / "run", folder)
        cfg = tiny_config(tmp_path, max_steps=4, resume="auto", weight_decay=wd, allow_changes=["weight_decay"],
                          results_dir=str(folder))  # fmt: skip
        train(cfg, Pixels())
        runs[wd] = load_checkpoint(latest_checkpoint(folder / "checkpoints"))
    assert all(g["weight_decay"] == 0.5 for g in runs[0.5]["optimizer"]["param_groups"])
    assert not torch.equal(
        runs[0.5]["model"]["x_embedder.proj.weight"], runs[0.0]["model"]["x_embedder.proj.weight"]
    )


def weights(path):
    ckpt = load_checkpoint(path)
    return ckpt["model"], ckpt["ema"], ckpt["optimizer"]["state"]


def test_resume_is_bit_identical(tmp_path):
    straight = train(tiny_config(tmp_path / "a", max_steps=6), Pixels())
    train(tiny_config(tmp_path / "b", max_steps=3), Pixels())
    resumed = train(tiny_config(tmp_path / "b", max_steps=6, resume="auto"), Pixels())
    assert straight["step"] == resumed["step"] == 6
    last = latest_checkpoint(tmp_path / "b" / "run" / "checkpoints")
    written = last.stat().st_mtime_ns
    train(tiny_config(tmp_path / "b", max_steps=6, resume="auto"), Pixels())  # finished: nothing to redo
    assert last.stat().st_mtime_ns == written  # and the last checkpoint is not written again
    a = weights(latest_checkpoint(tmp_path / "a" / "run" / "checkpoints"))
    b = weights(latest_checkpoint(tmp_path / "b" / "run" / "checkpoints"))
    for sa, sb in zip(a[:2], b[:2]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    for pa, pb in zip(a[2].values(), b[2].values()):
        assert torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
    # the zero-initialised output layer really moved, so the equality above means something
    assert torch.count_nonzero(a[0]["final_layer.linear.weight"]) > 0


def test_metrics_jsonl_and_tensorboard(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=8, log_every=2, mfu_warmup_steps=0, sample_every=4)
    train(cfg, Pixels())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    saved = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    flops = training_flops_per_image(DiTConfig(**saved["model_config"]))
    for r in rows:
        assert METRIC_KEYS <= r.keys()
        memory = {"max_memory_gib", "max_memory_reserved_gib", "alloc_retries"}
        for k in METRIC_KEYS - memory - {"loss_scale", "peak_source"}:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), k
        assert all(r[k] is None for k in memory) and r["loss_scale"] is None  # no CUDA, no fp16
        # independent MFU: counted FLOPs / measured step time / peak
        step_time = 1.0 / r["steps_per_sec"]
        expected = 8 * flops.model / step_time / (0.05e12)
        assert r["mfu"] == pytest.approx(expected, rel=0.01)
        assert r["images_per_sec"] == pytest.approx(8 * r["steps_per_sec"], rel=0.01)
        assert 0 <= r["host_data_wait_frac"] <= 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("samples/ema")] == [4, 8]  # EMA grids, kept out of the MFU windows
    tb = {e.step: e.value for e in ea.Scalars("train/mfu")}
    assert sorted(tb) == [2, 4, 6, 8]
    for r in rows:
        assert tb[r["step"]] == pytest.approx(r["mfu"], rel=1e-6)
    assert [e.value for e in ea.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def test_a_nan_batch_is_skipped_and_counted(tmp_path):
    data = Pixels(nan_items={5})
    train(tiny_config(tmp_path, max_steps=8, log_every=8), data)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["nonfinite_steps"] >= 1 and math.isfinite(row["loss"])
    model, ema, _ = weights(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert all(torch.isfinite(v).all() for v in list(model.values()) + list(ema.values()))


def test_nonfinite_streak_stops_with_last_good_state(tmp_path):
    data = Pixels(nan_items=range(32))
    with pytest.raises(UserError, match="non-finite for 4 steps"):
        train(tiny_config(tmp_path, max_steps=20, log_every=4, max_nonfinite=3), data)
    saved = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in saved] == [4]
    model, _, _ = weights(saved[0][1])
    assert all(torch.isfinite(v).all() for v in model.values())
    assert torch.count_nonzero(model["final_layer.linear.weight"]) == 0  # no update was ever applied


def test_a_streak_that_ends_between_log_steps_is_still_seen():
    from dit.runtime import Runtime
    from dit.train.ledger import StepCounters

    counters, loss = StepCounters(torch.device("cpu")), torch.tensor(0.5)
    for bad in (0, 1, 1, 1, 0, 1):
        counters.add(loss, torch.tensor(bool(bad)))
    with Runtime("cpu") as runtime:
        first = counters.read(runtime)
        assert (first["longest_nonfinite_streak"], first["nonfinite_streak"], first["nonfinite_steps"]) == (
            3,
            1,
            4,
        )
        counters.add(loss, torch.tensor(True))  # the running streak carries into the next window
        assert counters.read(runtime)["longest_nonfinite_streak"] == 2


def test_refuses_to_overwrite_or_resume_a_different_run(tmp_path):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    with pytest.raises(UserError, match="--resume auto"):
        train(tiny_config(tmp_path, max_steps=4), Pixels())
    with pytest.raises(UserError, match="hidden 64"):
        train(tiny_config(tmp_path, max_steps=4, hidden_size=64, resume="auto"), Pixels())


def test_bad_configs_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        train(tiny_config(tmp_path, precision="fp16"), Pixels())
    with pytest.raises(UserError, match="--data-path"):
        train(tiny_config(tmp_path))
    with pytest.raises(UserError, match="divisible"):
        train(tiny_config(tmp_path, global_batch_size=9, grad_accum_steps=2), Pixels())
    with pytest.raises(UserError, match="max-steps"):
        tiny_config(tmp_path, max_steps=0)


@pytest.mark.parametrize("repa", [False, True])
def test_no_host_sync_outside_log_steps(tmp_path, monkeypatch, repa):
    """Count every way a step could read a device value back (item, tolist, bool, float, int, numpy); with REPA
    (its encoder run in the step, the projector, the alignment loss and its counter) too."""
    from dit.runtime import Runtime
    from dit.train import Trainer

    options = {}
    if repa:
        from helpers import random_vit_weights

        weights = random_vit_weights(tmp_path / "vit.safetensors")
        options = dict(repa_encoder="test_vit", repa_encoder_weights=weights, repa_depth=1, repa_projector_dim=16)
    trainer = Trainer(tiny_config(tmp_path, max_steps=4, log_every=1000, **options), Runtime("cpu"), Pixels())
    assert (trainer.repa is not None) == repa
    batches = [next(iter(trainer.loader))]
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    with _ScalarReads() as reads:  # and the C++ conversions (a tensor passed where a number is expected)
        for _ in range(3):
            trainer.train_step(batches, log_step=False)
    assert calls == [] and reads.count == 0 and trainer.state.step == 3
    with _ScalarReads() as reads:
        trainer.counters.loss_sum.item()  # the spies do see a read when there is one
    assert calls == ["item"] and reads.count == 1


class _ScalarReads(TorchDispatchMode):
    """Counts aten::_local_scalar_dense, the op every device-to-host scalar read goes through."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_auto_checkpointing_picks_the_fewest_blocks_that_fit():
    from dit.cost.memory import estimate_training_memory, fewest_checkpointed_blocks, usable_memory
    from dit.model.config import model_config

    xl = model_config("DiT-XL/2")
    full = estimate_training_memory(xl, 128, "bf16", checkpointed_blocks=0).total
    none = estimate_training_memory(xl, 128, "bf16", checkpointed_blocks=xl.depth).total
    budget = (full + none) / 2
    k = fewest_checkpointed_blocks(xl, 128, budget, precision="bf16")
    assert 0 < k < xl.depth
    assert estimate_training_memory(xl, 128, "bf16", checkpointed_blocks=k).total <= budget
    assert estimate_training_memory(xl, 128, "bf16", checkpointed_blocks=k - 1).total > budget
    with pytest.raises(UserError, match="does not fit"):
        fewest_checkpointed_blocks(xl, 128, none / 2, precision="bf16")
    # one headroom rule: 10% of the device, at least 2 GiB, unless a reserve is given
    assert usable_memory(80 * 2**30) == 72 * 2**30 and usable_memory(8 * 2**30) == 6 * 2**30
    assert usable_memory(80 * 2**30, reserve_gib=1) == 79 * 2**30


@pytest.mark.parametrize(
    "precision,attention,kernel",
    [("fp32", "auto", "sdpa"), ("bf16", "auto", "explicit"), ("bf16", "math", "math")],
)
def test_attention_kernel_sets_hardware_flops_and_memory(tmp_path, precision, attention, kernel):
    from dit.cost.memory import estimate_training_memory
    from dit.runtime import Runtime
    from dit.train import Trainer

    cfg = tiny_config(tmp_path, precision=precision, attention=attention)
    trainer = Trainer(cfg, Runtime("cpu", precision), Pixels())
    model_cfg, flops = trainer.state.model.config, trainer.ledger.flops
    assert trainer.attention == kernel
    assert {b.attn.backend for b in trainer.state.model.blocks} == {attention}
    assert flops == training_flops_per_image(model_cfg, fused_attention=kernel == "sdpa")
    assert (flops.hardware > flops.model) == (kernel == "sdpa")  # flash recomputes QK^T
    log = (tmp_path / "run" / "log.txt").read_text()
    assert f"{kernel} attention" in log
    explicit = estimate_training_memory(model_cfg, 8, precision, attention="explicit")
    assert explicit.parts["attention_matrices"] > 0


def test_diffusion_and_lr_options_reach_the_run_and_the_sampler(tmp_path):
    from dit.runtime import Runtime
    from dit.sample.generate import Sampler
    from dit.sample.loading import load_sampling_model
    from dit.train import Trainer

    cfg = tiny_config(
        tmp_path,
        max_steps=4,
        noise_schedule="squaredcos_cap_v2",
        predict_xstart=True,
        learn_sigma=False,
        warmup_steps=2,
        lr_schedule="cosine",
        min_lr_frac=0.1,
    )
    trainer = Trainer(cfg, Runtime("cpu"), Pixels())
    assert trainer.state.model.config.learn_sigma is False
    assert trainer.objective.diffusion.betas.max() > 0.5  # cosine caps
    lr_at = lambda step: cfg.optim.lr_at(step, cfg.budget.max_steps)  # noqa: E731
    assert [lr_at(s) for s in (0, 1)] == pytest.approx([5e-4, 1e-3])
    assert lr_at(3) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    trainer.run()
    sm = load_sampling_model(str(latest_checkpoint(tmp_path / "run" / "checkpoints")), vae="none")
    d = Sampler(sm, 10).process
    assert sm.predict_xstart and d.model_mean_type.name == "START_X" and d.model_var_type.name == "FIXED_LARGE"
    assert d.alphas_cumprod[0] == pytest.approx(trainer.objective.diffusion.alphas_cumprod[0])


def test_a_finite_loss_with_non_finite_gradients_is_skipped(tmp_path):
    """Backward can overflow where the forward did not: the step is skipped, the weights and EMA untouched."""
    from dit.runtime import Runtime
    from dit.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, max_steps=4, log_every=1000), Runtime("cpu"), Pixels())
    batches = [next(iter(trainer.loader))]
    trainer.train_step(batches, log_step=False)  # one good step, so the EMA and the weights differ from init
    model, ema = trainer.state.model, trainer.state.ema.model
    before = [p.detach().clone() for p in (*model.parameters(), *ema.parameters())]
    hook = model.final_layer.linear.weight.register_hook(lambda g: g * float("inf"))
    trainer.train_step(batches, log_step=False)
    hook.remove()
    after = [p.detach() for p in (*model.parameters(), *ema.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert int(trainer.counters.nonfinite_total) == 1 and trainer.state.step == 2


def test_on_cuda_each_record_has_its_windows_peaks_reserved_memory_and_retries(tmp_path, monkeypatch):
    """A fake CUDA allocator: every record reads the peaks, then resets them (a window's own, not the process's);
    the first record's window is compared once with the memory estimate that --activation-checkpointing auto uses."""
    from types import SimpleNamespace

    from dit.runtime import Runtime
    from dit.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, max_steps=4, log_every=1000), Runtime("cpu"), Pixels())
    ledger, peaks, infos = trainer.ledger, {"allocated": 3 * 2**30, "reserved": 5 * 2**30}, []
    resets = []

    def reset(device):
        resets.append(device)
        peaks.update(allocated=2**30, reserved=2 * 2**30)

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 7})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(ledger.sinks, "info", lambda message, stamp=None: infos.append(message))
    cuda = torch.device("cuda", 0)
    ledger.runtime = SimpleNamespace(device=cuda, world=1, is_main=True, sync=lambda: None)
    args = dict(epoch=0, counters={"loss": 1.0, "nonfinite_steps": 0}, grad_norm=None, lr=1e-3, in_warmup=False)
    ledger.count(8, 0.0)
    first = ledger.log(step=1, **args)
    ledger.count(8, 0.0)
    second = ledger.log(step=2, **args)
    assert (first["max_memory_gib"], first["max_memory_reserved_gib"], first["alloc_retries"]) == (3, 5, 7)
    assert (second["max_memory_gib"], second["max_memory_reserved_gib"]) == (1, 2)  # after the reset
    assert resets == [cuda, cuda]
    compared = [line for line in infos if line.startswith("memory, first window")]
    assert len(compared) == 1 and "5 GiB reserved" in compared[0]
    assert f"estimate {ledger.memory_estimate / 2**30:.3g} GiB" in compared[0] and ledger.memory_estimate > 0


def test_checkpoints_saved_every_step_are_one_line_per_log_window(tmp_path):
    """`--ckpt-every 1` printed a "saved checkpoint" line per step: one line per log window names them and the
    newest, and the final save is still named on its own (the resume line depends on it)."""
    cfg = tiny_config(tmp_path, max_steps=8, ckpt_every=1, log_every=4, keep_last=0, progress=False)
    train(cfg, dataset=Pixels())
    text = (tmp_path / "run" / "log.txt").read_text().splitlines()
    lines = [line.split(" ", 1)[1] for line in text if line.split(" ", 1)[1].startswith("saved")]  # after the time
    folder = tmp_path / "run" / "checkpoints"
    assert lines == [
        f"saved 4 checkpoints, steps 1 to 4; the newest {folder / '0000004.pt'}",
        f"saved 3 checkpoints, steps 5 to 7; the newest {folder / '0000007.pt'}",
        f"saved checkpoint {folder / '0000008.pt'}",
    ], lines
    assert len(list_checkpoints(folder)) == 8
