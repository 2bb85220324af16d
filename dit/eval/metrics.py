"""The metrics as pure math on feature arrays, defined as the ADM evaluator defines them (docs/evaluation.md gives
the formulas and where each choice comes from)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

from dit.io.errors import UserError

SQRTM_EPS = 1e-6  # ADM's offset on both covariances' diagonals when sqrtm(Σ1 Σ2) is not finite
IMAG_TOLERANCE = 1e-3  # ADM: a complex sqrtm is accepted only if its diagonal is real within this
IS_SPLIT_SIZE = 5000  # ADM: consecutive splits of 5,000 images (10 splits for 50,000)
PR_NEIGHBOURS = 3  # ADM and Kynkäänniemi et al.: the ball of a point reaches its 3rd nearest neighbour
PR_BATCH_SIZE = 10_000  # ADM's row and column blocks


def mean_cov(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) in float64; sigma is the unbiased sample covariance (N - 1), as np.cov gives ADM."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise UserError(f"a covariance needs a 2-D array of at least 2 feature vectors, got shape {x.shape}.")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def min_images_for_covariance(dim: int) -> int:
    """A d-dimensional sample covariance is full rank only from d + 1 images on."""
    return dim + 1


def check_enough_images(num_images: int, dim: int, what: str) -> None:
    """Refuse a Fréchet distance whose covariance would be rank-deficient (it is then biased and unstable)."""
    need = min_images_for_covariance(dim)
    if num_images < need:
        raise UserError(
            f"{what} has {num_images} images, too few for a full-rank covariance of {dim}-d features: "
            f"it needs at least {need}. Evaluate more images (or leave this metric out with --metrics)."
        )


@dataclass(frozen=True)
class Frechet:
    value: float
    eps_used: bool  # True when sqrtm(Σ1 Σ2) was not finite and ADM's retry with ε·I on both Σ was needed


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = SQRTM_EPS
) -> Frechet:
    """‖μ1 − μ2‖² + Tr Σ1 + Tr Σ2 − 2 Tr √(Σ1 Σ2) with scipy's sqrtm, as ADM: a non-finite root is retried with
    ``eps`` on both diagonals, a complex one kept (its real part) if its diagonal is real within IMAG_TOLERANCE."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    d = len(mu1)
    if mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise UserError(
            f"statistics of different shapes cannot be compared: mu {mu1.shape} and {mu2.shape}, sigma "
            f"{sigma1.shape} and {sigma2.shape}. Compute both with the same feature network."
        )
    # as ADM's sqrtm(disp=False): only a non-finite root is retried with eps, whatever newer scipy warns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
        eps_used = not np.isfinite(covmean).all()
        if eps_used:
            offset = np.eye(d) * eps
            covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if not np.isfinite(covmean).all():
        raise UserError(
            f"the matrix square root is not finite even with {eps:g} added to both covariances: the statistics "
            "hold NaN or inf values (check the images and the reference file)."
        )
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        if imag > IMAG_TOLERANCE:
            raise UserError(
                f"the matrix square root has an imaginary diagonal part of {imag:.3g} (> {IMAG_TOLERANCE:g}): the "
                "covariances are numerically degenerate; evaluate more images."
            )
        covmean = covmean.real
    diff = mu1 - mu2
    value = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean)
    return Frechet(float(value), eps_used)


def inception_score(logits: torch.Tensor, split_size: int = IS_SPLIT_SIZE) -> float:
    """Mean over consecutive splits of exp(E_x KL(p(y|x) ‖ p(y))), in set order and without shuffling, as ADM."""
    log_p = torch.as_tensor(logits).double().log_softmax(dim=1)
    scores = []
    for part in log_p.split(split_size):
        p = part.exp()
        log_marginal = p.mean(dim=0).log()
        # p log(p / p(y)) with its limit 0 where p underflows to 0 (where p(y) may be 0 too)
        kl = torch.where(p > 0, p * (part - log_marginal), 0.0).sum(dim=1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores))


PR_DISTANCES = ("float32", "float16")  # float16: ADM's, for matching published numbers


def _squared_distances(a: torch.Tensor, b: torch.Tensor, distances: str = "float32") -> torch.Tensor:
    """‖a_i‖² − 2 a_i·b_j + ‖b_j‖², clamped at 0, one matmul per block as ADM; ``float16``: in half precision as
    ADM's evaluator, in float32 where the block is not finite."""
    if distances == "float16":
        h = _squared_distances(a.half(), b.half())
        if torch.isfinite(h).all():
            return h.float()
    return (a.square().sum(1, keepdim=True) - 2.0 * a @ b.T + b.square().sum(1)).clamp_(min=0)


def knn_radii(
    features: torch.Tensor, k: int = PR_NEIGHBOURS, batch_size: int = PR_BATCH_SIZE, distances: str = "float32"
) -> torch.Tensor:
    """Squared distance from every point to its k-th nearest neighbour within its own set (itself excluded)."""
    if len(features) <= k:
        raise UserError(f"precision and recall need more than k={k} images per set, got {len(features)}.")
    radii = []
    for rows in features.split(batch_size):
        d = torch.cat([_squared_distances(rows, cols, distances) for cols in features.split(batch_size)], dim=1)
        radii.append(d.kthvalue(k + 1, dim=1).values)  # the point itself is the 1st, at distance 0
    return torch.cat(radii)


def precision_recall(
    ref: torch.Tensor,
    ref_radii: torch.Tensor,
    samples: torch.Tensor,
    sample_radii: torch.Tensor,
    batch_size: int = PR_BATCH_SIZE,
    distances: str = "float32",
) -> tuple[float, float]:
    """Precision: samples inside a reference ball; recall: reference points inside a sample ball (k-NN radii)."""
    sample_in = torch.zeros(len(samples), dtype=torch.bool, device=samples.device)
    ref_in = torch.zeros(len(ref), dtype=torch.bool, device=ref.device)
    for i in range(0, len(ref), batch_size):
        for j in range(0, len(samples), batch_size):
            d = _squared_distances(ref[i : i + batch_size], samples[j : j + batch_size], distances)
            sample_in[j : j + batch_size] |= (d <= ref_radii[i : i + batch_size, None]).any(dim=0)
            ref_in[i : i + batch_size] |= (d <= sample_radii[None, j : j + batch_size]).any(dim=1)
    return sample_in.float().mean().item(), ref_in.float().mean().item()


def pairwise_flops(n: int, m: int, dim: int) -> int:
    """FLOPs of one n x m squared-distance block: the matmul (2·n·m·d) and the two norms (2·(n+m)·d)."""
    return 2 * n * m * dim + 2 * (n + m) * dim


def class_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of images whose arg-max class is the label they were sampled for."""
    if len(logits) != len(labels):
        raise UserError(f"{len(logits)} images but {len(labels)} labels: give one class label per image.")
    return (torch.as_tensor(logits).argmax(dim=1).cpu() == torch.as_tensor(labels).cpu()).float().mean().item()


BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_LEVEL = 0.95


class FrechetToReference:
    """Fréchet distances of many (μ, Σ) against one fixed reference, in float64 on ``device``:
    Tr √(Σ Σr) = Σ √λ(Σr^½ Σ Σr^½), one ``eigvalsh`` per resample instead of scipy's ``sqrtm``, Σr^½ computed once."""

    def __init__(self, mu: np.ndarray, sigma: np.ndarray, device: torch.device | str = "cpu"):
        self.mu = torch.as_tensor(np.asarray(mu, np.float64), device=device)
        sigma = torch.as_tensor(np.asarray(sigma, np.float64), device=device)
        w, v = torch.linalg.eigh((sigma + sigma.T) / 2)
        self.root = (v * w.clamp(min=0).sqrt()) @ v.T
        self.trace = torch.trace(sigma)

    def __call__(self, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Distances of ``mu`` (..., d) and ``sigma`` (..., d, d), batched over the leading dimensions."""
        product = self.root @ sigma @ self.root
        eig = torch.linalg.eigvalsh((product + product.mT) / 2).clamp(min=0)
        diff = mu - self.mu
        trace = sigma.diagonal(dim1=-2, dim2=-1).sum(-1)
        return (diff * diff).sum(-1) + trace + self.trace - 2 * eig.sqrt().sum(-1)


def resample_indices(n: int, resamples: int, seed: int) -> torch.Tensor:
    """(resamples, n) row indices drawn with replacement, from a generator of their own (the same for a seed)."""
    return torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def bootstrap_fd(
    features: torch.Tensor | np.ndarray, reference: FrechetToReference, indices: torch.Tensor
) -> np.ndarray:
    """The FD of every resample of ``features`` (rows from ``indices``) to the reference."""
    x = torch.as_tensor(features).to(device=reference.mu.device, dtype=torch.float64)
    n = len(x)
    mean = x.mean(dim=0)
    centred = x - mean
    counts = torch.zeros(len(indices), n, dtype=torch.float64, device=x.device)
    counts.scatter_add_(1, indices.to(x.device), torch.ones_like(counts))
    shift = counts @ centred / n  # each resample's mean, minus the full set's
    sigmas = torch.stack([(centred.T * w) @ centred for w in counts])
    sigmas = (sigmas - n * shift[:, :, None] * shift[:, None, :]) / (n - 1)
    return reference(mean + shift, sigmas).cpu().numpy()


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high

    def __str__(self) -> str:
        return f"[{self.low:.4g}, {self.high:.4g}]"


def bootstrap_interval(value: float, values: np.ndarray, level: float = BOOTSTRAP_LEVEL) -> Interval:
    """The central ``level`` share of the bootstrap values (Efron's percentile interval) shifted by the bootstrap's
    bias, mean(values) − value, so that it is the spread of ``value`` itself (docs/evaluation.md); at least 0."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail]) - (np.mean(values) - value)
    return Interval(max(float(low), 0.0), float(high))  # a distance is not negative


def fd_interval(
    value: float,
    features: torch.Tensor | np.ndarray,
    mu: np.ndarray,
    sigma: np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    level: float = BOOTSTRAP_LEVEL,
) -> Interval:
    """Bootstrap interval of a sample set's FD against fixed reference statistics (not resampled)."""
    x = torch.as_tensor(features)
    reference = FrechetToReference(mu, sigma, x.device)
    return bootstrap_interval(value, bootstrap_fd(x, reference, resample_indices(len(x), resamples, seed)), level)


@dataclass(frozen=True)
class Paired:
    share_a_ahead: float  # share of resamples in which A's distance is strictly lower than B's
    a: np.ndarray  # each resample's distance, A and B on the same rows
    b: np.ndarray


def paired_bootstrap(
    features_a: torch.Tensor | np.ndarray,
    features_b: torch.Tensor | np.ndarray,
    mu: np.ndarray,
    sigma: np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Paired:
    """Two aligned sets against one reference on the same resamples, so that their shared noise cancels."""
    a, b = torch.as_tensor(features_a), torch.as_tensor(features_b)
    if a.shape != b.shape:
        raise UserError(
            f"a paired comparison needs two aligned sets of the same size and features, got {tuple(a.shape)} and "
            f"{tuple(b.shape)}: sample both with the same seeds and labels."
        )
    reference = FrechetToReference(mu, sigma, a.device)
    indices = resample_indices(len(a), resamples, seed)
    values_a, values_b = bootstrap_fd(a, reference, indices), bootstrap_fd(b, reference, indices)
    return Paired(float(np.mean(values_a < values_b)), values_a, values_b)
