"""Throughput benchmarks of what users run: the real trainer's step, the sampler, the accounting, the reader.

Every timing synchronises the device before reading the clock, leaves warm-up steps out, and reports the
median with the 10th and 90th percentiles. Results are plain dicts, so the face can print a table and
write JSON that ``dit-cost train --calibration FILE`` reads.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

from dit.cost.analytic import sampling_flops_per_image
from dit.cost.peaks import measure_matmul_peak, resolve_peak
from dit.engine.trainer import TrainConfig, Trainer
from dit.models import attention_kernel


class SyntheticLatents(Dataset):
    """Random 4-channel latents and labels: the model's input without a data set or a VAE."""

    def __init__(self, n: int, channels: int, size: int, num_classes: int = 1000):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, channels, size, size, generator=g)
        self.y = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_s": statistics.median(times), "p10_s": q[0], "p90_s": q[-1], "samples": len(times)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _bench_trainer(model: str, image_size: int, batch_size: int, results_dir: str, **options):
    """A trainer on synthetic latents, its counters reset, and one batch already on its device."""
    cfg = TrainConfig(
        model=model,
        image_size=image_size,
        vae="none",  # the synthetic data are latents already
        global_batch_size=batch_size,
        num_workers=0,
        results_dir=results_dir,
        **options,
    )
    trainer = Trainer(cfg, SyntheticLatents(max(2 * batch_size, 16), 4, image_size // 8))
    trainer.reset_counters()
    trainer.model.train()
    x, y = next(iter(trainer.loader))
    return trainer, [(x.to(trainer.device), y.to(trainer.device))]


def _train_row(
    trainer: Trainer, model: str, image_size: int, precision: str, compile: bool, times, losses
) -> dict:
    spread = _spread(times)
    batch = trainer.cfg.global_batch_size
    rate = batch / spread["median_s"]
    peak = trainer.peak
    row = {
        "mode": "train",
        "model": model,
        "image_size": image_size,
        "precision": precision,
        "batch_per_device": batch,
        "checkpoint_blocks": trainer.model.num_checkpointed_blocks,
        "compile": compile,
        "attention": trainer.attention,
        "device": _device_name(trainer.device),
        **spread,
        "images_per_sec": rate,
        "model_tflops": rate * trainer.flops.model / 1e12,
        "hardware_tflops": rate * trainer.flops.hardware / 1e12,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
        "mfu": rate * trainer.flops.model / peak.flops,
        "hfu": rate * trainer.flops.hardware / peak.flops,
        "losses": losses,
    }
    if trainer.device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
    return row


def bench_train(
    model: str = "DiT-S/2",
    image_size: int = 256,
    precisions: tuple[str, ...] = ("fp32",),
    batch_size: int = 8,
    checkpoint_blocks: str = "none",
    compile: bool = False,
    steps: int = 10,
    warmup: int = 3,
    device: str | None = None,
    peak_tflops: float | None = None,
    attention: str = "auto",
    peak_probe_s: float = 0.0,
) -> list[dict]:
    """Training steps through ``Trainer.train_step`` (data on the device), one row per precision.

    The precisions take turns step by step, so that a ratio between them is paired: on a shared machine
    whose speed drifts by 10% from minute to minute, separate runs would measure the drift. With
    ``peak_probe_s`` each round also times the fp32 and bf16 matmul ceilings for that long, and each row
    gets the median of those probes: a peak measured under the same conditions as the steps.
    """
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for precision in precisions:
            trainer, batches = _bench_trainer(
                model,
                image_size,
                batch_size,
                f"{out}/{precision}",
                max_steps=steps + warmup,
                precision=precision,
                checkpoint_blocks=checkpoint_blocks,
                compile=compile,
                attention=attention,
                device=device,
                peak_tflops=peak_tflops,
            )
            runs.append((precision, trainer, batches, [], []))
        probes = {"fp32": [], "bf16": []}
        for i in range(warmup + steps):
            for _, trainer, batches, times, losses in runs:
                _sync(trainer.device)
                start = time.perf_counter()
                trainer.train_step(batches, log_step=False)
                _sync(trainer.device)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                trainer.step += 1
                losses.append(float(trainer.loss_sum) / max(int(trainer.loss_count), 1))
                trainer.reset_counters()
            if peak_probe_s and i >= warmup:
                for p in probes:
                    probes[p].append(measure_matmul_peak(p, peak_probe_s, device) / 1e12)
        rows = []
        for precision, trainer, _, times, losses in runs:
            row = _train_row(trainer, model, image_size, precision, compile, times, losses)
            if peak_probe_s:
                row["matmul_peak_tflops_during"] = {p: statistics.median(v) for p, v in probes.items()}
            rows.append(row)
            trainer.sinks.close()
    return rows


def bench_matmul_peaks(precisions=("fp32", "bf16"), seconds: float = 2.0, device: str | None = None) -> dict:
    """This machine's measured matmul ceiling per precision, for ratios within one benchmark run."""
    return {p: measure_matmul_peak(p, seconds, device) / 1e12 for p in precisions}


def bench_sample(
    model: str = "DiT-S/2",
    image_size: int = 256,
    precision: str = "fp32",
    batch_size: int = 8,
    num_sampling_steps: int = 10,
    cfg_scale: float = 4.0,
    repeats: int = 3,
    device: str | None = None,
    peak_tflops: float | None = None,
    attention: str = "auto",
) -> dict:
    """Images/s and MFU of the guided DDPM sampler on random weights (speed does not depend on them)."""
    from dit.engine.sampling import SamplingModel, generate, make_diffusion, precision_scope, resolve_device
    from dit.models import create_model

    dev = resolve_device(device)
    net = create_model(model, input_size=image_size // 8).to(dev).eval().set_attention(attention)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    sm = SamplingModel(net, "random", image_size, None, None)
    diffusion = make_diffusion(sm, num_sampling_steps)
    labels, seeds = [i % 1000 for i in range(batch_size)], list(range(batch_size))
    times = []
    with precision_scope(precision, dev) as autocast:
        for i in range(repeats + 1):
            _sync(dev)
            start = time.perf_counter()
            generate(sm, diffusion, labels, seeds, "ddpm", cfg_scale, 3, autocast)
            _sync(dev)
            if i:  # the first run warms up
                times.append(time.perf_counter() - start)
    spread = _spread(times)
    flops = sampling_flops_per_image(net.config, num_sampling_steps, cfg_scale).model
    rate = batch_size / spread["median_s"]
    peak = resolve_peak(_device_name(dev) if dev.type == "cuda" else "cpu", precision, peak_tflops)
    return {
        "mode": "sample",
        "model": model,
        "image_size": image_size,
        "precision": precision,
        "batch": batch_size,
        "num_sampling_steps": num_sampling_steps,
        "cfg_scale": cfg_scale,
        "attention": attention_kernel(attention, dev.type, dtype),
        "device": _device_name(dev),
        **spread,
        "images_per_sec": rate,
        "model_tflops": rate * flops / 1e12,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
        "mfu": rate * flops / peak.flops,
    }


def bench_accounting(
    model: str = "DiT-S/2",
    batch_size: int = 8,
    log_every: int = 100,
    precision: str = "fp32",
    image_size: int = 256,
) -> dict:
    """What cost accounting adds to a step: the meter's per-step counters, and one log (window + sinks)
    amortised over ``log_every`` steps, against the measured step time of the same configuration."""
    (step,) = bench_train(model, image_size, (precision,), batch_size, steps=5, warmup=2)
    with tempfile.TemporaryDirectory() as out:
        trainer, _ = _bench_trainer(model, image_size, batch_size, out, precision=precision)
        n = 20000
        start = time.perf_counter()
        for _ in range(n):
            trainer.meter.step(batch_size, data_wait_s=1e-4)
        per_step = (time.perf_counter() - start) / n
        logs = 200
        start = time.perf_counter()
        for i in range(logs):
            window = trainer.meter.window()
            trainer.sinks.log({"step": i, "loss": 0.1, "grad_norm": 1.0, **window})
        per_log = (time.perf_counter() - start) / logs
        trainer.sinks.close()
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


def bench_reader(store: str, batch_size: int = 256, seconds: float = 3.0, repeats: int = 5) -> dict:
    """Latent-store samples/s per process through a DataLoader (batched ``__getitems__``), from the page cache."""
    from dit.data.latents import LatentStoreDataset

    ds = LatentStoreDataset(store)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=0)

    def rate(duration):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            for x, _ in loader:
                count += len(x)
                if time.perf_counter() - start >= duration:
                    break
        return count / (time.perf_counter() - start)

    rate(1.0)  # page cache and allocator warm-up
    rates = sorted(rate(seconds) for _ in range(repeats))
    return {
        "mode": "reader",
        "store": store,
        "items": len(ds),
        "latent_shape": list(ds.latent_shape),
        "storage_dtype": ds.manifest["storage_dtype"],
        "batch": batch_size,
        "best_samples_per_sec": rates[-1],
        "median_samples_per_sec": statistics.median(rates),
        "threads": torch.get_num_threads(),
    }


def bench_loss_curves(base: TrainConfig, dataset, runs=(("fp32", 0), ("bf16", 0), ("fp32", 1)), tail=0.25) -> dict:
    """Does a precision change the training curve by more than another seed does?

    Each (precision, seed) in ``runs`` trains ``base`` on ``dataset`` through the real loop and keeps its
    logged window losses. The first run is the reference; every other run's gap to it, the mean loss over
    the last ``tail`` of the logged windows relative to the reference's, is set beside the gap of the
    reference precision's other seeds: the noise a loss curve has anyway.
    """
    import dataclasses
    import json
    from pathlib import Path

    from dit.engine.trainer import train

    curves = {}
    for precision, seed in runs:
        with tempfile.TemporaryDirectory() as out:
            cfg = dataclasses.replace(
                base,
                precision=precision,
                seed=seed,
                results_dir=out,
                ckpt_every=10 * base.max_steps,
                progress=False,
            )
            train(cfg, dataset)
            lines = (json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines())
            curves[f"{precision} seed {seed}"] = [
                (r["step"], r["loss"]) for r in lines if r.get("loss") is not None
            ]

    def tail_mean(curve):
        losses = [loss for _, loss in curve]
        return statistics.fmean(losses[-max(1, round(tail * len(losses))) :])

    (ref_name, ref), *others = curves.items()
    ref_precision = runs[0][0]
    gaps = {name: tail_mean(curve) / tail_mean(ref) - 1 for name, curve in others}
    seed_gaps = [abs(gap) for name, gap in gaps.items() if name.startswith(ref_precision + " ")]
    return {
        "mode": "loss",
        "reference": ref_name,
        "steps": base.max_steps,
        "log_every": base.log_every,
        "tail_fraction": tail,
        "tail_mean_loss": {name: tail_mean(curve) for name, curve in curves.items()},
        "tail_gap_to_reference": gaps,
        "seed_noise": max(seed_gaps) if seed_gaps else None,
        "curves": curves,
    }


def profile_train_step(
    model: str = "DiT-S/2", precision: str = "fp32", batch_size: int = 8, image_size: int = 256, rows: int = 25
) -> str:
    """Where one training step's time goes: torch.profiler's op table (self time) after two warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as out:
        trainer, batches = _bench_trainer(model, image_size, batch_size, out, precision=precision)
        for _ in range(2):
            trainer.train_step(batches, log_step=False)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
        with profile(activities=activities, record_shapes=True) as prof:
            trainer.train_step(batches, log_step=False)
            _sync(trainer.device)
        trainer.sinks.close()
    key = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows)


def bench_attention(
    model: str = "DiT-S/2",
    precision: str = "fp32",
    batch_size: int = 8,
    image_size: int = 256,
    backends=("flash", "math", "explicit"),
    repeats: int = 9,
    device: str | None = None,
) -> list[dict]:
    """Forward + backward of one block's attention per kernel, at the model's shapes (median of ``repeats``)."""
    from dit.models import Attention, model_config

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mc = model_config(model, input_size=image_size // 8)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    attn = Attention(mc.hidden_size, mc.num_heads).to(dev, dtype)
    x = torch.randn(batch_size, mc.tokens, mc.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    out = []
    for backend in backends:
        attn.backend = backend
        times = []
        for i in range(repeats + 1):
            _sync(dev)
            start = time.perf_counter()
            attn(x).sum().backward()
            _sync(dev)
            if i:
                times.append(time.perf_counter() - start)
        out.append(
            {
                "mode": "attention",
                "model": model,
                "precision": precision,
                "batch": batch_size,
                "attention": attention_kernel(backend, dev.type, dtype),
                "device": _device_name(dev),
                **_spread(times),
            }
        )
    return out
