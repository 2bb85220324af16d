"""The rule (studies/compare.py): "better" only when both judges agree, the paired bootstrap puts A ahead in at
least 95% of resamples under each, and the seeds' ranges do not overlap; one test per clause."""

from __future__ import annotations

import numpy as np
from helpers import face

from dit.eval.metrics import mean_cov

compare = face("studies/compare.py")
Evidence, Judged, better, verdict = compare.Evidence, compare.Judged, compare.better, compare.verdict

A_AHEAD = [Evidence("fid", (40.0, 42.0), (50.0, 53.0), 0.99), Evidence("fd_judge", (7.0, 7.2), (8.0, 8.5), 0.97)]


def test_better_when_every_clause_holds():
    v = verdict(A_AHEAD)
    assert v.verdict == "better" and len(v.reasons) == 2


def test_worse_is_the_same_rule_the_other_way():
    swapped = [Evidence(e.judge, e.b_scores, e.a_scores, 1 - e.share_a_ahead) for e in A_AHEAD]
    assert verdict(swapped).verdict == "worse"


def test_one_judge_is_not_enough():
    v = verdict(A_AHEAD[:1])
    assert v.verdict == "within noise" and "needs two" in v.reasons[0]


def test_a_share_below_95_percent_is_noise():
    weak = [A_AHEAD[0], Evidence("fd_judge", (7.0, 7.2), (8.0, 8.5), 0.94)]
    v = verdict(weak)
    assert v.verdict == "within noise" and any("94.0% of paired resamples" in r for r in v.reasons)


def test_overlapping_seed_ranges_are_noise():
    overlap = [A_AHEAD[0], Evidence("fd_judge", (7.0, 8.1), (8.0, 8.5), 0.99)]
    v = verdict(overlap)
    assert v.verdict == "within noise" and any("seed ranges overlap" in r for r in v.reasons)


def test_judges_that_disagree_are_noise():
    disagree = [A_AHEAD[0], Evidence("fd_judge", (8.0, 8.5), (7.0, 7.2), 0.20)]
    v = verdict(disagree)
    assert v.verdict == "within noise" and v.reasons[0] == "the judges disagree on the direction"


def test_better_runs_the_paired_bootstrap_on_features():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2000, 8))
    references = {"fid": mean_cov(ref), "fd_judge": mean_cov(ref @ rng.standard_normal((8, 8)))}
    noise = rng.standard_normal((300, 8))
    close, far = noise, noise + 0.8  # the same rows (seeds), one set shifted away from the reference
    a = {k: Judged((1.0, 1.1), close) for k in references}
    b = {k: Judged((2.0, 2.2), far) for k in references}
    assert better(a, b, references, resamples=50).verdict == "better"
    assert better(b, a, references, resamples=50).verdict == "worse"
