"""SiT's interpolant paths (Ma et al. 2024), t = 0 noise x0, t = 1 data x1: x_t = alpha_t x1 + sigma_t x0,
u_t = alpha'_t x1 + sigma'_t x0, and v = (alpha'/alpha) x + d_t s with d_t = ``drift_var``."""

from __future__ import annotations

import math

import torch

PATHS = ("linear", "gvp", "vp")


def _expand(coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return coef.reshape(-1, *([1] * (x.dim() - 1)))


class Path:
    """alpha_t, sigma_t and their derivatives for one path, on per-sample times t (shape (N,))."""

    def __init__(self, kind: str = "linear", beta_min: float = 0.1, beta_max: float = 20.0):
        if kind not in PATHS:
            raise ValueError(f"unknown path {kind!r}: one of {PATHS}")
        self.kind, self.beta_min, self.beta_max = kind, beta_min, beta_max

    def alpha_sigma(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha, alpha', sigma, sigma')."""
        if self.kind == "linear":
            return t, torch.ones_like(t), 1 - t, -torch.ones_like(t)
        if self.kind == "gvp":
            half_pi = math.pi / 2
            return (torch.sin(half_pi * t), half_pi * torch.cos(half_pi * t), torch.cos(half_pi * t),
                    -half_pi * torch.sin(half_pi * t))  # fmt: skip
        # VP: log alpha = L(t) = -(1-t)^2 (b1 - b0) / 4 - (1-t) b0 / 2, so alpha' = alpha L'(t)
        b0, b1 = self.beta_min, self.beta_max
        log_alpha = -0.25 * (1 - t) ** 2 * (b1 - b0) - 0.5 * (1 - t) * b0
        d_log_alpha = 0.5 * (1 - t) * (b1 - b0) + 0.5 * b0
        alpha = torch.exp(log_alpha)
        # sigma = sqrt(1 - alpha^2) through expm1, exact in fp32 near t = 1 (docs/flow_matching.md)
        sigma = torch.sqrt(-torch.expm1(2 * log_alpha))
        return alpha, alpha * d_log_alpha, sigma, -(alpha**2) * d_log_alpha / sigma

    def drift_var(self, t: torch.Tensor) -> torch.Tensor:
        """d_t: the score's coefficient in the velocity (SiT's ``compute_drift`` second output)."""
        if self.kind == "vp":
            return 0.5 * (self.beta_min + (1 - t) * (self.beta_max - self.beta_min))
        alpha, d_alpha, sigma, d_sigma = self.alpha_sigma(t)
        return d_alpha / alpha * sigma**2 - sigma * d_sigma

    def interpolate(
        self, t: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_t, u_t): the point on the path and the velocity there, for noise x0 and data x1."""
        alpha, d_alpha, sigma, d_sigma = (_expand(c, x1) for c in self.alpha_sigma(t))
        return alpha * x1 + sigma * x0, d_alpha * x1 + d_sigma * x0

    def velocity(self, x: torch.Tensor, t: torch.Tensor, prediction: str, out: torch.Tensor) -> torch.Tensor:
        """The velocity at (x, t) from a model's output ``out`` of the given prediction type."""
        if prediction == "velocity":
            return out
        alpha, d_alpha, _, _ = (_expand(c, x) for c in self.alpha_sigma(t))
        score = self.score(x, t, prediction, out)
        return d_alpha / alpha * x + _expand(self.drift_var(t), x) * score

    def score(self, x: torch.Tensor, t: torch.Tensor, prediction: str, out: torch.Tensor) -> torch.Tensor:
        """The score (gradient of log p_t) at (x, t) from the model's output."""
        alpha, d_alpha, sigma, d_sigma = (_expand(c, x) for c in self.alpha_sigma(t))
        if prediction == "score":
            return out
        if prediction == "noise":
            return -out / sigma
        # velocity: s = (v - (alpha'/alpha) x) / d_t, as SiT writes it: finite at t = 0, where the SDE starts
        ratio = alpha / d_alpha
        return (ratio * out - x) / (sigma**2 - ratio * d_sigma * sigma)
