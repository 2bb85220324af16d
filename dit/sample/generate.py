"""Generation: per-image noise, guided denoising with the objective's sampler, VAE decoding, and the checks on a
request. Semantics follow the official DiT scripts (docs/sampling.md), except that image i's noise comes from its
own generator seeded by (seed, i), so a sample set is the same on any number of devices and after any resume."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dit import objectives
from dit.data.vae import ChannelNorm, decode
from dit.io.config import FieldError
from dit.io.errors import UserError
from dit.model.config import DiTConfig, check_path_drop
from dit.model.dit import DiT, extrapolate
from dit.objectives import Objective
from dit.objectives.samplers import DEFAULT_METHODS, guided_at, sampling_plan
from dit.objectives.sampling_section import SamplingSection
from dit.objectives.times import latent_dim, shift_factor
from dit.objectives.transport import Transport
from dit.runtime import Precision, Stream, mix_seed

# The official sample.py's classes: golden retriever, otter, red panda, geyser, macaw, valley, balloon, arctic fox.
OFFICIAL_CLASS_LABELS = (207, 360, 387, 974, 88, 979, 417, 279)
# --guidance-channels (its choices) as ``Guidance.channels`` holds them: 3 (the official code's) or every channel.
GUIDANCE_CHANNELS = {"3": 3, "all": "all"}


@dataclass
class SamplingModel:
    """A DiT in eval mode with what sampling needs to know about it."""

    model: DiT
    weights: str  # which weights were loaded: "ema", "model" or "state_dict"
    image_size: int  # pixels per side of the images it makes
    vae: torch.nn.Module | None  # None: a pixel-space model whose outputs are images in [-1, 1]
    vae_spec: str | None
    # The objective's record (``Objective.sampling_fields``): a diffusion's schedule and target, a flow's transport.
    noise_schedule: str = "linear"
    predict_xstart: bool = False
    transport: Transport | None = None
    time_shift: float = 1.0  # the diffusion's training shift (a flow's is its transport's)
    latent_norm: ChannelNorm | None = None  # --latent-norm channel's statistics, undone before decoding

    @property
    def config(self) -> DiTConfig:
        return self.model.config

    @property
    def objective(self) -> Objective:
        """The objective its samplers follow, rebuilt from the fields that record it."""
        return objectives.of_sampling_fields(self.noise_schedule, self.predict_xstart, self.transport,
                                             self.config.learn_sigma, self.time_shift)  # fmt: skip

    @classmethod
    def from_objective(
        cls,
        model: DiT,
        weights: str,
        image_size: int,
        vae,
        vae_spec: str | None,
        objective: Objective,
        latent_norm: ChannelNorm | None = None,
    ) -> SamplingModel:
        """``model`` sampled as ``objective`` says; ``latent_norm`` None: the VAE's scaling rule."""
        return cls(
            model, weights, image_size, vae, vae_spec, **objective.sampling_fields(), latent_norm=latent_norm
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


def noise_seed(seed: int, index: int) -> int:
    """The seed of image ``index``'s noise: independent of rank, batch and world size."""
    return mix_seed(Stream.NOISE, seed, index)


@dataclass(frozen=True)
class Guidance:
    """Scale (1 or less: off), guided channels (3, the official code's, or "all"), interval of times (None: all;
    t/1000 for diffusion, 1 = noise; flow t, 1 = data). It guides against the unconditional pass (``path_drop``:
    without the sparse blocks, SPRINT's) or ``guide``, a weaker model (autoguidance, Karras et al. 2024)."""

    scale: float = 1.0
    channels: int | str = 3
    interval: tuple[float, float] | None = None
    path_drop: bool = False
    guide: DiT | None = None

    def __post_init__(self):
        if self.guide is not None and self.path_drop:
            raise UserError(
                "--guidance-path-drop guides against the model's own unconditional pass, --guide-ckpt against "
                "another model: pass one of them."
            )


class GuidedModel:
    """The DiT as a sampler calls it, one row per image: a guided evaluation makes two passes ([conditional;
    null label] through ``forward_with_cfg``, or model and guide combined by ``extrapolate``), an unguided one a
    single pass. The plan says which are guided, in call order (adaptive samplers: judged at each call's time)."""

    def __init__(self, model, guidance: Guidance, precision: Precision | None, plan: Sequence[bool] | None):
        self.model, self.guidance, self.precision, self.plan = model, guidance, precision, plan
        self.guided = self.unguided = 0

    @property
    def evaluations(self) -> int:
        return self.guided + self.unguided

    def _is_guided(self, t: torch.Tensor) -> bool:
        if self.plan is not None:
            if self.evaluations >= len(self.plan):
                raise RuntimeError(f"the sampler made more than the {len(self.plan)} evaluations it planned")
            return self.plan[self.evaluations]
        g = self.guidance
        return g.scale > 1 and (g.interval is None or guided_at(float(t[0]), g.scale, g.interval))

    def _guided(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.guidance
        if g.guide is not None:
            channels = self.model.guided_channels(g.channels)
            return extrapolate(self.model(x, t, y), g.guide(x, t, y), g.scale, channels)
        null = torch.full_like(y, self.model.config.num_classes)
        both = self.model.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]), g.scale,
                                           g.channels, path_drop=g.path_drop)  # fmt: skip
        return both[: len(x)]

    def __call__(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        guided = self._is_guided(t)
        with self.precision.autocast() if self.precision is not None else nullcontext():
            out = self._guided(x, t, y) if guided else self.model(x, t, y)
        self.guided += guided
        self.unguided += not guided
        return out.float()


class Sampler:
    """One sampling method with its settings, guidance and plan (``dit.objectives.samplers``), made before it
    runs; ``run`` leaves ``nfe``, ``guided_nfe`` and ``unguided_nfe``, the evaluations per image it made."""

    def __init__(self, sm: SamplingModel, num_steps: int, kind: str | None = None, *, method: str | None = None,
                 guidance: Guidance = Guidance(), diffusion_form: str = "sigma", last_step: str = "mean",
                 atol: float = 1e-6, rtol: float = 1e-3, sample_eps: float | None = None,
                 time_shift: float | str | None = None):  # fmt: skip
        objective = sm.objective
        kind = objective.sampler(kind)
        objective.check_options(kind, method, sample_eps, diffusion_form)
        if guidance.scale > 1 and guidance.guide is None and sm.config.class_dropout_prob <= 0:  # no null class
            raise UserError(
                "this model was trained without class dropout, so it has no unconditional label to guide against: "
                "pass --guidance-scale 1."
            )
        # None: the run's shift; "auto": RAE's for this model's latent
        self.time_shift = (
            objective.time_shift if time_shift is None else shift_factor(time_shift, latent_dim(sm.config))
        )
        if guidance.path_drop:
            check_path_drop(True, sm.config)
        self.plan = sampling_plan(
            kind, num_steps, method=method, last_step=last_step, guidance_scale=guidance.scale,
            interval=guidance.interval, flow_interval=objective.sampling_interval(sample_eps),
            time_shift=self.time_shift,
        )  # fmt: skip
        self.sm, self.kind, self.guidance = sm, kind, guidance
        self.sample_eps = sample_eps  # None: the run's (a sample set's manifest records which)
        self.method = method or DEFAULT_METHODS.get(kind)
        self.process = objective.process(num_steps, sample_eps, self.time_shift)  # what the sampler integrates
        self.loop = objective.sampling_loop(kind, self.process, self.plan, method=self.method,
                                            diffusion_form=diffusion_form, last_step=last_step, atol=atol, rtol=rtol)  # fmt: skip
        self.nfe = self.guided_nfe = self.unguided_nfe = 0
        self._rows, self._guided_rows, self._unguided_rows = 0, 0, 0

    @classmethod
    def from_options(cls, sm: SamplingModel, c: SamplingSection, guide: DiT | None = None) -> Sampler:
        """The sampler a sampling section asks for; ``guide``: autoguidance's model (None: classifier-free)."""
        try:
            kind = sm.objective.sampler(c.sampler, fast=c.FAST)
            has_null_class = sm.config.num_classes > 0 and sm.config.class_dropout_prob > 0
            scale = c.guidance(has_null_class or guide is not None)  # autoguidance needs no null class
        except FieldError as e:
            raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
        channels = GUIDANCE_CHANNELS[c.guidance_channels]
        guidance = Guidance(scale, channels, c.guidance_interval, c.guidance_path_drop, guide)
        return cls(
            sm, c.num_sampling_steps, kind, method=c.sampling_method, guidance=guidance,
            diffusion_form=c.diffusion_form, last_step=c.last_step, atol=c.atol, rtol=c.rtol, sample_eps=c.sample_eps,
            time_shift=c.time_shift,
        )  # fmt: skip

    @property
    def planned_nfe(self) -> int | None:
        """Evaluations per image before running (None for the adaptive dopri5)."""
        return self.plan.nfe

    def describe(self) -> str:
        return self.plan.sampler

    def run(self, model, x: torch.Tensor, y: torch.Tensor, noise: Callable, *, precision: Precision | None = None,
            progress: bool = False) -> torch.Tensor:  # fmt: skip
        """Denoise ``x`` (one row per image) with labels ``y``; ``noise(x)`` draws each step's per-image noise."""
        fn = GuidedModel(model, self.guidance, precision, self.plan.guided)
        with torch.no_grad():
            x = self.loop(fn, x, {"y": y}, noise, progress)
        if self.plan.nfe is not None and fn.evaluations != self.plan.nfe:
            raise RuntimeError(
                f"{self.describe()} made {fn.evaluations} evaluations, not the {self.plan.nfe} planned"
            )
        self.guided_nfe, self.unguided_nfe, self.nfe = fn.guided, fn.unguided, fn.evaluations
        self._rows += len(x)  # dopri5's count differs per batch: the cost of a set is its mean
        self._guided_rows += fn.guided * len(x)
        self._unguided_rows += fn.unguided * len(x)
        return x

    @property
    def mean_guided_nfe(self) -> float:
        """Guided evaluations per image over every batch this sampler ran (before any: the plan's, or 0)."""
        return self._guided_rows / self._rows if self._rows else float(self.plan.guided_nfe or 0)

    @property
    def mean_unguided_nfe(self) -> float:
        return self._unguided_rows / self._rows if self._rows else float(self.plan.unguided_nfe or 0)

    @property
    def mean_nfe(self) -> float:
        """Evaluations per image over every batch this sampler ran (dopri5: they differ per batch)."""
        return self.mean_guided_nfe + self.mean_unguided_nfe


def sample_latents(
    sm: SamplingModel,
    sampler: Sampler,
    labels: Sequence[int],
    seeds: Sequence[int],
    *,
    precision: Precision | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """The DiT's part: denoised samples (latents, or pixels for pixel-space models), one per (label, seed); row i's
    noise, at every step, from image i's own generator, whatever the batch holds."""
    cfg, device = sm.config, next(sm.model.parameters()).device
    shape = (cfg.in_channels, cfg.input_size, cfg.input_size)
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def noise(like: torch.Tensor | None = None) -> torch.Tensor:  # ``like`` (as ``randn_like`` takes it): unused
        return torch.stack([torch.randn(shape, generator=g, device=device) for g in generators])

    y = torch.tensor(list(labels), dtype=torch.long, device=device)
    return sampler.run(sm.model, noise(), y, noise, precision=precision, progress=progress)


def to_images(sm: SamplingModel, samples: torch.Tensor, precision: Precision | None = None) -> torch.Tensor:
    """The VAE's part: images in [-1, 1], (N, 3, H, W) float32 on the CPU; decoded in ``precision.frozen()``."""
    if sm.vae is None:
        images = samples.clamp(-1, 1)
    else:
        with precision.frozen() if precision is not None else nullcontext():
            images = decode(sm.vae, samples, sm.latent_norm)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.float().cpu()


def generate(
    sm: SamplingModel,
    sampler: Sampler,
    labels: Sequence[int],
    seeds: Sequence[int],
    *,
    precision: Precision | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Images in [-1, 1], (N, 3, H, W) float32 on the CPU, one per (label, seed)."""
    samples = sample_latents(sm, sampler, labels, seeds, precision=precision, progress=progress)
    return to_images(sm, samples, precision)
