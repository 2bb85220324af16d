"""Loss terms both objectives add beside their MSE."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def velocity_direction(v_pred: torch.Tensor, v_target: torch.Tensor) -> torch.Tensor:
    """LightningDiT's cosine velocity loss, per sample (N,): 1 - cos(v_pred, v_target) over the channels at each
    position, averaged over the positions (its ``cosine_similarity(..., dim=1)`` then ``mean_flat``)."""
    cos = F.cosine_similarity(v_pred, v_target, dim=1)
    return (1 - cos).mean(dim=tuple(range(1, cos.dim())))
