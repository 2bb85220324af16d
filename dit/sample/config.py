"""The sampling faces' settings: one dataclass each, sharing the flags that say which weights and how."""

from __future__ import annotations

from dataclasses import dataclass

from dit.config import check_positive, check_writable_file, option
from dit.errors import UserError
from dit.runtime import PRECISIONS
from dit.sampling_plan import LAST_STEPS, SAMPLERS, check_guidance_interval
from dit.transport.samplers import DIFFUSION_FORMS

GUIDANCE_HELP = "classifier-free guidance scale; 1 disables it (--cfg-scale is the official spelling)"
CHANNELS_HELP = "noise channels to guide: 3 (the official code, used for the paper's FIDs) or all"
# ---- samplers and the guidance interval (dit.sampling_plan) ----
SAMPLER_HELP = (
    "diffusion models: ddpm (ancestral, the default) or ddim (eta 0), our loops; diffusers' schedulers dpmpp-2m, "
    "dpmpp-2m-sde, unipc, deis, euler, heun (2 evaluations a step but the last); flow models: ode (the default) or sde"
)
INTERVAL_HELP = (
    "guide only the evaluations whose time lies in [LO, HI] (Kynkaenniemi et al. 2024), the others run unguided "
    "(one pass); time is t/1000 for diffusion (1 = noise) and the flow's t (1 = data); default: every evaluation"
)


@dataclass
class SamplingOptions:
    """Where the weights come from and how to run them (sample.py and sample_ddp.py alike)."""

    ckpt: str | None = option(
        None,
        "our training checkpoint, an official train.py file, or a bare state dict (default: the official "
        "DiT-XL-2-<image size>.pt release, downloaded if missing)",
    )
    model: str | None = option(None, "for files without a config (default DiT-XL/2)")
    image_size: int | None = option(None, "pixels per side, for files without a config (default 256)")
    num_classes: int | None = option(None, "for files without a config (default 1000)")
    vae: str | None = option(
        None, "ema, mse, a hub id, a folder, or none (default: as the official scripts, or the run's own VAE)"
    )
    objective: str | None = option(
        None, "for files without a config: flow for a SiT release (default: as recorded, else diffusion)",
        choices=("diffusion", "flow"),
    )  # fmt: skip
    guidance_scale: float = option(4.0, GUIDANCE_HELP, aliases=("--cfg-scale",))
    guidance_channels: str = option("3", CHANNELS_HELP, choices=("3", "all"), aliases=("--cfg-channels",))
    num_sampling_steps: int = option(
        250, "diffusion: respaced steps (official rounding); flow: grid steps (Heun: 2 evaluations each)"
    )
    sampler: str | None = option(None, SAMPLER_HELP, choices=SAMPLERS)
    sampling_method: str | None = option(
        None,
        "flow models: ode euler, heun (the default), ab2, ab3, ab4 (Adams-Bashforth, 1 evaluation a step) or dopri5 "
        "(adaptive, torchdiffeq); sde euler (the default) or heun",
    )
    guidance_interval: list[float] | None = option(None, INTERVAL_HELP)
    diffusion_form: str = option(
        "sigma", "flow sde: the diffusion coefficient w(t) (SiT's choices)", choices=DIFFUSION_FORMS
    )
    last_step: str = option("mean", "flow sde: the last deterministic step (SiT's, h = 0.04)", choices=LAST_STEPS)
    sample_eps: float | None = option(
        None, "flow: keep the sampler's time grid this far from the ends (default: the run's, else SiT's)"
    )
    atol: float = option(1e-6, "flow ode dopri5: absolute tolerance (SiT's default)")
    rtol: float = option(1e-3, "flow ode dopri5: relative tolerance (SiT's default)")
    precision: str = option("tf32", "fp32, tf32 (the official scripts), bf16 or fp16 (CUDA)", choices=PRECISIONS)
    ema: bool = option(True, "sample with the EMA weights (--no-ema: the raw weights)")
    device: str | None = option(None, "default: cuda if available, else cpu")
    peak_tflops: float | None = option(None, "device peak for MFU (default: datasheet table, else measured)")
    tf32: bool | None = option(None, "the official scripts' switch: --tf32 is --precision tf32, --no-tf32 is fp32")

    def __post_init__(self):
        if self.tf32 is not None:  # one precision setting: the official flag only chooses between two of them
            self.precision = "tf32" if self.tf32 else "fp32"
        check_positive(self, "num_sampling_steps", "peak_tflops", "image_size", "atol", "rtol")
        if self.sample_eps is not None and not 0 <= self.sample_eps < 0.5:
            raise UserError(f"--sample-eps must be in [0, 0.5), got {self.sample_eps}.")
        if not self.guidance_scale >= 1:
            raise UserError(
                f"--guidance-scale (--cfg-scale) must be >= 1 (1 disables guidance), got {self.guidance_scale}."
            )
        check_guidance_interval(self.guidance_interval)


@dataclass
class SampleConfig(SamplingOptions):
    """sample.py: one image per class label, in a PNG grid."""

    class_labels: list[int] | None = option(None, "one image per label (default: the official eight)")
    seed: int = option(0, "image i uses the noise of (seed, i)")
    out: str = option("sample.png", "PNG grid to write")
    nrow: int = option(4, "images per grid row")
    progress: bool = option(True, "show the denoising progress")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "nrow")
        check_writable_file(self.out, "--out")


@dataclass
class FidConfig(SamplingOptions):
    """sample_ddp.py: an FID sample set (PNGs and the ADM evaluator's .npz), any number of processes."""

    guidance_scale: float = option(
        1.5, GUIDANCE_HELP + "; 1.5 on 3 channels is the paper's FID setting", aliases=("--cfg-scale",)
    )
    sample_dir: str = option("samples", "where the set's folder and .npz go")
    per_proc_batch_size: int = option(32, "images per batch on each process")
    num_fid_samples: int = option(50_000, "images in the set")
    global_seed: int = option(0, "image i's label and noise are keyed by (global seed, i)")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "per_proc_batch_size", "num_fid_samples")
