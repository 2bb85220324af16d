"""The rule that decides whether one setting (a sampler, a recipe) is better than another (docs/evaluation.md):
every judge, at least two, puts A ahead in >= 95% of paired bootstrap resamples and A's per-seed scores all
below B's. "worse" is the rule with A and B swapped; anything else is "within noise", with the reasons."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dit.eval.metrics import BOOTSTRAP_RESAMPLES, paired_bootstrap
from dit.io.errors import UserError

MIN_SHARE = 0.95
MIN_JUDGES = 2


@dataclass(frozen=True)
class Evidence:
    """One judge on A against B: Fréchet distances per seed, and the share of paired resamples A is ahead in."""

    judge: str
    a_scores: Sequence[float]
    b_scores: Sequence[float]
    share_a_ahead: float


@dataclass(frozen=True)
class Verdict:
    verdict: str  # "better", "worse" or "within noise": A against B
    reasons: tuple[str, ...]
    shares: Mapping[str, float] = field(default_factory=dict)  # per judge: the share of resamples A is ahead in


def not_ahead(
    judge: str, share: float, mine: Sequence[float], theirs: Sequence[float], min_share: float = MIN_SHARE
) -> list[str]:
    """Why ``judge`` does not put the first set ahead by the rule's two tests (empty if it does)."""
    why = []
    if share < min_share:
        why.append(f"{judge}: ahead in {share:.1%} of paired resamples (< {min_share:.0%})")
    if max(mine) >= min(theirs):
        why.append(f"{judge}: seed ranges overlap ([{min(mine):.4g}, {max(mine):.4g}] against "
                   f"[{min(theirs):.4g}, {max(theirs):.4g}])")  # fmt: skip
    return why


def verdict(evidence: Sequence[Evidence], min_share: float = MIN_SHARE) -> Verdict:
    """Apply the rule to each judge's evidence (a tie in a resample counts for neither side)."""
    return Verdict(*_verdict(evidence, min_share), {e.judge: e.share_a_ahead for e in evidence})


def _verdict(evidence: Sequence[Evidence], min_share: float) -> tuple[str, tuple[str, ...]]:
    judges = [e.judge for e in evidence]
    if len(set(judges)) < MIN_JUDGES:
        return ("within noise", (f"{len(set(judges))} judge(s) ({', '.join(judges)}): the rule needs two",))
    for e in evidence:
        if not e.a_scores or not e.b_scores:
            raise UserError(f"{e.judge}: the rule needs at least one seed's score for each setting.")
    a_reasons = [
        r for e in evidence for r in not_ahead(e.judge, e.share_a_ahead, e.a_scores, e.b_scores, min_share)
    ]
    if not a_reasons:
        return ("better", tuple(f"{e.judge}: ahead in {e.share_a_ahead:.1%} of paired resamples, seeds "
                                       f"{max(e.a_scores):.4g} < {min(e.b_scores):.4g}" for e in evidence))  # fmt: skip
    # B's share is 1 - A's: a resample with equal distances counts for B
    b_reasons = [
        r for e in evidence for r in not_ahead(e.judge, 1 - e.share_a_ahead, e.b_scores, e.a_scores, min_share)
    ]
    if not b_reasons:
        return ("worse", tuple(f"{e.judge}: behind in {1 - e.share_a_ahead:.1%} of paired resamples, seeds "
                                      f"{min(e.a_scores):.4g} > {max(e.b_scores):.4g}" for e in evidence))  # fmt: skip
    disagree = len({e.share_a_ahead >= 0.5 for e in evidence}) > 1
    return "within noise", (("the judges disagree on the direction",) if disagree else ()) + tuple(a_reasons)


@dataclass(frozen=True)
class Judged:
    """One setting under one judge: its Fréchet distance per seed, and those seeds' features in seed order."""

    scores: Sequence[float]
    features: np.ndarray


def better(
    a: Mapping[str, Judged],
    b: Mapping[str, Judged],
    references: Mapping[str, tuple[np.ndarray, np.ndarray]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    min_share: float = MIN_SHARE,
) -> Verdict:
    """Is setting A better than B? ``a``, ``b``: per judge, scores and features; ``references``: (mu, sigma)."""
    if set(a) != set(b) or set(a) - set(references):
        raise UserError(
            f"A is judged by {sorted(a)}, B by {sorted(b)}, references exist for {sorted(references)}: give both "
            "settings the same judges, each with its reference."
        )
    evidence = []
    for judge in sorted(a):
        paired = paired_bootstrap(a[judge].features, b[judge].features, *references[judge], resamples, seed)
        evidence.append(Evidence(judge, tuple(a[judge].scores), tuple(b[judge].scores), paired.share_a_ahead))
    return verdict(evidence, min_share)
