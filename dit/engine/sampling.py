"""Sampling from DiT checkpoints: image grids for people and reproducible FID sample sets for evaluators.

Semantics follow the official DiT scripts: classifier-free guidance on a [conditional; unconditional]
batch that shares its noise, the null label ``num_classes``, ``clip_denoised=False``, VAE decoding of
``latents / scaling_factor`` and uint8 via ``clamp(127.5 x + 128)``. One deliberate change: every image
draws its noise from its own generator seeded by (seed, image index), so a sample set is the same on any
number of devices and after any resume (the official per-rank seeding is not).
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torchvision.utils import save_image
from tqdm import tqdm

from dit.atomic import atomic_write
from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.cost.peaks import peak_for_current_device
from dit.diffusion import create_diffusion
from dit.engine.checkpoint import load_checkpoint, model_weights
from dit.engine.host_memory import keep_freed_host_memory
from dit.errors import UserError
from dit.models import MODEL_NAMES, DiT, DiTConfig, model_config, registry_name
from dit.vae import VAE_ALIASES, decode, latent_downsample, load_vae

SAMPLERS = ("ddpm", "ddim")
PRECISIONS = ("fp32", "tf32", "bf16")
# The official sample.py's classes: golden retriever, otter, red panda, geyser, macaw, valley, balloon, arctic fox.
OFFICIAL_CLASS_LABELS = (207, 360, 387, 974, 88, 979, 417, 279)
DEFAULT_MODEL, DEFAULT_IMAGE_SIZE, DEFAULT_NUM_CLASSES = "DiT-XL/2", 256, 1000

# --------------------------------------------------------------------------------------------------------
# Model and VAE from a checkpoint
# --------------------------------------------------------------------------------------------------------


@dataclass
class SamplingModel:
    """A DiT in eval mode with what sampling needs to know about it."""

    model: DiT
    weights: str  # which weights were loaded: "ema", "model" or "state_dict"
    image_size: int  # pixels per side of the images it makes
    vae: torch.nn.Module | None  # None: a pixel-space model whose outputs are images in [-1, 1]
    vae_spec: str | None
    noise_schedule: str = "linear"
    predict_xstart: bool = False

    @property
    def config(self) -> DiTConfig:
        return self.model.config


def recorded_run_config(ckpt: dict) -> dict:
    """What a checkpoint says about its run: ours under ``config``, official train.py under ``args``."""
    for key in ("config", "args"):
        if isinstance(ckpt.get(key), dict):
            return dict(ckpt[key])
    return {}


def _agree(flag: str, given, recorded):
    """The recorded value unless the user asked for a different one, which is a mistake worth naming."""
    if given is not None and recorded is not None and given != recorded:
        raise UserError(
            f"{flag} {given} does not match the checkpoint, which was trained with {flag} {recorded}: "
            f"drop {flag} or pass {recorded}."
        )
    return given if given is not None else recorded


def load_sampling_model(
    ckpt_path: str | os.PathLike,
    model: str | None = None,
    image_size: int | None = None,
    num_classes: int | None = None,
    vae: str | None = None,
    use_ema: bool = True,
    device: str | torch.device = "cpu",
    sd_decoder: str = "mse",
) -> SamplingModel:
    """Build and load the DiT a checkpoint holds, and the VAE to decode its samples.

    Our checkpoints carry their model config and run config; official ``train.py`` files carry ``args``;
    official releases are bare state dicts, built from ``model``/``image_size``/``num_classes`` (official
    defaults DiT-XL/2, 256, 1000). ``vae``: a spec for ``dit.vae.load_vae``, "none" for pixel space, or
    None for the default: the SD decoder ``sd_decoder`` (the official sample.py uses mse, sample_ddp.py
    ema) for runs on SD latents or of unknown kind, the run's own VAE when it was another one, and none
    when the run was pixel space.
    """
    if torch.device(device).type == "cpu":
        keep_freed_host_memory()
    ckpt = load_checkpoint(ckpt_path)
    run = recorded_run_config(ckpt)
    weights, which = model_weights(ckpt, use_ema)

    recorded_pixel = "vae" in run and run["vae"] in (None, "none")
    if vae == "none" and "vae" in run and not recorded_pixel:
        raise UserError(
            f"--vae none asks for a pixel-space model, but the checkpoint was trained on {run['vae']!r} latents: "
            "drop --vae none (or pass a VAE such as --vae mse)."
        )
    if vae not in (None, "none") and recorded_pixel:
        raise UserError(f"the checkpoint is a pixel-space model (trained without a VAE): drop --vae {vae}.")
    pixel = recorded_pixel or vae == "none"
    # The SD decoders share one latent space (ema or mse decode the same latents); any other VAE does not.
    recorded_vae = run.get("vae")
    sd_family = recorded_vae in (None, *VAE_ALIASES, *VAE_ALIASES.values())
    vae_spec = None if pixel else (vae or (sd_decoder if sd_family else recorded_vae))
    vae_module = None if pixel else load_vae(vae_spec, device=device, dtype=torch.float32)
    factor = 1 if pixel else latent_downsample(vae_module)

    if "model_config" in ckpt:
        cfg = DiTConfig(**ckpt["model_config"])
        name = registry_name(cfg) or "custom"
        if model is not None and model != name:
            raise UserError(f"--model {model} does not match the checkpoint, which holds {name}: drop --model.")
        _agree("--num-classes", num_classes, cfg.num_classes)
        image_size = _agree("--image-size", image_size, run.get("image_size")) or cfg.input_size * factor
    else:
        name = _agree("--model", model, run.get("model")) or DEFAULT_MODEL
        image_size = _agree("--image-size", image_size, run.get("image_size")) or DEFAULT_IMAGE_SIZE
        num_classes = _agree("--num-classes", num_classes, run.get("num_classes")) or DEFAULT_NUM_CLASSES
        if image_size % factor:
            raise UserError(f"--image-size {image_size} is not a multiple of the VAE's downsampling {factor}.")
        # A pixel-space bare state dict does not say its channel count; its patch embedding does.
        patch = weights.get("x_embedder.proj.weight")
        channels = patch.shape[1] if pixel and patch is not None else (3 if pixel else 4)
        cfg = model_config(name, input_size=image_size // factor, num_classes=num_classes, in_channels=channels)
    if cfg.input_size * factor != image_size:
        raise UserError(
            f"--image-size {image_size} needs a model input of {image_size // factor}, but the checkpoint's model "
            f"takes {cfg.input_size}: pass --image-size {cfg.input_size * factor}."
        )
    if pixel and cfg.in_channels not in (1, 3):
        raise UserError(
            f"a pixel-space model must make 1- or 3-channel images, this one has {cfg.in_channels} channels: "
            "pass the VAE it was trained with (--vae)."
        )

    net = DiT.from_config(cfg)
    net.load_weights(weights, source=f"{ckpt_path} ({which} weights)")
    net = net.to(device).eval().requires_grad_(False)
    schedule = run.get("noise_schedule") or "linear"
    return SamplingModel(net, which, image_size, vae_module, vae_spec, schedule, bool(run.get("predict_xstart")))


# --------------------------------------------------------------------------------------------------------
# Checks on what the user asked for
# --------------------------------------------------------------------------------------------------------


def parse_cfg_channels(value: str | int) -> int | str:
    """``--cfg-channels``: 3 (the official behaviour, used for the paper's FID) or "all"."""
    if str(value) == "all":
        return "all"
    if str(value) == "3":
        return 3
    raise UserError(f"--cfg-channels must be 3 (official) or all, got {value!r}.")


def check_guidance(cfg_scale: float, cfg: DiTConfig):
    if not cfg_scale >= 1.0:
        raise UserError(f"--cfg-scale must be >= 1 (1 disables guidance), got {cfg_scale}.")
    if cfg_scale > 1.0 and cfg.class_dropout_prob <= 0:
        raise UserError(
            "this model was trained without class dropout, so it has no unconditional label to guide against: "
            "pass --cfg-scale 1."
        )


def check_labels(labels: Sequence[int], num_classes: int) -> list[int]:
    labels = [int(y) for y in labels]
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
    if num_classes == DEFAULT_NUM_CLASSES:
        return list(OFFICIAL_CLASS_LABELS)
    return [i % num_classes for i in range(8)]


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} was asked for but CUDA is not available: pass --device cpu.")
    return torch.device(device)


# --------------------------------------------------------------------------------------------------------
# Seeds, noise and the denoising loop
# --------------------------------------------------------------------------------------------------------


def _derived_seed(*words: int) -> int:
    """A 63-bit seed mixed from the words with numpy's SeedSequence, so nearby inputs give unrelated streams."""
    if any(w < 0 for w in words):
        raise UserError(f"seeds must be >= 0, got {words[0]}.")
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0] >> np.uint64(1))


def noise_seed(seed: int, index: int) -> int:
    """The seed of image ``index``'s noise: independent of rank, batch and world size."""
    return _derived_seed(seed, index, 0)


def fid_label(seed: int, index: int, num_classes: int) -> int:
    """Image ``index``'s class in a sample set: uniform like the official sample_ddp.py, but per image."""
    return int(np.random.default_rng(_derived_seed(seed, index, 1)).integers(num_classes))


class PerImageNoise:
    """Gaussian noise where row i always comes from image i's own generator, whatever the batch holds."""

    def __init__(self, seeds: Sequence[int], shape: Sequence[int], device: torch.device):
        self.shape, self.device = tuple(shape), device
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self) -> torch.Tensor:
        return torch.stack([torch.randn(self.shape, generator=g, device=self.device) for g in self.generators])


@contextmanager
def precision_scope(precision: str, device: torch.device):
    """fp32: exact float32 matmuls; tf32: TF32 matmuls and convs (Ampere+); bf16: autocast around the DiT.

    Yields the autocast context to wrap model calls with; the TF32 switches are restored on exit.
    """
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision = conv.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    try:
        if precision == "bf16":
            yield lambda: torch.autocast(device.type, dtype=torch.bfloat16)
        else:
            yield nullcontext
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


def guided_model_fn(model: DiT, cfg_scale: float, cfg_channels: int | str, autocast=nullcontext) -> Callable:
    """The model as the diffusion calls it: plain at scale 1, ``forward_with_cfg`` above; float32 out."""

    def fn(x, t, y):
        with autocast():
            out = model.forward_with_cfg(x, t, y, cfg_scale, cfg_channels) if cfg_scale > 1 else model(x, t, y)
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
    if sampler not in SAMPLERS:
        raise UserError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}.")
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


def make_diffusion(sm: SamplingModel, num_steps: int):
    if num_steps < 1:
        raise UserError(f"--num-sampling-steps must be >= 1, got {num_steps}.")
    return create_diffusion(
        str(num_steps),
        noise_schedule=sm.noise_schedule,
        learn_sigma=sm.config.learn_sigma,
        predict_xstart=sm.predict_xstart,
    )


def generate(
    sm: SamplingModel,
    diffusion,
    labels: Sequence[int],
    seeds: Sequence[int],
    sampler: str = "ddpm",
    cfg_scale: float = 1.0,
    cfg_channels: int | str = 3,
    autocast=nullcontext,
    progress: bool = False,
) -> torch.Tensor:
    """Images in [-1, 1], (N, 3, H, W) float32 on the CPU, one per (label, seed)."""
    cfg, device = sm.config, next(sm.model.parameters()).device
    shape = (cfg.in_channels, cfg.input_size, cfg.input_size)
    noise = PerImageNoise(seeds, shape, device)
    x = noise()
    y = torch.tensor(list(labels), dtype=torch.long, device=device)
    if cfg_scale > 1:  # [conditional; unconditional], sharing the noise; the null label is num_classes
        x, y = torch.cat([x, x]), torch.cat([y, torch.full_like(y, cfg.num_classes)])
    model_fn = guided_model_fn(sm.model, cfg_scale, cfg_channels, autocast)
    samples = denoise(model_fn, diffusion, x, y, sampler, noise, progress)[: len(labels)]
    images = decode(sm.vae, samples) if sm.vae is not None else samples.clamp(-1, 1)
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.float().cpu()


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [-1, 1] to (N, H, W, 3) uint8, rounding as the official sample_ddp.py does."""
    return torch.clamp(127.5 * images + 128.0, 0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


# --------------------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------------------


@dataclass
class SamplingCost:
    """What a batch of images cost: FLOPs from the analytic formula, time from the clock."""

    model_flops_per_image: float  # the DiT over all steps, doubled where guidance doubles the batch
    vae_flops_per_image: float  # one VAE decode; 0 for pixel-space models
    images: int
    wall_s: float
    peak_flops: float | None
    peak_source: str

    @property
    def flops_per_image(self) -> float:
        return self.model_flops_per_image + self.vae_flops_per_image

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mfu(self) -> float | None:
        """DiT FLOP/s over the device peak. The VAE decode is reported but not counted, as in training."""
        if not self.peak_flops or self.wall_s <= 0:
            return None
        return self.model_flops_per_image * self.images / self.wall_s / self.peak_flops

    def summary(self) -> str:
        if self.mfu is None:
            mfu = f"n/a ({self.peak_source})"
        else:
            mfu = f"{100 * self.mfu:.3g}% of {self.peak_flops / 1e12:.1f} TFLOP/s ({self.peak_source})"
        return (
            f"cost: {self.model_flops_per_image / 1e12:.4g} TFLOP/image DiT (guidance doubling included) + "
            f"{self.vae_flops_per_image / 1e12:.4g} TFLOP/image VAE decode; {self.images} images in "
            f"{self.wall_s:.2f} s = {self.images_per_s:.3g} images/s; MFU {mfu}"
        )


def flops_per_image(sm: SamplingModel, num_steps: int, cfg_scale: float) -> tuple[float, float]:
    """(DiT FLOPs incl. the guidance doubling, VAE decode FLOPs) per image, from the cost package."""
    decode_flops = float(vae_flops(dict(sm.vae.config), sm.image_size).decode) if sm.vae is not None else 0.0
    counted = sampling_flops_per_image(sm.config, num_steps, cfg_scale, vae_decode_flops=decode_flops)
    return counted.model, counted.vae_decode


def device_peak(precision: str, peak_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from), looked up before sampling: a device without a published rate
    gets MFU "n/a" and a reason, instead of an error after hours of sampling."""
    try:
        peak = peak_for_current_device(precision, peak_tflops)
    except UserError as e:
        if peak_tflops is not None:  # a bad --peak-tflops is the user's to fix
            raise
        return None, str(e)
    return peak.flops, f"{peak.device}, {peak.source}"


def measure_cost(
    sm: SamplingModel, num_steps: int, cfg_scale: float, images: int, wall_s: float, peak: tuple[float | None, str]
) -> SamplingCost:
    model_flops, decode_flops = flops_per_image(sm, num_steps, cfg_scale)
    return SamplingCost(model_flops, decode_flops, images, wall_s, *peak)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------------
# sample.py: a grid
# --------------------------------------------------------------------------------------------------------


@dataclass
class SampleConfig:
    ckpt: str
    model: str | None = None
    image_size: int | None = None
    num_classes: int | None = None
    vae: str | None = None
    cfg_scale: float = 4.0
    num_sampling_steps: int = 250
    sampler: str = "ddpm"
    class_labels: list[int] | None = None
    seed: int = 0
    cfg_channels: str = "3"
    precision: str = "tf32"
    ema: bool = True
    out: str = "sample.png"
    device: str | None = None
    peak_tflops: float | None = None
    nrow: int = 4
    progress: bool = True


@dataclass
class SampleReport:
    path: Path
    labels: list[int]
    weights: str
    cost: SamplingCost


def run_sample(c: SampleConfig) -> SampleReport:
    """Sample ``class_labels`` (one image each, image i seeded by (seed, i)) and write a PNG grid."""
    device = resolve_device(c.device)
    cfg_channels = parse_cfg_channels(c.cfg_channels)
    sm = load_sampling_model(c.ckpt, c.model, c.image_size, c.num_classes, c.vae, c.ema, device)
    check_guidance(c.cfg_scale, sm.config)
    labels = check_labels(
        c.class_labels if c.class_labels is not None else default_class_labels(sm.config.num_classes),
        sm.config.num_classes,
    )
    diffusion = make_diffusion(sm, c.num_sampling_steps)
    seeds = [noise_seed(c.seed, i) for i in range(len(labels))]
    peak = device_peak(c.precision, c.peak_tflops)
    with precision_scope(c.precision, device) as autocast:
        _sync(device)
        start = time.perf_counter()
        images = generate(sm, diffusion, labels, seeds, c.sampler, c.cfg_scale, cfg_channels, autocast, c.progress)
        _sync(device)
        wall = time.perf_counter() - start
    out = Path(c.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, out, nrow=c.nrow, normalize=True, value_range=(-1, 1))
    cost = measure_cost(sm, c.num_sampling_steps, c.cfg_scale, len(labels), wall, peak)
    return SampleReport(out, labels, sm.weights, cost)


# --------------------------------------------------------------------------------------------------------
# scripts/sample_ddp.py: FID sample sets
# --------------------------------------------------------------------------------------------------------


@dataclass
class FidConfig:
    ckpt: str
    model: str | None = None
    image_size: int | None = None
    num_classes: int | None = None
    vae: str | None = None
    sample_dir: str = "samples"
    per_proc_batch_size: int = 32
    num_fid_samples: int = 50_000
    cfg_scale: float = 1.5
    cfg_channels: str = "3"
    num_sampling_steps: int = 250
    sampler: str = "ddpm"
    global_seed: int = 0
    precision: str = "tf32"
    ema: bool = True
    device: str | None = None
    peak_tflops: float | None = None


@dataclass
class FidReport:
    folder: Path
    npz: Path | None  # written by rank 0 only
    generated: int  # images this rank made in this run (0 when everything was already there)
    cost: SamplingCost | None = field(default=None)


def png_path(folder: Path, index: int) -> Path:
    return folder / f"{index:06d}.png"


def sample_folder_name(c: FidConfig, sm: SamplingModel) -> str:
    """Like the official folder name, plus the sampler and guided channels, which change the set too."""
    name = (registry_name(sm.config) or "custom").replace("/", "-")
    vae = Path(sm.vae_spec).name if sm.vae_spec else "none"
    guided = "" if str(c.cfg_channels) == "3" else f"-cfgch-{c.cfg_channels}"
    return (
        f"{name}-{Path(c.ckpt).stem}-size-{sm.image_size}-vae-{vae}-cfg-{c.cfg_scale}{guided}"
        f"-seed-{c.global_seed}-{c.sampler}{c.num_sampling_steps}"
    )


def _set_identity(c: FidConfig, sm: SamplingModel) -> dict:
    """Everything that decides the pixels of image i (not N, the batch size or the world size)."""
    return {
        "ckpt": str(Path(c.ckpt).resolve()),
        "weights": sm.weights,
        "model_config": sm.config.to_dict(),
        "image_size": sm.image_size,
        "vae": sm.vae_spec,
        "cfg_scale": c.cfg_scale,
        "cfg_channels": str(c.cfg_channels),
        "sampler": c.sampler,
        "num_sampling_steps": c.num_sampling_steps,
        "global_seed": c.global_seed,
        "precision": c.precision,
    }


def write_png(path: Path, image: np.ndarray) -> None:
    atomic_write(path, lambda f: Image.fromarray(image).save(f, format="PNG"))


def batches(num_samples: int, batch_size: int, rank: int, world: int) -> list[range]:
    """Global batch b holds images [b*B, (b+1)*B); rank r takes b = r, r+W, ... So the batch an image is in,
    and hence its numerics, do not depend on the world size."""
    starts = range(0, num_samples, batch_size)
    return [range(s, min(s + batch_size, num_samples)) for s in starts][rank::world]


def pack_npz(folder: Path, num_samples: int, path: Path) -> Path:
    """Stream PNGs 0..N-1 into ``path`` as ``arr_0`` uint8 (N, H, W, 3), the ADM evaluator's input.

    np.savez would need all N images in memory at once (9.8 GB for 50k at 256 px); this writes the .npy
    member image by image into an uncompressed zip64 archive, which ``np.load`` reads the same way.
    """
    missing = [i for i in range(num_samples) if not png_path(folder, i).is_file()]
    if missing:
        raise UserError(
            f"{len(missing)} of {num_samples} samples are missing from {folder} (first: {missing[:5]}): "
            "run the same command again to finish the set."
        )
    first = np.asarray(Image.open(png_path(folder, 0)).convert("RGB"))
    header = {"descr": "|u1", "fortran_order": False, "shape": (num_samples, *first.shape)}

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for i in range(num_samples):
                    image = np.asarray(Image.open(png_path(folder, i)).convert("RGB"), dtype=np.uint8)
                    if image.shape != first.shape:
                        raise UserError(
                            f"{png_path(folder, i)} is {image.shape}, not {first.shape}: delete it and rerun."
                        )
                    member.write(image.tobytes())

    atomic_write(path, write)
    return path


@contextmanager
def distributed(device: str | None) -> Iterator[tuple[int, int, torch.device]]:
    """(rank, world size, device) under torchrun (NCCL on GPUs, gloo on CPUs); (0, 1, device) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield 0, 1, resolve_device(device)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    finally:
        dist.destroy_process_group()


def _barrier(world: int):
    if world > 1:
        dist.barrier()


def write_fid_samples(
    c: FidConfig, rank: int = 0, world: int = 1, device: torch.device | None = None
) -> FidReport:
    """Write images 0..N-1 as PNGs (skipping batches already on disk), then pack them into ``{folder}.npz``.

    Image i gets label ``fid_label(seed, i)`` and noise from ``noise_seed(seed, i)``, so any world size and
    any number of resumes give the same set; a folder made with other settings is refused, not mixed.
    """
    device = device or resolve_device(c.device)
    if c.num_fid_samples < 1 or c.per_proc_batch_size < 1:
        raise UserError("--num-fid-samples and --per-proc-batch-size must be >= 1.")
    cfg_channels = parse_cfg_channels(c.cfg_channels)
    sm = load_sampling_model(c.ckpt, c.model, c.image_size, c.num_classes, c.vae, c.ema, device, sd_decoder="ema")
    check_guidance(c.cfg_scale, sm.config)
    diffusion = make_diffusion(sm, c.num_sampling_steps)
    folder = Path(c.sample_dir) / sample_folder_name(c, sm)
    identity, manifest = _set_identity(c, sm), folder / "sample_set.json"
    if manifest.is_file() and json.loads(manifest.read_text()) != identity:
        raise UserError(
            f"{folder} holds samples made with other settings (see {manifest}): pass another --sample-dir "
            "or delete the folder."
        )
    _barrier(world)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".*.tmp"):  # PNGs half-written when a previous run was killed
            stale.unlink()
        if not manifest.is_file():
            atomic_write(manifest, lambda f: f.write(json.dumps(identity, indent=1).encode()))
    _barrier(world)

    peak = device_peak(c.precision, c.peak_tflops) if rank == 0 else (None, "")
    mine = batches(c.num_fid_samples, c.per_proc_batch_size, rank, world)
    todo = [b for b in mine if not all(png_path(folder, i).is_file() for i in b)]
    done_images = sum(len(b) for b in mine) - sum(len(b) for b in todo)
    bar = tqdm(
        total=sum(len(b) for b in mine),
        initial=done_images,
        disable=rank != 0,
        unit="img",
        desc=f"sampling (rank 0 of {world})",
        bar_format="{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}, ETA {remaining}, {rate_fmt}]",
    )
    generated, start = 0, time.perf_counter()
    with precision_scope(c.precision, device) as autocast:
        for batch in todo:
            labels = [fid_label(c.global_seed, i, sm.config.num_classes) for i in batch]
            seeds = [noise_seed(c.global_seed, i) for i in batch]
            images = to_uint8(
                generate(sm, diffusion, labels, seeds, c.sampler, c.cfg_scale, cfg_channels, autocast)
            )
            for i, image in zip(batch, images):
                write_png(png_path(folder, i), image)
            generated += len(batch)
            bar.update(len(batch))
    wall = time.perf_counter() - start
    bar.close()
    cost = None
    if rank == 0 and generated:
        cost = measure_cost(sm, c.num_sampling_steps, c.cfg_scale, generated, wall, peak)
    _barrier(world)
    npz = pack_npz(folder, c.num_fid_samples, folder.with_name(folder.name + ".npz")) if rank == 0 else None
    _barrier(world)
    return FidReport(folder, npz, generated, cost)


def add_checkpoint_flags(p, vae_default: str):
    """The flags both sampling faces share: where the weights come from and how to run them."""
    p.add_argument(
        "--ckpt", required=True, help="our training checkpoint, an official train.py file, or a bare state dict"
    )
    p.add_argument("--model", choices=MODEL_NAMES, help="for files without a config (default DiT-XL/2)")
    p.add_argument("--image-size", type=int, help="pixels per side, for files without a config (default 256)")
    p.add_argument("--num-classes", type=int, help="for files without a config (default 1000)")
    p.add_argument(
        "--vae",
        help=f"ema, mse, a hub id, a folder, or none (default: {vae_default} as official, or the run's own non-SD VAE)",
    )
    p.add_argument(
        "--cfg-channels", default="3", choices=["3", "all"], help="noise channels to guide (official: 3)"
    )
    p.add_argument("--num-sampling-steps", type=int, default=250)
    p.add_argument("--sampler", default="ddpm", choices=SAMPLERS)
    p.add_argument("--precision", default="tf32", choices=PRECISIONS)
    p.add_argument("--no-ema", dest="ema", action="store_false", help="sample with the raw weights, not the EMA")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--peak-tflops", type=float, help="device peak for MFU (default: datasheet table, else measured)"
    )
