"""The sampling section: how every face that samples (or plans sampling) says its sampler and settings."""

from __future__ import annotations

from dataclasses import dataclass

from dit.io.config import FieldError, Section, option
from dit.objectives.integrators import ODE_METHODS
from dit.objectives.samplers import (
    DIFFUSION_FORMS,
    LAST_STEPS,
    SAMPLERS,
    SCHEDULER_SAMPLERS,
    check_guidance_interval,
    check_method,
)

GUIDANCE_HELP = "classifier-free guidance scale; 1 disables it (--cfg-scale is the official spelling)"
CHANNELS_HELP = "noise channels to guide: 3 (the official code, used for the paper's FIDs) or all"
SAMPLER_HELP = (
    "diffusion models: ddpm (ancestral; their default) or ddim (eta 0), our loops; diffusers' schedulers "
    f"{', '.join(SCHEDULER_SAMPLERS)} (heun: 2 evaluations a step but the last); flow models: ode (their default) "
    "or sde"
)
TIME_SHIFT_HELP = (
    "SD3's timestep shift a (> 1: more of the steps near the noise; 1: none) or auto (RAE's sqrt(C x H x W / "
    "4096) of the latent): the flow's time grid, the diffusion's respaced timesteps (docs/flow_matching.md)"
)
INTERVAL_HELP = (
    "guide only the evaluations whose time lies in [LO, HI] (Kynkaenniemi et al. 2024), the others run unguided "
    "(one pass); time is t/1000 for diffusion (1 = noise) and the flow's t (1 = data); default: every evaluation"
)


@dataclass(frozen=True)
class SamplingSection(Section):
    """The sampler and its settings; the model decides what it leaves open (default sampler and guidance)."""

    FAST = False  # default to the objective's fast sampler (the in-loop evaluation's) instead of sample.py's
    GUIDANCE_DEFAULT = 4.0  # the official sample.py's, for a model with a null class

    sampler: str | None = option(None, SAMPLER_HELP, choices=SAMPLERS)
    sampling_method: str | None = option(
        None,
        "flow models: ode euler, heun (the default), ab2, ab3, ab4 (Adams-Bashforth, 1 evaluation a step) or dopri5 "
        "(adaptive, torchdiffeq); sde euler (the default) or heun",
        choices=ODE_METHODS,  # SDE_METHODS are among them
    )
    num_sampling_steps: int = option(
        250, "diffusion: respaced steps (official rounding); flow: grid steps (Heun: 2 evaluations each)", ge=1
    )
    guidance_scale: float | None = option(
        None, GUIDANCE_HELP + "; default 4 for a model with a null class, else 1", aliases=("--cfg-scale",), ge=1
    )
    guidance_channels: str = option("3", CHANNELS_HELP, choices=("3", "all"), aliases=("--cfg-channels",))
    guidance_interval: tuple[float, ...] | None = option(None, INTERVAL_HELP, ge=0, le=1)
    guidance_path_drop: bool = option(
        False, "SPRINT's path-drop guidance: the unconditional pass skips the sparse blocks of a model trained with "
        "--token-drop (sprint layout), about half a pass"
    )  # fmt: skip
    diffusion_form: str = option(
        "sigma", "flow sde: the diffusion coefficient w(t) (SiT's choices)", choices=DIFFUSION_FORMS
    )
    last_step: str = option("mean", "flow sde: the last deterministic step (SiT's, h = 0.04)", choices=LAST_STEPS)
    sample_eps: float | None = option(
        None, "flow: keep the sampler's time grid this far from the ends (default: the run's, else SiT's)", ge=0,
        lt=0.5,
    )  # fmt: skip
    time_shift: float | str | None = option(
        None, TIME_SHIFT_HELP + "; default: the run's", choices=("auto",), gt=0
    )
    atol: float = option(1e-6, "flow ode dopri5: absolute tolerance (SiT's default)", gt=0)
    rtol: float = option(1e-3, "flow ode dopri5: relative tolerance (SiT's default)", gt=0)

    def check(self) -> None:
        check_method(self.sampler, self.sampling_method, self.last_step)
        check_guidance_interval(self.guidance_interval)

    def guidance(self, has_null_class: bool) -> float:
        """The guidance scale for a model with (or without) a null class: the asked one, else the default."""
        if self.guidance_scale is None:
            return self.GUIDANCE_DEFAULT if has_null_class else 1.0
        if self.guidance_scale > 1 and not has_null_class:
            raise FieldError(
                "this model was trained without a null class (unconditional, or no class dropout), so there is "
                "nothing to guide against: pass {guidance_scale} 1, or leave it out."
            )
        return self.guidance_scale


@dataclass(frozen=True)
class FidSamplingSection(SamplingSection):
    """The sampling section with an FID set's default guidance: 1.5 on 3 channels, the paper's FID setting."""

    GUIDANCE_DEFAULT = 1.5

    guidance_scale: float | None = option(
        None, GUIDANCE_HELP + "; default 1.5 (on 3 channels the paper's FID setting) for a model with a null class, "
        "else 1", aliases=("--cfg-scale",), ge=1,
    )  # fmt: skip
