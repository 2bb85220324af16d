"""The ``dit-cost`` subcommands' settings: one dataclass each, sharing the model and budget flags.

No torch here (nor in anything it imports): ``dit-cost`` answers in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

from dit.config import option
from dit.cost import memory, peaks, plan
from dit.errors import UserError
from dit.model_config import MODEL_NAMES

CKPT_HELP = "activation checkpointing: none, all, or N (the first N blocks recomputed in backward)"


@dataclass
class ModelArgs:
    model: str | None = option(None, f"registry name: one of {', '.join(MODEL_NAMES)}")
    image_size: int = option(256, "pixels (the model's input is the VAE's latent of it, or the image itself)")
    vae: str = option(
        "ema",
        "the latent space: ema or mse (the SD VAE), a folder with an AutoencoderKL config.json, or none (pixel space)",
    )
    latent_size: int | None = option(None, "the model's input size, if not image size / the VAE's downsampling")
    in_channels: int | None = option(None, "default: the VAE's latent channels (4 for SD), or 3 with --vae none")
    num_classes: int = option(1000, "classes")
    learn_sigma: bool = option(
        True, "output 2C channels (learned variance), as DiT does; --no-learn-sigma for a flow model"
    )
    depth: int | None = option(None, "custom size")
    hidden_size: int | None = option(None, "custom size")
    num_heads: int | None = option(None, "custom size")
    patch_size: int | None = option(None, "custom size")

    def config(self, model: str | None = None):
        return plan.model_for_image(
            model if model is not None else self.model,
            self.image_size,
            vae=plan.vae_config_for(self.vae),
            latent_size=self.latent_size,
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            learn_sigma=None if self.learn_sigma else False,
            depth=self.depth,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            patch_size=self.patch_size,
        )

    def checkpointed(self, cfg, value: str, allow_auto: bool = False) -> int | str:
        """--activation-checkpointing: none, all, N, or (memory with a device) auto."""
        text = str(value).lower()
        if text == "auto" and allow_auto:
            return "auto"
        blocks = 0 if text == "none" else cfg.depth if text == "all" else int(text) if text.isdigit() else -1
        if not 0 <= blocks <= cfg.depth:
            raise UserError(
                f"--activation-checkpointing must be none, all or a block count 0..{cfg.depth} (the depth), "
                f"got {value!r}" + ("; auto needs --gpu or --memory-gib." if text == "auto" else ".")
            )
        return blocks


@dataclass
class BudgetArgs:
    gpu: str | None = option(None, "device name or alias (H100-SXM, A100, 'NVIDIA L40S'); see `dit-cost peaks`")
    num_gpus: int = option(1, "devices")
    precision: str = option("bf16", "the precision the peak is read for", choices=peaks.PRECISIONS)
    mfu: float | None = option(None, "model FLOPs utilisation in (0, 1], e.g. 0.4 (with --gpu: time and cost)")
    calibration: str | None = option(None, "calibration JSON from a benchmark (schema: docs/cost_model.md)")
    peak_tflops: float | None = option(None, "dense peak TFLOP/s per device, overriding the table")
    price_per_hour: float | None = option(None, "price of one device-hour, for the cost line")

    def budget(self) -> dict:
        return dict(
            device=self.gpu,
            precision=self.precision,
            mfu=self.mfu,
            calibration=self.calibration,
            price_per_device_hour=self.price_per_hour,
            peak_tflops=self.peak_tflops,
        )


@dataclass
class FlopsArgs(ModelArgs):
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


@dataclass
class TrainArgs(ModelArgs, BudgetArgs):
    """compute (and with a device: time and cost) of a training run"""

    global_batch_size: int = option(256, "images per optimizer step, all devices together")
    max_steps: int = option(400_000, "optimizer steps")
    activation_checkpointing: str = option("none", CKPT_HELP + " (memory and hardware FLOPs)")
    json: bool = option(False, "print JSON")
    # ---- REPA: auxiliary FLOPs (the encoder's shape from timm's config on the meta device: no download) ----
    repa_encoder: str | None = option(None, "REPA: its encoder (a timm ViT name, or digits-mae): adds its FLOPs")
    repa_input_size: int | None = option(
        None, "REPA: the encoder's input pixels (default: the DiT's grid x patch)"
    )
    repa_projector_dim: int = option(2048, "REPA: hidden width of the projector")
    repa_cached_features: bool = option(
        False, "REPA: features from a latent store (the encoder paid once per image view, at extraction)"
    )


@dataclass
class SampleArgs(ModelArgs, BudgetArgs):
    """compute (and with a device: time and cost) of sampling N images"""

    num_images: int = option(50_000, "images to sample")
    num_sampling_steps: int = option(250, "denoising steps")
    guidance_scale: float = option(
        1.5, "classifier-free guidance scale; above 1 doubles the batch", aliases=("--cfg-scale",)
    )
    sampler: str = option("ddpm", "ddpm or ddim (diffusion), ode or sde (flow matching)",
                          choices=("ddpm", "ddim", "ode", "sde"))  # fmt: skip
    sampling_method: str | None = option(None, "ode: euler, heun or dopri5 (default heun); sde: euler or heun")
    last_step: str = option("mean", "sde: the last step (none saves one evaluation)")
    nfe: int | None = option(None, "network evaluations per image, for the adaptive dopri5 (read a run's log)")
    json: bool = option(False, "print JSON")

    def method(self) -> str | None:
        """The ODE/SDE integrator (None for DDPM/DDIM); the transport is imported here, not with the planner."""
        from dit.transport.samplers import DEFAULT_METHODS

        return self.sampling_method or DEFAULT_METHODS.get(self.sampler)

    def evaluations(self) -> int:
        """Network evaluations per image of the chosen sampler: steps for DDPM/DDIM/Euler, 2 per Heun step."""
        from dit.transport.samplers import ODE_METHODS, SDE_METHODS, planned_nfe

        if self.num_sampling_steps < 1:
            raise UserError(f"--num-sampling-steps must be >= 1, got {self.num_sampling_steps}.")
        if self.sampler in ("ddpm", "ddim"):
            if self.sampling_method is not None:
                raise UserError(
                    f"--sampling-method is for the flow samplers ode and sde, not --sampler {self.sampler}."
                )
            return self.nfe or self.num_sampling_steps
        methods, method = (ODE_METHODS if self.sampler == "ode" else SDE_METHODS), self.method()
        if method not in methods:
            raise UserError(f"--sampling-method for --sampler {self.sampler} must be one of {', '.join(methods)}.")
        planned = planned_nfe(self.sampler, method, self.num_sampling_steps, self.last_step)
        if planned is None and self.nfe is None:
            raise UserError(f"{method} picks its own steps: pass --nfe, the evaluations per image a run printed.")
        return self.nfe or planned


@dataclass
class MemoryArgs(ModelArgs):
    """training memory per device: analytic, traced, largest batch"""

    batch_per_device: int | None = option(None, "images per device per step")
    global_batch_size: int | None = option(None, "images per step over --num-gpus devices")
    num_gpus: int = option(1, "devices")
    precision: str = option("bf16", "training precision", choices=memory.MEMORY_PRECISIONS)
    activation_checkpointing: str = option("none", CKPT_HELP + ", or auto (the fewest that fit; needs a device)")
    ema: bool = option(True, "an fp32 EMA copy of the weights")
    sharding: str = option("ddp", "data parallelism", choices=("ddp", "fsdp"))
    trace: bool = option(False, "also trace one real step on fake tensors")
    gpu: str | None = option(None, "device, for its memory and the largest batch that fits")
    memory_gib: float | None = option(None, "device memory, if --gpu does not say")
    memory_reserve_gib: float | None = option(
        None, "kept free for the CUDA context and fragmentation (default: 10%, at least 2 GiB)"
    )
    json: bool = option(False, "print JSON")


@dataclass
class PeaksArgs:
    """the peak table, or the peak for one device name ('cpu' measures)"""

    device: str | None = option(None, "a device name to resolve, e.g. 'NVIDIA H100 80GB HBM3' or cpu")
    precision: str = option("bf16", "precision", choices=peaks.PRECISIONS)
    peak_tflops: float | None = option(None, "override")
    json: bool = option(False, "print JSON")


@dataclass(kw_only=True)
class PlotArgs(ModelArgs):
    """PNG charts: 'flops' (all configs), 'memory' (one config vs batch) or 'quality' (FID against training FLOPs)"""

    chart: str = option(help="flops, memory or quality", choices=("flops", "memory", "quality"), positional=True)
    runs: list[str] = option([], "quality: run folders (their --results-dir), one line each", positional=True)
    out: str = option(help="PNG path")
    labels: list[str] | None = option(None, "quality: a legend label per run (default: the folders)")
    precision: str = option("bf16", "training precision (memory chart)", choices=memory.MEMORY_PRECISIONS)
    gpu: str | None = option(None, "device, for its memory line")
    memory_gib: float | None = option(None, "device memory, if --gpu does not say")
    traced_batches: str | None = option(None, "comma-separated batches to trace as points, e.g. 8,64")


@dataclass(kw_only=True)
class QualityArgs:
    """the training compute, time and cost at which a run reached a target FID"""

    run: str = option(help="the run's folder (its --results-dir)", positional=True)
    target_fid: float = option(help="the FID to reach")
    price_per_hour: float | None = option(None, "price of one device-hour, for the cost")
    gpu: str | None = option(None, "also: the time on this device (with --mfu and --num-gpus)")
    num_gpus: int = option(1, "devices, with --gpu")
    precision: str = option("bf16", "the precision the peak is read for, with --gpu", choices=peaks.PRECISIONS)
    mfu: float | None = option(None, "MFU on --gpu, in (0, 1]")
    json: bool = option(False, "print JSON")
