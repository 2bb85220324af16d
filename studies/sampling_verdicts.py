"""The rule applied to a sampling study: every setting against a baseline (DDPM-250) under both judges; or,
with ``--against``, two training recipes: the same setting sampled from each recipe's checkpoints.

Reads one ``studies/sampling_study.py`` JSON per sampling seed (the same checkpoint, sample count and judges) and
each setting's kept features, and for every setting all the studies ran: its digit FID and digit-judge FD per
seed, the share of paired bootstrap resamples (the same rows of both sets: image i has the same noise seed and
label) in which it is ahead of the baseline under each judge, and the verdict of ``compare.py``:
"better", "worse" or "within noise". "matches" holds where neither judge puts the baseline ahead by the
rule's two tests (>= 95% of paired resamples and the seeds' ranges apart). The cheapest setting that matches
is the study's answer to "what does DDPM-250's quality cost".

  python studies/sampling_verdicts.py --studies docs/results/sampling_judged_s0.json \\
      docs/results/sampling_judged_s1.json --baseline ddpm-250-g1-all --out docs/results/sampling_verdicts.json

With ``--against``, ``--studies`` are one recipe's studies (one per training seed, one sampling seed) and
``--against`` the other's, in the same seed order: each setting both ran is judged A (``--studies``) against B.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from compare import Judged, better, not_ahead
from dit.eval.digit_nets import DIGIT_JUDGE_REFERENCE, load_digit_classifier
from dit.eval.reference import digits_reference, load_reference
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.io.userfiles import read_matrices
from sampling_study import features_path, read_study, setting_name
from seeded import command, write_json

SCORES = ("fid", "fd_judge")
FEATURES_FIX = (
    "the study keeps each setting's features beside its JSON: remove a damaged one and rerun "
    "studies/sampling_study.py with that --out, which runs the settings again whose features are missing"
)


@dataclass(frozen=True)
class VerdictsConfig(Section):
    """Every setting of a sampling study against a baseline, by the rule (both judges, paired, seeds)."""

    studies: tuple[str, ...] = option(help="one studies/sampling_study.py JSON per sampling seed")
    baseline: str = option("ddpm-250-g1-all", "the setting to match: SAMPLER-STEPS-gSCALE-INTERVAL")
    against: tuple[str, ...] | None = option(
        None, "another recipe's studies (one per training seed): judge the same settings of --studies against them"
    )
    out: str | None = option(None, "write the verdicts here (JSON)")


FACE = Face(
    "studies/sampling_verdicts.py",
    __doc__,
    sections={"verdicts": VerdictsConfig},
    outputs={"out": "file"},
    inputs={"studies": "file", "against": "file"},
)


def references() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each judge's statistics of the 4,000 training digits, as the study scored against them."""
    classifier = digits_reference(load_digit_classifier())
    judge = load_reference(str(DIGIT_JUDGE_REFERENCE))
    return {"fid": (classifier.mu, classifier.sigma), "fd_judge": (judge.mu, judge.sigma)}


def load(
    studies: tuple[str, ...], refs: dict[str, tuple[np.ndarray, np.ndarray]], recipes: bool = False
) -> tuple[dict[str, list[dict]], dict[str, dict[str, Judged]]]:
    """Per setting run by every study: its rows (seed order) and, per judge, its scores and stacked features.
    A sampler's studies differ in the sampling seed; a recipe's (``recipes``) in the checkpoint (training seed)."""
    data = [read_study(p) for p in studies]
    shared = ("seed",) if recipes else ("ckpt_sha256",)
    modes = [d.get("labels", "random") for d in data]  # a study written before the label modes drew random ones
    kinds = {
        (*(d[k] for k in shared), d["num_samples"], tuple(d["feature_networks"]), m) for d, m in zip(data, modes)
    }
    if len(kinds) != 1:
        raise UserError(
            f"the studies must share the {' and '.join(shared)}, the sample count, the judges and the labels "
            "(balanced or random)."
        )
    if len({d["ckpt_sha256" if recipes else "seed"] for d in data}) != len(data):
        raise UserError("two studies of one seed: give one study per seed.")
    per = [{setting_name(r): r for r in d["rows"]} for d in data]
    widths = {s: len(mu) for s, (mu, _) in refs.items()}
    common = [k for k in per[0] if all(k in p for p in per)]
    rows, judged = {}, {}
    for k in common:
        rows[k] = [p[k] for p in per]
        paths = [features_path(s, r) for s, r in zip(studies, rows[k])]
        files = [
            read_matrices(p, "kept features", FEATURES_FIX, widths, d["num_samples"]) for p, d in zip(paths, data)
        ]
        judged[k] = {s: Judged([r[s] for r in rows[k]], np.concatenate([f[s] for f in files])) for s in SCORES}
    return rows, judged


def recipes(c: VerdictsConfig, argv: list[str] | None) -> int:
    """Each setting both recipes ran: A (--studies) against B (--against), by the rule."""
    if len(c.against) != len(c.studies):
        raise UserError("--against needs as many studies (training seeds) as --studies.")
    refs = references()
    (_, a), (_, b) = load(c.studies, refs, recipes=True), load(c.against, refs, recipes=True)
    out = []
    for k in (k for k in a if k in b):
        v = better(a[k], b[k], refs)
        out.append({"setting": k, **{f"{s}_a": a[k][s].scores for s in SCORES}, **{f"{s}_b": b[k][s].scores
                    for s in SCORES}, "verdict": v.verdict, "reasons": list(v.reasons), "shares_ahead": dict(v.shares)})  # fmt: skip
        print(f"{k}: {v.verdict} (A ahead in {v.shares['fid']:.0%} / {v.shares['fd_judge']:.0%} of paired resamples; "
              f"FID A {a[k]['fid'].scores} B {b[k]['fid'].scores}; judge A {a[k]['fd_judge'].scores} B "
              f"{b[k]['fd_judge'].scores})")  # fmt: skip
    if c.out:
        write_json(c.out, {"command": command("sampling_verdicts.py", argv), "rows": out})
    return 0


def main(argv: list[str] | None = None) -> int:
    c = FACE.parse(argv).sections["verdicts"]
    if c.against:
        return recipes(c, argv)
    refs = references()
    rows, judged = load(c.studies, refs)
    if c.baseline not in rows:
        raise UserError(f"--baseline {c.baseline} is not in every study; they share: {', '.join(rows)}.")
    base = judged[c.baseline]
    cost = rows[c.baseline][0]["sampling_tflop_per_1000"]
    table = []
    for k in sorted(rows, key=lambda k: rows[k][0]["sampling_tflop_per_1000"]):
        row = {"setting": k, "tflop_per_1000": rows[k][0]["sampling_tflop_per_1000"],
               "share_of_baseline_flops": rows[k][0]["sampling_tflop_per_1000"] / cost,
               **{s: judged[k][s].scores for s in SCORES},
               **{f"{s}_intervals": [r["intervals"][s] for r in rows[k]] for s in SCORES}}  # fmt: skip
        if k != c.baseline:
            v = better(judged[k], base, refs)
            row.update(verdict=v.verdict, reasons=list(v.reasons),
                       shares_ahead={s: float(share) for s, share in v.shares.items()},
                       matches=all(not_ahead(s, 1 - v.shares[s], base[s].scores, judged[k][s].scores)
                                       for s in SCORES))  # fmt: skip
        table.append(row)
    matching = [r for r in table if r.get("matches")]
    summary = {
        "command": command("sampling_verdicts.py", argv),
        "baseline": c.baseline,
        "cheapest_match": matching[0]["setting"] if matching else None,
        "rows": table,
    }
    print(
        "| setting | % of baseline FLOPs | digit FID by seed | judge FD by seed | ahead (FID / judge) | verdict | matches |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        shares = r.get("shares_ahead")
        ahead = f"{shares['fid']:.0%} / {shares['fd_judge']:.0%}" if shares else "baseline"
        print(
            f"| {r['setting']} | {r['share_of_baseline_flops']:.1%} | {' / '.join(f'{x:.1f}' for x in r['fid'])} | "
            f"{' / '.join(f'{x:.4f}' for x in r['fd_judge'])} | {ahead} | {r.get('verdict', '')} | "
            f"{'yes' if r.get('matches') else '' if shares is None else 'no'} |"
        )
    print(f"cheapest setting that matches {c.baseline}: {summary['cheapest_match']}", file=sys.stderr)
    if c.out:
        write_json(c.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
