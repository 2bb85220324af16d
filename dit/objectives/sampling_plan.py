"""Which network evaluations a sampler makes, at which times, and which of them are guided: before it runs.

No torch here: ``dit-cost sample`` plans with it in a fraction of a second, and the engine's samplers run
the same plan (the diffusion's respacing, the flow's time grid, the guided flags), so the planned count and
the count a run reports are equal by construction (tests/test_schedulers.py counts the passes).

Time units of a plan (and of ``--guidance-interval LO HI``, a closed interval):

- diffusion samplers (ours and diffusers' schedulers): t / T, where t is the original integer timestep the
  model sees (T = 1000 training steps; t = 999 is the noise end, 0 the data end), so 1 is noise, 0 is data;
- flow samplers: SiT's t in [0, 1], where 0 is noise and 1 is data (dit/objectives/transport's convention).

A guided evaluation runs the [conditional; unconditional] batch (two forward passes per image); an
unguided one the conditional rows alone (one pass). Each evaluation is guided iff the guidance scale is
above 1 and its own time lies in the interval (Kynkaenniemi et al. 2024, "Applying guidance in a limited
interval"), so both evaluations of a Heun step are judged apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.objectives.times import shift_time

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
LAST_STEP_SIZE = 0.04  # SiT's last SDE step: from 1 - 0.04 to 1
DIFFUSION_STEPS = 1000  # T: the training timesteps every DiT diffusion has


# ---- flow ODE integrators: one entry each, its step and the evaluations the step makes ----------------------
# ``ode_sample`` (dit/objectives/transport/samplers.py) runs ``step`` between grid points; the plan takes ``times`` from
# the same entry, so a new integrator is one line of ``ODE_INTEGRATORS`` (plain arithmetic: no torch here).


@dataclass(frozen=True)
class RungeKutta:
    """An explicit Runge-Kutta method by its Butcher tableau: stage i evaluates at t + c_i h, at x + h sum_j
    a_ij k_j; the step is x + h sum_i b_i k_i. One evaluation per stage."""

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    adaptive = False

    def times(self, t: float, t_next: float) -> list[float]:
        return [(1 - c) * t + c * t_next for c in self.c]  # c = 1 is t_next exactly

    def step(self, field, x, t: float, t_next: float, history: list):
        h, k = t_next - t, []
        for time, a in zip(self.times(t, t_next), self.a):
            k.append(field(x + h * sum(w * kj for w, kj in zip(a, k)) if a else x, time))
        return x + h * sum(b * kj for b, kj in zip(self.b, k))


# Adams-Bashforth weights on a uniform grid, newest velocity first: x' = x + h sum_j w_j v_{n-j}.
AB_WEIGHTS = {
    1: (1.0,),
    2: (3 / 2, -1 / 2),
    3: (23 / 12, -16 / 12, 5 / 12),
    4: (55 / 24, -59 / 24, 37 / 24, -9 / 24),
}


def adams_bashforth_step(x, h: float, velocities: Sequence):
    """One Adams-Bashforth step of order ``len(velocities)`` (newest first) on a uniform grid of step h."""
    return x + h * sum(w * v for w, v in zip(AB_WEIGHTS[len(velocities)], velocities))


@dataclass(frozen=True)
class AdamsBashforth:
    """Adams-Bashforth of order k: 1 evaluation a step, at its start, the earlier steps' velocities reused
    (training-free, as DEIS's and iPNDM's multistep samplers). The first k - 1 steps bootstrap with the lower
    orders (no start-up evaluations); their O(h^2) local error bounds the global order at 2 for k >= 2, the
    higher orders lower the error constant."""

    order: int
    adaptive = False

    def times(self, t: float, t_next: float) -> list[float]:
        return [t]

    def step(self, field, x, t: float, t_next: float, history: list):
        history.insert(0, field(x, t))
        del history[self.order :]
        return adams_bashforth_step(x, t_next - t, history)


@dataclass(frozen=True)
class Adaptive:
    """torchdiffeq's adaptive ``method`` between the grid's ends: its evaluations are known after the run only."""

    method: str
    adaptive = True


ODE_INTEGRATORS = {
    "euler": RungeKutta(c=(0.0,), a=((),), b=(1.0,)),
    "heun": RungeKutta(c=(0.0, 1.0), a=((), (1.0,)), b=(0.5, 0.5)),  # the trapezoid, torchdiffeq's heun2
    "ab2": AdamsBashforth(2),
    "ab3": AdamsBashforth(3),
    "ab4": AdamsBashforth(4),
    "dopri5": Adaptive("dopri5"),  # SiT's default (atol 1e-6, rtol 1e-3)
}
ODE_METHODS = tuple(ODE_INTEGRATORS)


def space_timesteps(num_timesteps: int, section_counts) -> set[int]:
    """The timesteps to keep (ADM's respacing).

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


def shift_timesteps(kept, time_shift: float, diffusion_steps: int = DIFFUSION_STEPS) -> list[int]:
    """A respacing's timesteps moved by the shift: i -> round((T - 1) tau'), tau = i / (T - 1) the noise fraction
    shifted as the flow's time (``shift_time`` on 1 - tau), so the ends 0 and T - 1 stay; two steps landing on
    one timestep are refused."""
    kept = sorted(kept, reverse=True)
    if time_shift == 1:
        return kept
    last = diffusion_steps - 1
    moved = [round(last * (1 - shift_time(1 - i / last, time_shift))) for i in kept]
    if len(set(moved)) < len(moved):
        raise UserError(
            f"--time-shift {time_shift:g} puts two of the {len(kept)} respaced steps on one of the {diffusion_steps} "
            "timesteps: pass fewer --num-sampling-steps, or a shift nearer 1."
        )
    return moved


def diffusion_timesteps(
    num_steps: int, diffusion_steps: int = DIFFUSION_STEPS, time_shift: float = 1.0
) -> list[int]:
    """The original timesteps a ``num_steps``-step respaced sampler visits, noise first (999, ..., 0)."""
    return shift_timesteps(space_timesteps(diffusion_steps, str(num_steps)), time_shift, diffusion_steps)


def flow_grid(kind: str, steps: int, t0: float, t1: float, last_step: str = "mean", time_shift: float = 1.0):
    """The time grid of a fixed-step flow sampler on [t0, t1].

    ODE: ``steps`` intervals from t0 to t1. SDE (as SiT): ``steps`` points, the Euler-Maruyama steps between
    them; with a last step the grid ends at 1 - 0.04 and the last step runs from there to t = 1 (SiT's), with
    ``--last-step none`` it ends at t1 itself. A ``time_shift`` moves the points inside the grid's ends
    (each fraction of the way shifted by ``shift_time``); the ends stay.
    """
    if kind == "ode":
        points, end = steps + 1, t1
    else:
        points, end = steps, (t1 if last_step == "none" else 1 - LAST_STEP_SIZE)
    if points == 1:
        return [t0]
    if time_shift != 1:
        return [t0 + (end - t0) * shift_time(i / (points - 1), time_shift) for i in range(points - 1)] + [end]
    return [t0 + (end - t0) * i / (points - 1) for i in range(points - 1)] + [end]


def check_guidance_interval(interval: Sequence[float] | None) -> tuple[float, float] | None:
    """``--guidance-interval LO HI``: two times with 0 <= LO <= HI <= 1, or None (guide every evaluation)."""
    if interval is None:
        return None
    values = [float(v) for v in interval]
    if len(values) != 2 or not all(math.isfinite(v) for v in values) or not 0 <= values[0] <= values[1] <= 1:
        raise UserError(
            f"--guidance-interval takes two times LO HI with 0 <= LO <= HI <= 1 (t/1000 for diffusion, 1 = noise; "
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
        return (
            None
            if integrator.adaptive
            else [t for i in range(len(grid) - 1) for t in integrator.times(*grid[i : i + 2])]
        )
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
    """A sampler with its method as one name, for sweeps: 'ode-heun' -> ('ode', 'heun'); 'dpmpp-2m' -> ('dpmpp-2m',
    None): only the flow samplers take a method."""
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
    """The plan of ``sampler`` with ``num_steps`` steps (``--num-sampling-steps``).

    Diffusion samplers: one evaluation per respaced step (``num_steps`` >= 2; diffusers' Heun: 2 per step but
    the last, 2N - 1). Flow samplers: see ``flow_grid``; ``flow_interval`` is the transport's sampling
    interval [t0, t1] (SiT's velocity models: [0, 1]). ``method`` is the flow integrator. ``time_shift`` (a
    number: "auto" resolved) moves the flow's grid (``flow_grid``) or the diffusion's kept timesteps
    (``shift_timesteps``).
    """
    if sampler not in SAMPLERS:
        raise UserError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}.")
    if num_steps < 1:
        raise UserError(f"--num-sampling-steps must be >= 1, got {num_steps}.")
    interval = check_guidance_interval(interval)
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
                f"--num-sampling-steps must be >= 2 for --sampler {sampler}: a one-step respacing has no posterior "
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


# ---- the sampling section: how every face that samples (or plans sampling) says it -------------------------

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
    """The sampler and its settings (sample.py, scripts/sample_ddp.py, train.py's ``--eval-*`` flags,
    ``dit-cost sample``). The model decides what the section leaves open: its objective the default sampler
    (``Objective.sampler``), whether it has a null class the default guidance (``guidance``). Faces with other defaults
    subclass it and say why."""

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
        interval = self.guidance_interval
        if interval is not None and (len(interval) != 2 or interval[0] > interval[1]):
            raise FieldError(
                "{guidance_interval} takes two times LO HI with 0 <= LO <= HI <= 1 (t/1000 for diffusion, 1 = "
                f"noise; flow t, 1 = data), got {' '.join(map(str, interval))}."
            )

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
