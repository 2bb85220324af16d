"""Training-time draws and the timestep shift, on the flow's axis (s = 1 is data), where SD3's shift reads
s' = s / (a - (a - 1) s) and LightningDiT's ``timestep_shift`` b is our a = 1 / b. No torch at import."""

from __future__ import annotations

import math

SHIFT_BASE_DIM = 4096  # RAE's base dimension n (arXiv 2510.11690, Sec. 4: a = sqrt(m / n), m = C x H x W)


def shift_time(s, a: float):
    """SD3's shift of signal fractions ``s`` (floats or tensors; 1 = data) by ``a``: s / (a - (a - 1) s)."""
    return s / (a - (a - 1) * s)


def unshift_time(s, a: float):
    """``shift_time``'s inverse: a s / (1 + (a - 1) s)."""
    return a * s / (1 + (a - 1) * s)


def latent_dim(model_cfg) -> int:
    """RAE's m for a model config (a ``DiTConfig``): the numbers in one latent, C x H x W."""
    return model_cfg.in_channels * model_cfg.input_size**2


def shift_factor(time_shift: float | str, latent_dim: int) -> float:
    """The shift a: ``time_shift`` itself, or for "auto" RAE's sqrt(latent_dim / 4096) (``latent_dim`` = C x H x W)."""
    return math.sqrt(latent_dim / SHIFT_BASE_DIM) if time_shift == "auto" else float(time_shift)


def logit_normal(n: int, mean: float, std: float, generator, device):
    """u = sigmoid(N(mean, std)) in (0, 1), read as the fraction of signal (1 = data; SD3's timesteps)."""
    import torch

    return torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
