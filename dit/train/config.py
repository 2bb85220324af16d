"""``TrainConfig``: every training option, its flag, its YAML key and its check, in one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dit.config import check_positive, option
from dit.errors import UserError
from dit.model_config import DiTConfig, model_config
from dit.models import ATTENTION_BACKENDS
from dit.runtime import PRECISIONS
from dit.sample.config import SAMPLERS
from dit.transport.path import PATHS
from dit.transport.transport import LOSS_WEIGHTS, PREDICTIONS, TIME_SAMPLING

# What a resumed run must share with its checkpoint: the data order and the model's math.
IDENTITY_FIELDS = (
    "seed", "global_batch_size", "image_size", "num_classes", "class_dropout_prob", "learn_sigma",
    "noise_schedule", "predict_xstart", "model", "depth", "hidden_size", "num_heads", "patch_size", "objective",
    "path_type", "prediction", "loss_weight", "time_sampling", "logit_mean", "logit_std", "train_eps",
    "repa_encoder", "repa_input_size", "repa_depth", "repa_projector_dim",
)  # fmt: skip
# What changes the optimisation: a resume may change these only when --allow-changes names them.
RECIPE_FIELDS = (
    "lr", "weight_decay", "warmup_steps", "lr_schedule", "min_lr_frac", "grad_clip", "ema_decay", "ema_warmup",
    "grad_accum_steps", "repa_coeff",
)  # fmt: skip
# Every other field (steps, precision, kernels, devices, logging, checkpoint cadence, evaluation) may change.

ACTIVATION_CHECKPOINTING_HELP = (
    "recompute block activations in backward to save memory: none, all, N (the first N blocks), or auto "
    "(the fewest blocks whose estimated step memory fits the device)"
)


@dataclass
class TrainConfig:
    # model
    model: str = option("DiT-XL/2", "registry name, e.g. DiT-XL/2 (sizes S/B/L/XL, patch 2/4/8)")
    depth: int | None = option(None, "custom size: override the registry depth")
    hidden_size: int | None = option(None, "custom size: override the hidden size")
    num_heads: int | None = option(None, "custom size: override the head count")
    patch_size: int | None = option(None, "custom size: override the patch size")
    image_size: int = option(256, "image size in pixels (latents are image_size / the VAE's downsampling)")
    num_classes: int = option(1000, "number of classes (the null class is added); 0: an unconditional model")
    class_dropout_prob: float = option(0.1, "label dropout for classifier-free guidance, in [0, 1)")
    learn_sigma: bool = option(True, "learn the variance (the hybrid loss) as DiT does; flow models never do")
    # the objective: DiT's Gaussian diffusion, or SiT's flow matching (docs/flow_matching.md)
    objective: str = option(
        "diffusion", "diffusion (DiT) or flow (SiT's flow matching)", choices=("diffusion", "flow")
    )
    noise_schedule: str = option("linear", "diffusion: beta schedule", choices=("linear", "squaredcos_cap_v2"))
    predict_xstart: bool = option(False, "diffusion: predict x0 instead of the noise")
    path_type: str = option("linear", "flow: the interpolant", choices=PATHS)
    prediction: str = option("velocity", "flow: what the model predicts", choices=PREDICTIONS)
    loss_weight: str = option("none", "flow, score or noise predictions: the loss weight", choices=LOSS_WEIGHTS)
    time_sampling: str = option(
        "uniform", "flow: training times, uniform (SiT) or logit-normal (SD3)", choices=TIME_SAMPLING
    )
    logit_mean: float = option(0.0, "flow, logit-normal times: the mean m of sigmoid(N(m, s))")
    logit_std: float = option(1.0, "flow, logit-normal times: the spread s")
    train_eps: float | None = option(
        None, "flow: times kept off the ends in training (default: SiT's for the path)"
    )
    sample_eps: float | None = option(None, "flow: times kept off the ends in sampling (default: SiT's)")
    # data
    data_path: str | None = option(None, "image folder with one sub-folder per class")
    feature_path: str | None = option(None, "latent store written by extract_features.py")
    vae: str = option("ema", "ema|mse|HUB_ID|LOCAL_DIR, or none for pixel space")
    num_workers: int = option(4, "data loader worker processes")
    # optimisation (the paper's recipe, except bf16 autocast where the paper used fp32 with TF32)
    global_batch_size: int = option(256, "images per optimizer step, all devices together")
    grad_accum_steps: int = option(1, "micro-batches per optimizer step")
    max_steps: int = option(400_000, "optimizer steps to train for")
    epochs: int | None = option(
        None, "the official train.py's length: epochs over the data, converted to --max-steps"
    )
    lr: float = option(1e-4, "AdamW learning rate (constant after warm-up)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(0, "linear learning-rate warm-up steps")
    lr_schedule: str = option(
        "constant", "after warm-up: constant, or cosine decay to min_lr_frac x lr", choices=("constant", "cosine")
    )
    min_lr_frac: float = option(0.1, "cosine schedule: final lr as a fraction of lr")
    grad_clip: float = option(0.0, "clip the gradient norm to this (0: off)")
    ema_decay: float = option(0.9999, "EMA decay")
    ema_warmup: bool = option(False, "EMA decay min(decay, (1+n)/(10+n)) for short runs")
    seed: int = option(0, "global seed", aliases=("--global-seed",))
    # speed
    precision: str = option("bf16", "matmul precision (the paper: fp32 with TF32, i.e. tf32)", choices=PRECISIONS)
    activation_checkpointing: str = option("none", ACTIVATION_CHECKPOINTING_HELP)
    memory_reserve_gib: float | None = option(
        None, "device memory kept free by --activation-checkpointing auto (default: 10%, at least 2 GiB)"
    )
    compile: bool = option(False, "torch.compile each DiT block")
    attention: str = option(
        "auto",
        "attention kernel: auto (explicit matmuls for bf16 on CPU, else SDPA's pick), sdpa, flash, efficient, "
        "cudnn, math, explicit",
        choices=ATTENTION_BACKENDS,
    )
    fsdp: bool = option(False, "shard weights, gradients, AdamW and EMA over the processes (FSDP2) instead of DDP")
    fused_optimizer: bool = option(True, "fused AdamW (else foreach)")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    # output, checkpoint files, logging
    results_dir: str = option("results/run", "this run's folder: checkpoints, metrics, TensorBoard")
    resume: str | None = option(None, "auto (latest in results-dir) or a checkpoint path")
    init_from: str | None = option(
        None,
        "fine-tune: start a fresh run from these weights (an official release, an official train.py file, or ours)",
    )
    init_from_weights: str = option("ema", "which weights of --init-from", choices=("ema", "model"))
    allow_changes: list[str] | None = option(
        None,
        f"on --resume, recipe fields that may differ from the checkpoint's: any of {', '.join(RECIPE_FIELDS)}",
    )
    log_every: int = option(100, "steps per log line (the only host syncs)")
    ckpt_every: int = option(50_000, "steps per checkpoint file")
    keep_last: int = option(5, "checkpoint files to keep (0: all)")
    max_nonfinite: int = option(10, "stop (at the next log step) once this many losses in a row were non-finite")
    mfu_warmup_steps: int = option(3, "first steps kept out of the MFU windows")
    peak_tflops: float | None = option(None, "override the device's peak TFLOP/s")
    price_per_hour: float | None = option(None, "device-hour price for the cost projection")
    progress: bool = option(False, "show a progress bar with ETA on rank 0")
    sample_every: int = option(0, "steps per EMA sample grid in TensorBoard (0: off)")
    # quality during training (docs/evaluation.md)
    eval_every: int = option(0, "steps per evaluation of the EMA weights, and one at the end (0: off)")
    eval_ref: str | None = option(None, "reference statistics (python -m dit.eval ref, or an ADM reference batch)")
    eval_num_samples: int = option(1000, "images per evaluation (FID needs more than the feature dimension)")
    eval_guidance_scale: float = option(
        1.0, "guidance scale of the evaluation samples", aliases=("--eval-cfg-scale",)
    )
    eval_sampling_steps: int = option(50, "denoising steps of the evaluation samples")
    eval_sampler: str | None = option(
        None, "sampler of the evaluation samples (default: ddim for diffusion, ode for flow)", choices=SAMPLERS
    )
    eval_batch_size: int = option(64, "evaluation images per batch on each process")
    eval_inception_weights: str | None = option(None, "Inception-v3 weights file, offline (default: download)")
    # ---- REPA (Yu et al. 2024): align block repa_depth's tokens with a frozen encoder's (docs/repa.md) ----
    repa_encoder: str | None = option(
        None, "REPA: a timm ViT name (vit_base_patch14_dinov2.lvd142m is REPA's) or digits-mae (ours); unset: off"
    )
    repa_encoder_weights: str | None = option(None, "REPA: the encoder's weights file, offline (default: timm's)")
    repa_input_size: int | None = option(
        None, "REPA: the encoder's input pixels (default: the DiT's token grid x the encoder's patch, e.g. 224)"
    )
    repa_depth: int = option(8, "REPA: align the tokens after this block (1-based; REPA's 8 for XL/2)")
    repa_coeff: float = option(0.5, "REPA: weight of the alignment loss (minus the cosine similarity)")
    repa_projector_dim: int = option(2048, "REPA: hidden width of the 3-layer MLP projector")

    def __post_init__(self):
        positive = ("global_batch_size", "grad_accum_steps", "max_steps", "log_every", "ckpt_every", "image_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}.")
        for name in (
            "lr",
            "weight_decay",
            "warmup_steps",
            "grad_clip",
            "num_workers",
            "keep_last",
            "sample_every",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}.")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}.")
        for name in ("ema_decay", "class_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}.")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise UserError(f"--min-lr-frac must be in [0, 1], got {self.min_lr_frac}.")
        check_positive(self, "epochs", "peak_tflops", "depth", "hidden_size", "num_heads", "patch_size")
        for name in ("price_per_hour", "memory_reserve_gib"):
            if (value := getattr(self, name)) is not None and value < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {value}.")
        if not self.eval_guidance_scale >= 1:
            raise UserError(
                f"--eval-guidance-scale must be >= 1 (1 disables guidance), got {self.eval_guidance_scale}."
            )
        if Path(self.results_dir).exists() and not Path(self.results_dir).is_dir():
            raise UserError(
                f"--results-dir {self.results_dir} is a file: pass a folder (it is created if missing)."
            )
        if self.max_nonfinite < 1 or self.mfu_warmup_steps < 0:
            raise UserError(
                f"--max-nonfinite must be >= 1 and --mfu-warmup-steps >= 0, got {self.max_nonfinite} and "
                f"{self.mfu_warmup_steps}."
            )
        parse_activation_checkpointing(self.activation_checkpointing)
        if self.objective == "flow":
            self.learn_sigma = False  # a flow model predicts one field; SiT's extra head is never read
            self.transport()  # checks the combination
        if self.init_from and self.resume:
            raise UserError(
                "--init-from starts a new run from other weights and --resume continues one: pass one of them "
                "(a fine-tune started with --init-from is continued with --resume auto alone)."
            )
        unknown = sorted(set(self.allow_changes or ()) - set(RECIPE_FIELDS))
        if unknown:
            raise UserError(
                f"--allow-changes {' '.join(unknown)}: only recipe fields may change on a resume "
                f"({', '.join(RECIPE_FIELDS)}); the seed, the batch, the data and the model may not."
            )
        if self.eval_every and not self.eval_ref:
            raise UserError("--eval-every needs --eval-ref: reference statistics (python -m dit.eval ref --help).")
        if self.eval_every and min(self.eval_num_samples, self.eval_sampling_steps, self.eval_batch_size) < 1:
            raise UserError("--eval-num-samples, --eval-sampling-steps and --eval-batch-size must be >= 1.")
        # REPA: the name and the depth are checked against timm and the model when the run is built
        from dit.encoder import check_weights_file

        check_weights_file(self.repa_encoder_weights)
        if self.repa_encoder_weights and not self.repa_encoder:
            raise UserError("--repa-encoder-weights needs --repa-encoder NAME (the timm model they belong to).")
        if self.repa_depth < 1 or self.repa_projector_dim < 1 or not self.repa_coeff >= 0:
            raise UserError(
                f"--repa-depth and --repa-projector-dim must be >= 1 and --repa-coeff >= 0, got {self.repa_depth}, "
                f"{self.repa_projector_dim} and {self.repa_coeff}."
            )
        check_positive(self, "repa_input_size")

    @property
    def pixel_space(self) -> bool:
        return str(self.vae).lower() == "none"

    def resume_conflicts(self, saved: dict) -> list[str]:
        """The fields of a checkpoint's run config (``saved``) this run may not change, as 'name: a -> b'."""
        allowed = set(self.allow_changes or ())
        return [
            f"{name}: {saved[name]!r} -> {getattr(self, name)!r}"
            for name in (*IDENTITY_FIELDS, *RECIPE_FIELDS)
            if name in saved and saved[name] != getattr(self, name) and name not in allowed
        ]

    def transport(self):
        """The flow-matching objective of this run (``objective == "flow"``)."""
        from dit.transport import Transport

        return Transport.from_record(vars(self))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then constant or cosine."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        return self.lr

    def model_config(self, in_channels: int, input_size: int) -> DiTConfig:
        """The DiT this run trains, for data of ``in_channels`` x ``input_size`` x ``input_size``."""
        sizes = ("depth", "hidden_size", "num_heads", "patch_size")
        return model_config(
            self.model,
            input_size=input_size,
            in_channels=in_channels,
            num_classes=self.num_classes,
            class_dropout_prob=self.class_dropout_prob,
            learn_sigma=self.learn_sigma,
            **{k: getattr(self, k) for k in sizes if getattr(self, k)},
        )


def parse_activation_checkpointing(value) -> int | str:
    """ "none" -> 0, "all", "auto", or a block count N >= 0 (the first N blocks are recomputed)."""
    text = str(value).lower()
    if text in ("none", "0", "false"):
        return 0
    if text in ("all", "auto"):
        return text
    if text.isdigit():
        return int(text)
    raise UserError(f"--activation-checkpointing must be none, all, auto or a block count N, got {value!r}.")
