"""How the digit FID's and the digit judge's FD spread and bias shrink with the sample count: 500, 1,000, 2,000.

Reads the kept features of one setting sampled with ``studies/sampling_study.py`` at a large ``--num-samples``
under one or more sampling seeds (every image has its own noise, so disjoint slices of a set are independent
sample sets). For each count n and score: the scores of the disjoint n-image slices (their mean, spread and
range: what a sampling seed changes), the mean width of their 95% bootstrap intervals, and the bias, from a
fit of score = S_inf + b / n over every slice (a Fréchet distance's finite-sample bias falls as 1 / n).

  python studies/sample_count.py --kept-features out/count_s0.features/unipc-15-g1.25-edm2.npz \\
      out/count_s1.features/unipc-15-g1.25-edm2.npz --counts 500 1000 2000 --out docs/results/sample_count.json
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from dit.eval.metrics import fd_interval, frechet_distance, mean_cov
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.io.userfiles import read_matrices
from sampling_verdicts import SCORES, references
from seeded import command, write_json


@dataclass(frozen=True)
class CountConfig(Section):
    """Spread, interval width and bias of the digit FID and the judge's FD against the sample count."""

    kept_features: tuple[str, ...] = option(help="kept features (.npz) of one setting, one file per sampling seed")
    counts: tuple[int, ...] = option([500, 1000, 2000], "sample counts to measure", ge=65)
    out: str | None = option(None, "write the measurement here (JSON)")


FACE = Face(
    "studies/sample_count.py",
    __doc__,
    sections={"count": CountConfig},
    outputs={"out": "file"},
    inputs={"kept_features": "file"},
)


def measure(sets: list[np.ndarray], mu: np.ndarray, sigma: np.ndarray, sizes: tuple[int, ...]) -> dict:
    """Per size: the disjoint slices' scores and interval widths; and the 1 / n fit over all of them."""
    out, xs, ys = {}, [], []
    for n in sizes:
        values, widths = [], []
        for features in sets:
            for start in range(0, len(features) - n + 1, n):
                part = features[start : start + n]
                value = frechet_distance(*mean_cov(part.astype(np.float64)), mu, sigma).value
                interval = fd_interval(value, part, mu, sigma)
                values.append(value)
                widths.append(interval.high - interval.low)
        if not values:
            raise UserError(f"--counts {n}: no feature file holds {n} samples; sample more or drop the size.")
        xs += [1 / n] * len(values)
        ys += values
        out[str(n)] = {"slices": len(values), "scores": values, "mean": float(np.mean(values)),
                       "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
                       "range": [min(values), max(values)], "mean_interval_width": float(np.mean(widths))}  # fmt: skip
    slope, limit = np.polyfit(xs, ys, 1)
    for n in sizes:
        out[str(n)]["bias"] = float(slope / n)  # the score's expected excess over an infinite set's
    return {"sizes": out, "infinite_set_estimate": float(limit), "bias_slope": float(slope)}


def main(argv: list[str] | None = None) -> int:
    c = FACE.parse(argv).sections["count"]
    refs = references()
    fix = "pass a file from the .features folder beside a studies/sampling_study.py JSON"
    widths = {s: len(mu) for s, (mu, _) in refs.items()}
    files = [read_matrices(p, "--kept-features", fix, widths) for p in c.kept_features]
    result = {
        "command": command("sample_count.py", argv),
        **{s: measure([f[s] for f in files], *refs[s], c.counts) for s in SCORES},
    }
    for s in SCORES:
        for n, r in result[s]["sizes"].items():
            std = "n/a" if r["std"] is None else f"{r['std']:.4g}"
            print(f"{s} n={n}: {r['slices']} slices, mean {r['mean']:.4g}, std {std}, range "
                  f"[{r['range'][0]:.4g}, {r['range'][1]:.4g}], interval width {r['mean_interval_width']:.4g}, "
                  f"bias {r['bias']:.4g}")  # fmt: skip
    if c.out:
        write_json(c.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
