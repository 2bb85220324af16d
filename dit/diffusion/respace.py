"""Timestep respacing: sample with a subset of the training timesteps (ADM's ``space_timesteps``)."""

from __future__ import annotations

import numpy as np

from dit.diffusion.gaussian_diffusion import GaussianDiffusion


def space_timesteps(num_timesteps: int, section_counts) -> set[int]:
    """The timesteps to keep.

    ``section_counts`` is "ddimN" (an exact stride: "ddim50" gives 0, 20, ..., 980), a comma-separated
    string or list of counts per equal section ("250" gives 0, 4, 8, ..., 991, 995, 999: each section is
    strided by rounding so that its ends are kept).
    """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            desired = int(section_counts[len("ddim") :])
            for stride in range(1, num_timesteps):
                if len(range(0, num_timesteps, stride)) == desired:
                    return set(range(0, num_timesteps, stride))
            raise ValueError(f"cannot make exactly {desired} steps from {num_timesteps} with an integer stride.")
        section_counts = [int(x) for x in section_counts.split(",")]
    size_per, extra = divmod(num_timesteps, len(section_counts))
    start, all_steps = 0, []
    for i, section_count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < section_count:
            raise ValueError(f"cannot divide a section of {size} steps into {section_count}.")
        frac_stride = 1 if section_count <= 1 else (size - 1) / (section_count - 1)
        cur, taken = 0.0, []
        for _ in range(section_count):
            taken.append(start + round(cur))
            cur += frac_stride
        all_steps += taken
        start += size
    return set(all_steps)


class SpacedDiffusion(GaussianDiffusion):
    """A diffusion over the kept timesteps, with betas recomputed from the base alpha-bar ratios.

    The model is still conditioned on the original integer timesteps (through ``timestep_map``).
    """

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
