"""The times a sampler steps on: ADM's respacing of the diffusion's timesteps (with the timestep shift) and
the flow samplers' time grids. No torch here: the sampling plan and the samplers read the same grids."""

from __future__ import annotations

from dit.io.errors import UserError
from dit.objectives.times import shift_time

LAST_STEP_SIZE = 0.04  # SiT's last SDE step: from 1 - 0.04 to 1
DIFFUSION_STEPS = 1000  # T: the training timesteps every DiT diffusion has


def space_timesteps(num_timesteps: int, section_counts) -> set[int]:
    """The timesteps to keep (ADM's respacing): "ddimN" an exact stride ("ddim50": 0, 20, ..., 980), or counts per
    equal section ("250": 0, 4, ..., 995, 999, each section's ends kept)."""
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
    """A respacing's timesteps shifted as the flow's time; the ends stay, and collisions are refused."""
    kept = sorted(kept, reverse=True)
    if time_shift == 1:
        return kept
    last = diffusion_steps - 1
    moved = [round(last * (1 - shift_time(1 - i / last, time_shift))) for i in kept]
    if len(set(moved)) < len(moved):
        raise UserError(
            f"--time-shift {time_shift:g} puts two of the {len(kept)} respaced steps on one timestep (of "
            f"{diffusion_steps}): pass fewer --num-sampling-steps, or a shift nearer 1."
        )
    return moved


def diffusion_timesteps(
    num_steps: int, diffusion_steps: int = DIFFUSION_STEPS, time_shift: float = 1.0
) -> list[int]:
    """The original timesteps a ``num_steps``-step respaced sampler visits, noise first (999, ..., 0)."""
    return shift_timesteps(space_timesteps(diffusion_steps, str(num_steps)), time_shift, diffusion_steps)


def flow_grid(kind: str, steps: int, t0: float, t1: float, last_step: str = "mean", time_shift: float = 1.0):
    """A fixed-step flow sampler's grid on [t0, t1]: ODE, ``steps`` intervals; SDE (as SiT), ``steps`` points to
    1 - 0.04, then a last step to t = 1 (none: to t1); ``time_shift`` moves the inner points."""
    if kind == "ode":
        points, end = steps + 1, t1
    else:
        points, end = steps, (t1 if last_step == "none" else 1 - LAST_STEP_SIZE)
    if points == 1:
        return [t0]
    if time_shift != 1:
        return [t0 + (end - t0) * shift_time(i / (points - 1), time_shift) for i in range(points - 1)] + [end]
    return [t0 + (end - t0) * i / (points - 1) for i in range(points - 1)] + [end]
