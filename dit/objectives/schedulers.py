"""diffusers' schedulers as samplers of our diffusion models: DPM-Solver++ (2M, and 2M SDE), UniPC, DEIS,
Euler and Heun (``--sampler dpmpp-2m`` etc.); our DDPM/DDIM loops stay the reference.

Our diffusion configures each scheduler: its training schedule is the respaced betas (the N steps kept of
the 1000), and it visits all N in order ("trailing" spacing, no offset), so its timestep k is our respaced
step k and the model sees ``timestep_map[k]``, the original timestep, as in our DDPM/DDIM (a test holds
diffusers' DDIM to ours). The scheduler gets the model's first C channels only: a learned-sigma DiT's
variance channels never reach it (diffusers' DPM-Solver with ``variance_type="learned"`` keeps the first 3,
wrong for 4-channel latents), as the noise, or as x0 ("sample") for an x0-predicting diffusion. Guidance
is applied before the scheduler sees the output. The SDE variant's noise comes from the per-image
generators (``variance_noise``), so a set is the same on any number of processes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dit.io.errors import require
from dit.io.progress import progress as progress_bar
from dit.objectives.gaussian import ModelMeanType, SpacedDiffusion
from dit.objectives.samplers import SCHEDULERS, SamplingPlan


def make_scheduler(name: str, diffusion: SpacedDiffusion, **overrides):
    """A diffusers scheduler (a ``SCHEDULERS`` name, or any diffusers scheduler class name) configured by
    ``diffusion``: its respaced betas, all of its steps, and its prediction (noise or x0)."""
    class_name, settings = SCHEDULERS.get(name, (name, {}))
    diffusers = require("diffusers", "vae", f"--sampler {name} (a diffusers scheduler)")
    x0 = diffusion.model_mean_type == ModelMeanType.START_X
    return getattr(diffusers, class_name)(
        num_train_timesteps=diffusion.num_timesteps,
        # diffusers takes alpha-bar as a float32 cumprod: at 5 of the cosine schedule's 1000 steps the last
        # respaced beta (1 - 2.4e-9 / 0.144) rounds to 1, alpha-bar to 0, sigma to inf, and every image to NaN
        # (digit FID 5938 for dpmpp-2m and unipc at 5 NFE). Kept at float32's largest beta below 1, the last
        # alpha-bar is 8.6e-9 instead of 2.4e-9: sigma_max 1.1e4 instead of 2.0e4, for x_T ~ N(0, I) alike.
        trained_betas=np.minimum(diffusion.betas, 1 - 2.0**-24).tolist(),
        timestep_spacing="trailing",
        steps_offset=0,
        prediction_type="sample" if x0 else "epsilon",
        **{**settings, **overrides},
    )


def scheduler_sample(
    scheduler,
    diffusion: SpacedDiffusion,
    plan: SamplingPlan,
    model: Callable,
    x: torch.Tensor,
    *,
    model_kwargs: dict,
    noise_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Denoise ``x`` (x_T ~ N(0, I)) with ``scheduler``, calling ``model(x_t, t, **model_kwargs)`` once per
    entry of its timesteps, which must be the evaluations ``plan`` counted (checked before the first)."""
    scheduler.set_timesteps(diffusion.num_timesteps, device=x.device)
    steps = [int(k) for k in scheduler.timesteps.tolist()]
    original = [int(diffusion.timestep_map[k]) for k in steps]
    planned = [round(t * diffusion.original_num_steps) for t in plan.times]
    if original != planned:
        raise RuntimeError(f"{plan.sampler} would evaluate at timesteps {original}, not the planned {planned}")
    model_t = torch.as_tensor(original, dtype=torch.long, device=x.device)
    channels = x.shape[1]
    stochastic = scheduler.config.get("algorithm_type", "").startswith("sde")
    x = x * scheduler.init_noise_sigma
    with progress_bar(len(scheduler.timesteps), plan.sampler, unit="step", enabled=progress) as bar:
        for i, k in enumerate(scheduler.timesteps):
            model_in = scheduler.scale_model_input(
                x, k
            )  # sigma-space schedulers: back to the variance-preserving x_t
            out = model(model_in, model_t[i].expand(len(x)), **model_kwargs)[:, :channels]
            extra = {"variance_noise": noise_fn(x)} if stochastic else {}
            x = scheduler.step(out, k, x, **extra).prev_sample
            bar.update(1)
    return x
