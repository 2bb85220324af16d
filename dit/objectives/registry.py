"""The objectives by name (``OBJECTIVES``: a new one is a module and an entry), and the one a record names."""

from __future__ import annotations

from dit.objectives.diffusion import DiffusionObjective
from dit.objectives.flow import FlowObjective
from dit.objectives.objective import Objective

OBJECTIVES: dict[str, type[Objective]] = {"diffusion": DiffusionObjective, "flow": FlowObjective}


def objective_for_sampler(sampler: str | None) -> type[Objective]:
    """The objective a sampler's name implies (none given: the default, diffusion), for planning without a model."""
    return next((o for o in OBJECTIVES.values() if sampler in o.samplers), OBJECTIVES["diffusion"])


def from_record(run: dict, learn_sigma: bool, latent_dim: int) -> Objective:
    """The objective a run's record names (diffusion without one), ``time_shift`` resolved for ``latent_dim``."""
    from dit.objectives.times import shift_factor

    run = {**run, "time_shift": shift_factor(run.get("time_shift", 1.0), latent_dim)}
    return OBJECTIVES[run.get("objective") or "diffusion"].from_record(run, learn_sigma)


def of_sampling_fields(noise_schedule: str, predict_xstart: bool, transport, learn_sigma: bool,
                       time_shift: float = 1.0) -> Objective:  # fmt: skip
    """The objective that ``dit.sample.SamplingModel``'s fields record (``sampling_fields``'s inverse)."""
    if transport is not None:
        return FlowObjective(transport)
    return DiffusionObjective(noise_schedule, predict_xstart, learn_sigma, time_shift=time_shift)
