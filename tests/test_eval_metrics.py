"""The metric math (dit/eval/metrics.py) and statistics files (dit/eval/reference.py), on feature arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_fidelity.metric_prc import calculate_precision_recall_full

from dit.eval.inception import INCEPTION_NAME
from dit.eval.metrics import (
    class_accuracy,
    frechet_distance,
    inception_score,
    knn_radii,
    mean_cov,
    precision_recall,
)
from dit.eval.reference import load_reference, save_stats, stats_from_features
from dit.io.errors import UserError


def gaussian_with_exact_moments(rng, n: int, mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """n samples whose sample mean and (N-1) covariance are exactly mu and sigma (whitened, then coloured)."""
    z = rng.standard_normal((n, len(mu)))
    z -= z.mean(axis=0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False))).T
    return mu + z @ np.linalg.cholesky(sigma).T


def random_spd(rng, d: int) -> np.ndarray:
    a = rng.standard_normal((d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def closed_form_frechet(mu1, sigma1, mu2, sigma2) -> float:
    """Tr √(Σ1 Σ2) as Tr √(Σ1^½ Σ2 Σ1^½), with symmetric eigendecompositions instead of scipy's sqrtm."""
    w, v = np.linalg.eigh(sigma1)
    root1 = (v * np.sqrt(w)) @ v.T
    inner = np.linalg.eigvalsh(root1 @ sigma2 @ root1)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.sum(np.sqrt(inner)))


def test_fid_of_two_gaussian_sets_equals_the_closed_form():
    rng = np.random.default_rng(0)
    d = 16
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    sigma1, sigma2 = random_spd(rng, d), random_spd(rng, d)
    x1 = gaussian_with_exact_moments(rng, 500, mu1, sigma1)
    x2 = gaussian_with_exact_moments(rng, 700, mu2, sigma2)
    fid = frechet_distance(*mean_cov(x1), *mean_cov(x2))
    expected = closed_form_frechet(mu1, sigma1, mu2, sigma2)
    assert fid.value == pytest.approx(expected, rel=1e-3) and not fid.eps_used
    # Diagonal covariances: FID = ‖μ1 − μ2‖² + Σ (√a − √b)², a formula with no matrix root at all.
    a, b = rng.uniform(0.5, 2, d), rng.uniform(0.5, 2, d)
    diagonal = frechet_distance(mu1, np.diag(a), mu2, np.diag(b)).value
    assert diagonal == pytest.approx(np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2), rel=1e-6)


def test_fid_estimated_from_samples_approaches_the_closed_form():
    rng = np.random.default_rng(1)
    d = 4
    mu1, mu2 = np.zeros(d), np.full(d, 0.5)
    sigma1, sigma2 = np.eye(d), np.diag([2.0, 1.0, 0.5, 1.0])
    x1 = rng.multivariate_normal(mu1, sigma1, 200_000)
    x2 = rng.multivariate_normal(mu2, sigma2, 200_000)
    expected = closed_form_frechet(mu1, sigma1, mu2, sigma2)
    assert frechet_distance(*mean_cov(x1), *mean_cov(x2)).value == pytest.approx(expected, rel=2e-2)


def test_fid_of_a_set_against_itself_is_zero():
    x = np.random.default_rng(2).standard_normal((300, 32)) * 3 + 1
    mu, sigma = mean_cov(x)
    assert abs(frechet_distance(mu, sigma, mu, sigma).value) < 1e-8 * np.trace(sigma)


def test_non_finite_sqrtm_uses_the_adm_epsilon_fallback():
    # Σ2[0, 0] underflows to 0, so Σ1 Σ2 = [[0, 1e-200], [0, 0]] is nilpotent and has no square root.
    sigma1, b = np.diag([1.0, 0.0]), np.array([1e-200, 1.0])
    sigma2 = np.outer(b, b)
    result = frechet_distance(np.zeros(2), sigma1, np.zeros(2), sigma2)
    # The exact distance is Tr Σ1 + Tr Σ2 − 2 Tr √(Σ1^½ Σ2 Σ1^½) = 2; ε = 1e-6 moves it by ~4·√ε.
    assert result.eps_used and result.value == pytest.approx(2.0, abs=5e-3)


def test_complex_square_root_is_refused():
    with pytest.raises(UserError, match="imaginary"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(2), np.diag([-1.0, 1.0]))


def test_mismatched_shapes_are_refused():
    with pytest.raises(UserError, match="different shapes"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_inception_score_of_uniform_predictions_is_one():
    assert inception_score(torch.zeros(100, 1008)) == pytest.approx(1.0, abs=1e-12)


def test_inception_score_of_confident_balanced_predictions_is_the_class_count():
    logits = torch.full((50, 10), -1e4)
    logits[torch.arange(50), torch.arange(50) % 10] = 0
    assert inception_score(logits) == pytest.approx(10.0, rel=1e-9)


def test_inception_score_averages_consecutive_splits_without_shuffling():
    # First split: one class only (IS 1); second split: 10 classes balanced (IS 10). ADM's mean: 5.5.
    logits = torch.full((20, 10), -1e4)
    logits[:10, 0] = 0
    logits[torch.arange(10, 20), torch.arange(10)] = 0
    assert inception_score(logits, split_size=10) == pytest.approx(5.5, rel=1e-9)
    assert inception_score(logits, split_size=20) == pytest.approx(
        np.exp(-(0.55 * np.log(0.55) + 9 * 0.05 * np.log(0.05)))
    )


def test_precision_recall_of_identical_sets_are_one():
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
    radii = knn_radii(x, 3, batch_size=64)
    assert precision_recall(x, radii, x.clone(), radii.clone(), batch_size=64) == (1.0, 1.0)


def test_precision_recall_match_an_independent_implementation():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(150, 8, generator=g)
    samples = torch.randn(120, 8, generator=g) * 1.2 + 1.0
    ours = precision_recall(ref, knn_radii(ref, 3, 37), samples, knn_radii(samples, 3, 37), batch_size=37)
    # torch-fidelity's full Euclidean-distance version; input 1 is the generated set, input 2 the reference.
    theirs = calculate_precision_recall_full(samples.double(), ref.double(), neighborhood=3, batch_size=1000)
    assert ours == pytest.approx(theirs, abs=1e-9)
    assert 0.1 < ours[0] < 0.95 and 0.1 < ours[1] < 0.95  # a case where balls partly overlap


def test_knn_radii_are_the_third_neighbour_excluding_self():
    x = torch.tensor([[0.0], [1.0], [3.0], [6.0], [10.0]])
    assert knn_radii(x, 3, batch_size=2).tolist() == [36.0, 25.0, 9.0, 25.0, 81.0]


def test_class_accuracy():
    logits = torch.eye(4)[[0, 1, 2, 3, 0]]
    assert class_accuracy(logits, torch.tensor([0, 1, 2, 0, 0])) == pytest.approx(0.8)
    with pytest.raises(UserError, match="labels"):
        class_accuracy(logits, torch.tensor([0, 1]))


def test_statistics_round_trip_and_checksum(tmp_path):
    g = torch.Generator().manual_seed(3)
    features = {"pool": torch.randn(40, 6, generator=g), "spatial": torch.randn(40, 5, generator=g)}
    stats = stats_from_features(features, "net-a", "test set")
    save_stats(tmp_path / "ref.npz", stats)
    back = load_reference(str(tmp_path / "ref.npz"))
    assert (back.feature_network, back.num_images, back.source) == ("net-a", 40, "test set")
    for key in ("mu", "sigma", "mu_s", "sigma_s", "features"):
        assert np.array_equal(getattr(back, key), getattr(stats, key)), key
    np.testing.assert_allclose(back.sigma, np.cov(features["pool"].double().numpy(), rowvar=False))

    with np.load(tmp_path / "ref.npz") as f:
        arrays = dict(f)
    arrays["mu"] = arrays["mu"] + 1e-9
    np.savez(tmp_path / "edited.npz", **arrays)
    with pytest.raises(UserError, match="checksum"):
        load_reference(str(tmp_path / "edited.npz"))


def test_adm_reference_batch_is_read_as_inception_statistics(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    np.savez(
        tmp_path / "adm.npz", arr_0=images, mu=np.zeros(3), sigma=np.eye(3), mu_s=np.ones(2), sigma_s=np.eye(2)
    )
    ref = load_reference(str(tmp_path / "adm.npz"))
    assert ref.feature_network == INCEPTION_NAME and ref.num_images is None and ref.features is None
    assert np.array_equal(ref.mu_s, np.ones(2))
    batch, labels = ref.images.read(1, 4)
    assert labels is None and torch.equal(batch, torch.from_numpy(images[1:4]).permute(0, 3, 1, 2))


def test_a_sample_set_as_reference_names_the_fix(tmp_path):
    np.savez(tmp_path / "samples.npz", np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(UserError, match="python -m dit.eval ref --npz"):
        load_reference(str(tmp_path / "samples.npz"))
