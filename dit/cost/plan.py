"""Budgets before a run: FLOPs, device-hours, days and money for training and for sampling N images. Time is
FLOPs / (devices x peak x MFU); MFU is never assumed: pass it, or a benchmark's calibration (``Calibration``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dit.cost.analytic import (
    RepaFlops,
    forward_macs,
    sampling_flops_per_image,
    training_flops_per_image,
    vae_flops,
)
from dit.cost.devices import device_memory_bytes, find_device
from dit.cost.memory import (
    MEMORY_PRECISIONS,
    estimate_training_memory,
    fewest_checkpointed_blocks,
    max_batch_that_fits,
    trace_training_memory,
    usable_memory,
)
from dit.cost.peaks import resolve_peak, table_peak
from dit.cost.report import GuideCost, MemoryPlan, SampleBudget, Timing, TrainingPlan, TrainMemory
from dit.cost.vae_facts import AUTOENCODER_KL_DEFAULTS, SD_VAE_CONFIG, known_vae_config, latent_downsample_of
from dit.io.atomic import atomic_write_bytes
from dit.io.errors import UserError
from dit.io.userfiles import read_json
from dit.model.config import DiTConfig, describe, model_config, registry_name


def vae_config_for(spec: str | None) -> dict | None:
    """The AutoencoderKL config a ``--vae`` value means (a known VAE, or a folder's config.json), read as JSON."""
    if spec is None or str(spec).lower() == "none":
        return None
    if (known := known_vae_config(spec)) is not None:
        return known
    path = Path(spec).expanduser() / "config.json"
    if not path.is_file():
        raise UserError(
            f"--vae {spec!r}: pass ema, mse, vavae, none, or a folder with an AutoencoderKL config.json (other hub "
            "ids are not looked up offline; download the folder and pass it)."
        )
    config = read_json(path, "the VAE's config", "pass a folder that save_pretrained wrote")
    if not isinstance(config, dict):
        raise UserError(
            f"the VAE's config {path} must hold a JSON object: pass a folder that save_pretrained wrote."
        )
    return {k: v for k, v in config.items() if not k.startswith("_")}


def model_for_image(
    model: str | None,
    image_size: int,
    vae: bool | dict | None = True,
    latent_size: int | None = None,
    in_channels: int | None = None,
    **overrides,
) -> DiTConfig:
    """The DiT config for ``image_size`` pixels: the VAE's latents (``vae`` True: the SD VAE's) or the pixels."""
    vae_config = SD_VAE_CONFIG if vae is True else (vae or None)
    down, channels = 1, 3
    if vae_config is not None:
        down = latent_downsample_of(vae_config)
        channels = int(vae_config.get("latent_channels", AUTOENCODER_KL_DEFAULTS["latent_channels"]))
    if latent_size is None:
        if image_size % down:
            raise UserError(
                f"--image-size {image_size} is not a multiple of {down} (the VAE's downsampling); "
                f"pick a multiple of {down}, or pass --latent-size / --vae none."
            )
        latent_size = image_size // down
    fields = {"input_size": latent_size, "in_channels": in_channels or channels}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if model is None:
        missing = [k for k in ("depth", "hidden_size", "num_heads", "patch_size") if k not in fields]
        if missing:
            raise UserError(
                "a custom model needs --depth, --hidden-size, --num-heads and --patch-size "
                f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)}), or pass --model."
            )
        return DiTConfig(**fields)
    return model_config(model, **fields)


@dataclass(frozen=True)
class Calibration:
    """A benchmark's calibration JSON: ``device`` as ``get_device_name()``, ``mfu`` as ``CostMeter`` reports it."""

    model: str
    image_size: int
    precision: str
    device: str
    mfu: float


def load_calibration(path: str) -> Calibration:
    data = read_json(path, "calibration file", "pass the JSON a benchmark wrote, or re-run the benchmark")
    missing = [k for k in Calibration.__dataclass_fields__ if not isinstance(data, dict) or k not in data]
    if missing:
        raise UserError(
            f"calibration file {path} lacks {', '.join(missing)}; see docs/cost_model.md for the schema."
        )
    casts = (str, int, str, str, float)  # the fields' types, in order
    cal = Calibration(*(cast(data[k]) for cast, k in zip(casts, Calibration.__dataclass_fields__)))
    if not 0 < cal.mfu <= 1:
        raise UserError(f"calibration file {path} has mfu {cal.mfu}; it must be in (0, 1].")
    return cal


def save_calibration(cal: Calibration, path: str, **extra) -> None:
    atomic_write_bytes(path, json.dumps({**asdict(cal), **extra}, indent=2).encode())


@dataclass(frozen=True)
class Budget:
    """What a plan runs on: the devices, the precision of their peak, the MFU or a calibration, a peak, a price."""

    num_devices: int = 1
    device: str | None = None
    precision: str = "bf16"
    mfu: float | None = None
    calibration: str | None = None
    price_per_device_hour: float | None = None
    peak_tflops: float | None = None


def _timing(cfg: DiTConfig, image_size: int, total_flops: float, images: int, b: Budget) -> Timing:
    """Time and money for ``total_flops`` on budget ``b``'s devices at an MFU of the peak; nulls without a device."""
    if b.device is None and b.mfu is None and b.calibration is None:
        if b.price_per_device_hour is not None:
            raise UserError("--price-per-hour needs a device and an MFU: pass --gpu and --mfu, or --calibration.")
        return Timing()
    if b.mfu is not None and b.calibration is not None:
        raise UserError("pass --mfu or --calibration, not both.")
    mfu, mfu_source, device = b.mfu, "given", b.device  # or a calibration's, which must match this plan
    if b.calibration is not None:
        cal = load_calibration(b.calibration)
        name = registry_name(cfg) or "custom"
        if (cal.model, cal.image_size, cal.precision) != (name, image_size, b.precision):
            raise UserError(
                f"calibration {b.calibration} is for {cal.model} at {cal.image_size} px in {cal.precision}, not "
                f"{name} at {image_size} px in {b.precision}: MFU does not carry over; benchmark this "
                "configuration or pass --mfu."
            )
        if device is not None and find_device(device) != find_device(cal.device):
            raise UserError(
                f"calibration {b.calibration} was measured on {cal.device!r}, not {device!r}: "
                "drop --gpu, or benchmark that device."
            )
        mfu, mfu_source, device = cal.mfu, f"calibration {b.calibration}", device or cal.device
    elif mfu is None:
        raise UserError(
            "--gpu gives time and cost only with an MFU: pass --mfu (model FLOPs utilisation, e.g. 0.4) or "
            "--calibration FILE from a benchmark; drop --gpu for the compute alone."
        )
    elif device is None:
        raise UserError("pass --gpu (a device name, e.g. H100-SXM; `dit-cost peaks` lists them).")
    override = b.peak_tflops is not None  # a plan takes the table's peak or this one, and never measures
    peak = resolve_peak(device, b.precision, b.peak_tflops) if override else table_peak(device, b.precision)
    seconds = total_flops / (b.num_devices * peak.flops * mfu)
    device_hours = seconds * b.num_devices / 3600
    price = b.price_per_device_hour
    return Timing(
        peak.device, peak.flops / 1e12, peak.source, mfu, mfu_source, images / seconds, seconds, device_hours,
        seconds / 86400, device_hours * price if price is not None else None, price,
    )  # fmt: skip


def plan_training(
    cfg: DiTConfig,
    image_size: int,
    global_batch_size: int,
    steps: int,
    budget: Budget = Budget(),
    checkpointed_blocks: int = 0,
    vae_config: dict | None = SD_VAE_CONFIG,
    fused_attention: bool = True,
    repa: RepaFlops | None = None,
    repa_cached: bool = False,
) -> TrainingPlan:
    """FLOPs per image, step and run (DiT, VAE encode, REPA apart), memory, and time and cost at one MFU."""
    num_devices, precision = budget.num_devices, budget.precision
    if global_batch_size % num_devices:
        raise UserError(
            f"--global-batch-size {global_batch_size} does not split over --num-gpus {num_devices}: "
            "make the batch a multiple of the device count."
        )
    train = training_flops_per_image(cfg, checkpointed_blocks, fused_attention)
    images = global_batch_size * steps
    total_flops = float(train.model) * images
    aux = float(repa.per_step_image(repa_cached)) if repa is not None else 0.0
    encode = vae_flops(vae_config, image_size).encode if vae_config is not None else None
    timing = _timing(cfg, image_size, total_flops + aux * images, images, budget)
    batch_per_device = global_batch_size // num_devices
    memory = None
    if precision in MEMORY_PRECISIONS:
        estimate = estimate_training_memory(
            cfg, batch_per_device, precision, checkpointed_blocks, world_size=num_devices
        )
        capacity = device_memory_bytes(timing.device) if timing.device else None
        memory = TrainMemory(estimate.total / 2**30, capacity / 2**30 if capacity else None)
    return TrainingPlan(
        registry_name(cfg) or "custom", describe(cfg), image_size, global_batch_size, batch_per_device,
        num_devices, precision, steps, images, train.forward / 1e9, train.model / 1e9, train.model / 2e9,
        train.hardware / 1e9, "fused" if fused_attention else "explicit", checkpointed_blocks,
        float(train.model) * global_batch_size, total_flops, total_flops / 2,
        *((encode / 1e9, encode * global_batch_size, encode * images) if encode is not None else (None,) * 3),
        *((repa.encoder_forward / 1e9, repa.projector_train / 1e9, repa_cached) if repa is not None else (None,) * 3),
        aux / 1e9, aux / train.model, aux * images, timing, memory,
    )  # fmt: skip


def plan_sampling(
    cfg: DiTConfig,
    image_size: int,
    num_images: int,
    num_sampling_steps: int,
    guidance_scale: float,
    budget: Budget = Budget(),
    vae_config: dict | None = SD_VAE_CONFIG,
    unguided_nfe: int = 0,
    path_drop: bool = False,
    guide: DiTConfig | None = None,
) -> SampleBudget:
    """FLOPs to sample ``num_images`` (steps x forward, x2 guided, + VAE decode), and time and cost at one MFU."""
    decode = vae_flops(vae_config, image_size).decode if vae_config is not None else 0
    per_image = sampling_flops_per_image(
        cfg, num_sampling_steps, guidance_scale, vae_decode_flops=decode, unguided_nfe=unguided_nfe,
        path_drop=path_drop, guide=guide,
    )  # fmt: skip
    total = per_image.total * num_images
    guide_cost = None
    if guide is not None:
        guide_cost = GuideCost(
            registry_name(guide) or "custom", forward_macs(guide, ratio=0).flops / 1e9, describe(guide)
        )
    return SampleBudget(
        registry_name(cfg) or "custom", describe(cfg), image_size, num_images, budget.num_devices, budget.precision,
        num_sampling_steps, guidance_scale, guidance_scale > 1, per_image.forward_passes,
        forward_macs(cfg, ratio=0).flops / 1e9, guide_cost, per_image.model / 1e9, per_image.model / 2e9,
        per_image.vae_decode / 1e9, per_image.total / 1e9, per_image.model * num_images,
        per_image.vae_decode * num_images, total, total / 2, _timing(cfg, image_size, total, num_images, budget),
    )  # fmt: skip


def plan_memory(
    cfg: DiTConfig,
    batch_per_device: int,
    precision: str = "bf16",
    checkpointed_blocks: int | str = 0,
    ema: bool = True,
    sharding: str = "ddp",
    world_size: int = 1,
    capacity_bytes: int | None = None,
    reserve_gib: float | None = None,
    trace: bool = False,
    ema_profiles: int = 0,
) -> MemoryPlan:
    """Step memory per device (analytic, optionally traced) and, with a capacity, the largest batch that fits."""
    usable = usable_memory(capacity_bytes, reserve_gib) if capacity_bytes is not None else None
    options = dict(
        precision=precision, ema=ema, sharding=sharding, world_size=world_size, ema_profiles=ema_profiles
    )
    if checkpointed_blocks == "auto":
        if usable is None:
            raise UserError(
                "--activation-checkpointing auto needs the device's memory: pass --gpu or --memory-gib."
            )
        checkpointed_blocks = fewest_checkpointed_blocks(cfg, batch_per_device, usable, **options)
    options["checkpointed_blocks"] = checkpointed_blocks
    estimate = estimate_training_memory(cfg, batch_per_device, **options)
    traced, fit = (None, None), (None, None, None)
    if trace:
        if world_size > 1:
            raise UserError("--trace runs one device; drop --num-gpus (sharding is analytic only).")
        peak = trace_training_memory(cfg, batch_per_device, precision, checkpointed_blocks, ema=ema)
        traced = peak.peak_bytes, peak.at_peak
    if capacity_bytes is not None:
        largest = max_batch_that_fits(cfg, usable, **options) if usable > 0 else 0
        fit = capacity_bytes, capacity_bytes - usable, largest
    return MemoryPlan(
        describe(cfg), batch_per_device, precision, ema, sharding, world_size, ema_profiles or None,
        checkpointed_blocks, estimate.total, estimate.parts, estimate.phase, *traced, *fit,
    )  # fmt: skip
