"""Token dropping: a DiT's sparse blocks see a kept subset of the tokens: ``sprint`` (SPRINT, arXiv 2510.21986),
fused back with the dense features, or ``maskdit`` (MaskDiT, arXiv 2306.09305), dropped at the input."""

from __future__ import annotations

import torch
from torch import nn

from dit.model.config import DiTConfig


def draw_kept(generator: torch.Generator, batch: int, tokens: int, kept: int, device) -> torch.Tensor:
    """(batch, kept) ascending token indices, a uniform subset per sample of the global batch."""
    scores = torch.rand(batch, tokens, generator=generator, device=device)
    return scores.argsort(dim=1)[:, :kept].sort(dim=1).values


def gather_tokens(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """(N, T, ...) -> (N, K, ...): each sample's kept tokens."""
    index = kept.view(*kept.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def kept_rope(rope: tuple[torch.Tensor, torch.Tensor] | None, kept: torch.Tensor):
    """RoPE tables (T, 1, dh) -> (N, K, 1, dh): each kept token keeps its original 2-D position."""
    return None if rope is None else tuple(table[kept] for table in rope)


class TokenDrop(nn.Module):
    """The mask token of the dropped positions and, for SPRINT, the fusion at the dense re-entry."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden_size
        self.layout = cfg.token_drop_layout
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d))
        self.fuse = nn.Linear(2 * d, d) if self.layout == "sprint" else None

    def pad(self, sparse: torch.Tensor, kept: torch.Tensor, tokens: int, fill: torch.Tensor | None = None):
        """(N, K, D) -> (N, T, D): the kept tokens at their positions, the mask token (plus ``fill``) elsewhere."""
        n, _, d = sparse.shape
        base = self.mask_token.to(sparse.dtype).expand(n, tokens, d)
        if fill is not None:
            base = base + fill.to(sparse.dtype)
        return base.scatter(1, kept.unsqueeze(-1).expand(-1, -1, d), sparse)

    def reenter(self, dense: torch.Tensor, sparse: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor:
        """SPRINT's fusion of the pre-drop dense features with the sparse output (None: the path dropped)."""
        if sparse is None:
            sparse = self.mask_token.to(dense.dtype).expand_as(dense)
        elif kept is not None:
            sparse = self.pad(sparse, kept, dense.shape[1])
        return self.fuse(torch.cat([dense, sparse], dim=-1))
