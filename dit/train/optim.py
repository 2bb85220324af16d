"""The optimisation recipe: AdamW, its schedule, the EMA, the batch and the data order's seed, and when non-finite
steps stop a run; the paper's by default (AdamW 1e-4 constant, no weight decay, batch 256, EMA 0.9999)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dit.checkpoint.posthoc import MAX_SIGMA_REL
from dit.io.config import FieldError, Section, option

# What a resume may change only when --allow-changes names it (the rest of this section fixes the data order).
RECIPE_FIELDS = (
    "lr", "weight_decay", "warmup_steps", "lr_schedule", "min_lr_frac", "grad_clip", "ema_decay", "ema_warmup",
    "ema_profiles", "grad_accum_steps", "repa_coeff", "adam_beta1", "adam_beta2", "adam_eps",
)  # fmt: skip


@dataclass(frozen=True)
class OptimSection(Section):
    global_batch_size: int = option(256, "images per optimizer step, all devices together", ge=1)
    grad_accum_steps: int = option(1, "micro-batches per optimizer step", ge=1)
    lr: float = option(1e-4, "AdamW learning rate (constant after warm-up)", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = option(0.9, "AdamW beta1: the decay of the gradient's running mean", ge=0, lt=1)
    adam_beta2: float = option(
        0.999, "AdamW beta2: the decay of the squared gradient's running mean (LightningDiT: 0.95)", ge=0, lt=1
    )
    adam_eps: float = option(1e-8, "AdamW epsilon, added to the second moment's root", gt=0)
    warmup_steps: int = option(0, "linear learning-rate warm-up steps", ge=0)
    lr_schedule: str = option(
        "constant", "after warm-up: constant, or cosine decay to min_lr_frac x lr", choices=("constant", "cosine")
    )
    min_lr_frac: float = option(0.1, "cosine schedule: final lr as a fraction of lr", ge=0, le=1)
    grad_clip: float = option(0.0, "clip the gradient norm to this (0: off)", ge=0)
    ema_decay: float = option(0.9999, "EMA decay", ge=0, lt=1)
    ema_warmup: bool = option(False, "EMA decay min(decay, (1+n)/(10+n)) for short runs")
    ema_profiles: tuple[float, ...] | None = option(
        None, "post-hoc EMA: the sigma_rel of each power-function EMA tracked beside the classic one (docs/ema.md)"
    )
    fused_optimizer: bool = option(True, "fused AdamW (else foreach)")
    seed: int = option(0, "global seed: the data order, every step's noise and the initial weights", ge=0,
                       aliases=("--global-seed",))  # fmt: skip
    max_nonfinite: int = option(
        10, "stop (at the next log step) once this many losses in a row were non-finite", ge=1
    )

    def check(self) -> None:
        profiles = self.ema_profiles or ()
        if any(not 0 < s <= MAX_SIGMA_REL for s in profiles):
            raise FieldError(
                f"{{ema_profiles}} {' '.join(f'{s:g}' for s in profiles)}: each sigma_rel must be in (0, "
                f"{MAX_SIGMA_REL:.4f}] (the widest power-function profile, the plain average); EDM2 tracks 0.05 0.1."
            )
        if len({f"{s:g}" for s in profiles}) < len(profiles):
            raise FieldError(f"{{ema_profiles}} {' '.join(f'{s:g}' for s in profiles)}: name each profile once.")

    def lr_at(self, step: int, max_steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of ``max_steps``: warm-up, then constant or cosine."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, max_steps - self.warmup_steps))
            return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        return self.lr

    def optimizer(self, model: nn.Module) -> torch.optim.AdamW:
        params = [p for p in model.parameters() if p.requires_grad]
        impl = {"fused": True} if self.fused_optimizer else {"foreach": True}
        return torch.optim.AdamW(params, lr=self.lr, **self._group(), **impl)

    def _group(self) -> dict:
        """AdamW's settings a param group holds (and a checkpoint keeps), the lr aside: set every step."""
        betas = (self.adam_beta1, self.adam_beta2)
        return {"weight_decay": self.weight_decay, "betas": betas, "eps": self.adam_eps}

    def reapply(self, optimizer: torch.optim.Optimizer) -> None:
        """Put this run's weight decay, betas and eps back into a resumed optimizer (lr is set every step)."""
        for group in optimizer.param_groups:
            group.update(self._group())
