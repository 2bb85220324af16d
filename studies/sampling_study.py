"""Sampling quality per FLOP on the digits: digit FID, the digit judge's FD (each with a bootstrap interval),
precision, recall and class accuracy against the sampling FLOPs of each sampler x network evaluations x
guidance scale x guidance interval, from one checkpoint.

The checkpoint is the quick start's (``bash scripts/quickstart.sh``) or a run of ``studies/scaling.py``
(digits in pixel space). Each setting draws ``--num-samples`` images (image i of every setting has the label
and noise of (seed, i); ``--labels`` balanced, N/C per class, or random), scored by the digit classifier and
by the digit judge against the 4,000 training digits, as the quick start and studies/scaling.py score theirs. Each setting's features are kept beside the
JSON (``--out`` with ``.features/``) for paired comparisons (``studies/sampling_verdicts.py``). The FLOPs are the DiT's as the sampler ran them: two passes per
guided evaluation, one per unguided one (``dit.objectives.samplers``); with ``--guide-ckpt`` every guided
setting is autoguidance, its second pass the guide's (docs/sampling.md). Finished rows are kept in the ``--out``
JSON and skipped when the command runs again, so a stopped study resumes; the chart (``--plot``) is FID
against sampling TFLOP per 1,000 images with the Pareto front. Not part of CI: the full grid is hours.

  python studies/sampling_study.py --ckpt results/quickstart/run/checkpoints/0001200.pt \\
      --out out/sampling_study/quickstart.json
  python studies/sampling_study.py --ckpt CKPT --samplers ddim dpmpp-2m --nfe 10 25 --guidance 1 2 \\
      --intervals all edm2 0.1:0.6
"""

from __future__ import annotations

import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dit.cost.plots import pyplot, save_figure
from dit.data.images import to_uint8
from dit.data.store import sha256_file
from dit.eval.digit_nets import load_digit_classifier
from dit.eval.evaluator import Evaluator, judges_for
from dit.eval.reference import digits_reference
from dit.io.atomic import atomic_write_bytes
from dit.io.cli import run_cli
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.io.userfiles import inside, read_json
from dit.objectives.samplers import check_guidance_interval, sampling_plan, split_sampler
from dit.runtime import Runtime
from dit.sample.cost import flops_per_image
from dit.sample.generate import Guidance, Sampler, generate, noise_seed
from dit.sample.guide import GUIDE_INPUTS, GUIDE_PREFIX, GuideSection, load_guide
from dit.sample.labels import LABEL_MODES, resumed_mode, set_labels
from dit.sample.loading import load_sampling_model
from seeded import command, write_json

# every fixed-step sampler (dopri5 has no NFE knob)
SPECS = ("ddpm", "ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "deis", "euler", "heun", "ode-euler", "ode-heun",
         "ode-ab2", "ode-ab3", "ode-ab4", "sde-euler", "sde-heun")  # fmt: skip
EDM2_SIGMAS = (0.28, 5.42)  # Kynkaenniemi et al. 2024's guidance interval for EDM2-S, in sigma = noise / signal


@dataclass(frozen=True)
class StudyConfig(Section):
    """Digit FID, precision, recall and class accuracy against sampling FLOPs, per sampler and setting."""

    ckpt: str = option(help="a digits checkpoint: the quick start's, or a studies/scaling.py run's")
    out: str = option("out/sampling_study/results.json", "the rows (JSON); a rerun skips the finished ones")
    plot: str | None = option(None, "the Pareto chart (PNG; default: --out with .png)")
    samplers: tuple[str, ...] | None = option(
        None, "default: every fixed-step sampler of the checkpoint's objective", choices=SPECS
    )
    nfe: tuple[int, ...] = option(
        [5, 10, 15, 25, 50, 100, 250],
        "network evaluations per image; a sampler that cannot make exactly N takes the most steps under N",
        ge=1,
    )
    guidance: tuple[float, ...] = option([1.0, 1.5, 2.0, 3.0], "guidance scales (1: none)", ge=1)
    intervals: tuple[str, ...] = option(
        ["all", "edm2"],
        "guidance intervals: all, edm2 (sigma in [0.28, 5.42], EDM2-S's, in this model's time), or LO:HI in "
        "--guidance-interval's units (t/1000 for diffusion, 1 = noise; flow t, 1 = data)",
    )
    num_samples: int = option(1000, "samples per setting (docs/evaluation.md: the sample count)", ge=65)
    batch_size: int = option(250, "samples per batch", ge=1)
    seed: int = option(0, "image i has the label and noise of (seed, i) in every setting", ge=0)
    labels: str | None = option(
        None, "class labels: balanced (N/C per class) or random (DiT's); default: a resumed study's own, balanced "
        "for a new one", choices=LABEL_MODES,
    )  # fmt: skip
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")
    precision: str = option("tf32", "sampling precision (on a CPU tf32 is fp32)", choices=("fp32", "tf32", "bf16"))


FACE = Face(
    "studies/sampling_study.py",
    __doc__,
    sections={"study": StudyConfig, "guide": (GuideSection, GUIDE_PREFIX)},
    outputs={"out": "file", "plot": "file"},
    inputs={"ckpt": "file", **GUIDE_INPUTS},
)


def parse_interval(text: str, sm) -> tuple[float, float] | None:
    if text == "all":
        return None
    if text == "edm2":  # the times (--guidance-interval's units) of EDM2's band of noise-to-signal ratios
        times, ratio = sm.objective.noise_to_signal()
        band = times[(ratio >= EDM2_SIGMAS[0]) & (ratio <= EDM2_SIGMAS[1])]
        return float(band.min()), float(band.max())
    try:
        values = [float(v) for v in text.split(":")]
    except ValueError:
        values = []
    if len(values) != 2:
        raise UserError(f"--intervals takes all, edm2 or LO:HI, got {text!r}.")
    try:
        return check_guidance_interval(values)
    except FieldError as e:
        raise UserError(e.spelled(lambda name: "--intervals")) from None


def steps_for(spec: str, nfe: int) -> int | None:
    """The most steps whose plan makes at most ``nfe`` evaluations (None: not even the fewest fit)."""
    kind, method = split_sampler(spec)
    best = None
    for steps in range(1, nfe + 1):
        try:
            if sampling_plan(kind, steps, method=method).nfe <= nfe:
                best = steps
        except UserError:  # too few steps for this sampler
            pass
    return best


def settings(c: StudyConfig, sm) -> list[dict]:
    """Every (sampler, NFE, guidance, interval) to run; scale 1 has no interval to vary."""
    samplers = sm.objective.samplers
    specs = c.samplers or tuple(s for s in SPECS if split_sampler(s)[0] in samplers)
    wrong = [s for s in specs if split_sampler(s)[0] not in samplers]
    if wrong:
        raise UserError(f"{c.ckpt} is a {sm.objective.noun} model: {', '.join(wrong)} cannot sample it.")
    intervals = {name: parse_interval(name, sm) for name in c.intervals}
    out = []
    for spec in specs:
        for nfe in c.nfe:
            steps = steps_for(spec, nfe)
            if steps is None:
                continue
            for scale in c.guidance:
                for name, interval in intervals.items() if scale > 1 else [("all", None)]:
                    out.append({"sampler": spec, "nfe_target": nfe, "steps": steps, "guidance_scale": scale,
                                "interval": name, "interval_times": None if interval is None else list(interval)})  # fmt: skip
    return list({setting_name(s): s for s in out}.values())  # two NFE targets can round to the same steps


def setting_name(row: dict) -> str:
    return "{sampler}-{steps}-g{guidance_scale:g}-{interval}".format(**row)


def run_setting(c: StudyConfig, sm, evaluator: Evaluator, setting: dict, precision, mode: str, guide=None) -> dict:
    """One setting's scores, with ``mode`` labels; ``guide``: autoguidance's guide model (None: classifier-free guidance)."""
    kind, method = split_sampler(setting["sampler"])
    interval = setting["interval_times"]
    guidance = Guidance(setting["guidance_scale"], 3, None if interval is None else tuple(interval), guide=guide)
    sampler = Sampler(sm, setting["steps"], kind, method=method, guidance=guidance)
    every_label, sampling_s = set_labels(mode, c.seed, c.num_samples, sm.config.num_classes), 0.0

    def batches():
        nonlocal sampling_s
        for start in range(0, c.num_samples, c.batch_size):
            index = range(start, min(start + c.batch_size, c.num_samples))
            labels = [every_label[i] for i in index]
            began = time.perf_counter()
            images = generate(sm, sampler, labels, [noise_seed(c.seed, i) for i in index], precision=precision)
            sampling_s += time.perf_counter() - began
            yield to_uint8(images), labels  # quantised as saved samples are

    result = evaluator.evaluate(batches(), keep_features=True)
    np.savez(buffer := io.BytesIO(), **result["features"])
    atomic_write_bytes(features_path(c.out, setting), buffer.getvalue())
    model_flops, _ = flops_per_image(sm, sampler.mean_guided_nfe, sampler.mean_unguided_nfe, guidance)
    return {
        **setting,
        "labels": mode,
        "nfe": sampler.mean_nfe,
        "guided_nfe": sampler.mean_guided_nfe,
        "unguided_nfe": sampler.mean_unguided_nfe,
        **{k: result[k] for k in ("fid", "fd_judge", "intervals", "precision", "recall", "class_accuracy")},
        "sampling_tflop_per_1000": model_flops * 1000 / 1e12,
        "sampling_seconds": sampling_s,
    }


def features_path(out: str, row: dict) -> Path:
    """Where the study ``out`` keeps a setting's sample features: one .npz per setting, a score's under its key."""
    file = f"{setting_name(row).replace(':', '_')}.npz"
    fix = "a study's rows are settings studies/sampling_study.py ran: pass a study it wrote"
    return inside(Path(out).with_suffix(".features"), file, out, "row", fix, one_name=True)


NUMBER = (int, float)
STUDY_KEYS = {"ckpt_sha256": str, "num_samples": int, "seed": int, "feature_networks": list, "rows": list}
ROW_KEYS = {"sampler": str, "steps": int, "guidance_scale": NUMBER, "interval": str, "fid": NUMBER,
            "fd_judge": NUMBER, "intervals": dict, "sampling_tflop_per_1000": NUMBER}  # fmt: skip


def read_study(path: str) -> dict:
    """A study's JSON, checked to be one that studies/sampling_study.py wrote, down to the fields of its rows."""
    fix = "pass a JSON that studies/sampling_study.py wrote"
    data = read_json(path, "study", fix)
    if not isinstance(data, dict) or any(not isinstance(data.get(k), kind) for k, kind in STUDY_KEYS.items()):
        raise UserError(f"{path} is not a sampling study (it lacks {', '.join(STUDY_KEYS)}): {fix}.")
    for i, row in enumerate(data["rows"]):
        bad = [k for k, kind in ROW_KEYS.items() if not isinstance(row, dict) or not isinstance(row.get(k), kind)]
        if bad:
            raise UserError(f"{path}: row {i} lacks or mistypes {', '.join(bad)}: {fix}.")
    return data


def interval(row: dict, score: str) -> str:
    low, high = row["intervals"][score]
    return f"[{low:.4g}, {high:.4g}]"


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (cost, loss) points no other point beats on both (lower is better for each), by cost."""
    front, best = [], float("inf")
    for cost, loss in sorted(points):
        if loss < best:
            front.append((cost, loss))
            best = loss
    return front


def plot_sampling_front(path: str, rows: list[dict], title: str | None = None) -> str:
    """FID against sampling TFLOP per 1,000 images, a colour per sampler, and the Pareto front over all of them."""
    fig, ax = pyplot().subplots(figsize=(8, 5.5))
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        mine = [r for r in rows if r["sampler"] == sampler]
        ax.scatter([r["sampling_tflop_per_1000"] for r in mine], [r["fid"] for r in mine], s=18, label=sampler)
    front = pareto_front([(r["sampling_tflop_per_1000"], r["fid"]) for r in rows])
    ax.plot(*zip(*front), color="black", lw=1, drawstyle="steps-post", label="Pareto front")
    ax.set(xscale="log", yscale="log", xlabel="sampling TFLOP per 1,000 images (DiT, as run)", ylabel="FID")
    ax.set_title(title or "Quality against sampling compute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    sections = FACE.parse(argv).sections
    c, g = sections["study"], sections["guide"]
    out = Path(c.out)
    with Runtime(c.device, c.precision) as runtime:
        sm = load_sampling_model(c.ckpt, vae="none", device=runtime.device)
        guide = load_guide(g, sm, runtime.device)
        net = load_digit_classifier()
        reference = digits_reference(net)  # on the CPU, as the quick start's
        judges = judges_for(net.name, device=runtime.device)
        study = read_study(out) if out.is_file() else None
        # a study recorded before the label modes drew random labels
        mode = resumed_mode(c.labels, study and study.get("labels", "random"), out, "another --out")
        header = {"ckpt_sha256": sha256_file(c.ckpt), "num_samples": c.num_samples, "seed": c.seed,
                  "precision": c.precision, "feature_networks": [net.name, *(j.net.name for j in judges)],
                  "labels": mode}  # fmt: skip
        # None without a guide, as a study recorded before guides has, so that it still matches
        header["guide"] = g.ckpt and {"ckpt_sha256": sha256_file(g.ckpt), "weights": "ema" if g.ema else "model"}
        if study and {k: study.get(k) for k in header} != header:
            raise UserError(
                f"{out} holds a study of other settings ({', '.join(f'{k} {study.get(k)}' for k in header)}): pass "
                "another --out, or the same --ckpt, --guide-ckpt, --num-samples, --seed, --precision and judges."
            )
        # a row without its features runs again
        rows = [r for r in (study or {"rows": []})["rows"] if features_path(c.out, r).is_file()]
        done = {setting_name(r) for r in rows}
        todo = [s for s in settings(c, sm) if setting_name(s) not in done]
        print(f"{len(done)} settings done, {len(todo)} to run", file=sys.stderr)
        evaluator = Evaluator(
            net.to(runtime.device), reference, batch_size=c.batch_size, runtime=runtime, judges=judges
        )
        evaluator.check_count(c.num_samples)
        record = {"command": command("sampling_study.py", argv), "ckpt": c.ckpt, **header}
        for setting in todo:
            rows.append(r := run_setting(c, sm, evaluator, setting, runtime.precision, mode, guide))
            print(f"{r['sampler']} {r['steps']} steps ({r['nfe']:g} NFE, {r['guided_nfe']:g} guided), guidance "
                  f"{r['guidance_scale']:g} {r['interval']}, {mode} labels: FID {r['fid']:.1f} {interval(r, 'fid')}, judge FD "
                  f"{r['fd_judge']:.4g} {interval(r, 'fd_judge')}, accuracy {r['class_accuracy']:.1%}, "
                  f"{r['sampling_tflop_per_1000']:.3g} TFLOP / 1,000 images, {r['sampling_seconds']:.1f} s",
                  file=sys.stderr)  # fmt: skip
            write_json(out, {**record, "rows": rows})
    if rows:
        plot = c.plot or str(out.with_suffix(".png"))
        plot_sampling_front(plot, rows, f"Digit FID against sampling FLOPs: {Path(c.ckpt).name}")
        print(f"wrote {out} ({len(rows)} settings) and {plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
