"""Flow matching beside the Gaussian diffusion: SiT's interpolants, targets, losses and ODE/SDE samplers on
the same DiT (``learn_sigma`` off). ``Transport`` is the objective; ``samplers`` integrate it."""

from dit.objectives.transport.path import PATHS, Path
from dit.objectives.transport.transport import LOSS_WEIGHTS, PREDICTIONS, TIME_SAMPLING, Transport

__all__ = ["LOSS_WEIGHTS", "PATHS", "PREDICTIONS", "TIME_SAMPLING", "Path", "Transport"]
