"""Moving averages of the weights, updated every step with one fused foreach op each (no host sync): the classic
EMA, and the power-function profiles of post-hoc EMA (``dit.checkpoint.posthoc``) beside it."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dit.checkpoint.posthoc import gamma_of, profile_key
from dit.train.parallel import local

# Devices whose foreach kernels fuse a list of dense tensors into a few launches (docs/ema.md, "What it costs")
FUSED_FOREACH = ("cuda",)


class Average:
    """An fp32 shadow copy of every parameter: ``avg = d avg + (1 - d) model``, d = ``decay_at(n)``."""

    def __init__(self, model: nn.Module):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.num_updates = 0
        self._weights: torch.Tensor | None = None  # the buffer behind ``_dense_weights``

    def decay_at(self, n: int) -> float:
        raise NotImplementedError

    @torch.no_grad()
    def update(self, model: nn.Module, apply: torch.Tensor | None = None):
        """One update from ``model``'s parameters; ``apply`` (a 0/1 device scalar) skips it without a sync."""
        weight = 1.0 - self.decay_at(self.num_updates)
        # Under FSDP both models are sharded alike: each rank averages its own shards.
        dst, src = local(self.model.parameters()), local(p.detach() for p in model.parameters())
        if apply is None:
            torch._foreach_lerp_(dst, src, weight)
        elif dst[0].device.type in FUSED_FOREACH:  # the weight stays on the device (a number would be a sync)
            torch._foreach_lerp_(dst, src, self._dense_weights(dst, apply, weight))
        else:
            w = apply * weight
            torch._foreach_lerp_(dst, src, [w.expand_as(d) for d in dst])
        self.num_updates += 1

    def _dense_weights(self, dst: list[torch.Tensor], apply: torch.Tensor, weight: float) -> list[torch.Tensor]:
        """``apply * weight`` as dense views of one buffer: CUDA's fused foreach takes only dense tensors."""
        largest, buffer, t0 = max(d.numel() for d in dst), self._weights, dst[0]
        if buffer is None or buffer.numel() < largest or (buffer.dtype, buffer.device) != (t0.dtype, t0.device):
            buffer = self._weights = torch.empty(largest, dtype=t0.dtype, device=t0.device)
        torch.mul(apply.to(buffer.dtype).expand_as(buffer), weight, out=buffer)
        return [buffer[: d.numel()].view_as(d) for d in dst]


class PowerEMA(Average):
    """A post-hoc EMA profile: ``decay_at(n) = (1 - 1/(n + 1))^(gamma + 1)``, computed on the host."""

    def __init__(self, model: nn.Module, sigma_rel: float):
        super().__init__(model)
        self.sigma_rel, self.gamma = sigma_rel, gamma_of(sigma_rel)

    def decay_at(self, n: int) -> float:
        return (1.0 - 1.0 / (n + 1)) ** (self.gamma + 1.0)


class EMA(Average):
    """The classic EMA (``decay``, with the official ``warmup``) and the post-hoc ``profiles`` beside it."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = False, profiles=()):
        super().__init__(model)
        self.decay, self.warmup = decay, warmup
        self.profiles = {profile_key(s): PowerEMA(model, s) for s in profiles or ()}

    @property
    def models(self) -> list[nn.Module]:
        """Every shadow copy, the classic one first: what the parallelism places and shards as the model."""
        return [self.model, *(p.model for p in self.profiles.values())]

    def decay_at(self, n: int) -> float:
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    def update(self, model: nn.Module, apply: torch.Tensor | None = None):
        super().update(model, apply)
        for profile in self.profiles.values():
            profile.update(model, apply)

    def of(self, sigma_rel: float | None) -> nn.Module:
        """The copy to score: the tracked profile ``sigma_rel``, or the classic EMA for None."""
        return self.model if sigma_rel is None else self.profiles[profile_key(sigma_rel)].model
