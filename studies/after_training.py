"""Quality bought after training, on the digits (issue 39 item 4): post-hoc EMA's sigma_rel, autoguidance with an
early checkpoint and with a smaller model as guides against classifier-free guidance (CFG), and random against
balanced labels, each against today's default (the classic EMA, CFG 1.5, balanced labels), by the rule.

Reads the model's runs (one per training seed, ``studies/scaling.py --ema-profiles 0.05 0.1 --keep-evals``) and a
smaller model's run (the small guide). Reconstructs each --sigma-rels EMA per run (``python -m dit.checkpoint
ema``); samples each setting with ``studies/sampling_study.py`` (DDIM, sampling seed 0, so image i has the same
noise and label in every study, and the training seeds are the rule's seeds), keeping the features; then, per
method, picks its best setting (the lowest mean over both judges of its seed-mean score relative to the
default's) and judges it against the default, and autoguidance also against CFG's best, with the paired
bootstrap of ``studies/sampling_verdicts.py``. Everything lands in --work; a rerun skips what is there.

The CFG settings and an early-checkpoint guide cost the same (two passes of the model per step); the smaller guide
is cheaper per step, so it gets the most DDIM steps whose FLOPs stay within CFG's (``equal_flops_steps``). Each
method's best is picked on the samples that judge it: a "better" is worth confirming with --seed 1.

  python studies/after_training.py --runs out/after_runs/M-diffusion-s0 out/after_runs/M-diffusion-s1 \\
      --small out/after_runs/S-diffusion-s0 --work out/after --out out/after/after_training_verdict.json
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import sampling_verdicts
from compare import better
from dit.checkpoint.format import list_checkpoints
from dit.cost.analytic import forward_macs
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.sample.loading import read_model
from seeded import command, write_json

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class AfterConfig(Section):
    """Post-hoc EMA, autoguidance and label modes against today's default, by the rule (docs/evaluation.md)."""

    runs: tuple[str, ...] = option(
        help="the model's run folders, one per training seed (--ema-profiles, --keep-evals)"
    )
    small: str | None = option(None, "a smaller model's run folder: the small guide (none: no small-guide study)")
    work: str = option("out/after", "reconstructed EMAs and studies (a rerun skips what is there)")
    out: str = option("out/after/after_training_verdict.json", "the verdicts (JSON)")
    sigma_rels: tuple[float, ...] = option(
        [0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2],
        "the EMAs to rebuild: ones the snapshots draw (docs/ema.md; 11 snapshots of 0.05 and 0.1 draw 0.03 to 0.2)",
        gt=0,
    )
    guidance: tuple[float, ...] = option([1.5, 2.0, 3.0], "the scales of CFG and autoguidance", gt=1)
    default_guidance: float = option(1.5, "today's default scale", gt=1)
    steps: int = option(10, "DDIM steps of CFG and the default", ge=1)
    guide_steps: tuple[int, ...] | None = option(
        None, "the early guides' steps (default: every checkpoint a run kept before its last)", ge=1
    )
    num_samples: int = option(1000, "samples per setting (docs/evaluation.md: the sample count)", ge=65)
    batch_size: int = option(250, "samples per batch", ge=1)
    aggregate_only: bool = option(False, "judge the studies already in --work; run nothing")
    sampling_seed: int = option(
        0,
        "every study's sampling seed (image i's noise and label): another seed confirms a best picked on seed 0's",
        ge=0,
    )


FACE = Face(
    "studies/after_training.py",
    __doc__,
    sections={"after": AfterConfig},
    outputs={"work": "folder", "out": "file"},
    inputs={"runs": "folder", "small": "folder"},
)


def run(command: list) -> None:
    """One step of the study as its own command (its error line is its own); a failure stops the study."""
    command = [str(x) for x in command]
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if subprocess.run([sys.executable, *command], env=env).returncode:
        raise UserError(
            f"{' '.join(command)} failed (its message is above): fix it, then rerun; what is done is kept."
        )


def checkpoints(run_folder: str) -> list[tuple[int, Path]]:
    found = list_checkpoints(Path(run_folder) / "checkpoints")
    if not found:
        raise UserError(f"{run_folder} has no checkpoints: pass a finished run folder of studies/scaling.py.")
    return found


def forward_flops(ckpt: Path) -> float:
    return forward_macs(read_model(ckpt)[0].config, ratio=0).flops


def equal_flops_steps(steps: int, model_flops: float, guide_flops: float) -> int:
    """The most steps whose autoguided cost (model + guide per step) stays within CFG's (two model passes)."""
    return max(1, int(steps * 2 * model_flops // (model_flops + guide_flops)))


def run_studies(c: AfterConfig) -> tuple[dict, dict]:
    """Every study, run or found in --work: (the default's studies, per method its candidate studies)."""
    work, d = Path(c.work), c.default_guidance
    methods = {k: {} for k in ("posthoc_ema", "cfg", "autoguidance_early", "autoguidance_small", "random_labels")}
    small = checkpoints(c.small)[-1][1] if c.small else None
    default = []

    def study(method, label, name, ckpt, scales, labels="balanced", steps=c.steps, guide=None) -> Path:
        """One sampling study of ``method`` (skipped with --aggregate-only), filed under ``label``."""
        extra = ["--guide-ckpt", guide] if guide else []
        out = work / f"{name}-s{seed}.json"
        if not c.aggregate_only:
            run([ROOT / "studies/sampling_study.py", "--ckpt", ckpt, "--out", out, "--samplers", "ddim", "--nfe", steps,
                 "--guidance", *scales, "--intervals", "all", "--num-samples", c.num_samples, "--batch-size",
                 c.batch_size, "--seed", c.sampling_seed, "--labels", labels, *extra])  # fmt: skip
        methods[method].setdefault(label, []).append(out)
        return out

    for seed, folder in enumerate(c.runs):
        kept = checkpoints(folder)
        final = kept[-1][1]
        early = [(s, p) for s, p in kept[:-1] if c.guide_steps is None or s in c.guide_steps]
        if len(early) < len(c.guide_steps or [None]):
            raise UserError(f"{folder} keeps no early checkpoint{' at each --guide-steps' * bool(c.guide_steps)}: "
                            "train it with studies/scaling.py --keep-evals, or pass --guide-steps it kept.")  # fmt: skip
        default.append(study("cfg", "classic EMA", "classic", final, sorted({d, *c.guidance})))
        study("random_labels", "random labels", "random", final, [d], labels="random")
        for sigma in c.sigma_rels:
            ema = work / f"ema-{sigma:g}-s{seed}.pt"
            if not c.aggregate_only and not ema.is_file():
                run(["-m", "dit.checkpoint", "ema", folder, "--sigma-rel", sigma, "--out", ema])
            study("posthoc_ema", f"sigma_rel {sigma:g}", f"ema-{sigma:g}", ema, [d])
        for step, guide in early:
            label = f"guide: step {step} of the same run"
            study("autoguidance_early", label, f"auto-early{step}", final, c.guidance, guide=guide)
        if small is not None:
            steps = equal_flops_steps(c.steps, forward_flops(final), forward_flops(small))
            label = f"guide: {small.parent.parent.name}"
            study("autoguidance_small", label, "auto-small", final, c.guidance, steps=steps, guide=small)
    return {"studies": default, "setting": f"ddim-{c.steps}-g{d:g}-all"}, {k: v for k, v in methods.items() if v}


AGAINST = {"autoguidance_early": ("default", "cfg"), "autoguidance_small": ("default", "cfg")}


def aggregate(default: dict, methods: dict, refs: dict) -> dict:
    """Per method, its best setting and its verdicts against the default (autoguidance also against CFG's best).
    ``default``: {"studies": [paths per seed], "setting"}; ``methods``: {method: {label: [paths per seed]}}."""
    load, judges = sampling_verdicts.load, sampling_verdicts.SCORES
    base_rows, base = load(tuple(str(p) for p in default["studies"]), refs, recipes=True)
    if default["setting"] not in base:
        raise UserError(f"the default's studies lack {default['setting']}: run them with its scale and steps.")
    base_rows, base = base_rows[default["setting"]], base[default["setting"]]
    base_mean = {s: sum(base[s].scores) / len(base[s].scores) for s in judges}
    best = {"default": (base_rows, base)}
    out = {"default": {"setting": default["setting"], **scores(base_rows)}, "methods": {}}
    for method, studies in methods.items():
        candidates, found = [], {}
        for label, paths in studies.items():
            rows, judged = load(tuple(str(p) for p in paths), refs, recipes=True)
            for setting in rows:
                rel = sum(sum(judged[setting][s].scores) / len(paths) / base_mean[s] for s in judges) / len(judges)
                cost = rows[setting][0]["sampling_tflop_per_1000"]
                candidates.append(
                    dict(study=label, setting=setting, mean_score_relative_to_default=rel, tflop_per_1000=cost)
                )
                found[label, setting] = rows[setting], judged[setting]
        pick = min(candidates, key=lambda x: x["mean_score_relative_to_default"])
        best[method] = rows, judged = found[pick["study"], pick["setting"]]
        against_rows = {}
        for against in AGAINST.get(method, ("default",)):
            if against in best:
                v = better(judged, best[against][1], refs)
                against_rows[against] = {"verdict": v.verdict, "reasons": list(v.reasons),
                                         "shares_ahead": {s: float(x) for s, x in v.shares.items()}}  # fmt: skip
        out["methods"][method] = {
            "best": {k: pick[k] for k in ("study", "setting", "mean_score_relative_to_default")},
            **scores(rows),
            "verdicts": against_rows,
            "candidates": candidates,
        }
    return out


def scores(rows: list[dict]) -> dict:
    """A setting's sampling FLOPs and, per judge, its score and bootstrap interval per training seed."""
    out = {"tflop_per_1000": rows[0]["sampling_tflop_per_1000"], "labels": rows[0].get("labels", "random")}
    for s in sampling_verdicts.SCORES:
        out[s] = [r[s] for r in rows]
        out[f"{s}_intervals"] = [r["intervals"][s] for r in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    c = FACE.parse(argv).sections["after"]
    Path(c.work).mkdir(parents=True, exist_ok=True)
    default, methods = run_studies(c)
    summary = {
        "command": command("after_training.py", argv),
        "rule": "docs/evaluation.md: both judges, >= 95% of paired resamples, the training seeds' ranges apart",
        **aggregate(default, methods, sampling_verdicts.references()),
    }
    write_json(c.out, summary)
    for method, row in summary["methods"].items():
        print(f"{method}: best {row['best']['study']} {row['best']['setting']} ({row['tflop_per_1000']:.3g} TFLOP / "
              f"1,000); " + "; ".join(f"vs {k}: {v['verdict']}" for k, v in row["verdicts"].items()))  # fmt: skip
    print(f"wrote {c.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
