"""Gaussian diffusion for DiT: ``create_diffusion`` (``create.py``) takes the official arguments."""

from dit.objectives.gaussian.create import create_diffusion
from dit.objectives.gaussian.gaussian_diffusion import (
    LOSS_WEIGHTINGS,
    TIMESTEP_SAMPLINGS,
    GaussianDiffusion,
    LossType,
    ModelMeanType,
    ModelVarType,
    get_named_beta_schedule,
)
from dit.objectives.gaussian.respace import SpacedDiffusion, space_timesteps

__all__ = [
    "LOSS_WEIGHTINGS",
    "TIMESTEP_SAMPLINGS",
    "GaussianDiffusion",
    "LossType",
    "ModelMeanType",
    "ModelVarType",
    "SpacedDiffusion",
    "create_diffusion",
    "get_named_beta_schedule",
    "space_timesteps",
]
