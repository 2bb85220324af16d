"""Training-time draws both objectives share."""

import torch


def logit_normal(n: int, mean: float, std: float, generator: torch.Generator | None, device) -> torch.Tensor:
    """u = sigmoid(N(mean, std)) in (0, 1), read as the fraction of signal (1 = data; SD3's timesteps)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
