"""Budgets before a run: FLOPs, device-hours, days and money for training, and for sampling N images.

Time comes from FLOPs / (devices x peak x MFU). MFU is never assumed: pass it, or pass the calibration
JSON a benchmark wrote for this model, image size, precision and device (schema: ``Calibration``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from dit.atomic import atomic_write_bytes
from dit.cost.analytic import (
    SD_VAE_CONFIG,
    forward_macs,
    sampling_flops_per_image,
    training_flops_per_image,
    vae_flops,
)
from dit.cost.memory import MEMORY_PRECISIONS, estimate_training_memory
from dit.cost.peaks import Peak, device_memory_bytes, find_device, resolve_peak, table_peak
from dit.errors import UserError
from dit.model_config import DiTConfig, describe, model_config, registry_name

VAE_DOWNSAMPLE = 8  # SD VAE: 256 px images -> 32 x 32 x 4 latents


def model_for_image(
    model: str | None,
    image_size: int,
    vae: bool = True,
    latent_size: int | None = None,
    in_channels: int | None = None,
    **overrides,
) -> DiTConfig:
    """The DiT config for images of ``image_size`` pixels: latents of image/8 x 4 channels with the VAE,
    the pixels themselves (3 channels) without it. ``model`` None builds a custom config from overrides."""
    if image_size is None or image_size <= 0:
        raise UserError(f"--image-size must be a positive number of pixels, got {image_size}.")
    if latent_size is None:
        if vae and image_size % VAE_DOWNSAMPLE:
            raise UserError(
                f"--image-size {image_size} is not a multiple of {VAE_DOWNSAMPLE} (the VAE's downsampling); "
                "pick a multiple of 8, or pass --latent-size / --no-vae."
            )
        latent_size = image_size // VAE_DOWNSAMPLE if vae else image_size
    elif latent_size <= 0:
        raise UserError(f"--latent-size must be positive, got {latent_size}.")
    fields = {"input_size": latent_size, "in_channels": in_channels or (4 if vae else 3)}
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


# --------------------------------------------------------------------------------------------------------
# Calibration: what a benchmark measured, so that plans use a real MFU
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Calibration JSON: required keys below; anything else a benchmark adds is kept in the file, ignored.

    {"model": "DiT-XL/2", "image_size": 256, "precision": "bf16", "device": "NVIDIA H100 80GB HBM3",
     "mfu": 0.41}
    ``device`` is the ``torch.cuda.get_device_name()`` string (or a table name); ``mfu`` is model FLOPs
    (3 x forward, 2 FLOPs per MAC) per second over the datasheet peak, as ``CostMeter`` reports it.
    """

    model: str
    image_size: int
    precision: str
    device: str
    mfu: float


def load_calibration(path: str) -> Calibration:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"calibration file {path} does not exist: pass the JSON a benchmark wrote.") from None
    except json.JSONDecodeError as e:
        raise UserError(f"calibration file {path} is not valid JSON ({e}): re-run the benchmark.") from None
    missing = [k for k in Calibration.__dataclass_fields__ if not isinstance(data, dict) or k not in data]
    if missing:
        raise UserError(
            f"calibration file {path} lacks {', '.join(missing)}; see docs/cost_model.md for the schema."
        )
    cal = Calibration(
        model=str(data["model"]),
        image_size=int(data["image_size"]),
        precision=str(data["precision"]),
        device=str(data["device"]),
        mfu=float(data["mfu"]),
    )
    if not 0 < cal.mfu <= 1:
        raise UserError(f"calibration file {path} has mfu {cal.mfu}; it must be in (0, 1].")
    return cal


def save_calibration(cal: Calibration, path: str, **extra) -> None:
    """Write a calibration atomically (a half-written file would mislead every later plan)."""
    atomic_write_bytes(path, json.dumps({**asdict(cal), **extra}, indent=2).encode())


def _mfu_and_device(
    cfg: DiTConfig, image_size: int, precision: str, device: str | None, mfu: float | None, calibration: str | None
) -> tuple[float, str, str]:
    """(mfu, where it came from, device name) from --mfu or a calibration that matches this plan."""
    if mfu is not None and calibration is not None:
        raise UserError("pass --mfu or --calibration, not both.")
    if calibration is not None:
        cal = load_calibration(calibration)
        name = registry_name(cfg) or "custom"
        if (cal.model, cal.image_size, cal.precision) != (name, image_size, precision):
            raise UserError(
                f"calibration {calibration} is for {cal.model} at {cal.image_size} px in {cal.precision}, not "
                f"{name} at {image_size} px in {precision}: MFU does not carry over; benchmark this "
                "configuration or pass --mfu."
            )
        if device is not None and find_device(device) != find_device(cal.device):
            raise UserError(
                f"calibration {calibration} was measured on {cal.device!r}, not {device!r}: "
                "drop --gpu, or benchmark that device."
            )
        return cal.mfu, f"calibration {calibration}", device or cal.device
    if mfu is None:
        raise UserError("pass --mfu (model FLOPs utilisation, e.g. 0.4) or --calibration FILE from a benchmark.")
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], got {mfu}.")
    if device is None:
        raise UserError("pass --gpu (a device name, e.g. H100-SXM; `dit-cost peaks` lists them).")
    return mfu, "given", device


def _peak(device: str, precision: str, peak_tflops: float | None) -> Peak:
    if peak_tflops is not None:
        return resolve_peak(device, precision, override_tflops=peak_tflops)
    return table_peak(device, precision)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise UserError(f"{name} must be positive, got {value}.")


def _budget(
    total_flops: float,
    num_devices: int,
    peak: Peak,
    mfu: float,
    mfu_source: str,
    price_per_device_hour: float | None,
) -> dict:
    """Time and money for ``total_flops`` on ``num_devices`` running at ``mfu`` of ``peak``."""
    seconds = total_flops / (num_devices * peak.flops * mfu)
    device_hours = seconds * num_devices / 3600
    return {
        "total_flops": total_flops,
        "device": peak.device,
        "num_devices": num_devices,
        "precision": peak.precision,
        "peak_tflops_per_device": peak.flops / 1e12,
        "peak_source": peak.source,
        "mfu": mfu,
        "mfu_source": mfu_source,
        "seconds": seconds,
        "device_hours": device_hours,
        "days": seconds / 86400,
        "price_per_device_hour": price_per_device_hour,
        "cost": device_hours * price_per_device_hour if price_per_device_hour is not None else None,
    }


# --------------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------------


def plan_training(
    cfg: DiTConfig,
    image_size: int,
    global_batch_size: int,
    steps: int,
    num_devices: int,
    device: str | None = None,
    precision: str = "bf16",
    mfu: float | None = None,
    calibration: str | None = None,
    price_per_device_hour: float | None = None,
    peak_tflops: float | None = None,
    checkpointed_blocks: int = 0,
) -> dict:
    """FLOPs in both conventions, device-hours, days and cost of a training run, plus memory per device."""
    for name, value in (
        ("--global-batch-size", global_batch_size),
        ("--steps", steps),
        ("--num-gpus", num_devices),
    ):
        _positive(name, value)
    _positive("--price-per-hour", price_per_device_hour)
    if global_batch_size % num_devices:
        raise UserError(
            f"--global-batch-size {global_batch_size} does not split over --num-gpus {num_devices}: "
            "make the batch a multiple of the device count."
        )
    mfu, mfu_source, device = _mfu_and_device(cfg, image_size, precision, device, mfu, calibration)
    peak = _peak(device, precision, peak_tflops)
    train = training_flops_per_image(cfg, checkpointed_blocks=checkpointed_blocks)
    images = global_batch_size * steps
    total_flops = float(train.model) * images
    budget = _budget(total_flops, num_devices, peak, mfu, mfu_source, price_per_device_hour)
    batch_per_device = global_batch_size // num_devices
    plan = {
        "model": registry_name(cfg) or "custom",
        "description": describe(cfg),
        "image_size": image_size,
        "global_batch_size": global_batch_size,
        "batch_per_device": batch_per_device,
        "steps": steps,
        "images": images,
        "forward_gflops_per_image": train.forward / 1e9,
        "train_gflops_per_image": train.model / 1e9,
        "total_macs": total_flops / 2,  # the DiT paper's "Gflops" convention
        "images_per_sec": images / budget["seconds"],
        **budget,
    }
    if precision in MEMORY_PRECISIONS:
        memory = estimate_training_memory(
            cfg, batch_per_device, precision, checkpointed_blocks, world_size=num_devices
        )
        plan["memory_gib_per_device"] = memory.total / 2**30
        capacity = device_memory_bytes(device)
        plan["device_memory_gib"] = capacity / 2**30 if capacity else None
    return plan


def plan_sampling(
    cfg: DiTConfig,
    image_size: int,
    num_images: int,
    num_sampling_steps: int,
    cfg_scale: float,
    num_devices: int,
    device: str | None = None,
    precision: str = "bf16",
    mfu: float | None = None,
    calibration: str | None = None,
    price_per_device_hour: float | None = None,
    peak_tflops: float | None = None,
    vae_config: dict | None = SD_VAE_CONFIG,
) -> dict:
    """FLOPs, time and cost to sample ``num_images``: steps x forward (x2 with guidance) + VAE decode.

    The VAE decode is assumed to run at the same MFU as the DiT (say so when quoting the time).
    """
    _positive("--num-images", num_images)
    _positive("--num-gpus", num_devices)
    _positive("--price-per-hour", price_per_device_hour)
    mfu, mfu_source, device = _mfu_and_device(cfg, image_size, precision, device, mfu, calibration)
    peak = _peak(device, precision, peak_tflops)
    decode = vae_flops(vae_config, image_size).decode if vae_config is not None else 0
    per_image = sampling_flops_per_image(cfg, num_sampling_steps, cfg_scale, vae_decode_flops=decode)
    budget = _budget(per_image.total * num_images, num_devices, peak, mfu, mfu_source, price_per_device_hour)
    return {
        "model": registry_name(cfg) or "custom",
        "image_size": image_size,
        "num_images": num_images,
        "num_sampling_steps": num_sampling_steps,
        "cfg_scale": cfg_scale,
        "forward_passes_per_image": per_image.forward_passes,
        "forward_gflops": forward_macs(cfg).flops / 1e9,
        "model_gflops_per_image": per_image.model / 1e9,
        "vae_decode_gflops_per_image": per_image.vae_decode / 1e9,
        "gflops_per_image": per_image.total / 1e9,
        "images_per_sec": num_images / budget["seconds"],
        **budget,
    }
