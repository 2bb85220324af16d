"""SiT's flow matching (``dit.objectives.transport``) as an ``Objective``."""

from __future__ import annotations

import dataclasses
import math

from dit.io.errors import UserError
from dit.objectives.objective import Objective
from dit.objectives.samplers import FLOW_SAMPLERS


class FlowObjective(Objective):
    """A ``Transport``: times in [0, 1] (1 = data), one predicted field, ODE/SDE samplers on a time grid."""

    name = "flow"
    samplers = FLOW_SAMPLERS
    default_sampler = fast_sampler = "ode"
    learns_sigma = False
    noun = "flow-matching"

    def __init__(self, transport):
        self.transport = transport

    @classmethod
    def from_record(cls, run: dict, learn_sigma: bool = False) -> FlowObjective:
        from dit.objectives.transport import Transport

        return cls(Transport.from_record(run))

    @property
    def time_shift(self) -> float:
        return self.transport.time_shift

    def sampling_fields(self) -> dict:
        return {"transport": self.transport}

    def task(self) -> dict:
        t = self.transport
        return {"objective": self.name, "path_type": t.path_type, "prediction": t.prediction, "learn_sigma": False}

    def sample_t(self, n, generator, device):
        return self.transport.sample_t(n, generator, device)

    def training_losses(self, model_fn, x, t, model_kwargs=None, noise=None) -> dict:
        return self.transport.training_losses(model_fn, x, t, model_kwargs, noise=noise)

    def process(self, num_steps, sample_eps, time_shift=None):
        """The transport with the sampler's ``sample_eps`` (None: the run's); the plan's grid carries the shift."""
        return self.transport if sample_eps is None else dataclasses.replace(self.transport, sample_eps=sample_eps)

    def sampling_interval(self, sample_eps) -> tuple[float, float]:
        return self.process(0, sample_eps).interval(training=False)

    def check_options(self, kind, method, sample_eps, diffusion_form) -> None:
        if kind == "sde" and diffusion_form == "SBDM":
            from dit.objectives.transport.samplers import diffusion_coefficient

            t0 = self.sampling_interval(sample_eps)[0]
            if not math.isfinite(diffusion_coefficient(self.process(0, sample_eps), "SBDM", t0)):
                raise UserError(
                    f"the SBDM diffusion is infinite at t = {t0:g}: pass a --sample-eps above 0, or another "
                    "--diffusion-form."
                )

    def sampling_loop(self, kind, process, plan, *, method, diffusion_form, last_step, atol, rtol):
        """The ODE (``ODE_INTEGRATORS[method]``) or the SDE along the plan's grid."""
        from dit.io.progress import progress as progress_bar
        from dit.objectives.transport.samplers import FlowField, ode_sample, sde_sample

        def loop(fn, x, kwargs, noise, progress):
            field, grid = FlowField(process, fn, kwargs), plan.grid
            ticks = None if plan.times is None else len(grid) - 1  # an adaptive integrator picks its own steps
            with progress_bar(ticks, plan.sampler, unit="step", enabled=progress) as bar:
                if kind == "ode":
                    return ode_sample(field, x, grid, method, atol=atol, rtol=rtol, progress=bar)
                return sde_sample(field, x, grid, noise, method=method, form=diffusion_form, last_step=last_step,
                                  progress=bar)  # fmt: skip

        return loop

    def noise_to_signal(self) -> tuple:
        import torch

        t = torch.linspace(0, 1, 10_001, dtype=torch.float64)[1:-1]
        alpha, _, sigma, _ = self.transport.path.alpha_sigma(t)
        return t.numpy(), (sigma / alpha).numpy()

    def manifest(self, sample_eps) -> dict:
        """The transport's fields, the recipe's defaults left out so that older sets keep their identity."""
        record = dataclasses.asdict(self.process(0, sample_eps))
        return {k: v for k, v in record.items() if (k, v) not in (("time_shift", 1.0), ("cos_loss_weight", 0.0))}
