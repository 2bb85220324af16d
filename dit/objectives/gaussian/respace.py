"""Timestep respacing: sample with a subset of the training timesteps (``dit.objectives.respacing``'s)."""

from __future__ import annotations

import numpy as np

from dit.objectives.gaussian.gaussian_diffusion import GaussianDiffusion
from dit.objectives.respacing import space_timesteps

__all__ = ["SpacedDiffusion", "space_timesteps"]


class SpacedDiffusion(GaussianDiffusion):
    """A diffusion over the kept timesteps; the model still sees the original ones (``timestep_map``)."""

    def __init__(self, use_timesteps, **kwargs):
        base = GaussianDiffusion(**kwargs)
        self.use_timesteps = set(use_timesteps)
        self.original_num_steps = len(base.betas)
        last_alpha_cumprod, new_betas, timestep_map = 1.0, [], []
        for i, alpha_cumprod in enumerate(base.alphas_cumprod):
            if i in self.use_timesteps:
                new_betas.append(1 - alpha_cumprod / last_alpha_cumprod)
                last_alpha_cumprod = alpha_cumprod
                timestep_map.append(i)
        kwargs["betas"] = np.array(new_betas)
        super().__init__(timestep_map=timestep_map, **kwargs)
