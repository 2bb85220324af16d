"""Bootstrap intervals of Fréchet distances and the paired comparison (dit.eval.metrics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dit.eval.metrics import (
    FrechetToReference,
    bootstrap_fd,
    fd_interval,
    frechet_distance,
    mean_cov,
    paired_bootstrap,
    resample_indices,
)
from dit.io.errors import UserError


def gaussian(n: int, d: int, seed: int, shift: float = 0.0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = np.eye(d) + 0.3 * rng.standard_normal((d, d)) / np.sqrt(d)
    return (rng.standard_normal((n, d)) * scale) @ mixing + shift


@pytest.fixture(scope="module")
def reference() -> tuple[np.ndarray, np.ndarray]:
    return mean_cov(gaussian(4000, 16, seed=1))


def test_the_fast_distance_is_adms(reference):
    """Tr √(Σ Σr) through Σr^½ and eigvalsh equals scipy's sqrtm of the product, as the ADM evaluator takes it."""
    for seed, shift, scale in ((2, 0.0, 1.0), (3, 0.5, 1.5), (4, -1.0, 0.5)):
        mu, sigma = mean_cov(gaussian(300, 16, seed, shift, scale))
        fast = FrechetToReference(*reference)(torch.from_numpy(mu), torch.from_numpy(sigma))
        assert float(fast) == pytest.approx(frechet_distance(mu, sigma, *reference).value, rel=1e-9)


def test_each_resample_is_the_distance_of_its_rows(reference):
    x = gaussian(200, 16, seed=5, shift=0.2)
    indices = resample_indices(len(x), 4, seed=0)
    values = bootstrap_fd(x, FrechetToReference(*reference), indices)
    direct = [frechet_distance(*mean_cov(x[rows.numpy()]), *reference).value for rows in indices]
    assert values == pytest.approx(direct, rel=1e-9)


def test_an_interval_covers_the_full_set_value_and_is_seeded(reference):
    for seed, shift in ((6, 0.0), (7, 0.3), (8, 1.0)):
        x = gaussian(500, 16, seed, shift)
        value = frechet_distance(*mean_cov(x), *reference).value
        interval = fd_interval(value, x, *reference, resamples=100, seed=0)
        assert interval.covers(value) and interval.low < interval.high
        assert fd_interval(value, x, *reference, resamples=100, seed=0) == interval
        assert fd_interval(value, x, *reference, resamples=100, seed=1) != interval


def test_the_paired_comparison_is_antisymmetric_and_seeded(reference):
    a, b = gaussian(400, 16, seed=9, shift=0.10), gaussian(400, 16, seed=10, shift=0.12)
    ab, ba = paired_bootstrap(a, b, *reference, resamples=100), paired_bootstrap(b, a, *reference, resamples=100)
    assert not np.any(ab.a == ab.b)  # no ties, so the two shares must add up to one
    assert ab.share_a_ahead + ba.share_a_ahead == pytest.approx(1.0)
    assert 0 < ab.share_a_ahead < 1  # close sets: the resamples do not all agree
    assert paired_bootstrap(a, b, *reference, resamples=100).share_a_ahead == ab.share_a_ahead
    far = gaussian(400, 16, seed=11, shift=1.0)
    assert paired_bootstrap(a, far, *reference, resamples=100).share_a_ahead == 1.0


def test_a_paired_comparison_needs_aligned_sets(reference):
    with pytest.raises(UserError, match="aligned sets of the same size"):
        paired_bootstrap(gaussian(400, 16, 1), gaussian(300, 16, 2), *reference)
