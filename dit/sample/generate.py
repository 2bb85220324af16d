"""Generation: per-image noise, guided denoising (DDPM, DDIM, or the flow ODE/SDE), VAE decoding, and the checks on a request.

Semantics follow the official DiT scripts: classifier-free guidance on a [conditional; unconditional]
batch that shares its noise, the null label ``num_classes``, ``clip_denoised=False``, VAE decoding of
``latents / scaling_factor + shift_factor`` (shift 0 for the SD VAEs) and uint8 via ``clamp(127.5 x + 128)``. One deliberate change: every image
draws its noise from its own generator seeded by (seed, image index), so a sample set is the same on any
number of devices and after any resume (the official per-rank seeding is not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dit.config import FieldError
from dit.diffusion import create_diffusion
from dit.errors import UserError
from dit.models import DiT, DiTConfig
from dit.runtime import Precision, Stream, mix_seed
from dit.sampling import DIFFUSION_SAMPLERS, FLOW_SAMPLERS, SamplingSection
from dit.transport import Transport
from dit.transport.samplers import (
    DEFAULT_METHODS,
    ODE_METHODS,
    SDE_METHODS,
    FlowField,
    diffusion_coefficient,
    ode_sample,
    planned_nfe,
    sde_sample,
)
from dit.vae import decode

# The official sample.py's classes: golden retriever, otter, red panda, geyser, macaw, valley, balloon, arctic fox.
OFFICIAL_CLASS_LABELS = (207, 360, 387, 974, 88, 979, 417, 279)


@dataclass
class SamplingModel:
    """A DiT in eval mode with what sampling needs to know about it."""

    model: DiT
    weights: str  # which weights were loaded: "ema", "model" or "state_dict"
    image_size: int  # pixels per side of the images it makes
    vae: torch.nn.Module | None  # None: a pixel-space model whose outputs are images in [-1, 1]
    vae_spec: str | None
    noise_schedule: str = "linear"  # diffusion models
    predict_xstart: bool = False
    transport: Transport | None = None  # flow models: their objective; None for diffusion models

    @property
    def config(self) -> DiTConfig:
        return self.model.config

    @classmethod
    def from_run(
        cls, model: DiT, weights: str, image_size: int, vae, vae_spec: str | None, run: dict
    ) -> SamplingModel:
        """What a run's config (a checkpoint's record, or a TrainConfig as a dict) says about its objective."""
        transport = None
        if run.get("objective") == "flow":
            transport = Transport.from_record(run)
        schedule, xstart = run.get("noise_schedule") or "linear", bool(run.get("predict_xstart"))
        return cls(model, weights, image_size, vae, vae_spec, schedule, xstart, transport)


# ---- checks on what the user asked for --------------------------------------------------------------------


def parse_guidance_channels(value: str | int) -> int | str:
    """``--guidance-channels``: 3 (the official behaviour, used for the paper's FID) or "all"."""
    if str(value) == "all":
        return "all"
    if str(value) == "3":
        return 3
    raise UserError(f"--guidance-channels must be 3 (official) or all, got {value!r}.")


def check_guidance(guidance_scale: float, cfg: DiTConfig) -> None:
    if not guidance_scale >= 1.0:
        raise UserError(
            f"--guidance-scale (--cfg-scale) must be >= 1 (1 disables guidance), got {guidance_scale}."
        )
    if guidance_scale > 1.0 and cfg.class_dropout_prob <= 0:
        raise UserError(
            "this model was trained without class dropout, so it has no unconditional label to guide against: "
            "pass --guidance-scale 1."
        )


def check_labels(labels: Sequence[int], num_classes: int) -> list[int]:
    labels = [int(y) for y in labels]
    if num_classes == 0:  # unconditional: one image per entry, the label itself unused
        return [0] * len(labels)
    if not labels:
        raise UserError("no class labels given: pass --class-labels with at least one label.")
    bad = [y for y in labels if not 0 <= y < num_classes]
    if bad:
        raise UserError(
            f"class labels {bad} are out of range for a {num_classes}-class model: use labels 0..{num_classes - 1}."
        )
    return labels


def default_class_labels(num_classes: int) -> list[int]:
    """The official sample.py's eight ImageNet classes, or the first eight classes of other models."""
    if num_classes == 1000:
        return list(OFFICIAL_CLASS_LABELS)
    return [i % num_classes if num_classes else 0 for i in range(8)]


# ---- seeds and noise --------------------------------------------------------------------------------------


def noise_seed(seed: int, index: int) -> int:
    """The seed of image ``index``'s noise: independent of rank, batch and world size."""
    return mix_seed(Stream.NOISE, seed, index)


def fid_label(seed: int, index: int, num_classes: int) -> int:
    """Image ``index``'s class in a sample set: uniform like the official sample_ddp.py, but per image."""
    return mix_seed(Stream.LABEL, seed, index) % num_classes if num_classes else 0  # bias < classes / 2**63


class PerImageNoise:
    """Gaussian noise where row i always comes from image i's own generator, whatever the batch holds."""

    def __init__(self, seeds: Sequence[int], shape: Sequence[int], device: torch.device):
        self.shape, self.device = tuple(shape), device
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self) -> torch.Tensor:
        return torch.stack([torch.randn(self.shape, generator=g, device=self.device) for g in self.generators])


# ---- the denoising loop -----------------------------------------------------------------------------------


def guided_model_fn(
    model: DiT, guidance_scale: float, guidance_channels: int | str, precision: Precision | None = None
) -> Callable:
    """The model as the diffusion calls it: plain at scale 1, ``forward_with_cfg`` above; float32 out."""

    def fn(x, t, y):
        with precision.autocast() if precision is not None else nullcontext():
            if guidance_scale > 1:
                out = model.forward_with_cfg(x, t, y, guidance_scale, guidance_channels)
            else:
                out = model(x, t, y)
        return out.float()

    return fn


@torch.no_grad()
def denoise(
    model_fn: Callable,
    diffusion,
    x_T: torch.Tensor,
    y: torch.Tensor,
    sampler: str = "ddpm",
    step_noise: Callable[[], torch.Tensor] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Run the reverse process from ``x_T`` with labels ``y`` (both already doubled for guidance).

    DDPM is written out here (mean + sigma z from ``p_mean_variance``) rather than ``p_sample_loop`` because
    the library loop draws each step's noise for the whole batch from the global RNG; ``step_noise`` gives
    per-image streams. DDIM with eta = 0 draws no noise, so it uses ``ddim_sample`` as it is.
    """
    if sampler not in DIFFUSION_SAMPLERS:
        raise UserError(f"--sampler must be one of {', '.join(DIFFUSION_SAMPLERS)}, got {sampler!r}.")
    x, kwargs = x_T, {"y": y}
    steps = range(diffusion.num_timesteps - 1, -1, -1)
    for i in tqdm(steps, disable=not progress, leave=False, desc=sampler):
        t = torch.full((len(x),), i, dtype=torch.long, device=x.device)
        if sampler == "ddim":
            x = diffusion.ddim_sample(model_fn, x, t, clip_denoised=False, model_kwargs=kwargs)["sample"]
            continue
        out = diffusion.p_mean_variance(model_fn, x, t, clip_denoised=False, model_kwargs=kwargs)
        x = out["mean"]
        if i > 0:  # no noise on the last step
            noise = step_noise() if step_noise is not None else torch.randn_like(x)
            x = x + torch.exp(0.5 * out["log_variance"]) * noise.repeat(len(x) // len(noise), 1, 1, 1)
    return x


class Sampler:
    """One sampling method with its settings; ``run`` denoises a batch and leaves ``nfe``, the network
    evaluations it made (a guided batch is one evaluation of a doubled batch)."""

    def __init__(self, sm: SamplingModel, num_steps: int, kind: str | None = None, method: str | None = None,
                 diffusion_form: str = "sigma", last_step: str = "mean", atol: float = 1e-6, rtol: float = 1e-3,
                 sample_eps: float | None = None):  # fmt: skip
        if num_steps < 1:
            raise UserError(f"--num-sampling-steps must be >= 1, got {num_steps}.")
        flow = sm.transport is not None
        kind = kind or ("ode" if flow else "ddpm")
        if kind not in (FLOW_SAMPLERS if flow else DIFFUSION_SAMPLERS):
            allowed = FLOW_SAMPLERS if flow else DIFFUSION_SAMPLERS
            raise UserError(
                f"--sampler {kind} does not sample a {'flow-matching' if flow else 'diffusion'} model: use "
                f"{' or '.join(allowed)}."
            )
        methods = {"ode": ODE_METHODS, "sde": SDE_METHODS}.get(kind, ())
        if method is not None and not methods:
            raise UserError(f"--sampling-method is for flow models' ode and sde samplers, not --sampler {kind}.")
        method = method or DEFAULT_METHODS.get(kind)
        if methods and method not in methods:
            raise UserError(
                f"--sampling-method for --sampler {kind} must be one of {', '.join(methods)}, got {method!r}."
            )
        if sample_eps is not None and not flow:
            raise UserError("--sample-eps is for flow models: a diffusion model's sampler has no such interval.")
        self.transport = sm.transport
        if flow and sample_eps is not None:
            self.transport = dataclasses.replace(sm.transport, sample_eps=sample_eps)
        if flow and kind == "sde" and diffusion_form == "SBDM":
            t0 = self.transport.interval(training=False)[0]
            if not math.isfinite(diffusion_coefficient(self.transport, "SBDM", t0)):
                raise UserError(
                    f"the SBDM diffusion is infinite at t = {t0:g}: pass a --sample-eps above 0, or another "
                    "--diffusion-form."
                )
        if flow and planned_nfe(kind, method, num_steps, last_step) == 0:
            raise UserError(
                f"--num-sampling-steps {num_steps} with --last-step none makes no network evaluation: pass 2 or more."
            )
        if not flow and num_steps < 2:
            raise UserError(
                f"--num-sampling-steps must be >= 2 for --sampler {kind}: a one-step respacing has no posterior "
                "(the official diffusion's variances need two steps)."
            )
        self.sm, self.kind, self.method, self.num_steps = sm, kind, method, num_steps
        self.diffusion_form, self.last_step, self.atol, self.rtol = diffusion_form, last_step, atol, rtol
        self.diffusion = None if flow else create_diffusion(
            str(num_steps), noise_schedule=sm.noise_schedule, learn_sigma=sm.config.learn_sigma,
            predict_xstart=sm.predict_xstart,
        )  # fmt: skip
        self.nfe, self._rows, self._nfe_rows = 0, 0, 0

    @classmethod
    def from_options(cls, sm: SamplingModel, c: SamplingSection) -> Sampler:
        """The sampler a sampling section asks for, its default chosen by the model's objective."""
        flow = sm.transport is not None
        try:
            kind = c.kind(flow)
        except FieldError as e:
            raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
        return cls(
            sm, c.num_sampling_steps, kind, c.sampling_method, c.diffusion_form, c.last_step, c.atol, c.rtol,
            c.sample_eps,
        )  # fmt: skip

    @property
    def planned_nfe(self) -> int | None:
        """Evaluations per image before running (None for the adaptive dopri5)."""
        if self.diffusion is not None:
            return self.num_steps
        return planned_nfe(self.kind, self.method, self.num_steps, self.last_step)

    def describe(self) -> str:
        return self.kind if self.method is None else f"{self.kind} {self.method}"

    def run(self, model_fn: Callable, x: torch.Tensor, y: torch.Tensor, step_noise: Callable, progress=False):
        if self.diffusion is not None:
            self.nfe = self.num_steps
            return denoise(model_fn, self.diffusion, x, y, self.kind, step_noise, progress)
        field = FlowField(self.transport, model_fn, {"y": y})
        ticks = None if self.method == "dopri5" else self.num_steps - (self.kind == "sde")  # SDE: the last step
        bar = tqdm(total=ticks, disable=not progress, leave=False, desc=self.describe())
        with torch.no_grad():
            if self.kind == "ode":
                x = ode_sample(field, x, self.num_steps, self.method, self.atol, self.rtol, bar)
            else:
                x = sde_sample(field, x, self.num_steps, step_noise, self.method, self.diffusion_form,
                               last_step=self.last_step, progress=bar)  # fmt: skip
        bar.close()
        self.nfe = field.nfe
        self._rows += len(x)  # dopri5's count differs per batch: the cost of a set is its mean
        self._nfe_rows += field.nfe * len(x)
        return x

    @property
    def mean_nfe(self) -> float:
        """Evaluations per image over every batch this sampler ran (the last batch's before any flow run)."""
        return self._nfe_rows / self._rows if self._rows else self.nfe


def sample_latents(
    sm: SamplingModel,
    sampler: Sampler,
    labels: Sequence[int],
    seeds: Sequence[int],
    guidance_scale: float = 1.0,
    guidance_channels: int | str = 3,
    precision: Precision | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """The DiT's part: denoised samples (latents, or pixels for pixel-space models), one per (label, seed)."""
    cfg, device = sm.config, next(sm.model.parameters()).device
    noise = PerImageNoise(seeds, (cfg.in_channels, cfg.input_size, cfg.input_size), device)
    x = noise()
    y = torch.tensor(list(labels), dtype=torch.long, device=device)
    if guidance_scale > 1:  # [conditional; unconditional], sharing the noise; the null label is num_classes
        x, y = torch.cat([x, x]), torch.cat([y, torch.full_like(y, cfg.num_classes)])
    model_fn = guided_model_fn(sm.model, guidance_scale, guidance_channels, precision)
    return sampler.run(model_fn, x, y, noise, progress)[: len(labels)]


def to_images(sm: SamplingModel, samples: torch.Tensor) -> torch.Tensor:
    """The VAE's part: samples to RGB images in [-1, 1], (N, 3, H, W) float32 on the CPU."""
    images = decode(sm.vae, samples) if sm.vae is not None else samples.clamp(-1, 1)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.float().cpu()


def generate(
    sm: SamplingModel,
    sampler: Sampler,
    labels: Sequence[int],
    seeds: Sequence[int],
    guidance_scale: float = 1.0,
    guidance_channels: int | str = 3,
    precision: Precision | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Images in [-1, 1], (N, 3, H, W) float32 on the CPU, one per (label, seed)."""
    samples = sample_latents(sm, sampler, labels, seeds, guidance_scale, guidance_channels, precision, progress)
    return to_images(sm, samples)
