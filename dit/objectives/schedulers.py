"""diffusers' schedulers as samplers of our diffusion, on the respaced betas with "trailing" spacing, so that their
step k is ours; they see the first C channels only, and the SDE's noise comes from the per-image generators."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dit.io.errors import require
from dit.io.progress import progress as progress_bar
from dit.objectives.gaussian import ModelMeanType, SpacedDiffusion
from dit.objectives.samplers import SCHEDULERS, SamplingPlan


def make_scheduler(name: str, diffusion: SpacedDiffusion, **overrides):
    """A diffusers scheduler configured by ``diffusion``: its respaced betas, all its steps, its prediction."""
    class_name, settings = SCHEDULERS.get(name, (name, {}))
    diffusers = require("diffusers", "vae", f"--sampler {name} (a diffusers scheduler)")
    x0 = diffusion.model_mean_type == ModelMeanType.START_X
    return getattr(diffusers, class_name)(
        num_train_timesteps=diffusion.num_timesteps,
        # below 1 in float32: a few-step cosine schedule's last beta rounded to 1 (docs/reliability.md, row 19)
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
    """Denoise ``x`` with ``scheduler``, one model call per timestep, as ``plan`` counted (checked first)."""
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
            # sigma-space schedulers: back to the variance-preserving x_t
            model_in = scheduler.scale_model_input(x, k)
            out = model(model_in, model_t[i].expand(len(x)), **model_kwargs)[:, :channels]
            extra = {"variance_noise": noise_fn(x)} if stochastic else {}
            x = scheduler.step(out, k, x, **extra).prev_sample
            bar.update(1)
    return x
