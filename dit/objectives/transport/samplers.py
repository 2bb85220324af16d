"""ODE and SDE samplers for flow-matching models on ``flow_grid``'s grids, counting the network evaluations they
make: ``ODE_INTEGRATORS``, and SiT's Euler-Maruyama and Heun with one call each (docs/flow_matching.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dit.objectives.integrators import ODE_INTEGRATORS
from dit.objectives.transport.path import _expand
from dit.objectives.transport.transport import Transport


class FlowField:
    """(velocity, score) at (x, t) from one network call; ``nfe`` counts the calls."""

    def __init__(self, transport: Transport, model_fn: Callable, model_kwargs: dict):
        self.transport, self.path, self.model_fn, self.kwargs = transport, transport.path, model_fn, model_kwargs
        self.nfe = 0

    def __call__(self, x: torch.Tensor, t: float, score: bool = False):
        tt = torch.full((len(x),), float(t), device=x.device)
        out = self.model_fn(x, tt, **self.kwargs)[:, : x.shape[1]]
        self.nfe += 1
        v = self.path.velocity(x, tt, self.transport.prediction, out)
        return (v, self.path.score(x, tt, self.transport.prediction, out)) if score else v


def ode_sample(
    field: FlowField, x: torch.Tensor, grid: Sequence[float], method: str = "heun", *, atol=1e-6, rtol=1e-3,
    progress=None,
):  # fmt: skip
    """Integrate over the grid with ``ODE_INTEGRATORS[method]``, or (adaptive) between its two ends."""
    integrator = ODE_INTEGRATORS[method]
    if integrator.adaptive:
        from dit.io.errors import require

        odeint = require("torchdiffeq", "flow", f"the adaptive {method} sampler").odeint
        ts = torch.tensor([grid[0], grid[-1]], dtype=torch.float64, device=x.device)
        return odeint(lambda t, y: field(y, float(t)), x, ts, method=integrator.method, atol=atol, rtol=rtol)[-1]
    history = []  # a multistep method's earlier velocities
    for i in range(len(grid) - 1):
        x = integrator.step(field, x, grid[i], grid[i + 1], history)
        if progress is not None:
            progress.update(1)
    return x


def diffusion_coefficient(transport: Transport, form: str, t: float, norm: float = 1.0) -> float:
    """w(t) of the SDE dx = (v + w s) dt + sqrt(2 w) dW (SiT's ``compute_diffusion``)."""
    tt = torch.tensor([t], dtype=torch.float64)
    if form == "constant":
        return norm
    if form == "SBDM":
        return norm * float(transport.path.drift_var(tt))
    if form == "sigma":
        return norm * float(transport.path.alpha_sigma(tt)[2])
    if form == "linear":
        return norm * (1 - t)
    if form == "decreasing":
        return 0.25 * (norm * math.cos(math.pi * t) + 1) ** 2
    return norm * math.sin(math.pi * t) ** 2  # increasing-decreasing


def sde_sample(
    field: FlowField,
    x: torch.Tensor,
    grid: Sequence[float],
    noise: Callable[[torch.Tensor], torch.Tensor],
    *,
    method: str = "euler",
    form: str = "sigma",
    norm: float = 1.0,
    last_step: str = "mean",
    progress=None,
):
    """Euler-Maruyama (or Heun) steps over the grid, then the last deterministic step to t = 1."""

    def drift(y, t):
        v, s = field(y, t, score=True)
        return v + diffusion_coefficient(field.transport, form, t, norm) * s

    for i in range(len(grid) - 1):
        t, dt = grid[i], grid[i + 1] - grid[i]
        w = diffusion_coefficient(field.transport, form, t, norm)
        z = noise(x)
        if method == "euler":
            x = x + drift(x, t) * dt + math.sqrt(2 * w * dt) * z
        else:  # SiT's Heun: the noise first, then a Heun step on the drift
            x = x + math.sqrt(2 * w * dt) * z
            k1 = drift(x, t)
            k2 = drift(x + dt * k1, grid[i + 1])
            x = x + 0.5 * dt * (k1 + k2)
        if progress is not None:
            progress.update(1)
    t, h = grid[-1], 1 - grid[-1]
    if last_step == "none":
        return x
    if last_step == "euler":
        return x + h * field(x, t)
    if last_step == "mean":
        return x + h * drift(x, t)
    alpha, _, sigma, _ = (_expand(c, x) for c in field.path.alpha_sigma(torch.full((len(x),), t, device=x.device)))
    _, s = field(x, t, score=True)
    return x / alpha + sigma**2 / alpha * s  # Tweedie: E[x1 | x_t]
