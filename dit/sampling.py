"""How to sample, as every face that samples or plans sampling says it: the sampler names, their methods and
the ``SamplingSection`` (sample.py, scripts/sample_ddp.py, train.py's ``--eval-*`` flags, ``dit-cost sample``).

No torch here: ``dit-cost sample`` plans with the same vocabulary and the same evaluation counts
(``planned_nfe``) that the samplers in ``dit.transport.samplers`` and ``dit.sample.generate`` run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dit.config import FieldError, Section, option

DIFFUSION_SAMPLERS = ("ddpm", "ddim")
FLOW_SAMPLERS = ("ode", "sde")
SAMPLERS = DIFFUSION_SAMPLERS + FLOW_SAMPLERS
ODE_METHODS = ("euler", "heun", "dopri5")
SDE_METHODS = ("euler", "heun")
DEFAULT_METHODS = {"ode": "heun", "sde": "euler"}
DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")
LAST_STEPS = ("mean", "tweedie", "euler", "none")
GUIDANCE_HELP = "classifier-free guidance scale; 1 disables it (--cfg-scale is the official spelling)"
CHANNELS_HELP = "noise channels to guide: 3 (the official code, used for the paper's FIDs) or all"
# A model with a null class (trained with class dropout) is guided at 4 by default, as the official
# sample.py; one without (unconditional, or no dropout) has nothing to guide against and samples at 1.
DEFAULT_GUIDANCE = 4.0


def planned_nfe(kind: str, method: str | None, steps: int, last_step: str = "mean") -> int | None:
    """Network evaluations per image of a sampler (None for the adaptive dopri5: known after the run)."""
    if kind in DIFFUSION_SAMPLERS:
        return steps
    if kind == "ode":
        return {"euler": steps, "heun": 2 * steps}.get(method)
    em_steps = max(steps, 1) - 1
    return em_steps * (1 if method == "euler" else 2) + (0 if last_step == "none" else 1)


@dataclass(frozen=True)
class SamplingSection(Section):
    """The sampler and its settings; the model's objective (flow or diffusion) picks the default sampler and
    whether it has a null class the default guidance. Faces with other defaults subclass it and say why."""

    DIFFUSION_DEFAULT = "ddpm"  # the official sample.py's sampler
    GUIDANCE_DEFAULT = DEFAULT_GUIDANCE

    sampler: str | None = option(
        None,
        "diffusion models: ddpm (ancestral; their default) or ddim (eta 0); flow models: ode (their default) or sde",
        choices=SAMPLERS,
    )
    sampling_method: str | None = option(
        None,
        "flow models: ode euler, heun (the default) or dopri5 (adaptive, torchdiffeq); sde euler (the default) or heun",
        choices=tuple(dict.fromkeys(ODE_METHODS + SDE_METHODS)),
    )
    num_sampling_steps: int = option(
        250, "diffusion: respaced steps (official rounding); flow: grid steps (Heun: 2 evaluations each)", ge=1
    )
    guidance_scale: float | None = option(
        None, GUIDANCE_HELP + f"; default {DEFAULT_GUIDANCE:g} for a model with a null class, else 1",
        aliases=("--cfg-scale",), ge=1,
    )  # fmt: skip
    guidance_channels: str = option("3", CHANNELS_HELP, choices=("3", "all"), aliases=("--cfg-channels",))
    diffusion_form: str = option(
        "sigma", "flow sde: the diffusion coefficient w(t) (SiT's choices)", choices=DIFFUSION_FORMS
    )
    last_step: str = option("mean", "flow sde: the last deterministic step (SiT's, h = 0.04)", choices=LAST_STEPS)
    sample_eps: float | None = option(
        None, "flow: keep the sampler's time grid this far from the ends (default: the run's, else SiT's)", ge=0, lt=0.5
    )  # fmt: skip
    atol: float = option(1e-6, "flow ode dopri5: absolute tolerance (SiT's default)", gt=0)
    rtol: float = option(1e-3, "flow ode dopri5: relative tolerance (SiT's default)", gt=0)

    def check(self) -> None:
        if self.sampler in DIFFUSION_SAMPLERS and self.sampling_method is not None:
            raise FieldError(
                f"{{sampling_method}} is for flow models' ode and sde samplers, not {{sampler}} {self.sampler}."
            )
        if self.sampler is not None and self.sampling_method is not None:
            methods = ODE_METHODS if self.sampler == "ode" else SDE_METHODS
            if self.sampling_method not in methods:
                raise FieldError(
                    f"{{sampling_method}} for {{sampler}} {self.sampler} must be one of {', '.join(methods)}, got "
                    f"{self.sampling_method!r}."
                )

    def kind(self, flow: bool) -> str:
        """The sampler for a flow (True) or diffusion model; one of the other family's is refused."""
        kind = self.sampler or ("ode" if flow else self.DIFFUSION_DEFAULT)
        allowed = FLOW_SAMPLERS if flow else DIFFUSION_SAMPLERS
        if kind not in allowed:
            raise FieldError(
                f"{{sampler}} {kind} does not sample a {'flow-matching' if flow else 'diffusion'} model: use "
                f"{' or '.join(allowed)}."
            )
        return kind

    def method(self, flow: bool) -> str | None:
        kind = self.kind(flow)
        return self.sampling_method or DEFAULT_METHODS.get(kind)

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
