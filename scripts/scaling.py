"""Quality against compute at three model sizes: the DiT paper's scaling question on the quick start's digits.

Each size trains on MNIST-5k (the quick start's recipe and batch) for the same training-FLOPs budget, so the
smaller models take more steps, and is evaluated with the digit FID at evenly spaced steps. About 35 minutes
on 2 CPU cores; not part of CI.

  python scripts/scaling.py --out out/scaling --plot docs/images/scaling_mnist.png \\
      --json docs/results/scaling_mnist.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dit.atomic import atomic_write_bytes
from dit.cli import run_cli
from dit.config import option, parse_config
from dit.cost.analytic import training_flops_per_image
from dit.cost.plots import plot_quality
from dit.cost.quality import compute_to_target, read_run
from dit.data.digits import DigitDataset
from dit.eval.features import load_digit_classifier
from dit.eval.reference import digits_reference, save_stats
from dit.train import train
from dit.train.recipes import PRESETS, digits_train_config

# (name, depth, hidden size, heads): the quick start's model in the middle, a 6x smaller and a 3x larger one.
SIZES = (("S", 4, 64, 2), ("M", 6, 128, 4), ("L", 8, 192, 6))


@dataclass
class ScalingConfig:
    """Train three DiT sizes on the digits for one FLOPs budget each; plot digit FID against compute."""

    budget_tflops: float = option(60.0, "training FLOPs per model (model FLOPs, TFLOP)")
    evaluations: int = option(6, "evaluations per run, evenly spaced in steps")
    eval_samples: int = option(500, "EMA samples per evaluation")
    eval_sampling_steps: int = option(10, "DDIM steps of the evaluation samples")
    eval_guidance_scale: float = option(1.5, "guidance of the evaluation samples")
    sizes: list[str] = option(["S", "M", "L"], "which sizes to run", choices=tuple(s[0] for s in SIZES))
    targets: list[float] = option([400.0, 200.0, 100.0], "digit FIDs to report the compute to")
    seed: int = option(0, "training seed")
    precision: str = option("fp32", "training precision", choices=("fp32", "bf16"))
    out: str = option("out/scaling", "runs go to OUT/SIZE")
    plot: str | None = option(None, "write the FID-against-FLOPs chart here (PNG)")
    json: str | None = option(None, "write the summary here")


def run_size(c: ScalingConfig, name: str, depth: int, hidden: int, heads: int, ref: str) -> Path:
    preset = dataclasses.replace(PRESETS["default"], depth=depth, hidden_size=hidden, num_heads=heads)
    folder = Path(c.out) / name
    base = digits_train_config(preset, 1, folder, None)
    per_step = training_flops_per_image(base.model_config(1, preset.image_size)).model * preset.batch_size
    steps = max(c.evaluations, round(c.budget_tflops * 1e12 / per_step))
    cfg = digits_train_config(
        preset, steps, folder, None, eval_ref=ref, eval_every=max(1, steps // c.evaluations),
        eval_samples=c.eval_samples, sample_steps=c.eval_sampling_steps,
    )  # fmt: skip
    cfg = dataclasses.replace(
        cfg, eval_guidance_scale=c.eval_guidance_scale, seed=c.seed, precision=c.precision, progress=False,
        ckpt_every=steps, keep_last=1, log_every=max(1, steps // 50),
    )  # fmt: skip
    if not (folder / "metrics.jsonl").is_file():  # a finished size is reused: the script can be resumed
        train(cfg, DigitDataset(preset.image_size))
    return folder


def main(argv: list[str] | None = None) -> int:
    c = parse_config(ScalingConfig, argv, description=__doc__)
    Path(c.out).mkdir(parents=True, exist_ok=True)
    ref = str(Path(c.out) / "digits_ref.npz")
    save_stats(ref, digits_reference(load_digit_classifier()))
    runs = {}
    for name, depth, hidden, heads in SIZES:
        if name in c.sizes:
            runs[name] = run_size(c, name, depth, hidden, heads, ref)
            print(f"{name}: done ({runs[name]})", file=sys.stderr)
    summary = {
        "command": "python scripts/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": {},
    }
    for name, folder in runs.items():
        train_rows, evals = read_run(str(folder))
        summary["runs"][name] = {
            "folder": str(folder),
            "steps": evals[-1]["step"],
            "evaluations": [
                {k: e[k] for k in ("step", "total_model_pflops", "fid", "class_accuracy", "precision", "recall")}
                for e in evals
            ],  # fmt: skip
            "mean_mfu": sum(r["mfu"] for r in train_rows if not r["in_warmup"])
            / max(1, sum(not r["in_warmup"] for r in train_rows)),
            "to_target": {str(t): compute_to_target(str(folder), t) for t in c.targets},
        }
        for t in c.targets:
            r = summary["runs"][name]["to_target"][str(t)]
            r.pop("evaluations")
    if c.plot:
        labels = [f"DiT {n} (depth {d}, hidden {h})" for n, d, h, _ in SIZES if n in runs]
        plot_quality(c.plot, [str(f) for f in runs.values()], labels, "Digit FID against training FLOPs, 3 sizes")
    text = json.dumps(summary, indent=1)
    if c.json:
        atomic_write_bytes(c.json, (text + "\n").encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
