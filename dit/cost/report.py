"""What a plan reports: the training, sampling and memory plans as dataclasses, and their one renderer (the text,
or ``--json``: the fields in order, each nested part's in its place). No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields


def _part(**default):
    """A field holding a nested part: its fields stand in its place in the JSON, none of them when it is None."""
    return field(**default, metadata={"part": True})


def flat(plan) -> dict:
    """A plan's JSON object: fields in order, parts in place; None optionals and text-only fields left out."""
    out = {}
    for f in fields(plan):
        value = getattr(plan, f.name)
        if f.metadata.get("part"):
            out.update(flat(value) if value is not None else {})
        elif not (f.metadata.get("text") or f.metadata.get("optional") and value is None):
            out[f.name] = value
    return out


@dataclass(frozen=True)
class Timing:
    """Time and money of a plan; every field None without a device and an MFU (or a calibration)."""

    device: str | None = None
    peak_tflops_per_device: float | None = None
    peak_source: str | None = None
    mfu: float | None = None
    mfu_source: str | None = None
    images_per_sec: float | None = None
    seconds: float | None = None
    device_hours: float | None = None
    days: float | None = None
    cost: float | None = None
    price_per_device_hour: float | None = None


@dataclass(frozen=True)
class TrainMemory:
    """A training plan's analytic memory per device, and the device's (None when its name does not say)."""

    memory_gib_per_device: float
    device_memory_gib: float | None


@dataclass(frozen=True)
class RepaUse:
    repa_encoder: str
    repa_input_size: int


@dataclass(frozen=True)
class EmaSnapshots:
    ema_snapshots: int
    ema_snapshot_gib: float
    ema_snapshots_gib: float


@dataclass(frozen=True)
class TrainingPlan:
    """FLOPs of a training run (the DiT's; the VAE encoder's and REPA's beside them), its time and money."""

    model: str
    description: str
    image_size: int
    global_batch_size: int
    batch_per_device: int
    num_devices: int
    precision: str
    steps: int
    images: int
    forward_gflops_per_image: float
    train_gflops_per_image: float
    train_gmacs_per_image: float
    hardware_gflops_per_image: float
    hardware_attention: str
    checkpointed_blocks: int
    step_flops: float
    total_flops: float
    total_macs: float  # the DiT paper's "Gflops" convention
    vae_encode_gflops_per_image: float | None
    vae_encode_flops_per_step: float | None
    vae_encode_total_flops_on_the_fly: float | None
    repa_encoder_forward_gflops_per_image: float | None
    repa_projector_train_gflops_per_image: float | None
    repa_features_cached: bool | None
    aux_gflops_per_image: float
    aux_share_of_dit: float
    aux_total_flops: float
    timing: Timing = _part()
    memory: TrainMemory | None = _part()
    repa: RepaUse | None = _part(default=None)
    ema: EmaSnapshots | None = _part(default=None)


@dataclass(frozen=True)
class GuideCost:
    """Autoguidance's guide in a sampling plan: its name and forward FLOPs (and its description, for the text)."""

    guide_model: str
    guide_forward_gflops: float
    description: str = field(metadata={"text": True})


@dataclass(frozen=True)
class Evaluations:
    """Which network evaluations a sampler makes per image (the command's sampling plan)."""

    sampler: str
    guidance_interval: list[float] | None
    nfe: int
    guided_nfe: int
    unguided_nfe: int


@dataclass(frozen=True)
class SampleBudget:
    """FLOPs of sampling N images (the DiT's and the VAE decode's), its time and money."""

    model: str
    description: str
    image_size: int
    num_images: int
    num_devices: int
    precision: str
    num_sampling_steps: int
    guidance_scale: float
    guided: bool
    forward_passes_per_image: int
    forward_gflops: float
    guide: GuideCost | None = _part()
    model_gflops_per_image: float
    model_gmacs_per_image: float
    vae_decode_gflops_per_image: float
    gflops_per_image: float
    total_model_flops: float
    total_vae_flops: float
    total_flops: float
    total_macs: float
    timing: Timing = _part()
    evaluations: Evaluations | None = _part(default=None)


@dataclass(frozen=True)
class MemoryPlan:
    """Step memory per device (analytic, optionally traced) and, with a device's memory, the largest batch."""

    model: str
    batch_per_device: int
    precision: str
    ema: bool
    sharding: str
    world_size: int
    ema_profiles: int | None = field(metadata={"optional": True})  # absent without post-hoc EMA
    checkpointed_blocks: int
    estimate_bytes: int
    estimate_parts: dict[str, int]
    peak_phase: str
    traced_bytes: int | None = field(metadata={"optional": True})  # with --trace: MemTracker's peak, by category
    traced_parts: dict[str, int] | None = field(metadata={"optional": True})
    # with a device's memory: it, what is kept free, and the largest batch per device that fits the rest
    device_memory_bytes: int | None = field(metadata={"optional": True})
    reserve_bytes: int | None = field(metadata={"optional": True})
    max_batch_per_device: int | None = field(metadata={"optional": True})


def print_table(rows: list[list], headers: list[str]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_pairs(pairs: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        print(f"{key.ljust(width)}  {value}")


def num(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def _timing_pairs(t: Timing, num_devices: int, precision: str) -> list[tuple[str, object]]:
    if t.seconds is None:
        return [("time and cost", "pass --gpu and --mfu (or --calibration) for throughput, hours and price")]
    pairs = [
        ("devices", f"{num_devices} x {t.device}, peak {num(t.peak_tflops_per_device, 1)} TFLOP/s "
                    f"{precision} ({t.peak_source})"),
        ("MFU", f"{t.mfu:.3f} ({t.mfu_source})"),
        ("throughput", f"{num(t.images_per_sec, 2)} images/s"),
        ("device-hours", num(t.device_hours, 1)),
        ("wall-clock", f"{num(t.days, 3)} days ({num(t.seconds / 3600, 2)} h)"),
    ]  # fmt: skip
    if t.cost is not None:
        pairs.append(("cost", f"{num(t.cost, 2)} at {t.price_per_device_hour} per device-hour"))
    return pairs


def _training_pairs(r: TrainingPlan) -> list[tuple[str, object]]:
    out = [
        ("model", f"{r.description} at {r.image_size} px"),
        ("run", f"{r.steps:,} steps x global batch {r.global_batch_size} = {r.images:,} images"),
        ("DiT / image", f"{num(r.train_gflops_per_image, 2)} GFLOP = {num(r.train_gmacs_per_image, 2)} GMAC "
                        f"(3 x forward {num(r.forward_gflops_per_image, 2)} GFLOP)"),
        ("DiT / step", f"{r.step_flops:.4e} FLOP"),
        ("total FLOPs (DiT)", f"{r.total_flops:.4e} FLOP = {r.total_macs:.4e} MAC (paper 'flops')"),
    ]  # fmt: skip
    if r.vae_encode_gflops_per_image is not None:
        enc = r.vae_encode_gflops_per_image
        out.append(
            ("VAE encode", f"{num(enc, 2)} GFLOP = {num(enc / 2, 2)} GMAC per image: "
             f"{r.vae_encode_flops_per_step:.4e} FLOP per step and {r.vae_encode_total_flops_on_the_fly:.4e} "
             "in total if encoded on the fly; once per image view if pre-extracted (extract_features.py)")
        )  # fmt: skip
    if r.repa_encoder_forward_gflops_per_image is not None:
        enc, proj = r.repa_encoder_forward_gflops_per_image, r.repa_projector_train_gflops_per_image
        where = "once per image view, at extraction" if r.repa_features_cached else "in every step"
        out.append(
            ("REPA (auxiliary)", f"{r.repa.repa_encoder} at {r.repa.repa_input_size} px forward {num(enc, 2)} GFLOP "
             f"per image ({where}) + projector {num(proj, 2)} GFLOP (trained, 3x forward) = "
             f"{num(r.aux_gflops_per_image, 2)} GFLOP per training image, {r.aux_share_of_dit:.1%} of the "
             f"DiT's; {r.aux_total_flops:.4e} FLOP in total (time below counts it; mfu is the DiT's)")
        )  # fmt: skip
    out += _timing_pairs(r.timing, r.num_devices, r.precision)
    if r.ema is not None:
        e = r.ema
        out.append(("post-hoc EMA snapshots", f"{e.ema_snapshots:,} x {num(e.ema_snapshot_gib, 3)} GiB = "
                    f"{num(e.ema_snapshots_gib, 3)} GiB of disk, all kept (checkpoints/ema/)"))  # fmt: skip
    if r.memory is not None:
        m = r.memory
        cap = f" of {num(m.device_memory_gib, 0)} GiB" if m.device_memory_gib else ""
        out.append(("memory / device", f"{num(m.memory_gib_per_device, 1)} GiB{cap} (analytic, AdamW + EMA, "
                                       f"{r.batch_per_device} images per device)"))  # fmt: skip
    return out


def _sampling_pairs(r: SampleBudget) -> list[tuple[str, object]]:
    e = r.evaluations
    guided = f" (guidance {r.guidance_scale:g} doubles the batch)" if e.guided_nfe else " (no guidance)"
    if e.guidance_interval:
        guided += f", guided in [{e.guidance_interval[0]:g}, {e.guidance_interval[1]:g}]"
    passes = f"{r.forward_passes_per_image} passes x {num(r.forward_gflops, 2)} GFLOP"
    if r.guide is not None:
        guided = f" (autoguidance {r.guidance_scale:g}: the second pass the guide's)" if e.guided_nfe else guided
        passes = (f"{e.nfe} passes x {num(r.forward_gflops, 2)} GFLOP + {e.guided_nfe} guide passes x "
                  f"{num(r.guide.guide_forward_gflops, 2)} GFLOP")  # fmt: skip
    out = [
        ("model", f"{r.description} at {r.image_size} px"),
        *([("guide", r.guide.description)] if r.guide is not None else []),
        ("DiT / image", f"{e.nfe} network evaluations (NFE; {e.sampler}, {r.num_sampling_steps} steps): "
                        f"{e.guided_nfe} guided x 2 passes + {e.unguided_nfe} unguided x 1 pass{guided} = "
                        f"{passes} = "
                        f"{num(r.model_gflops_per_image / 1e3, 4)} TFLOP = {num(r.model_gmacs_per_image / 1e3, 4)} TMAC"),
    ]  # fmt: skip
    if r.vae_decode_gflops_per_image:
        out.append(("VAE decode / image", f"{num(r.vae_decode_gflops_per_image, 2)} GFLOP"))
    out += [
        ("total", f"{r.total_flops:.4e} FLOP for {r.num_images:,} images (DiT {r.total_model_flops:.4e}, "
                  f"VAE {r.total_vae_flops:.4e}) = {r.total_macs:.4e} MAC"),
        *_timing_pairs(r.timing, r.num_devices, r.precision),
    ]  # fmt: skip
    if r.timing.seconds is not None and r.vae_decode_gflops_per_image:
        out.append(("note", "the VAE decode is assumed to run at the DiT's MFU"))
    return out


def _print_memory(r: MemoryPlan) -> None:
    print(
        f"{r.model}, batch {r.batch_per_device} per device, {r.precision}, {r.checkpointed_blocks} checkpointed "
        f"blocks, {'EMA, ' if r.ema else ''}{r.sharding} x {r.world_size}\n"
    )
    print_table([[k, num(v / 2**30, 3)] for k, v in r.estimate_parts.items()], ["part", "GiB"])
    pairs = [("analytic peak", f"{num(r.estimate_bytes / 2**30, 3)} GiB (at the {r.peak_phase})")]
    if r.traced_bytes is not None:
        t = r.traced_bytes
        pairs.append(
            ("traced peak (FakeTensor)", f"{num(t / 2**30, 3)} GiB (analytic/traced {r.estimate_bytes / t:.3f})")
        )
    if r.device_memory_bytes is not None:
        pairs.append(("device memory", f"{num(r.device_memory_bytes / 2**30, 1)} GiB, "
                                       f"{num(r.reserve_bytes / 2**30, 1)} GiB kept for context and allocator"))  # fmt: skip
        pairs.append(("largest batch per device that fits", r.max_batch_per_device))
    print()
    print_pairs(pairs)


def show(plan: TrainingPlan | SampleBudget | MemoryPlan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(flat(plan), indent=2))
    elif isinstance(plan, MemoryPlan):
        _print_memory(plan)
    else:
        print_pairs(_training_pairs(plan) if isinstance(plan, TrainingPlan) else _sampling_pairs(plan))
