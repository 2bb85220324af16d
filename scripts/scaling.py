"""Quality against compute on the quick start's digits: model sizes (the DiT paper's scaling question) and
objectives (DiT's diffusion against SiT's flow matching), each over one or more seeds.

Each run trains on MNIST-5k (the quick start's recipe and batch) for the same training-FLOPs budget, so the
smaller models take more steps, and is evaluated with the digit FID at evenly spaced steps, with samplers of
equal network evaluations (DDIM 10 steps for diffusion, Heun 5 steps = 10 NFE for flow). A finished run is
reused and a stopped one resumes, so the script can be rerun. Not part of CI; times are in docs/evaluation.md.

  python scripts/scaling.py --results-dir out/studies --plot docs/images/scaling_mnist.png \\
      --out docs/results/scaling_mnist.json
  python scripts/scaling.py --sizes M --objectives diffusion flow --seeds 0 1 --results-dir out/studies \\
      --plot docs/images/flow_vs_diffusion_mnist.png --out docs/results/flow_vs_diffusion_mnist.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dit.atomic import atomic_write_bytes
from dit.cli import run_cli
from dit.config import Face, Section, option
from dit.cost.analytic import training_flops_per_image
from dit.cost.plots import plot_quality
from dit.cost.quality import compute_to_target, read_run
from dit.data.digits import DigitDataset
from dit.eval.features import load_digit_classifier
from dit.eval.reference import digits_reference, save_stats
from dit.runtime.stop import EXIT_CODES
from dit.train import train
from dit.train.recipes import PRESETS, digits_train_config

# (name, depth, hidden size, heads): the quick start's model in the middle, a 2.6x smaller and a 2.9x larger one
# (in training FLOPs per image; a smaller S spent its budget in too many steps to finish on a CPU).
SIZES = (("S", 4, 96, 3), ("M", 6, 128, 4), ("L", 8, 192, 6))


@dataclass(frozen=True)
class ScalingConfig(Section):
    """Train DiT sizes x objectives x seeds on the digits for one FLOPs budget each; plot FID against compute."""

    budget_tflops: float = option(60.0, "training FLOPs per model (model FLOPs, TFLOP)", gt=0)
    eval_every_tflops: float = option(
        10.0,
        "training FLOPs between evaluations (TFLOP), and one at the end: a larger budget continues a run",
        gt=0,
    )
    eval_num_samples: int = option(500, "EMA samples per evaluation", ge=65, aliases=("--eval-samples",))
    eval_num_sampling_steps: int = option(
        10, "network evaluations per evaluation sample: DDIM steps, or twice the Heun steps of a flow run", ge=2,
        aliases=("--eval-sampling-steps",),
    )  # fmt: skip
    eval_guidance_scale: float = option(1.5, "guidance of the evaluation samples", ge=1)
    sizes: tuple[str, ...] = option(["S", "M", "L"], "which sizes to run", choices=tuple(s[0] for s in SIZES))
    objectives: tuple[str, ...] = option(["diffusion"], "training objectives", choices=("diffusion", "flow"))
    seeds: tuple[int, ...] = option([0], "training seeds (one run each)", ge=0)
    targets: tuple[float, ...] = option([400.0, 200.0, 100.0], "digit FIDs to report the compute to", gt=0)
    precision: str = option("fp32", "training precision", choices=("fp32", "bf16"))
    results_dir: str = option(
        "out/scaling", "runs go to RESULTS_DIR/SIZE-OBJECTIVE-sSEED (a run already there is reused)"
    )
    plot: str | None = option(None, "write the FID-against-FLOPs chart here (PNG)")
    out: str | None = option(None, "write the summary here (JSON)")


FACE = Face("scripts/scaling.py", __doc__, sections={"scaling": ScalingConfig})


def run_one(c: ScalingConfig, size: tuple, objective: str, seed: int, ref: str) -> tuple[Path, int]:
    """Train (or resume, or reuse) one run; its folder and the steps of this budget."""
    name, depth, hidden, heads = size
    preset = dataclasses.replace(PRESETS["default"], depth=depth, hidden_size=hidden, num_heads=heads)
    folder = Path(c.results_dir) / run_name(name, objective, seed)
    base = digits_train_config(preset, 1, folder, None)
    per_step = training_flops_per_image(base.model_config(1, preset.image_size)).model * preset.batch_size
    steps = max(1, round(c.budget_tflops * 1e12 / per_step))
    every = max(1, int(c.eval_every_tflops * 1e12 / per_step))  # the same steps for any budget
    flow = objective == "flow"
    cfg = digits_train_config(
        preset, steps, folder, None, eval_ref=ref, eval_every=every,
        eval_samples=c.eval_num_samples,
        sample_steps=c.eval_num_sampling_steps // 2 if flow else c.eval_num_sampling_steps,
    )  # fmt: skip
    cfg = cfg.replace(
        eval_guidance_scale=c.eval_guidance_scale, seed=seed, precision=c.precision, progress=False,
        ckpt_every=every, keep_last=1, log_every=max(1, steps // 50), resume="auto",
        objective=objective, eval_sampler="ode" if flow else "ddim",
    )  # fmt: skip
    if not finished(folder, steps):  # a finished run is reused, a stopped one resumes
        result = train(cfg, DigitDataset(preset.image_size))
        if result.get("signal"):
            raise SystemExit(EXIT_CODES[result["signal"]])
    return folder, steps


def run_name(size: str, objective: str, seed: int) -> str:
    """One folder per run, so two studies in one --out share the runs they have in common."""
    return f"{size}-{objective}-s{seed}"


def finished(folder: Path, steps: int) -> bool:
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        return False
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return any(r.get("kind") == "eval" and r.get("step") == steps for r in rows)


def main(argv: list[str] | None = None) -> int:
    c = FACE.parse(argv).sections["scaling"]
    Path(c.results_dir).mkdir(parents=True, exist_ok=True)
    ref = str(Path(c.results_dir) / "digits_ref.npz")
    save_stats(ref, digits_reference(load_digit_classifier()))
    runs, labels = {}, []
    for size in SIZES:
        if size[0] not in c.sizes:
            continue
        for objective in c.objectives:
            for seed in c.seeds:
                key = run_name(size[0], objective, seed)
                runs[key] = run_one(c, size, objective, seed, ref)
                labels.append(f"DiT {size[0]} (depth {size[1]}, hidden {size[2]}) {objective}, seed {seed}")
                print(f"{key}: done ({runs[key][0]})", file=sys.stderr)
    summary = {
        "command": "python scripts/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": {},
    }
    for name, (folder, steps) in runs.items():
        train_rows, evals = read_run(str(folder), steps)  # a run trained past this budget is read up to it
        summary["runs"][name] = {
            "folder": str(folder),
            "steps": evals[-1]["step"],
            "evaluations": [
                {k: e[k] for k in ("step", "total_model_pflops", "fid", "class_accuracy", "precision", "recall")}
                for e in evals
            ],  # fmt: skip
            "mean_mfu": sum(r["mfu"] for r in train_rows if not r["in_warmup"])
            / max(1, sum(not r["in_warmup"] for r in train_rows)),
            "to_target": {str(t): compute_to_target(str(folder), t, up_to_step=steps) for t in c.targets},
        }
        for t in c.targets:
            r = summary["runs"][name]["to_target"][str(t)]
            r.pop("evaluations")
    if c.plot:
        title = "Digit FID against training FLOPs" + (
            f", {len(c.sizes)} sizes" if len(c.sizes) > 1 else f": {' vs '.join(c.objectives)}"
        )
        plot_quality(c.plot, [str(f) for f, _ in runs.values()], labels, title, [n for _, n in runs.values()])
    text = json.dumps(summary, indent=1)
    if c.out:
        atomic_write_bytes(c.out, (text + "\n").encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
