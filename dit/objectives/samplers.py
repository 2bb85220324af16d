"""Which network evaluations a sampler makes, at which times, and which of them are guided: before it runs.
No torch: ``dit-cost sample`` plans with it, and the engine's samplers run the same plan, so the planned and
the reported counts are equal by construction.

Times (of a plan and of ``--guidance-interval LO HI``, closed): diffusion t / T (T = 1000, the original timestep;
1 is noise, 0 is data); flow SiT's t in [0, 1] (0 is noise, 1 is data). An evaluation is guided (two passes)
iff the scale is above 1 and its own time lies in the interval (Kynkaenniemi et al. 2024).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dit.io.config import FieldError
from dit.io.errors import UserError
from dit.objectives.integrators import ODE_INTEGRATORS
from dit.objectives.respacing import DIFFUSION_STEPS, diffusion_timesteps, flow_grid

# The sampler registry: the --sampler choices; each objective (dit.objectives) names its own from here.
DIFFUSION_SAMPLERS = ("ddpm", "ddim")  # the diffusion's own loops (the reference)
# diffusers' schedulers: sampler name -> (diffusers class, its settings beyond the schedule)
SCHEDULERS = {
    "dpmpp-2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp-2m-sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "unipc": ("UniPCMultistepScheduler", {"solver_order": 2}),
    "deis": ("DEISMultistepScheduler", {"solver_order": 2}),
    "euler": ("EulerDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
}
SCHEDULER_SAMPLERS = tuple(SCHEDULERS)
FLOW_SAMPLERS = ("ode", "sde")
SAMPLERS = DIFFUSION_SAMPLERS + SCHEDULER_SAMPLERS + FLOW_SAMPLERS
SDE_METHODS = ("euler", "heun")
DEFAULT_METHODS = {"ode": "heun", "sde": "euler"}
LAST_STEPS = ("mean", "tweedie", "euler", "none")
DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")  # SiT's w(t)


def check_guidance_interval(interval: Sequence[float] | None) -> tuple[float, float] | None:
    """The one rule of a guidance interval (``SamplingSection.check``; a study's own interval flag): two times
    with 0 <= LO <= HI <= 1, or None (guide every evaluation). Names the field as ``{guidance_interval}``."""
    if interval is None:
        return None
    values = [float(v) for v in interval]
    if len(values) != 2 or not all(math.isfinite(v) for v in values) or not 0 <= values[0] <= values[1] <= 1:
        raise FieldError(
            "{guidance_interval} takes two times LO HI with 0 <= LO <= HI <= 1 (t/1000 for diffusion, 1 = noise; "
            f"flow t, 1 = data), got {' '.join(map(str, interval))}."
        )
    return values[0], values[1]


def guided_at(time: float, guidance_scale: float, interval: tuple[float, float] | None) -> bool:
    """Whether an evaluation at ``time`` (the plan's units) runs guided."""
    return guidance_scale > 1 and (interval is None or interval[0] <= time <= interval[1])


@dataclass(frozen=True)
class SamplingPlan:
    """The evaluations of one sampler run, in the order it makes them (``times`` None: adaptive, dopri5)."""

    sampler: str  # what the cost line names: "ddpm", "dpmpp-2m", "ode heun", ...
    steps: int
    times: tuple[float, ...] | None
    guided: tuple[bool, ...] | None
    grid: tuple[float, ...] | None = None  # flow samplers: the time grid they step on

    @property
    def nfe(self) -> int | None:
        return None if self.times is None else len(self.times)

    @property
    def guided_nfe(self) -> int | None:
        return None if self.guided is None else sum(self.guided)

    @property
    def unguided_nfe(self) -> int | None:
        return None if self.guided is None else len(self.guided) - sum(self.guided)

    @property
    def forward_passes(self) -> int | None:
        """Forward passes per image: 2 per guided evaluation, 1 per unguided one."""
        return None if self.guided is None else 2 * self.guided_nfe + self.unguided_nfe


def _flow_times(kind: str, method: str, grid: list[float], last_step: str) -> list[float] | None:
    if kind == "ode":
        integrator = ODE_INTEGRATORS[method]
        if integrator.adaptive:
            return None
        return [t for i in range(len(grid) - 1) for t in integrator.times(*grid[i : i + 2])]
    per_step = 2 if method == "heun" else 1
    times = [t for i in range(len(grid) - 1) for t in (grid[i], grid[i + 1])[:per_step]]
    return times + ([] if last_step == "none" else [grid[-1]])


def check_method(sampler: str | None, method: str | None, last_step: str = "mean") -> None:
    """The one check of a sampler's method and last step against the sampler (its name's, not the objective's:
    ``Objective.check_options``); names fields as ``{field}`` (a face spells them as flags)."""
    if sampler is not None and sampler not in FLOW_SAMPLERS and method is not None:
        raise FieldError(
            f"{{sampling_method}} is for flow models' ode and sde samplers, not {{sampler}} {sampler}."
        )
    methods = {"sde": SDE_METHODS}.get(sampler, tuple(ODE_INTEGRATORS))
    if method is not None and method not in methods:
        raise FieldError(
            f"{{sampling_method}} for {{sampler}} {sampler} must be one of {', '.join(methods)}, got {method!r}."
        )
    if last_step not in LAST_STEPS:
        raise FieldError(f"{{last_step}} must be one of {', '.join(LAST_STEPS)}, got {last_step!r}.")


def split_sampler(spec: str) -> tuple[str, str | None]:
    """A sweep's sampler name split: 'ode-heun' -> ('ode', 'heun'); 'dpmpp-2m' -> ('dpmpp-2m', None)."""
    kind, _, method = spec.partition("-")
    return (kind, method) if kind in FLOW_SAMPLERS and method else (spec, None)


def settings_record(kind: str, method: str | None, diffusion_form: str, last_step: str, atol: float, rtol: float):
    """The settings of sampler ``kind`` a sample set's manifest keeps (None: they do not apply to it)."""
    adaptive = kind == "ode" and ODE_INTEGRATORS[method].adaptive
    return {
        "sde": [diffusion_form, last_step] if kind == "sde" else None,
        "tolerances": [atol, rtol] if adaptive else None,
    }


def sampling_plan(
    sampler: str,
    num_steps: int,
    *,
    method: str | None = None,
    last_step: str = "mean",
    guidance_scale: float = 1.0,
    interval: Sequence[float] | None = None,
    flow_interval: tuple[float, float] = (0.0, 1.0),
    diffusion_steps: int = DIFFUSION_STEPS,
    time_shift: float = 1.0,
) -> SamplingPlan:
    """The plan of ``sampler`` with ``num_steps`` steps: diffusion, one evaluation per respaced step (diffusers'
    Heun: 2N - 1); flow, ``flow_grid`` over the transport's ``flow_interval``. ``time_shift`` is a number ("auto"
    resolved). The sampling section checks ``sampler``, ``num_steps`` and ``interval``; here, the samplers' own."""
    try:
        check_method(sampler, method, last_step)
    except FieldError as e:
        raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
    if sampler in FLOW_SAMPLERS:
        method = method or DEFAULT_METHODS[sampler]
        grid = flow_grid(sampler, num_steps, *flow_interval, last_step, time_shift)
        times = _flow_times(sampler, method, grid, last_step)
        if times is not None and not times:
            raise UserError(
                f"--num-sampling-steps {num_steps} with --last-step none makes no network evaluation: pass 2 or more."
            )
        name, grid = f"{sampler} {method}", tuple(grid)
    else:
        if num_steps < 2:
            raise UserError(
                f"--sampler {sampler} needs --num-sampling-steps 2 or more: a one-step respacing has no posterior "
                "(the official diffusion's variances need two steps)."
            )
        if num_steps > diffusion_steps:
            raise UserError(f"--num-sampling-steps {num_steps} exceeds the diffusion's {diffusion_steps} steps.")
        steps = diffusion_timesteps(num_steps, diffusion_steps, time_shift)
        if sampler == "heun":  # diffusers' Heun: Euler to the next level, then its correction there
            steps = steps[:1] + [t for t in steps[1:] for _ in range(2)]
        times, name, grid = [t / diffusion_steps for t in steps], sampler, None
    guided = None if times is None else tuple(guided_at(t, guidance_scale, interval) for t in times)
    return SamplingPlan(name, num_steps, None if times is None else tuple(times), guided, grid)
