"""The benchmarks' modes and their runner: one dataclass per mode (``dit.bench.config``) and one ``run`` that
returns rows; the ``train`` mode's JSON is what ``dit-cost train --calibration`` reads."""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dit.bench import config as c
from dit.bench.kernels import bench_attention, bench_reader, bench_sample, synthetic_store
from dit.bench.steps import (
    DIGITS,
    bench_accounting,
    bench_loss_curves,
    bench_matmul_peaks,
    bench_precision_quality,
    bench_repeat,
    bench_train,
    profile_train_step,
)
from dit.io.errors import UserError

MODES = {
    "train": (c.TrainBench, "training-step throughput and MFU, precisions paired"),
    "sample": (c.SampleBench, "guided DDPM sampling throughput and MFU"),
    "accounting": (c.AccountingBench, "what cost accounting adds to a step"),
    "reader": (c.ReaderBench, "latent-store reader samples/s"),
    "loss": (c.LossBench, "fp32 and bf16 curves of the quick-start model, official objective"),
    "profile": (c.ProfileBench, "torch.profiler's op table of one training step"),
    "attention": (c.AttentionBench, "one block's attention forward + backward per kernel"),
    "repeat": (c.RepeatBench, "the quick start's training repeated: MFU from run to run"),
    "precision": (c.PrecisionBench, "bf16 against fp32 in digit FID at equal steps, two seeds each"),
}


@dataclass
class Result:
    rows: list[dict] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # the table's columns
    extra: dict = field(default_factory=dict)  # written to the JSON beside the rows
    notes: list[str] = field(default_factory=list)  # lines printed after the table
    text: str | None = None  # a mode whose output is text (profile)


def run(mode: str, cfg, on_row: Callable[[dict], None] | None = None) -> Result:
    """The mode's rows; ``on_row`` gets each row as it finishes, so that a later crash loses nothing."""
    return globals()[f"_{mode}"](cfg, on_row or (lambda row: None))


def _device_memory(a: c.TrainBench) -> int | None:
    """The bytes the fit check allows for, None for no check."""
    import torch

    if a.memory_gib is not None:
        return int(a.memory_gib * 2**30) or None
    if a.device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(a.device or "cuda")).total_memory


def _unfit(
    a: c.TrainBench, capacity: int | None, model: str, batch: int, ckpt: str, attention: str, precision: str
):
    """Why this configuration would not fit the device by dit-cost's estimate; None if it fits or cannot tell."""
    import torch

    from dit.cost.memory import estimate_training_memory, usable_memory
    from dit.io.config import FieldError
    from dit.model.config import model_config, parse_activation_checkpointing
    from dit.model.layers import attention_kernel
    from dit.runtime import Precision

    if capacity is None or model == DIGITS:  # the digits model fits any device
        return None
    cfg = model_config(model, input_size=a.image_size // 8)
    try:
        blocks = parse_activation_checkpointing(ckpt, cfg.depth)
    except FieldError:
        return None
    if blocks == "auto":
        return None
    device_type = "cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu"
    kernel = attention_kernel(attention, device_type, Precision(precision, "cuda").compute_dtype)
    kind = "explicit" if kernel in ("explicit", "math") else "fused"
    estimate = estimate_training_memory(cfg, batch, precision, blocks, attention=kind).total
    budget = usable_memory(capacity)
    if estimate <= budget:
        return None
    return (
        f"dit-cost memory estimates {estimate / 2**30:.1f} GiB for {model} {precision} at batch {batch} with "
        f"{blocks} checkpointed blocks, over the {budget / 2**30:.1f} GiB usable of {capacity / 2**30:.1f} GiB: "
        "checkpoint more blocks or lower the batch"
    )


def _train(a: c.TrainBench, on_row) -> Result:
    # Without probes between rounds the ceilings are only context for the fraction column: a short look.
    probe_s = 2.0 if a.peak_probe else 0.25
    r = Result(extra={"matmul_peak_tflops": bench_matmul_peaks(("fp32", "bf16"), probe_s, a.device)})
    capacity = _device_memory(a)
    grid = itertools.product(a.model, a.global_batch_size, a.activation_checkpointing, a.compile, a.attention)
    for model, batch, ckpt, comp, attention in grid:
        unfit = {p: _unfit(a, capacity, model, batch, ckpt, attention, p) for p in a.precision}
        for precision, reason in unfit.items():
            if reason is not None:
                row = {"mode": "train", "model": model, "image_size": a.image_size, "precision": precision,
                       "batch_per_device": batch, "activation_checkpointing": ckpt, "compile": comp == "on",
                       "attention": attention, "skipped": reason}  # fmt: skip
                print(f"skipped: {reason}", file=sys.stderr)
                r.rows.append(row)
                on_row(row)
        precisions = tuple(p for p, reason in unfit.items() if reason is None)
        if not precisions:
            continue
        group = bench_train(
            model=model, image_size=a.image_size, precisions=precisions, batch_size=batch,
            activation_checkpointing=ckpt, compile=comp == "on", steps=a.timed_steps, warmup=a.untimed_steps,
            device=a.device, peak_tflops=a.peak_tflops, attention=attention, peak_probe_s=a.peak_probe,
            token_drops=a.token_drop,
        )  # fmt: skip
        fp32 = {row["token_drop"]: row for row in group if row["precision"] == "fp32"}
        full = {row["precision"]: row for row in group if not row["token_drop"]}
        for row in group:
            if row["token_drop"] and row["precision"] in full:  # paired: the ratios took turns step by step
                row["speedup_vs_no_drop"] = full[row["precision"]]["median_s"] / row["median_s"]
            during = row.get("matmul_peak_tflops_during", r.extra["matmul_peak_tflops"])
            row["fraction_of_fp32_matmul_peak"] = row["model_tflops"] / during["fp32"]
            if row["token_drop"] in fp32:  # paired: the precisions took turns step by step
                row["speedup_vs_fp32"] = fp32[row["token_drop"]]["median_s"] / row["median_s"]
            print(
                f"{model} {row['precision']} token drop {row['token_drop']:g} batch {batch} activation checkpointing "
                f"{ckpt} compile {comp} attention {row['attention']}: {row['median_s']:.4g} s/step",
                file=sys.stderr,
            )
            on_row(row)
        r.rows += group
    r.keys = ["model", "precision", "token_drop", "batch_per_device", "checkpointed_blocks", "compile", "attention",
              "median_s", "p10_s", "p90_s", "images_per_sec", "model_tflops", "mfu", "hfu", "peak_source",
              "fraction_of_fp32_matmul_peak", "speedup_vs_fp32", "speedup_vs_no_drop"]  # fmt: skip
    if any("skipped" in row for row in r.rows):
        r.keys.append("skipped")
    # Measured again at the end: a drift between the two says the machine's speed changed during the run.
    r.extra["matmul_peak_tflops_after"] = bench_matmul_peaks(("fp32", "bf16"), probe_s, a.device)
    r.notes.append(
        f"matmul peaks measured in this run (TFLOP/s): before {r.extra['matmul_peak_tflops']}, "
        f"after {r.extra['matmul_peak_tflops_after']}"
    )
    if a.calibration:
        from dit.cost.plan import Calibration, save_calibration

        # an MFU above 1 divides by a peak below what the step reached: such a row cannot calibrate anything
        usable = [row for row in r.rows if 0 < row.get("mfu", 0) <= 1]
        if not usable:
            raise UserError("--calibration: every row's MFU is above 1 (its peak is too low): pass --peak-tflops.")
        best = max(usable, key=lambda row: row["mfu"])
        cal = Calibration(best["model"], best["image_size"], best["precision"], best["device"], best["mfu"])
        save_calibration(cal, a.calibration, benchmark=best)
        r.notes.append(f"calibration (best MFU {best['mfu']:.1%}) written to {a.calibration}")
    return r


def _sample(a: c.SampleBench, on_row) -> Result:
    r, run = Result(), (a.num_sampling_steps, a.guidance_scale, a.repeats, a.device, a.peak_tflops)
    for model, precision, batch, attention in itertools.product(a.model, a.precision, a.batch_size, a.attention):
        r.rows.append(bench_sample(model, a.image_size, precision, batch, *run, attention))
        on_row(r.rows[-1])
    r.keys = ["model", "precision", "batch", "attention", "num_sampling_steps", "guidance_scale", "median_s",
              "images_per_sec", "model_tflops", "mfu", "peak_source"]  # fmt: skip
    return r


def _accounting(a: c.AccountingBench, on_row) -> Result:
    rows = [
        bench_accounting(model, batch, a.log_every, precision, a.image_size)
        for model, precision, batch in itertools.product(a.model, a.precision, a.global_batch_size)
    ]
    return Result(
        rows, ["model", "batch", "log_every", "meter_step_us", "log_ms", "step_median_s", "overhead_frac"]
    )


def _reader(a: c.ReaderBench, on_row) -> Result:
    import torch

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = a.store or synthetic_store(tmp, a.num_images)
        row = bench_reader(store, a.global_batch_size, a.seconds, a.repeats)
    return Result(
        [row], ["items", "storage_dtype", "batch", "threads", "best_samples_per_sec", "median_samples_per_sec"]
    )


def _profile(a: c.ProfileBench, on_row) -> Result:
    return Result(text=profile_train_step(a.model, a.precision, a.global_batch_size, a.image_size, a.rows))


def _attention(a: c.AttentionBench, on_row) -> Result:
    rows = bench_attention(
        a.model, a.precision, a.global_batch_size, a.image_size, tuple(a.attention), device=a.device
    )
    return Result(rows, ["model", "precision", "batch", "attention", "median_s", "p10_s", "p90_s"])


def _repeat(a: c.RepeatBench, on_row) -> Result:
    rows = bench_repeat(a.repeats, a.max_steps, fresh_peak=a.peak == "fresh", eval_every=a.eval_every)
    mfus = [row["mfu"] for row in rows]
    r = Result(rows, ["run", "steps", "mfu", "steps_per_sec", "peak_tflops", "fresh_peak", "evaluations"])
    r.extra["max_over_min_mfu"] = max(mfus) / min(mfus)
    r.notes.append(
        f"MFU over {a.repeats} runs: {min(mfus):.2%} to {max(mfus):.2%} (max/min {max(mfus) / min(mfus):.3f})"
    )
    return r


def _precision(a: c.PrecisionBench, on_row) -> Result:
    rows = bench_precision_quality(a.max_steps, tuple(a.precision), tuple(a.seeds), a.eval_samples, a.device)
    r = Result(
        rows, ["precision", "seed", "steps", "fid", "class_accuracy", "precision_metric", "recall", "final_loss"]
    )
    by = {p: [row["fid"] for row in rows if row["precision"] == p] for p in a.precision}
    for p, fids in by.items():
        r.notes.append(f"{p}: digit FID {' and '.join(f'{f:.1f}' for f in fids)} over seeds {list(a.seeds)}")
    return r


def _loss(a: c.LossBench, on_row) -> Result:
    """The quick-start model and digits, trained with DiT's own objective (linear schedule, learned sigma)."""
    from dit.data.digits import DigitDataset
    from dit.train.recipes import PRESETS, digits_train_config

    preset = PRESETS["default"]
    base = digits_train_config(preset, a.max_steps, Path(tempfile.gettempdir()) / "unused", a.device)
    base = base.replace(noise_schedule="linear", predict_xstart=False, learn_sigma=True, log_every=a.log_every)
    result = bench_loss_curves(base, DigitDataset(preset.image_size))
    if a.plot:
        _plot_curves(result["curves"], a.log_every, a.plot)
    rows = [
        {"run": name, "tail_mean_loss": loss, "gap_to_reference": result["tail_gap_to_reference"].get(name, 0.0)}
        for name, loss in result["tail_mean_loss"].items()
    ]
    extra = {k: v for k, v in result.items() if k not in ("tail_mean_loss", "tail_gap_to_reference")}
    note = (
        f"last {result['tail_fraction']:.0%} of {result['steps']} steps; seed-to-seed noise in fp32: "
        f"{result['seed_noise']:.2%}"
    )
    return Result(rows, ["run", "tail_mean_loss", "gap_to_reference"], extra, [note])


def _plot_curves(curves: dict, log_every: int, path: str) -> None:
    from dit.cost.plots import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(*zip(*curve), label=name, lw=1.2)
    ax.set(xlabel="step", ylabel=f"training loss (mean of {log_every} steps)", yscale="log")
    ax.set_title("Quick-start DiT on MNIST digits: bf16 autocast against fp32")
    ax.legend()
    save_figure(fig, path)
