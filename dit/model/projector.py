"""REPA (Yu et al. 2024), the trained half: a 3-layer MLP projects the DiT's tokens after one block onto a frozen
encoder's patch features, and the loss adds their negative cosine similarity, averaged over tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dit.model.dit import DiT


class RepaProjector(nn.Sequential):
    """REPA's projector: Linear(D, P), SiLU, Linear(P, P), SiLU, Linear(P, encoder width), per token."""

    def __init__(self, hidden_size: int, projector_dim: int, feature_dim: int):
        super().__init__(
            nn.Linear(hidden_size, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, projector_dim),
            nn.SiLU(),
            nn.Linear(projector_dim, feature_dim),
        )
        for m in self:  # as the DiT's own linears (REPA's projector is initialised with its model)
            if isinstance(m, nn.Linear) and not m.weight.is_meta:
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)


class RepaModel(nn.Module):
    """The DiT and its projector as one module (DDP and the optimizer see both); sampling uses ``dit`` alone."""

    def __init__(self, dit: DiT, projector: RepaProjector, depth: int):
        super().__init__()
        self.dit, self.projector, self.depth = dit, projector, depth

    def forward(self, x: torch.Tensor, t: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        out, hidden = self.dit(x, t, return_hidden_at=self.depth, **kwargs)
        return out, self.projector(hidden)


def repa_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per image: minus the cosine similarity of projected and target tokens (N, T, C), mean over tokens."""
    return -F.cosine_similarity(projected.float(), target.float(), dim=-1).mean(dim=1)


def resample_tokens(tokens: torch.Tensor, grid: int) -> torch.Tensor:
    """(N, g*g, C) tokens on a g x g grid -> (N, grid*grid, C), bilinear (antialiased when shrinking)."""
    n, t, c = tokens.shape
    side = round(t**0.5)
    if side * side != t:
        raise ValueError(f"{t} patch tokens are not a square grid")
    if side == grid:
        return tokens
    image = tokens.transpose(1, 2).reshape(n, c, side, side).float()
    image = F.interpolate(image, size=(grid, grid), mode="bilinear", align_corners=False, antialias=grid < side)
    return image.flatten(2).transpose(1, 2).to(tokens.dtype)
