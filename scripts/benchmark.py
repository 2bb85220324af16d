"""Benchmarks: training-step and sampling throughput, accounting overhead, latent-store reader speed.

  python scripts/benchmark.py train --model DiT-S/2 DiT-B/2 --batch-size 8 --precision fp32 bf16
  python scripts/benchmark.py train --model DiT-XL/2 --batch-size 64 --precision bf16 --compile \\
      --calibration calib.json          # then: dit-cost train ... --calibration calib.json
  python scripts/benchmark.py sample --model DiT-XL/2 --num-sampling-steps 50 --cfg-scale 4
  python scripts/benchmark.py accounting --model DiT-S/2
  python scripts/benchmark.py reader [--store STORE]   # default: a synthetic 10,000-image 4x32x32 store
  python scripts/benchmark.py loss --steps 400 --plot curves.png   # bf16 vs fp32 training curves
  python scripts/benchmark.py profile --model DiT-S/2 --precision fp32     # one step's op table
  python scripts/benchmark.py attention --model DiT-B/2 --precision bf16   # attention kernels, one block

Each run prints a table and, with --json FILE, writes every row (the machine's measured matmul peaks too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

from dit.cli import run_cli
from dit.engine import benchmark as bench
from dit.engine.host_memory import keep_freed_host_memory
from dit.models import ATTENTION_BACKENDS


def _table(rows: list[dict], keys: list[str]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode in ("train", "sample", "accounting"):
        s = sub.add_parser(mode)
        s.add_argument("--model", nargs="+", default=["DiT-S/2"])
        s.add_argument("--batch-size", type=int, nargs="+", default=[8])
        s.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "tf32", "bf16", "fp16"])
        s.add_argument("--json", help="write the rows (and the matmul peaks) to this file")
        s.add_argument("--image-size", type=int, default=256)
        if mode != "accounting":
            s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
            s.add_argument("--peak-tflops", type=float, help="override the peak used for MFU")
            s.add_argument("--attention", nargs="+", default=["auto"], choices=ATTENTION_BACKENDS)
        if mode == "train":
            s.add_argument("--checkpoint-blocks", nargs="+", default=["none"])
            s.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"])
            s.add_argument("--steps", type=int, default=10)
            s.add_argument("--warmup", type=int, default=3)
            s.add_argument("--calibration", help="write the best row as a dit-cost calibration JSON")
            s.add_argument(
                "--peak-probe",
                type=float,
                default=0.25,
                help="seconds of fp32 and bf16 matmul-peak probes between step rounds (0: off); the fp32 "
                "fraction divides by their median",
            )
        if mode == "sample":
            s.add_argument("--num-sampling-steps", type=int, default=10)
            s.add_argument("--cfg-scale", type=float, default=4.0)
            s.add_argument("--repeats", type=int, default=3)
        if mode == "accounting":
            s.add_argument("--log-every", type=int, default=100)
    r = sub.add_parser("reader")
    r.add_argument("--store", help="an existing store (default: a synthetic one in a temp folder)")
    r.add_argument("--images", type=int, default=10_000)
    r.add_argument("--batch-size", type=int, default=256)
    r.add_argument("--seconds", type=float, default=3.0)
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--threads", type=int, default=1, help="torch threads (1: one data process's share)")
    r.add_argument("--json")
    lc = sub.add_parser("loss", help="fp32 and bf16 curves of the quick-start model, official objective")
    lc.add_argument("--steps", type=int, default=400)
    lc.add_argument("--log-every", type=int, default=10)
    lc.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    lc.add_argument("--plot", help="write the curves to this PNG")
    lc.add_argument("--json")
    pr = sub.add_parser("profile", help="torch.profiler's op table of one training step")
    at = sub.add_parser("attention", help="one block's attention forward + backward per kernel")
    for s in (pr, at):
        s.add_argument("--model", default="DiT-S/2")
        s.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
        s.add_argument("--batch-size", type=int, default=8)
        s.add_argument("--image-size", type=int, default=256)
    pr.add_argument("--rows", type=int, default=25)
    at.add_argument("--attention", nargs="+", default=["flash", "math", "explicit"], choices=ATTENTION_BACKENDS)
    at.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    at.add_argument("--json")
    args = p.parse_args(argv)

    rows, extra = [], {}
    if (getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
        keep_freed_host_memory()  # as the trainer and the sampler do on CPU, so peaks and steps compare
    if args.mode == "train":
        extra["matmul_peak_tflops"] = bench.bench_matmul_peaks(("fp32", "bf16"), device=args.device)
        grid = itertools.product(args.model, args.batch_size, args.checkpoint_blocks, args.compile, args.attention)
        for model, batch, ckpt, comp, attention in grid:
            group = bench.bench_train(
                model, args.image_size, tuple(args.precision), batch, ckpt, comp == "on", args.steps, args.warmup,
                args.device, args.peak_tflops, attention, args.peak_probe,
            )  # fmt: skip
            fp32 = next((r for r in group if r["precision"] == "fp32"), None)
            for row in group:
                during = row.get("matmul_peak_tflops_during", extra["matmul_peak_tflops"])
                row["fraction_of_fp32_matmul_peak"] = row["model_tflops"] / during["fp32"]
                if fp32 is not None:  # paired: the precisions took turns step by step
                    row["speedup_vs_fp32"] = fp32["median_s"] / row["median_s"]
                print(
                    f"{model} {row['precision']} batch {batch} ckpt {ckpt} compile {comp} attention "
                    f"{row['attention']}: {row['median_s']:.4g} s/step",
                    file=sys.stderr,
                )
            rows += group
        keys = ["model", "precision", "batch_per_device", "checkpoint_blocks", "compile", "attention", "median_s", "p10_s", "p90_s",
                "images_per_sec", "model_tflops", "mfu", "hfu", "peak_source", "fraction_of_fp32_matmul_peak",
                "speedup_vs_fp32"]  # fmt: skip
        # Measured again at the end: a drift between the two says the machine's speed changed during the run.
        extra["matmul_peak_tflops_after"] = bench.bench_matmul_peaks(("fp32", "bf16"), device=args.device)
        print(
            f"matmul peaks measured in this run (TFLOP/s): before {extra['matmul_peak_tflops']}, "
            f"after {extra['matmul_peak_tflops_after']}"
        )
        if args.calibration:
            from dit.cost.plan import Calibration, save_calibration

            best = max(rows, key=lambda row: row["mfu"])
            cal = Calibration(best["model"], best["image_size"], best["precision"], best["device"], best["mfu"])
            save_calibration(cal, args.calibration, benchmark=best)
            print(f"calibration (best MFU {best['mfu']:.1%}) written to {args.calibration}")
    elif args.mode == "sample":
        grid = itertools.product(args.model, args.precision, args.batch_size, args.attention)
        for model, precision, batch, attention in grid:
            rows.append(
                bench.bench_sample(
                    model,
                    args.image_size,
                    precision,
                    batch,
                    args.num_sampling_steps,
                    args.cfg_scale,
                    args.repeats,
                    args.device,
                    args.peak_tflops,
                    attention,
                )  # fmt: skip
            )
        keys = ["model", "precision", "batch", "attention", "num_sampling_steps", "cfg_scale", "median_s", "images_per_sec",
                "model_tflops", "mfu", "peak_source"]  # fmt: skip
    elif args.mode == "accounting":
        for model, precision, batch in itertools.product(args.model, args.precision, args.batch_size):
            rows.append(bench.bench_accounting(model, batch, args.log_every, precision, args.image_size))
        keys = ["model", "batch", "log_every", "meter_step_us", "log_ms", "step_median_s", "overhead_frac"]
    elif args.mode == "profile":
        print(bench.profile_train_step(args.model, args.precision, args.batch_size, args.image_size, args.rows))
        return 0
    elif args.mode == "attention":
        rows = bench.bench_attention(
            args.model, args.precision, args.batch_size, args.image_size, tuple(args.attention), device=args.device
        )
        keys = ["model", "precision", "batch", "attention", "median_s", "p10_s", "p90_s"]
    elif args.mode == "loss":
        result = _loss_curves(args)
        rows = [
            {
                "run": name,
                "tail_mean_loss": loss,
                "gap_to_reference": result["tail_gap_to_reference"].get(name, 0.0),
            }
            for name, loss in result["tail_mean_loss"].items()
        ]
        keys = ["run", "tail_mean_loss", "gap_to_reference"]
        extra = {k: v for k, v in result.items() if k not in ("tail_mean_loss", "tail_gap_to_reference")}
        print(
            f"last {result['tail_fraction']:.0%} of {result['steps']} steps; seed-to-seed noise in fp32: "
            f"{result['seed_noise']:.2%}"
        )
    else:
        torch.set_num_threads(args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            store = args.store or _synthetic_store(tmp, args.images)
            rows.append(bench.bench_reader(store, args.batch_size, args.seconds, args.repeats))
        keys = ["items", "storage_dtype", "batch", "threads", "best_samples_per_sec", "median_samples_per_sec"]
    print(_table(rows, keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **extra, "argv": sys.argv[1:] if argv is None else argv}, f, indent=2)
    return 0


def _loss_curves(args) -> dict:
    """The quick-start model and digits, trained with DiT's own objective (linear schedule, learned sigma)."""
    import dataclasses

    from dit.quickstart import PRESETS, DigitDataset, train_config

    preset = PRESETS["default"]
    base = train_config(preset, args.steps, Path(tempfile.gettempdir()) / "unused", args.device)
    base = dataclasses.replace(
        base, noise_schedule="linear", predict_xstart=False, learn_sigma=True, log_every=args.log_every
    )
    result = bench.bench_loss_curves(base, DigitDataset(preset.image_size))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, curve in result["curves"].items():
            ax.plot(*zip(*curve), label=name, lw=1.2)
        ax.set(xlabel="step", ylabel=f"training loss (mean of {args.log_every} steps)", yscale="log")
        ax.set_title("Quick-start DiT on MNIST digits: bf16 autocast against fp32")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return result


def _synthetic_store(folder: str, images: int) -> str:
    """An ImageNet-like store: 4x32x32 fp16 moments with flips, 1000 classes."""
    from dit.data.latents import write_moments_store

    g = torch.Generator().manual_seed(0)
    moments = torch.randn(images, 2, 2, 4, 32, 32, generator=g).half()
    moments[:, :, 1].abs_()
    write_moments_store(folder, moments, torch.randint(0, 1000, (images,), generator=g), 1000)
    return folder


if __name__ == "__main__":
    sys.exit(run_cli(main))
