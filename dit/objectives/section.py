"""The objective's section: DiT's Gaussian diffusion or SiT's flow matching, and their options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dit.io.config import FieldError, Section, option
from dit.objectives import OBJECTIVES, Objective, from_record
from dit.objectives.gaussian.gaussian_diffusion import LOSS_WEIGHTINGS
from dit.objectives.sampling_section import TIME_SHIFT_HELP
from dit.objectives.times import latent_dim
from dit.objectives.transport.path import PATHS
from dit.objectives.transport.transport import LOSS_WEIGHTS, PREDICTIONS, TIME_SAMPLING

# One flag for the loss weight of either objective; which values apply depends on it.
DIFFUSION_LOSS_WEIGHTS = LOSS_WEIGHTINGS  # none, min-snr (Min-SNR-gamma on the MSE term)
FLOW_LOSS_WEIGHTS = LOSS_WEIGHTS  # none, velocity, likelihood (SiT's, for score and noise predictions)


@dataclass(frozen=True)
class ObjectiveSection(Section):
    """DiT's diffusion (noise schedule, target) or SiT's flow matching (path, prediction, weight, times)."""

    objective: str = option(
        "diffusion", "diffusion (DiT) or flow (SiT's flow matching)", choices=tuple(OBJECTIVES)
    )
    noise_schedule: str = option("linear", "diffusion: beta schedule", choices=("linear", "squaredcos_cap_v2"))
    predict_xstart: bool = option(False, "diffusion: predict x0 instead of the noise")
    path_type: str = option("linear", "flow: the interpolant", choices=PATHS)
    prediction: str = option("velocity", "flow: what the model predicts", choices=PREDICTIONS)
    loss_weight: str = option(
        "none",
        "the loss weight: diffusion none or min-snr (Min-SNR-gamma on the MSE term, the VB term unweighted); "
        "flow (score or noise predictions) none, velocity or likelihood",
        choices=tuple(dict.fromkeys(DIFFUSION_LOSS_WEIGHTS + FLOW_LOSS_WEIGHTS)),
    )
    min_snr_gamma: float = option(5.0, "diffusion, --loss-weight min-snr: gamma in min(SNR, gamma)", gt=0)
    time_sampling: str = option(
        "uniform",
        "training times: uniform (DiT, SiT) or logit-normal (SD3; diffusion takes step floor((1 - u) T), u the "
        "flow time with 1 = data)",
        choices=TIME_SAMPLING,
    )
    logit_mean: float = option(
        0.0, "logit-normal times: the mean m of sigmoid(N(m, s)) (above 0: nearer the data)"
    )
    logit_std: float = option(1.0, "logit-normal times: the spread s", gt=0)
    train_eps: float | None = option(
        None, "flow: times kept off the ends in training (default: SiT's for the path)", ge=0, lt=0.5
    )
    sample_eps: float | None = option(
        None, "flow: times kept off the ends in sampling (default: SiT's)", ge=0, lt=0.5
    )
    time_shift: float | str = option(
        1.0, TIME_SHIFT_HELP + ", and the training times (shifted before diffusion's floor to a step); the "
        "samplers take it unless told otherwise", choices=("auto",), gt=0,
    )  # fmt: skip
    cos_loss_weight: float = option(
        0.0, "LightningDiT's velocity-direction loss: w (1 - cos) of the predicted velocity (implied, for noise, "
        "score and x0 predictions) and the true one, beside the MSE (0: off)", ge=0,
    )  # fmt: skip

    RECIPE = ("time_shift", "cos_loss_weight")  # what a resume may change when --allow-changes names it

    @classmethod
    def identity(cls) -> tuple[str, ...]:
        """The fields a resumed run must keep: every one but the sampler's and the recipe's."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("sample_eps", *cls.RECIPE))

    @property
    def implementation(self) -> type[Objective]:
        """The objective's class: what it samples with and whether the model may learn a variance."""
        return OBJECTIVES[self.objective]

    def check(self) -> None:
        if self.objective != "diffusion" and self.predict_xstart:
            raise FieldError(
                "{predict_xstart} is for the diffusion objective; a flow model predicts {prediction}."
            )
        at_noise = self.objective == "flow" and self.prediction != "velocity" and self.path_type != "vp"
        if self.cos_loss_weight and at_noise and self.train_eps == 0:
            raise FieldError(
                f"{{cos_loss_weight}} needs the velocity a {self.prediction} model implies, which is infinite at "
                "t = 0 (pure noise) on this path: keep {train_eps} above 0 (SiT's 1e-3 by default), or predict "
                "velocity."
            )

    def build(self, model_cfg) -> Objective:
        """The objective for the model of ``model_cfg`` (its variance, and latent size for ``auto`` shift)."""
        return from_record(self.__dict__, model_cfg.learn_sigma, latent_dim(model_cfg))
