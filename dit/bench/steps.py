"""Benchmarks of the training step: throughput by precision (paired), accounting overhead, a step's profile, loss
curves and repeated-run MFU; timings sync the device, skip warm-up, and give the median, p10 and p90."""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from dit.cost.peaks import device_name, measure_matmul_peak
from dit.runtime import Precision, Runtime
from dit.sample.cost import timed
from dit.train import TrainConfig, Trainer, train


def synthetic_latents(n: int, channels: int, size: int, num_classes: int = 1000) -> TensorDataset:
    """Random latents and labels: the model's input without a data set or a VAE."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, channels, size, size, generator=g)
    return TensorDataset(x, torch.randint(0, num_classes, (n,), generator=g))


def spread(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_s": statistics.median(times), "p10_s": q[0], "p90_s": q[-1], "samples": len(times)}


DIGITS = "digits"  # a model name for the digits recipe's model (dit/train/recipes.py) on 28 px, 1-channel images


def bench_trainer(
    model: str, image_size: int, batch_size: int, results_dir: str, **options
) -> tuple[Trainer, list]:
    """A trainer on synthetic latents with one batch on its device; model ``digits``: the digits recipe's model."""
    n = max(2 * batch_size, 16)
    if model == DIGITS:
        from dit.data.digits import NUM_CLASSES
        from dit.train.recipes import PRESETS, digits_train_config

        cfg = digits_train_config(PRESETS["default"], 1, Path(results_dir), None)
        cfg = cfg.replace(global_batch_size=batch_size, progress=False, **options)
        data = synthetic_latents(n, 1, cfg.model.image_size, NUM_CLASSES)
    else:  # vae none: the synthetic data are latents already
        options.update(vae="none", num_workers=0, global_batch_size=batch_size, results_dir=results_dir)
        cfg = TrainConfig.of(model=model, image_size=image_size, **options)
        data = synthetic_latents(n, 4, image_size // 8)
    runtime = Runtime.of(cfg.runtime)
    trainer = Trainer(cfg, runtime, data)
    trainer.state.model.train()
    x, y = next(iter(trainer.loader))
    return trainer, [(x.to(runtime.device), y.to(runtime.device))]


def timed_step(trainer: Trainer, batches) -> tuple[float, float]:
    """(seconds, loss) of one ``train_step``, under the trainer's precision flags."""
    with trainer.runtime.precision.flags():
        _, seconds = timed(trainer.runtime, trainer.train_step, batches)
    return seconds, trainer.counters.read(trainer.runtime)["loss"]


def bench_matmul_peaks(precisions=("fp32", "bf16"), seconds: float = 2.0, device: str | None = None) -> dict:
    """This machine's measured matmul ceiling per precision, for ratios within one benchmark run."""
    out = {}
    for p in precisions:
        with Precision(p, "cuda").flags():  # the runtime sets the matmul mode; fp32 means IEEE here too
            out[p] = measure_matmul_peak(p, seconds, device) / 1e12
    return out


def _train_row(trainer: Trainer, model: str, compile: bool, times, losses) -> dict:
    timing = spread(times)
    batch = trainer.cfg.optim.global_batch_size
    rate = batch / timing["median_s"]
    flops, peak = trainer.ledger.flops, trainer.ledger.peak
    model_cfg = trainer.state.model.config
    row = {
        "mode": "train",
        "model": model,
        "image_size": trainer.cfg.model.image_size,
        "precision": trainer.cfg.runtime.precision,
        "batch_per_device": batch,
        "checkpointed_blocks": trainer.state.model.num_checkpointed_blocks,
        "token_drop": model_cfg.token_drop,
        "compile": compile,
        "attention": trainer.attention,
        "device": device_name(trainer.runtime.device),
        **timing,
        "model_flops_per_step": flops.model * batch,
        "images_per_sec": rate,
        "model_tflops": rate * flops.model / 1e12,
        "hardware_tflops": rate * flops.hardware / 1e12,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
        "mfu": rate * flops.model / peak.flops,
        "hfu": rate * flops.hardware / peak.flops,
        "losses": losses,
    }
    if trainer.runtime.device.type == "cuda":  # since bench_train's reset: this row's steps (and its pairing's)
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(trainer.runtime.device) / 2**30
        row["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(trainer.runtime.device) / 2**30
    return row


def _fresh_device_memory(device: torch.device) -> None:
    """Free what earlier rows left cached and restart the peaks, so that a row's peak memory is its own."""
    if device.type == "cuda":
        gc.collect()  # the previous rows' trainers hold reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_train(
    *,
    model: str = "DiT-S/2",
    image_size: int = 256,
    precisions: tuple[str, ...] = ("fp32",),
    batch_size: int = 8,
    compile: bool = False,
    steps: int = 10,
    warmup: int = 3,
    peak_probe_s: float = 0.0,
    token_drops: tuple[float, ...] = (0.0,),
    **options,
) -> list[dict]:
    """One row per precision and ``token_drops`` ratio, the rows taking turns step by step (paired on a drifting
    machine); ``peak_probe_s`` times the matmul ceilings each round; ``compile`` resets Dynamo first; ``options``:
    train.py's activation_checkpointing (default none), attention, device and peak_tflops."""
    runs, device = [], options.get("device")
    if compile:
        torch._dynamo.reset()
    options = {"activation_checkpointing": "none", **options, "max_steps": steps + warmup, "compile": compile}
    with tempfile.TemporaryDirectory() as out:
        for precision, drop in ((p, r) for p in precisions for r in token_drops):
            run = dict(options, precision=precision, token_drop=drop)
            trainer, batches = bench_trainer(model, image_size, batch_size, f"{out}/{precision}-{drop}", **run)
            runs.append((trainer, batches, [], []))
        _fresh_device_memory(runs[0][0].runtime.device)
        probes = {"fp32": [], "bf16": []}
        for i in range(warmup + steps):
            for trainer, batches, times, losses in runs:
                seconds, loss = timed_step(trainer, batches)
                if i >= warmup:
                    times.append(seconds)
                losses.append(loss)
            if peak_probe_s and i >= warmup:
                for p, tflops in bench_matmul_peaks(tuple(probes), peak_probe_s, device).items():
                    probes[p].append(tflops)
        rows = []
        for trainer, _, times, losses in runs:
            row = _train_row(trainer, model, compile, times, losses)
            if peak_probe_s:
                row["matmul_peak_tflops_during"] = {p: statistics.median(v) for p, v in probes.items()}
            rows.append(row)
            trainer.ledger.close()
    return rows


def bench_accounting(
    model: str = "DiT-S/2",
    batch_size: int = 8,
    log_every: int = 100,
    precision: str = "fp32",
    image_size: int = 256,
) -> dict:
    """The cost accounting's share of a step: the meter's count, plus one log amortised over ``log_every``."""
    (step,) = bench_train(
        model=model, image_size=image_size, precisions=(precision,), batch_size=batch_size, steps=5, warmup=2
    )
    with tempfile.TemporaryDirectory() as out:
        trainer, _ = bench_trainer(model, image_size, batch_size, out, precision=precision)
        ledger, n = trainer.ledger, 20000
        start = time.perf_counter()
        for _ in range(n):
            ledger.count(batch_size, data_wait_s=1e-4)
        per_step = (time.perf_counter() - start) / n
        logs = 200
        start, counters = time.perf_counter(), {"loss": 0.1, "nonfinite_steps": 0}
        for i in range(logs):
            ledger.log(step=i, epoch=0, counters=counters, grad_norm=None, lr=1e-4, in_warmup=False)
        per_log = (time.perf_counter() - start) / logs
        ledger.close()
    overhead = per_step + per_log / log_every
    return {
        "mode": "accounting",
        "model": model,
        "batch": batch_size,
        "log_every": log_every,
        "meter_step_us": per_step * 1e6,
        "log_ms": per_log * 1e3,
        "step_median_s": step["median_s"],
        "overhead_per_step_us": overhead * 1e6,
        "overhead_frac": overhead / step["median_s"],
    }


def profile_train_step(
    model: str = "DiT-S/2", precision: str = "fp32", batch_size: int = 8, image_size: int = 256, rows: int = 25
) -> str:
    """Where one training step's time goes: torch.profiler's op table (self time) after two warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as out:
        trainer, batches = bench_trainer(model, image_size, batch_size, out, precision=precision)
        for _ in range(2):
            timed_step(trainer, batches)
        cuda = trainer.runtime.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            timed_step(trainer, batches)
        trainer.ledger.close()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows)


def bench_loss_curves(base: TrainConfig, dataset, runs=(("fp32", 0), ("bf16", 0), ("fp32", 1)), tail=0.25) -> dict:
    """Whether a precision moves the loss curve more than a seed does: each run's tail loss against the first's."""
    curves, never = {}, 10 * base.budget.max_steps  # a checkpoint step the runs never reach
    for precision, seed in runs:
        with tempfile.TemporaryDirectory() as out:
            cfg = base.replace(precision=precision, seed=seed, results_dir=out, ckpt_every=never, progress=False)
            train(cfg, dataset)
            lines = (json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines())
            curves[f"{precision} seed {seed}"] = [
                (r["step"], r["loss"]) for r in lines if r.get("loss") is not None
            ]

    def tail_mean(curve):
        losses = [loss for _, loss in curve]
        return statistics.fmean(losses[-max(1, round(tail * len(losses))) :])

    (ref_name, ref), *others = curves.items()
    gaps = {name: tail_mean(curve) / tail_mean(ref) - 1 for name, curve in others}
    seed_gaps = [abs(gap) for name, gap in gaps.items() if name.startswith(runs[0][0] + " ")]
    means = {name: tail_mean(curve) for name, curve in curves.items()}
    return {
        "mode": "loss",
        "reference": ref_name,
        "steps": base.budget.max_steps,
        "log_every": base.ledger.log_every,
        "tail_fraction": tail,
        "tail_mean_loss": means,
        "tail_gap_to_reference": gaps,
        "seed_noise": max(seed_gaps) if seed_gaps else None,
        "curves": curves,
    }


def bench_repeat(runs: int = 3, steps: int = 300, fresh_peak: bool = True, eval_every: int = 0) -> list[dict]:
    """The quick start's training ``runs`` times in fresh processes: each run's MFU and peak, and their spread."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            out = Path(tmp) / f"run{i}"
            env = {**os.environ, "DIT_CACHE_DIR": str(Path(tmp) / (f"cache{i}" if fresh_peak else "cache"))}
            argv = ["-m", "dit.quickstart", "--max-steps", str(steps), "--out", str(out), "--per-class", "1",
                    "--num-sampling-steps", "2", "--eval-samples", "100"]  # fmt: skip
            if eval_every:
                argv += ["--eval-every", str(eval_every)]
            done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"quick start run {i} failed:\n{done.stderr[-2000:]}")
            records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
            counted = [r for r in records if r.get("kind", "train") == "train" and not r["in_warmup"]]
            mean = {k: statistics.fmean(r[k] for r in counted) for k in ("mfu", "steps_per_sec")}
            row = {
                "mode": "repeat",
                "run": i,
                "steps": steps,
                **mean,
                "peak_tflops": counted[-1]["peak_tflops"],
                "fresh_peak": fresh_peak,
                "evaluations": sum(r.get("kind") == "eval" for r in records),
            }
            rows.append(row)
    return rows


def bench_precision_quality(
    steps: int = 1200,
    precisions=("fp32", "bf16"),
    seeds=(0, 1),
    eval_samples: int = 500,
    device: str | None = None,
) -> list[dict]:
    """The quick start's recipe at each precision and seed, scored by its EMA samples' digit FID and accuracy."""
    from dit.data.digits import DigitDataset
    from dit.eval.digit_nets import load_digit_classifier
    from dit.eval.reference import digits_reference, save_stats
    from dit.train.recipes import PRESETS, digits_train_config

    preset, rows = PRESETS["default"], []
    with tempfile.TemporaryDirectory() as tmp:
        ref = str(Path(tmp) / "digits_ref.npz")
        save_stats(ref, digits_reference(load_digit_classifier()))
        for precision in precisions:
            for seed in seeds:
                out = Path(tmp) / f"{precision}-{seed}"
                cfg = digits_train_config(preset, steps, out, device, eval_ref=ref, eval_samples=eval_samples)
                cfg = cfg.replace(precision=precision, seed=seed, progress=False, **preset.ddim_evaluation())
                train(cfg, DigitDataset(28))
                records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                final = [r for r in records if r["kind"] == "eval"][-1]
                losses = [r["loss"] for r in records if r["kind"] == "train"]
                row = {
                    "mode": "precision",
                    "precision": precision,
                    "seed": seed,
                    "steps": steps,
                    "fid": final["fid"],
                    "class_accuracy": final["class_accuracy"],
                    "precision_metric": final["precision"],
                    "recall": final["recall"],
                    "final_loss": statistics.fmean(losses[-max(1, len(losses) // 4) :]),
                }
                rows.append(row)
    return rows
