"""The flow ODE integrators, one entry each (its step and the evaluations it makes): ``ode_sample`` runs the step
and the sampling plan reads ``times``, so a new integrator is one line of ``ODE_INTEGRATORS``. No torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    """Adams-Bashforth of order k: one evaluation a step, the earlier velocities reused (as DEIS's and iPNDM's);
    the first k - 1 steps bootstrap with the lower orders, which bounds the global order at 2."""

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
