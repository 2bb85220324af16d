"""Exponential moving average of the weights, updated every step with one fused foreach op."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dit.train.parallel import local


class EMA:
    """An fp32 shadow copy of the model; ``ema = decay * ema + (1 - decay) * model`` over all parameters.

    Like the official DiT, it starts as a copy of the model and covers every parameter (the frozen
    positional table too). ``warmup`` uses decay = min(decay, (1 + n) / (10 + n)) at update n, without
    which a 0.9999 EMA of a short run is mostly the untrained initialisation.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = False):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self.warmup = decay, warmup
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.num_updates = 0

    def decay_at(self, n: int) -> float:
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, apply: torch.Tensor | None = None):
        """One update from ``model``'s parameters; ``apply`` (a 0/1 device scalar) skips it without a sync."""
        weight = 1.0 - self.decay_at(self.num_updates)
        # Under FSDP both models are sharded alike: each rank averages its own shards.
        dst, src = local(self.model.parameters()), local(p.detach() for p in model.parameters())
        if apply is None:
            torch._foreach_lerp_(dst, src, weight)
        else:  # a tensor weight per parameter: one 0-dim tensor would be read back as a number (a sync)
            w = apply * weight
            torch._foreach_lerp_(dst, src, [w.expand_as(d) for d in dst])
        self.num_updates += 1
