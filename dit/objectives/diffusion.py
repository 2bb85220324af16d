"""DiT's Gaussian diffusion (``dit.objectives.gaussian``, the official ``create_diffusion``) as an ``Objective``."""

from __future__ import annotations

import inspect

import numpy as np

from dit.io.errors import UserError
from dit.objectives.objective import Objective
from dit.objectives.samplers import DIFFUSION_SAMPLERS, SCHEDULER_SAMPLERS

# The section's names of GaussianDiffusion's options where they differ from its own.
RENAMED = {"loss_weight": "loss_weighting", "time_sampling": "timestep_sampling"}


class DiffusionObjective(Objective):
    """The 1000-step diffusion: integer training steps, the official losses, respaced samplers."""

    name = "diffusion"
    samplers = DIFFUSION_SAMPLERS + SCHEDULER_SAMPLERS
    default_sampler = "ddpm"  # the official sample.py's
    fast_sampler = "ddim"
    learns_sigma = True
    noun = "diffusion"

    def __init__(self, noise_schedule: str = "linear", predict_xstart: bool = False, learn_sigma: bool = True,
                 **recipe):  # fmt: skip
        """``recipe``: ``GaussianDiffusion``'s training options (loss weighting, times) under the section's names."""
        from dit.objectives.gaussian import create_diffusion

        self.noise_schedule, self.predict_xstart, self.learn_sigma = noise_schedule, predict_xstart, learn_sigma
        self._time_shift = recipe.get("time_shift", 1.0)
        self.diffusion = create_diffusion(
            "", noise_schedule=noise_schedule, learn_sigma=learn_sigma, predict_xstart=predict_xstart,
            **{RENAMED.get(k, k): v for k, v in recipe.items()},
        )  # fmt: skip

    @classmethod
    def from_record(cls, run: dict, learn_sigma: bool) -> DiffusionObjective:
        """Every option of the record that ``GaussianDiffusion`` takes: a new one needs no line here."""
        from dit.objectives.gaussian import GaussianDiffusion

        takes = inspect.signature(GaussianDiffusion).parameters
        recipe = {k: v for k, v in run.items() if RENAMED.get(k, k) in takes and v is not None}
        return cls(run.get("noise_schedule") or "linear", bool(run.get("predict_xstart")), learn_sigma, **recipe)

    @property
    def time_shift(self) -> float:
        return self._time_shift

    def sampling_fields(self) -> dict:
        return {"noise_schedule": self.noise_schedule, "predict_xstart": self.predict_xstart,
                "time_shift": self.time_shift}  # fmt: skip

    def task(self) -> dict:
        return {"objective": self.name, "noise_schedule": self.noise_schedule, "predict_xstart": self.predict_xstart,
                "learn_sigma": self.learn_sigma}  # fmt: skip

    def sample_t(self, n, generator, device):
        return self.diffusion.sample_t(n, generator, device)

    def training_losses(self, model_fn, x, t, model_kwargs=None, noise=None) -> dict:
        return self.diffusion.training_losses(model_fn, x, t, model_kwargs, noise=noise)

    def tables(self, device) -> DiffusionObjective:
        self.diffusion.tables(device)
        return self

    def check_options(self, kind, method, sample_eps, diffusion_form) -> None:
        if sample_eps is not None:
            raise UserError("--sample-eps is for flow models: a diffusion model's sampler has no such interval.")

    def process(self, num_steps, sample_eps, time_shift=None):
        from dit.objectives.gaussian import create_diffusion

        shift = self.time_shift if time_shift is None else time_shift
        return create_diffusion(str(num_steps), noise_schedule=self.noise_schedule, learn_sigma=self.learn_sigma,
                                predict_xstart=self.predict_xstart, time_shift=shift)  # fmt: skip

    def sampling_loop(self, kind, process, plan, **settings):
        """Our DDPM and DDIM loops, or a diffusers scheduler on the respaced diffusion."""
        if kind in SCHEDULER_SAMPLERS:
            from dit.objectives.schedulers import make_scheduler, scheduler_sample

            scheduler = make_scheduler(kind, process)
            return lambda fn, x, kwargs, noise, progress: scheduler_sample(
                scheduler, process, plan, fn, x, model_kwargs=kwargs, noise_fn=noise, progress=progress
            )
        loop = process.ddim_sample_loop if kind == "ddim" else process.p_sample_loop
        return lambda fn, x, kwargs, noise, progress: loop(
            fn, x.shape, x, clip_denoised=False, model_kwargs=kwargs, progress=progress, noise_fn=noise
        )

    def noise_to_signal(self) -> tuple:
        abar = self.diffusion.alphas_cumprod
        return np.arange(len(abar)) / len(abar), np.sqrt((1 - abar) / abar)

    def manifest(self, sample_eps) -> None:
        return None
