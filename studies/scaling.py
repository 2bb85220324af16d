"""Quality against compute on the quick start's digits: model sizes (the DiT paper's scaling question) and
objectives (DiT's diffusion against SiT's flow matching), each over one or more seeds.

Each run trains on MNIST-5k (the quick start's recipe and batch) for the same training-FLOPs budget, so the
smaller models take more steps, and is evaluated with the digit FID at evenly spaced steps, with samplers of
equal network evaluations (DDIM 10 steps for diffusion, Heun 5 steps = 10 NFE for flow). A finished run is
reused and a stopped one resumes, so the script can be rerun. Not part of CI; times are in docs/evaluation.md.

  python studies/scaling.py --results-dir out/studies --plot docs/images/scaling_mnist.png \\
      --out docs/results/scaling_mnist.json
  python studies/scaling.py --sizes M --objectives diffusion flow --seeds 0 1 --results-dir out/studies \\
      --plot docs/images/flow_vs_diffusion_mnist.png --out docs/results/flow_vs_diffusion_mnist.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from dit.cost.analytic import repa_flops, training_flops_per_image
from dit.cost.plots import plot_quality
from dit.cost.quality import compute_to_target, pflops_of, read_run
from dit.data.digits import DigitDataset
from dit.data.encoder import encoder_shape, resolve_input_size, upstream_flops
from dit.eval.digit_nets import load_digit_classifier
from dit.eval.reference import digits_reference, save_stats
from dit.io.cli import run_cli
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.objectives import OBJECTIVES
from dit.objectives.samplers import sampling_plan
from dit.runtime.stop import EXIT_CODES
from dit.train import train
from dit.train.recipes import PRESETS, digits_train_config
from seeded import command, report, write_json

# (name, depth, hidden size, heads): the quick start's model in the middle (docs/evaluation.md, "Scaling").
SIZES = (("S", 4, 96, 3), ("M", 6, 128, 4), ("L", 8, 192, 6))
# Training recipes (docs/recipes.md): options on top of the digits recipe; "a+b" combines two.
RECIPES = {
    "baseline": {},
    "min-snr": {"loss_weight": "min-snr"},  # Min-SNR-5 on the MSE term (Hang et al. 2023)
    "logit-normal": {"time_sampling": "logit-normal"},  # SD3's timesteps
    "blocks": {"norm": "rmsnorm", "mlp": "swiglu", "rope": True, "qk_norm": True},  # LightningDiT's bundle
    # the digit encoder (not the judge), block 2 of 6 (a third of the depth), a 256-wide projector: docs/repa.md
    "repa": {"repa_encoder": "digits-mae", "repa_depth": 2, "repa_projector_dim": 256, "repa_coeff": 0.5},
    # The frontier's recipes (docs/recipes.md), each alone. SPRINT at R = 0.5, dropping to the end (a full-token
    # second stage would sit between the evaluations of a continued budget); the evaluation samples at full tokens.
    "token-drop": {"token_drop": 0.5, "token_drop_layout": "sprint"},
    # RAE's dimension rule, a = sqrt(784 / 4096) = 0.44 for 28 x 28 x 1: no value tuned on the study itself.
    "time-shift": {"time_shift": "auto"},
    # on the velocity the x0 prediction implies; a digit has one channel: docs/recipes.md says what that leaves
    "cos-loss": {"cos_loss_weight": 1.0},
    "adam-beta2": {"adam_beta2": 0.95},  # LightningDiT's
}
# configs/frontier.yaml's stack, where it applies to the digits: its flow objective is the study's other axis
# (--objectives), and its batch, lr, EMA and steps are ImageNet's (the digits recipe keeps its own).
FRONTIER = ("blocks", "logit-normal", "token-drop", "time-shift", "cos-loss", "adam-beta2")
RECIPES["frontier"] = {k: v for part in FRONTIER for k, v in RECIPES[part].items()}


def recipe_options(recipe: str) -> dict:
    options = {}
    for part in recipe.split("+"):
        if part not in RECIPES:
            raise UserError(f"--recipes {recipe}: {part} is not one of {', '.join(RECIPES)} (join two with +).")
        options.update(RECIPES[part])
    return options


def flops_per_step(cfg, batch: int) -> tuple[float, float]:
    """The DiT's and REPA's training FLOPs per step, and the upstream FLOPs (the encoder's own training)."""
    model = cfg.model_config(1, cfg.model.image_size)
    dit = training_flops_per_image(model).model * batch
    if not cfg.repa_encoder.encoder:
        return dit, 0.0, 0.0
    name = cfg.repa_encoder.encoder
    size = resolve_input_size(name, cfg.repa_encoder.input_size, round(model.tokens**0.5))
    aux = repa_flops(encoder_shape(name, size), model, cfg.repa.projector_dim).per_step_image(False) * batch
    return dit, aux, upstream_flops(name) or 0.0


@dataclass(frozen=True)
class ScalingConfig(Section):
    """Train DiT sizes x objectives x seeds on the digits for one FLOPs budget each; plot FID against compute."""

    budget_tflops: float = option(60.0, "training FLOPs per model (model FLOPs, TFLOP)", gt=0)
    eval_every_tflops: float = option(
        10.0,
        "training FLOPs between evaluations (TFLOP), and one at the end: a larger budget continues a run",
        gt=0,
    )
    eval_num_samples: int = option(
        1000,
        "EMA samples per evaluation (docs/evaluation.md: the sample count)",
        ge=65,
        aliases=("--eval-samples",),
    )
    eval_num_sampling_steps: int = option(
        10, "network evaluations per evaluation sample: DDIM steps, or twice the Heun steps of a flow run", ge=2,
        aliases=("--eval-sampling-steps",),
    )  # fmt: skip
    eval_guidance_scale: float = option(1.5, "guidance of the evaluation samples", ge=1)
    sizes: tuple[str, ...] = option(["S", "M", "L"], "which sizes to run", choices=tuple(s[0] for s in SIZES))
    objectives: tuple[str, ...] = option(["diffusion"], "training objectives", choices=tuple(OBJECTIVES))
    recipes: tuple[str, ...] = option(
        ["baseline"],
        f"training recipes, each alone or joined with + ({', '.join(RECIPES)}), NAME:N for N seeds (0..N-1) "
        "instead of --seeds; with any but the baseline the budget and the x axis count total FLOPs (DiT + "
        "auxiliary + upstream)",
    )
    seeds: tuple[int, ...] = option([0], "training seeds (one run each)", ge=0)
    targets: tuple[float, ...] = option([400.0, 200.0, 100.0], "digit FIDs to report the compute to", gt=0)
    judge_targets: tuple[float, ...] = option(
        [], "digit-judge FDs to report the compute to (the second judge)", gt=0
    )
    precision: str = option("fp32", "training precision", choices=("fp32", "bf16"))
    results_dir: str = option(
        "out/scaling", "runs go to RESULTS_DIR/SIZE-OBJECTIVE-sSEED (a run already there is reused)"
    )
    plot: str | None = option(None, "write the FID-against-FLOPs chart here (PNG)")
    out: str | None = option(None, "write the summary here (JSON)")
    verdict: str | None = option(
        None, "write the verdict here (JSON): per recipe, the training FLOPs to the --against recipe's final "
        "quality under both judges, their ratio and whether the seeds are apart",
    )  # fmt: skip
    against: str = option("baseline", "the recipe the verdict measures the others against")
    ema_profiles: tuple[float, ...] | None = option(
        None, "post-hoc EMA profiles (sigma_rel) every run also tracks (docs/ema.md): the training and its classic "
        "EMA, today's default, are unchanged",
    )  # fmt: skip
    ema_snapshot_every: int = option(100, "with --ema-profiles: steps per snapshot of the profiles", ge=1)
    keep_evals: bool = option(
        False, "keep each evaluation's checkpoint for good (early checkpoints as autoguidance guides)"
    )

    def check(self) -> None:
        if self.verdict and self.against not in [spec.partition(":")[0] for spec in self.recipes]:
            raise FieldError(
                f"{{verdict}} measures the recipes against {self.against}, which {{recipes}} does not run: add "
                f"{self.against}:2 to {{recipes}}, or name one of them in {{against}}."
            )


FACE = Face(
    "studies/scaling.py",
    __doc__,
    sections={"scaling": ScalingConfig},
    outputs={"results_dir": "folder", "plot": "file", "out": "file", "verdict": "file"},
)


def run_one(c: ScalingConfig, size: tuple, objective: str, seed: int, ref: str, recipe: str = "baseline"):
    """Train (or resume, or reuse) one run for a budget of total FLOPs; its folder and its steps."""
    name, depth, hidden, heads = size
    preset = dataclasses.replace(PRESETS["default"], depth=depth, hidden_size=hidden, num_heads=heads)
    folder = Path(c.results_dir) / run_name(name, objective, seed, recipe)
    base = digits_train_config(preset, 1, folder, None).replace(**recipe_options(recipe))
    dit, aux, upstream = flops_per_step(base, preset.batch_size)
    steps = max(1, round((c.budget_tflops * 1e12 - upstream) / (dit + aux)))
    every = max(1, int(c.eval_every_tflops * 1e12 / (dit + aux)))  # the same steps for any budget
    sampler = OBJECTIVES[objective].fast_sampler  # the same NFE for every objective: steps of its fast sampler
    per_step = sampling_plan(sampler, 2).nfe // 2
    cfg = digits_train_config(
        preset, steps, folder, None, eval_ref=ref, eval_every=every,
        eval_samples=c.eval_num_samples,
        sample_steps=c.eval_num_sampling_steps // per_step,
    )  # fmt: skip
    cfg = cfg.replace(**study_options(c, objective, seed, steps, every), **recipe_options(recipe))
    if not finished(folder, steps):  # a finished run is reused, a stopped one resumes
        result = train(cfg, DigitDataset(preset.image_size))
        if result.get("signal"):
            raise SystemExit(EXIT_CODES[result["signal"]])
    return folder, steps


def study_options(c: ScalingConfig, objective: str, seed: int, steps: int, every: int) -> dict:
    """The options every run of the study shares, whatever its recipe (a recipe sets none of them)."""
    options = dict(
        eval_guidance_scale=c.eval_guidance_scale, seed=seed, precision=c.precision, progress=False,
        ckpt_every=every, keep_last=1, log_every=max(1, steps // 50), resume="auto",
        objective=objective, eval_sampler=OBJECTIVES[objective].fast_sampler, eval_guidance_interval=None,
    )  # fmt: skip
    # post-hoc EMA profiles and kept checkpoints only when asked (a run without them records none)
    if c.ema_profiles:
        options.update(ema_profiles=c.ema_profiles, ema_snapshot_every=c.ema_snapshot_every)
    if c.keep_evals:
        options["keep_every"] = every
    return options


def run_name(size: str, objective: str, seed: int, recipe: str = "baseline") -> str:
    """One folder per run, so two studies in one --results-dir share the runs they have in common."""
    return f"{size}-{objective}-s{seed}" if recipe == "baseline" else f"{size}-{objective}-{recipe}-s{seed}"


# the digit FID and the digit judge's FD (docs/evaluation.md: the rule), and where a run keeps its FLOPs to their targets
JUDGES = {"fid": "to_target", "fd_judge": "to_judge_target"}


def recipe_summary(runs: dict, targets, judge_targets=()) -> dict:
    """Per recipe, over its seeds: the FLOPs to each target (None: a seed never got there) and the scores at the
    budget, with their ranges."""
    out = {}
    for recipe in dict.fromkeys(r["recipe"] for r in runs.values()):
        mine = [r for r in runs.values() if r["recipe"] == recipe]
        final = [r["evaluations"][-1]["fid"] for r in mine]
        row = {"seeds": len(mine), "fid_at_budget": final, "fid_at_budget_range": [min(final), max(final)]}
        for (judge, key), wanted in zip(JUDGES.items(), (targets, judge_targets)):
            for t in wanted:
                flops = [reached_pflops(r[key][str(t)]) for r in mine if r[key][str(t)]["reached"]]
                every = len(flops) == len(mine)
                row[f"pflops_to_{judge}_{t:g}"] = flops if every else None
                row[f"pflops_to_{judge}_{t:g}_range"] = [min(flops), max(flops)] if every else None
        final = [r["evaluations"][-1].get("fd_judge") for r in mine]
        row["fd_judge_at_budget"] = final
        out[recipe] = row
    return out


def reached_pflops(result: dict) -> float:
    """The PFLOPs at which a ``compute_to_target`` result reached its target, whichever FLOPs it counted."""
    return result.get("total_pflops", result.get("total_model_pflops"))


def recipe_verdict(runs: dict, against: str, count: str, targets=(), judge_targets=()) -> dict:
    """Per recipe, the training FLOPs its seeds need to reach the ``against`` recipe's final quality (the worse of
    its seeds') under each judge, and their ratio to ``against``'s own (docs/recipes.md). A seed that never gets
    there has None; a claim needs the ranges apart in the same direction under both judges."""
    base = [r for r in runs.values() if r["recipe"] == against]
    quality = {}
    for judge in JUDGES:
        finals = [r["evaluations"][-1][judge] for r in base]
        if None in finals:
            raise UserError(
                f"--against {against}: its final evaluations have no {judge}; score them under both judges."
            )
        quality[judge] = max(finals)
    to_targets = recipe_summary(runs, targets, judge_targets)
    flops = {recipe: {judge: [_flops_to(r, quality[judge], count, judge) for r in runs.values()
                              if r["recipe"] == recipe] for judge in JUDGES} for recipe in to_targets}  # fmt: skip
    out = {"against": against, "flops_counted": count, "baseline_quality": quality, "recipes": {}}
    for recipe, mine in flops.items():
        row = {"seeds": len(mine["fid"]), "flops_to_baseline_quality": mine, "flops_ratio": {}, "seeds_apart": {}}
        directions = set()
        for judge in JUDGES:
            row["flops_ratio"][judge], direction = _compare(mine[judge], flops[against][judge])
            row["seeds_apart"][judge] = direction is not None
            directions.add(direction)
        row["both_judges"] = len(directions) == 1 and None not in directions
        row["claim"] = directions.pop() if row["both_judges"] else "within noise"
        out["recipes"][recipe] = {**row, "to_targets": to_targets[recipe]}
    return out


def _flops_to(run: dict, target: float, count: str, judge: str) -> float | None:
    """The training FLOPs at which ``run`` first reached ``target`` under ``judge`` (None: it never did)."""
    result = compute_to_target(run["folder"], target, up_to_step=run["steps"], count=count, score=judge)
    return reached_pflops(result) * 1e15 if result["reached"] else None


def _compare(mine: list, base: list) -> tuple[list | None, str | None]:
    """[lowest, highest] ratio of ``mine``'s FLOPs to ``base``'s (None: never reached), and ``fewer`` or ``more``
    where the two ranges do not overlap (None where they do)."""
    inf = float("inf")
    lo, hi = min(x if x is not None else inf for x in mine), max(x if x is not None else inf for x in mine)
    b_lo, b_hi = min(x if x is not None else inf for x in base), max(x if x is not None else inf for x in base)
    ratio = [lo / b_hi if lo < inf else None, hi / b_lo if hi < inf else None]
    return ratio, "fewer" if hi < b_lo else "more" if lo > b_hi else None


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
    runs, labels, recipe_of = {}, [], {}
    count = "model" if c.recipes == ("baseline",) else "total"
    for size in (s for s in SIZES if s[0] in c.sizes):
        for objective in c.objectives:
            for spec in c.recipes:
                recipe, _, n = spec.partition(":")
                recipe_options(recipe)  # an unknown name fails before any training
                for seed in range(int(n)) if n else c.seeds:
                    key = run_name(size[0], objective, seed, recipe)
                    runs[key] = run_one(c, size, objective, seed, ref, recipe)
                    recipe_of[key] = recipe
                    what = "" if recipe == "baseline" else f" {recipe}"
                    labels.append(
                        f"DiT {size[0]} (depth {size[1]}, hidden {size[2]}) {objective}{what}, seed {seed}"
                    )
                    print(f"{key}: done ({runs[key][0]})", file=sys.stderr)
    summary = {"command": command("scaling.py", argv), "flops_counted": count, "runs": {}}
    for name, (folder, steps) in runs.items():
        train_rows, evals = read_run(str(folder), steps)  # a run trained past this budget is read up to it
        keys = ("step", "total_model_pflops", "total_aux_pflops", "upstream_pflops", "fid", "fd_judge", "intervals",
                "class_accuracy", "precision", "recall")  # fmt: skip
        summary["runs"][name] = {
            "folder": str(folder),
            "recipe": recipe_of[name],
            "steps": evals[-1]["step"],
            "evaluations": [
                {
                    **{k: e.get(k) for k in keys},
                    "total_pflops": pflops_of(e, "total"),
                    "eval_labels": e.get("eval_labels", "random"),  # a row from before the label modes: random
                }
                for e in evals
            ],
            "mean_mfu": sum(r["mfu"] for r in train_rows if not r["in_warmup"])
            / max(1, sum(not r["in_warmup"] for r in train_rows)),
        }
        to = partial(compute_to_target, str(folder), up_to_step=steps, count=count)
        for (score, key), targets in zip(JUDGES.items(), (c.targets, c.judge_targets)):
            summary["runs"][name][key] = {str(t): to(t, score=score) for t in targets}
            for r in summary["runs"][name][key].values():
                r.pop("evaluations")
    if len(set(recipe_of.values())) > 1:
        summary["recipes"] = recipe_summary(summary["runs"], c.targets, c.judge_targets)
    if c.plot:
        title = "Digit FID against training FLOPs" + (
            f": {len(set(recipe_of.values()))} recipes" if len(set(recipe_of.values())) > 1
            else f", {len(c.sizes)} sizes" if len(c.sizes) > 1 else f": {' vs '.join(c.objectives)}"
        )  # fmt: skip
        groups = [recipe_of[k] for k in runs] if len(set(recipe_of.values())) > 1 else None
        plot_quality(c.plot, [str(f) for f, _ in runs.values()], labels, title, [n for _, n in runs.values()],
                     count=count, groups=groups)  # fmt: skip
    if c.verdict:
        verdict = recipe_verdict(summary["runs"], c.against, count, c.targets, c.judge_targets)
        write_json(c.verdict, {"command": summary["command"], **verdict})
    return report(summary, c.out)


if __name__ == "__main__":
    sys.exit(run_cli(main))
