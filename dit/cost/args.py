"""The ``dit-cost`` subcommands' settings: one dataclass each, sharing the model and budget flags; no torch."""

from __future__ import annotations

from dataclasses import dataclass

from dit.cost import devices, memory, plan
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.model.config import ModelSection, model_config, parse_activation_checkpointing
from dit.objectives import objective_for_sampler
from dit.objectives.samplers import sampling_plan
from dit.objectives.sampling_section import FidSamplingSection
from dit.objectives.times import latent_dim, shift_factor

CKPT_HELP = "activation checkpointing: none, all, or N (the first N blocks recomputed in backward)"
PROFILES_HELP = "post-hoc EMA: the sigma_rel of each profile train.py tracks (one fp32 copy of the weights each)"


@dataclass(frozen=True)
class CostModelSection(ModelSection):
    """The model section and the latent space dit-cost cannot read off the data: VAE, latent size, channels."""

    vae: str = option(
        "ema",
        "the latent space: ema or mse (the SD VAE), vavae (VA-VAE f16d32: 32 channels at 16x), a folder with an "
        "AutoencoderKL config.json, or none (pixel space)",
    )
    latent_size: int | None = option(
        None, "the model's input size, if not image size / the VAE's downsampling", ge=1
    )
    in_channels: int | None = option(
        None, "default: the VAE's latent channels (4 for SD), or 3 with --vae none", ge=1
    )

    def config(self, model: str | None = None):
        """The DiT this section describes (``model``: another registry name at the same sizes and space)."""
        return plan.model_for_image(
            model if model is not None else self.model, self.image_size, vae=plan.vae_config_for(self.vae),
            latent_size=self.latent_size, in_channels=self.in_channels, **self.dit_fields(),
        )  # fmt: skip

    def checkpointed(self, cfg, value: str, allow_auto: bool = False) -> int | str:
        """--activation-checkpointing for ``cfg``: a block count, or (memory with a device) auto."""
        try:
            blocks = parse_activation_checkpointing(value, cfg.depth)
        except FieldError as e:
            raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
        if blocks == "auto" and not allow_auto:
            raise UserError(
                "--activation-checkpointing auto needs a device: --gpu or --memory-gib (dit-cost memory)."
            )
        return blocks


@dataclass(frozen=True)
class HardwareSection(Section):
    """The devices a plan runs on, and what they cost: with --gpu and --mfu (or --calibration), time and price."""

    gpu: str | None = option(None, "device name or alias (H100-SXM, A100, 'NVIDIA L40S'); see `dit-cost peaks`")
    num_gpus: int = option(1, "devices", ge=1)
    precision: str = option("bf16", "the precision the peak is read for", choices=devices.PRECISIONS)
    mfu: float | None = option(None, "model FLOPs utilisation in (0, 1], e.g. 0.4 (with --gpu: time and cost)",
                               gt=0, le=1)  # fmt: skip
    calibration: str | None = option(None, "calibration JSON from a benchmark (schema: docs/cost_model.md)")
    peak_tflops: float | None = option(None, "dense peak TFLOP/s per device, overriding the table", gt=0)
    price_per_hour: float | None = option(None, "price of one device-hour, for the cost line", gt=0)

    def budget(self) -> plan.Budget:
        h = self
        return plan.Budget(h.num_gpus, h.gpu, h.precision, h.mfu, h.calibration, h.price_per_hour, h.peak_tflops)


@dataclass(frozen=True)
class FlopsArgs(Section):
    """analytic FLOPs per image, by component"""

    all: bool = option(False, "every registry config at --image-size")
    activation_checkpointing: str = option("none", CKPT_HELP + " (hardware FLOPs)")
    attention: str = option(
        "fused", "the attention kernel hardware FLOPs assume: fused (flash, efficient, cuDNN: backward recomputes "
        "QK^T) or explicit (the matrix is kept)", choices=("fused", "explicit"),
    )  # fmt: skip
    measure: bool = option(False, "also count with FlopCounterMode on the meta device")
    fvcore: bool = option(False, "also count with fvcore (runs the model on the CPU; pip install fvcore)")
    json: bool = option(False, "print JSON")


@dataclass(frozen=True)
class TrainArgs(Section):
    """compute (and with a device: time and cost) of a training run"""

    global_batch_size: int = option(256, "images per optimizer step, all devices together", ge=1)
    max_steps: int = option(400_000, "optimizer steps to train for", ge=1)
    activation_checkpointing: str = option("none", CKPT_HELP + " (memory and hardware FLOPs)")
    ema_profiles: tuple[float, ...] | None = option(None, PROFILES_HELP + ": their snapshots' disk")
    ema_snapshot_every: int = option(5_000, "with --ema-profiles: steps per snapshot of the profiles", ge=1)
    json: bool = option(False, "print JSON")
    # REPA's flags are train.py's sections; whether its features come from a store is this plan's own question
    repa_cached_features: bool = option(
        False, "REPA: features from a latent store (the encoder paid once per image view, at extraction)"
    )


@dataclass(frozen=True)
class SampleHardwareSection(HardwareSection):
    """The hardware section with sampling's default precision, tf32 (sample.py's and sample_ddp.py's)."""

    precision: str = option(
        "tf32",
        "the precision the peak is read for (the sampling faces' default: tf32)",
        choices=devices.PRECISIONS,
    )


@dataclass(frozen=True)
class SampleArgs(Section):
    """compute (and with a device: time and cost) of sampling N images"""

    num_images: int = option(50_000, "images to sample", ge=1)
    nfe: int | None = option(
        None, "network evaluations per image, for the adaptive dopri5 (read a run's log)", ge=1
    )
    guide_model: str | None = option(
        None, "autoguidance (sample.py's --guide-ckpt): the guide's size, a model of the same classes, images and "
        "latents whose forward replaces the unconditional pass of each guided evaluation (a registry name)",
    )  # fmt: skip
    json: bool = option(False, "print JSON")

    def check(self) -> None:
        if self.guide_model is not None:
            try:
                model_config(self.guide_model)
            except UserError as e:
                raise FieldError("{guide_model}: " + str(e)) from None


def sample_evaluations(cfg, sampling: FidSamplingSection, args: SampleArgs):
    """(the sampler's plan, its guidance scale, network evaluations and unguided ones per image): the plan's, or
    --nfe for the adaptive dopri5. Guidance: the asked one, else 1.5 with a null class or --guide-model, else 1."""
    guided_by_default = cfg.num_classes > 0 and cfg.class_dropout_prob > 0 or args.guide_model is not None
    try:
        guidance = sampling.guidance(guided_by_default)
    except FieldError as e:
        raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
    shift = sampling.time_shift  # "auto": RAE's for the model's latent
    shift = 1.0 if shift is None else shift_factor(shift, latent_dim(cfg) if shift == "auto" else 0)
    kind = objective_for_sampler(sampling.sampler).sampler(sampling.sampler, fast=sampling.FAST)
    plan = sampling_plan(
        kind, sampling.num_sampling_steps, method=sampling.sampling_method, last_step=sampling.last_step,
        guidance_scale=guidance, interval=sampling.guidance_interval, time_shift=shift,
    )  # fmt: skip
    if plan.nfe is not None:
        if args.nfe is not None and args.nfe != plan.nfe:
            raise UserError(f"--nfe is for dopri5: {plan.sampler} makes {plan.nfe} evaluations; drop --nfe.")
        return plan, guidance, plan.nfe, plan.unguided_nfe
    guided = guidance > 1
    if args.nfe is None:
        raise UserError(
            f"{sampling.sampling_method} picks its own steps: pass --nfe, the evaluations per image a run printed."
        )
    if sampling.guidance_interval is not None and guided:
        raise UserError(
            "dopri5 picks its times as it runs, so which evaluations fall in --guidance-interval is known only "
            "after a run: read its cost line, or plan without the interval (every evaluation guided)."
        )
    return plan, guidance, args.nfe, 0 if guided else args.nfe


@dataclass(frozen=True)
class MemoryArgs(Section):
    """training memory per device: analytic, traced, largest batch"""

    batch_size: int | None = option(None, "images per device per step", ge=1, aliases=("--batch-per-device",))
    global_batch_size: int | None = option(None, "images per step over --num-gpus devices", ge=1)
    num_gpus: int = option(1, "devices", ge=1)
    precision: str = option("bf16", "training precision", choices=memory.MEMORY_PRECISIONS)
    activation_checkpointing: str = option("none", CKPT_HELP + ", or auto (the fewest that fit; needs a device)")
    ema: bool = option(True, "an fp32 EMA copy of the weights")
    ema_profiles: tuple[float, ...] | None = option(None, PROFILES_HELP)
    fsdp: bool = option(False, "shard weights, gradients, AdamW and EMA over the devices (FSDP2) instead of DDP")
    trace: bool = option(False, "also trace one real step on fake tensors")
    gpu: str | None = option(None, "device, for its memory and the largest batch that fits")
    memory_gib: float | None = option(None, "device memory, if --gpu does not say", gt=0)
    memory_reserve_gib: float | None = option(
        None, "kept free for the CUDA context and fragmentation (default: 10%, at least 2 GiB)", ge=0
    )
    json: bool = option(False, "print JSON")

    def check(self) -> None:
        if self.batch_size is None and self.global_batch_size is None:
            raise FieldError("pass --batch-per-device, or {global_batch_size} with {num_gpus}.")
        if self.batch_size is None and self.global_batch_size % self.num_gpus:
            raise FieldError(
                f"{{global_batch_size}} {self.global_batch_size} does not split over {self.num_gpus} GPUs."
            )

    @property
    def batch_per_device(self) -> int:
        return self.batch_size if self.batch_size is not None else self.global_batch_size // self.num_gpus


@dataclass(frozen=True)
class PeaksArgs(Section):
    """the peak table, or the peak for one device name ('cpu' measures): `dit-cost peaks cpu`"""

    gpu: str | None = option(None, "a device name to resolve, e.g. 'NVIDIA H100 80GB HBM3' or cpu",
                             aliases=("--device",))  # fmt: skip
    device_name: str | None = option(None, "the device name as an argument, as --gpu takes it", positional=True)
    precision: str = option("bf16", "precision", choices=devices.PRECISIONS)
    peak_tflops: float | None = option(None, "override the table", gt=0)
    json: bool = option(False, "print JSON")

    def check(self) -> None:
        if self.gpu is not None and self.device_name is not None and self.gpu != self.device_name:
            raise FieldError(f"name one device: {{gpu}} {self.gpu!r} or {self.device_name!r}, not both.")


@dataclass(frozen=True, kw_only=True)
class PlotArgs(Section):
    """PNG charts: 'flops' (all configs), 'memory' (one config vs batch) or 'quality' (FID against training FLOPs)"""

    chart: str = option(help="flops, memory or quality", choices=("flops", "memory", "quality"), positional=True)
    runs: tuple[str, ...] = option(
        [], "quality: run folders (their --results-dir), one line each", positional=True
    )
    out: str = option(help="PNG path")
    labels: tuple[str, ...] | None = option(None, "quality: a legend label per run (default: the folders)")
    precision: str = option("bf16", "training precision (memory chart)", choices=memory.MEMORY_PRECISIONS)
    gpu: str | None = option(None, "device, for its memory line")
    memory_gib: float | None = option(None, "device memory, if --gpu does not say", gt=0)
    traced_batches: str | None = option(None, "comma-separated batches to trace as points, e.g. 8,64")

    def check(self) -> None:
        if self.chart == "quality" and not self.runs:
            raise FieldError(
                "dit-cost plot quality needs run folders: dit-cost plot quality RUN [RUN ...] --out FILE."
            )
        if self.chart == "quality" and self.labels and len(self.labels) != len(self.runs):
            raise FieldError(f"{{labels}} gives {len(self.labels)} labels for {len(self.runs)} runs: one per run.")


@dataclass(frozen=True, kw_only=True)
class QualityArgs(Section):
    """the training compute, time and cost at which a run reached a target FID"""

    run: str = option(help="the run's folder (its --results-dir)", positional=True)
    target_fid: float = option(help="the FID to reach")
    price_per_hour: float | None = option(None, "price of one device-hour, for the cost", gt=0)
    gpu: str | None = option(None, "also: the time on this device (with --mfu and --num-gpus)")
    num_gpus: int = option(1, "devices, with --gpu", ge=1)
    precision: str = option("bf16", "the precision the peak is read for, with --gpu", choices=devices.PRECISIONS)
    mfu: float | None = option(None, "MFU on --gpu, in (0, 1]", gt=0, le=1)
    json: bool = option(False, "print JSON")

    def check(self) -> None:
        if (self.gpu is None) != (self.mfu is None):
            raise FieldError("a time on another device needs {gpu} and {mfu} in (0, 1].")
