"""Gaussian diffusion with the semantics DiT inherits from IDDPM/ADM.

Schedules are float64 numpy arrays under the official names, also kept as tensors on each device that uses
them (uploaded once: a step makes no host-to-device copies), cast to float32 after indexing as the original
does. The training options beyond the original (Min-SNR, logit-normal timesteps, the timestep shift, the
velocity-direction term) are off by default: docs/recipes.md, "Timestep options".
"""

from __future__ import annotations

import enum
import math
from collections import deque

import numpy as np
import torch

from dit.io.progress import progress as progress_bar
from dit.objectives.gaussian.diffusion_utils import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from dit.objectives.terms import velocity_direction
from dit.objectives.times import logit_normal, shift_time


class ModelMeanType(enum.Enum):
    START_X = enum.auto()  # the model predicts x_0
    EPSILON = enum.auto()  # the model predicts the noise


class ModelVarType(enum.Enum):
    FIXED_SMALL = enum.auto()  # posterior variance
    FIXED_LARGE = enum.auto()  # beta_t
    LEARNED_RANGE = enum.auto()  # the model interpolates between the two in log space


LOSS_WEIGHTINGS = ("none", "min-snr")
TIMESTEP_SAMPLINGS = ("uniform", "logit-normal")


class LossType(enum.Enum):
    MSE = enum.auto()  # MSE, plus the VB term when the variance is learned
    RESCALED_MSE = enum.auto()  # the same, with the VB term scaled by num_timesteps / 1000
    RESCALED_KL = enum.auto()  # the bound times num_timesteps

    def is_vb(self) -> bool:
        return self == LossType.RESCALED_KL


def get_named_beta_schedule(schedule_name: str, num_diffusion_timesteps: int) -> np.ndarray:
    """ "linear" (1e-4..0.02 at 1000 steps, scaled for other counts) or "squaredcos_cap_v2" (cosine)."""
    if schedule_name == "linear":
        scale = 1000 / num_diffusion_timesteps
        return np.linspace(scale * 0.0001, scale * 0.02, num_diffusion_timesteps, dtype=np.float64)
    if schedule_name in ("squaredcos_cap_v2", "cosine"):
        return betas_for_alpha_bar(
            num_diffusion_timesteps, lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        )
    raise ValueError(f"unknown beta schedule {schedule_name!r}; use 'linear' or 'squaredcos_cap_v2'.")


def betas_for_alpha_bar(num_diffusion_timesteps: int, alpha_bar, max_beta: float = 0.999) -> np.ndarray:
    """Betas that discretise a cumulative alpha_bar(t), t in [0, 1], capped at max_beta."""
    betas = []
    for i in range(num_diffusion_timesteps):
        t1, t2 = i / num_diffusion_timesteps, (i + 1) / num_diffusion_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return np.array(betas, dtype=np.float64)


class GaussianDiffusion:
    """Forward process, losses and samplers for a model that outputs (N, C or 2C, H, W); ``timestep_map`` (set by
    respacing) gives each step's original integer timestep, the one the model is conditioned on."""

    def __init__(
        self,
        *,
        betas,
        model_mean_type: ModelMeanType,
        model_var_type: ModelVarType,
        loss_type: LossType,
        timestep_map=None,
        loss_weighting: str = "none",
        min_snr_gamma: float = 5.0,
        timestep_sampling: str = "uniform",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        time_shift: float = 1.0,
        cos_loss_weight: float = 0.0,
    ):
        self.model_mean_type = model_mean_type
        self.model_var_type = model_var_type
        self.loss_type = loss_type
        for name, value, allowed in (
            ("loss_weighting", loss_weighting, LOSS_WEIGHTINGS),
            ("timestep_sampling", timestep_sampling, TIMESTEP_SAMPLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {allowed}")
        if not (math.isfinite(min_snr_gamma) and min_snr_gamma > 0):
            raise ValueError(f"min_snr_gamma must be a positive number, got {min_snr_gamma}")
        if not (math.isfinite(logit_mean) and math.isfinite(logit_std) and logit_std > 0):
            raise ValueError(f"logit_mean must be finite and logit_std positive, got {logit_mean}, {logit_std}")
        self.loss_weighting, self.min_snr_gamma = loss_weighting, float(min_snr_gamma)
        self.timestep_sampling, self.logit_mean, self.logit_std = timestep_sampling, logit_mean, logit_std
        self.time_shift, self.cos_loss_weight = time_shift, cos_loss_weight

        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or not ((betas > 0).all() and (betas <= 1).all()):
            raise ValueError("betas must be a 1-D array in (0, 1].")
        self.betas = betas
        self.num_timesteps = int(betas.shape[0])
        self.timestep_map = np.arange(self.num_timesteps) if timestep_map is None else np.asarray(timestep_map)

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas, axis=0)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The posterior variance is 0 at t = 0; its log takes the t = 1 value there.
        self.posterior_log_variance_clipped = (
            np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
            if self.num_timesteps > 1
            else np.array([], dtype=np.float64)
        )
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (
            (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        )
        self.log_betas = np.log(betas)
        fixed_large = np.append(self.posterior_variance[1], betas[1:])
        self.fixed_large_variance, self.fixed_large_log_variance = fixed_large, np.log(fixed_large)
        self.mse_weight = self._min_snr_weight() if loss_weighting == "min-snr" else None
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _min_snr_weight(self) -> np.ndarray:
        """Min-SNR-gamma per timestep (Hang et al. 2023): min(SNR, gamma) on an x0 target, divided by SNR on
        a noise target (the same objective)."""
        snr = self.alphas_cumprod / (1.0 - self.alphas_cumprod)
        clipped = np.minimum(snr, self.min_snr_gamma)
        return clipped / snr if self.model_mean_type == ModelMeanType.EPSILON else clipped

    # ---- tables on the device ---------------------------------------------------------------------------

    def tables(self, device) -> dict[str, torch.Tensor]:
        """Every float64 table (and the timestep map) on ``device``, uploaded once and cached."""
        device = torch.device(device)
        if device not in self._device_tables:
            dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
            arrays = {n: v for n, v in vars(self).items() if isinstance(v, np.ndarray) and v.dtype == np.float64}
            tabs = {n: torch.as_tensor(v, dtype=dtype, device=device) for n, v in arrays.items()}
            tabs["timestep_map"] = torch.as_tensor(self.timestep_map, dtype=torch.long, device=device)
            self._device_tables[device] = tabs
        return self._device_tables[device]

    def _extract(self, name: str, t: torch.Tensor, broadcast_shape) -> torch.Tensor:
        """Table ``name`` at timesteps t, as float32 shaped (N, 1, 1, ...) to broadcast over a batch."""
        values = self.tables(t.device)[name][t].float()
        return values.view(-1, *([1] * (len(broadcast_shape) - 1)))

    def sample_t(self, batch: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """Training timesteps, integers in [0, num_timesteps): "uniform" is exactly the official
        ``torch.randint(0, T, (batch,))``; otherwise u (1 = data, as the flow's time; logit-normal or U(0, 1)),
        shifted by ``time_shift``, becomes step floor((1 - u) T), clamped to T - 1."""
        if self.timestep_sampling == "uniform" and self.time_shift == 1:
            return torch.randint(0, self.num_timesteps, (batch,), generator=generator, device=device)
        if self.timestep_sampling == "uniform":
            u = torch.rand(batch, generator=generator, device=device)
        else:
            u = logit_normal(batch, self.logit_mean, self.logit_std, generator, device)
        if self.time_shift != 1:
            u = shift_time(u, self.time_shift)
        return ((1.0 - u) * self.num_timesteps).long().clamp_(0, self.num_timesteps - 1)

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The original integer timesteps that the model sees for this diffusion's step indices."""
        return self.tables(t.device)["timestep_map"][t]

    # ---- forward process --------------------------------------------------------------------------------

    def q_sample(self, x_start, t, noise=None):
        """Sample x_t ~ q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)."""
        if noise is None:
            noise = torch.randn_like(x_start)
        return (
            self._extract("sqrt_alphas_cumprod", t, x_start.shape) * x_start
            + self._extract("sqrt_one_minus_alphas_cumprod", t, x_start.shape) * noise
        )

    def q_posterior_mean_variance(self, x_start, x_t, t):
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = (
            self._extract("posterior_mean_coef1", t, x_t.shape) * x_start
            + self._extract("posterior_mean_coef2", t, x_t.shape) * x_t
        )
        variance = self._extract("posterior_variance", t, x_t.shape).expand_as(x_t)
        log_variance = self._extract("posterior_log_variance_clipped", t, x_t.shape).expand_as(x_t)
        return mean, variance, log_variance

    # ---- the model's distribution -----------------------------------------------------------------------

    def p_mean_variance(self, model, x, t, clip_denoised=True, denoised_fn=None, model_kwargs=None):
        """p(x_{t-1} | x_t) and the model's x_0 prediction; ``model`` is called with the original timesteps."""
        model_kwargs = model_kwargs or {}
        n, c = x.shape[:2]
        model_output = model(x, self.model_timesteps(t), **model_kwargs)
        extra = None

        if self.model_var_type == ModelVarType.LEARNED_RANGE:
            if model_output.shape[:2] != (n, c * 2):
                raise ValueError(
                    f"a learned-variance model must output {2 * c} channels, got {model_output.shape}"
                )
            model_output, model_var_values = model_output.split(c, dim=1)
            min_log = self._extract("posterior_log_variance_clipped", t, x.shape)
            max_log = self._extract("log_betas", t, x.shape)
            frac = (model_var_values + 1) / 2  # the model outputs v in [-1, 1]
            model_log_variance = frac * max_log + (1 - frac) * min_log
            model_variance = torch.exp(model_log_variance)
        else:
            if self.model_var_type == ModelVarType.FIXED_LARGE:
                var_name, log_name = "fixed_large_variance", "fixed_large_log_variance"
            else:
                var_name, log_name = "posterior_variance", "posterior_log_variance_clipped"
            model_variance = self._extract(var_name, t, x.shape).expand_as(x)
            model_log_variance = self._extract(log_name, t, x.shape).expand_as(x)
            if model_output.shape[1] == 2 * c:  # a learned-sigma model sampled with a fixed variance
                model_output, extra = model_output.split(c, dim=1)

        x0_model = self.model_mean_type == ModelMeanType.START_X
        pred_xstart = model_output if x0_model else self._predict_xstart_from_eps(x, t, model_output)
        if denoised_fn is not None:
            pred_xstart = denoised_fn(pred_xstart)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        model_mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {
            "mean": model_mean,
            "variance": model_variance,
            "log_variance": model_log_variance,
            "pred_xstart": pred_xstart,
            "extra": extra,
        }

    def _predict_xstart_from_eps(self, x_t, t, eps):
        return (
            self._extract("sqrt_recip_alphas_cumprod", t, x_t.shape) * x_t
            - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.shape) * eps
        )

    def _predict_eps_from_xstart(self, x_t, t, pred_xstart):
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t.shape) * x_t - pred_xstart) / self._extract(
            "sqrt_recipm1_alphas_cumprod", t, x_t.shape
        )

    # ---- sampling: ancestral (DDPM) and DDIM ---------------------------------------------------------------
    # ``noise_fn(x)`` draws a step's noise like x (default ``torch.randn_like``): dit.sample passes per-image
    # generators, so that an image's noise does not depend on the batch it is in.

    def p_sample(self, model, x, t, *, clip_denoised=True, denoised_fn=None, model_kwargs=None, noise_fn=None):
        out = self.p_mean_variance(model, x, t, clip_denoised, denoised_fn, model_kwargs)
        noise = (noise_fn or torch.randn_like)(x)
        nonzero_mask = (t != 0).float().view(-1, *([1] * (x.dim() - 1)))  # no noise at t = 0
        sample = out["mean"] + nonzero_mask * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def ddim_sample(
        self, model, x, t, *, clip_denoised=True, denoised_fn=None, model_kwargs=None, eta=0.0, noise_fn=None
    ):
        out = self.p_mean_variance(model, x, t, clip_denoised, denoised_fn, model_kwargs)
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        alpha_bar = self._extract("alphas_cumprod", t, x.shape)
        alpha_bar_prev = self._extract("alphas_cumprod_prev", t, x.shape)
        sigma = (
            eta * torch.sqrt((1 - alpha_bar_prev) / (1 - alpha_bar)) * torch.sqrt(1 - alpha_bar / alpha_bar_prev)
        )
        sample = out["pred_xstart"] * torch.sqrt(alpha_bar_prev) + torch.sqrt(1 - alpha_bar_prev - sigma**2) * eps
        if eta > 0:  # eta = 0 is deterministic: no noise drawn
            nonzero_mask = (t != 0).float().view(-1, *([1] * (x.dim() - 1)))
            sample = sample + nonzero_mask * sigma * (noise_fn or torch.randn_like)(x)
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def _loop(self, step, model, shape, noise, device, progress, **kwargs):
        if device is None:
            device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else "cpu"
        img = noise if noise is not None else torch.randn(*shape, device=device)
        with progress_bar(self.num_timesteps, "sampling", unit="step", enabled=progress) as bar:
            for i in range(self.num_timesteps - 1, -1, -1):
                t = torch.full((shape[0],), i, dtype=torch.long, device=device)
                with torch.no_grad():
                    out = step(model, img, t, **kwargs)
                yield out
                img = out["sample"]
                bar.update(1)

    def p_sample_loop_progressive(self, model, shape, noise=None, *, device=None, progress=False, **step_kwargs):
        """Each step's output of ``p_sample_loop`` (keywords: ``p_sample``'s)."""
        return self._loop(self.p_sample, model, shape, noise, device, progress, **step_kwargs)

    def p_sample_loop(self, model, shape, noise=None, **kwargs):
        """Ancestral sampling from x_T to x_0; DiT's scripts pass clip_denoised=False."""
        return deque(self.p_sample_loop_progressive(model, shape, noise, **kwargs), maxlen=1)[0]["sample"]

    def ddim_sample_loop_progressive(self, model, shape, noise=None, *, device=None, progress=False, **kwargs):
        """Each step's output of ``ddim_sample_loop`` (keywords: ``ddim_sample``'s)."""
        return self._loop(self.ddim_sample, model, shape, noise, device, progress, **kwargs)

    def ddim_sample_loop(self, model, shape, noise=None, **kwargs):
        """DDIM sampling (eta = 0: deterministic); it ignores the learned variance."""
        return deque(self.ddim_sample_loop_progressive(model, shape, noise, **kwargs), maxlen=1)[0]["sample"]

    # ---- losses -------------------------------------------------------------------------------------------

    def _vb_terms_bpd(self, model, x_start, x_t, t, clip_denoised=True, model_kwargs=None):
        """Per-sample VB term in bits per dim: KL(q || p) for t > 0, the decoder NLL at t = 0."""
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model, x_t, t, clip_denoised=clip_denoised, model_kwargs=model_kwargs)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, out["mean"], out["log_variance"])) / math.log(2.0)
        decoder_nll = -discretized_gaussian_log_likelihood(
            x_start, means=out["mean"], log_scales=0.5 * out["log_variance"]
        )
        decoder_nll = mean_flat(decoder_nll) / math.log(2.0)
        return {"output": torch.where(t == 0, decoder_nll, kl), "pred_xstart": out["pred_xstart"]}

    def training_losses(self, model, x_start, t, model_kwargs=None, noise=None):
        """Per-sample ``loss`` and, for MSE losses, ``mse`` (and ``vb`` if learned). A learned variance's VB term
        sees the mean's prediction detached, so it trains the variance channels only (IDDPM's hybrid objective);
        Min-SNR weighting makes ``loss`` = w_t mse + vb, the VB term unweighted and ``mse`` the raw error."""
        model_kwargs = model_kwargs or {}
        if noise is None:
            noise = torch.randn_like(x_start)
        x_t = self.q_sample(x_start, t, noise=noise)
        terms = {}

        if self.loss_type.is_vb():
            terms["loss"] = self._vb_terms_bpd(model, x_start, x_t, t, False, model_kwargs)["output"]
            if self.loss_type == LossType.RESCALED_KL:
                terms["loss"] = terms["loss"] * self.num_timesteps
            return terms

        model_output = model(x_t, self.model_timesteps(t), **model_kwargs)
        if self.model_var_type == ModelVarType.LEARNED_RANGE:
            c = x_t.shape[1]
            if model_output.shape[:2] != (x_t.shape[0], 2 * c):
                raise ValueError(
                    f"a learned-variance model must output {2 * c} channels, got {model_output.shape}"
                )
            model_output, model_var_values = model_output.split(c, dim=1)
            frozen_out = torch.cat([model_output.detach(), model_var_values], dim=1)
            terms["vb"] = self._vb_terms_bpd(lambda *_, **__: frozen_out, x_start, x_t, t, False)["output"]
            if self.loss_type == LossType.RESCALED_MSE:
                terms["vb"] = terms["vb"] * (self.num_timesteps / 1000.0)

        target = noise if self.model_mean_type == ModelMeanType.EPSILON else x_start
        terms["mse"] = mean_flat((target - model_output) ** 2)
        mse = terms["mse"]
        if self.mse_weight is not None:  # a table lookup on the device: no host sync
            mse = mse * self._extract("mse_weight", t, mse.shape)
        terms["loss"] = mse + terms["vb"] if "vb" in terms else mse
        if self.cos_loss_weight:
            terms["cos"] = velocity_direction(*self._velocities(x_start, x_t, t, noise, model_output))
            terms["loss"] = terms["loss"] + self.cos_loss_weight * terms["cos"]
        return terms

    def _velocities(self, x_start, x_t, t, noise, model_output):
        """(implied, true) v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans and Ho 2022), from the prediction."""
        if self.model_mean_type == ModelMeanType.EPSILON:
            eps, x0 = model_output, self._predict_xstart_from_eps(x_t, t, model_output)
        else:
            eps, x0 = self._predict_eps_from_xstart(x_t, t, model_output), model_output
        a, b = (self._extract(n, t, x_t.shape) for n in ("sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod"))
        return a * eps - b * x0, a * noise - b * x_start
