"""Flow matching on the DiT backbone: SiT's objective. The model sees the raw time t in [0, 1] (1 = data) and
predicts the velocity (the default), the score or the noise; per-sample losses, the mean over the latent:

  velocity: |v - u_t|^2                          (SiT never weights it)
  noise:    w |eps_hat - x0|^2                    score: w |sigma_t s_hat + x0|^2
  w = 1 (none), (d_t / sigma_t)^2 (velocity: the velocity loss in disguise), d_t / sigma_t^2 (likelihood)

Training times, their shift and the cosine term: docs/flow_matching.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dit.objectives.terms import velocity_direction
from dit.objectives.times import logit_normal, shift_time
from dit.objectives.transport.path import PATHS, Path, _expand

PREDICTIONS = ("velocity", "score", "noise")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
TIME_SAMPLING = ("uniform", "logit-normal")


def default_eps(path: str, prediction: str) -> tuple[float, float]:
    """SiT's (train_eps, sample_eps): velocity on linear/GVP 0 and 0, VP 1e-5 and 1e-3, else 1e-3 and 1e-3."""
    if path == "vp":
        return 1e-5, 1e-3
    if prediction == "velocity":
        return 0.0, 0.0
    return 1e-3, 1e-3


@dataclass(frozen=True)
class Transport:
    path_type: str = "linear"
    prediction: str = "velocity"
    loss_weight: str = "none"
    time_sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    train_eps: float | None = None  # None: SiT's default for the path and prediction
    sample_eps: float | None = None
    time_shift: float = 1.0  # SD3's a (resolved: "auto" is the section's), on the draw and the sampler's grid
    cos_loss_weight: float = 0.0  # LightningDiT's velocity-direction term beside the MSE

    def __post_init__(self):
        for value, allowed in ((self.path_type, PATHS), (self.prediction, PREDICTIONS),
                               (self.loss_weight, LOSS_WEIGHTS), (self.time_sampling, TIME_SAMPLING)):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {allowed}")

    @classmethod
    def from_record(cls, record: dict) -> Transport:
        """From a run's options (a TrainConfig's fields, or a checkpoint's record of them): the same names."""
        return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})

    @property
    def path(self) -> Path:
        return Path(self.path_type)

    def eps(self) -> tuple[float, float]:
        train, sample = default_eps(self.path_type, self.prediction)
        return (self.train_eps if self.train_eps is not None else train,
                self.sample_eps if self.sample_eps is not None else sample)  # fmt: skip

    def interval(self, training: bool) -> tuple[float, float]:
        """[t0, t1] of training times or the sampler's grid (SiT's ``check_interval``); VP starts at 0."""
        eps = self.eps()[0 if training else 1]
        return (0.0 if self.path_type == "vp" else eps), 1 - eps

    def sample_t(self, n: int, generator: torch.Generator, device) -> torch.Tensor:
        t0, t1 = self.interval(training=True)
        if self.time_sampling == "uniform":
            u = torch.rand(n, generator=generator, device=device)
        else:
            u = logit_normal(n, self.logit_mean, self.logit_std, generator, device)
        if self.time_shift != 1:
            u = shift_time(u, self.time_shift)
        return t0 + (t1 - t0) * u

    def training_losses(self, model, x1: torch.Tensor, t: torch.Tensor, model_kwargs=None, noise=None) -> dict:
        """{"loss": (N,)} for data x1 at times t with noise x0 (drawn here unless given), as SiT computes it."""
        x0 = torch.randn_like(x1) if noise is None else noise
        path = self.path
        xt, ut = path.interpolate(t, x0, x1)
        out = model(xt, t, **(model_kwargs or {}))[:, : x1.shape[1]]
        terms = self._mse(path, t, out, x0, x1, ut)
        if self.cos_loss_weight:
            terms["cos"] = velocity_direction(path.velocity(xt, t, self.prediction, out), ut)
            terms["loss"] = terms["loss"] + self.cos_loss_weight * terms["cos"]
        return terms

    def _mse(self, path: Path, t, out, x0, x1, ut) -> dict:
        """{"loss": (N,)}: SiT's MSE of the prediction, weighted for score and noise predictions."""
        if self.prediction == "velocity":
            return {"loss": ((out - ut) ** 2).mean(dim=tuple(range(1, x1.dim())))}
        _, _, sigma, _ = path.alpha_sigma(t)
        d = path.drift_var(t)
        weights = {"none": torch.ones_like(t), "velocity": (d / sigma) ** 2, "likelihood": d / sigma**2}
        err = out - x0 if self.prediction == "noise" else _expand(sigma, x1) * out + x0
        return {"loss": weights[self.loss_weight] * (err**2).mean(dim=tuple(range(1, x1.dim())))}
