"""The training loop: DDP through accelerate, AMP, EMA, exact resume, and cost at every log step.

Everything random in a step (timesteps, noise, class dropout, augmentation) is drawn from streams keyed
by (seed, step) and sliced by global sample position, so a run is bit-identical across resumes and
equal (to float tolerance) across world sizes. The hot loop touches the host only at log steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dit.config import to_dict
from dit.diffusion import create_diffusion
from dit.engine.checkpoint import latest_checkpoint, load_checkpoint, save_training_checkpoint
from dit.engine.data_order import SeededItems, StepOrder, mix_seed
from dit.engine.ema import EMA
from dit.engine.host_memory import keep_freed_host_memory
from dit.engine.metrics import MetricSinks
from dit.engine.sharding import full_model_state, full_optimizer_state, load_optimizer_state, shard
from dit.errors import UserError
from dit.models import ATTENTION_BACKENDS, DiT, DiTConfig, attention_kernel, describe, model_config

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def _opt(help_text: str, **kw):
    return field(metadata={"help": help_text, **kw})


@dataclass
class TrainConfig:
    # model
    model: str = field(
        default="DiT-XL/2", metadata={"help": "registry name, e.g. DiT-XL/2 (sizes S/B/L/XL, patch 2/4/8)"}
    )
    depth: int | None = field(default=None, metadata={"help": "custom size: override the registry depth"})
    hidden_size: int | None = field(default=None, metadata={"help": "custom size: override the hidden size"})
    num_heads: int | None = field(default=None, metadata={"help": "custom size: override the head count"})
    patch_size: int | None = field(default=None, metadata={"help": "custom size: override the patch size"})
    image_size: int = field(default=256, metadata={"help": "image size in pixels (latents are image_size/8)"})
    num_classes: int = field(default=1000, metadata={"help": "number of classes (the null class is added)"})
    class_dropout_prob: float = field(default=0.1, metadata={"help": "label dropout for classifier-free guidance"})
    learn_sigma: bool = field(default=True, metadata={"help": "learn the variance (the hybrid loss) as DiT does"})
    noise_schedule: str = field(
        default="linear", metadata={"help": "beta schedule", "choices": ("linear", "squaredcos_cap_v2")}
    )
    predict_xstart: bool = field(default=False, metadata={"help": "predict x0 instead of the noise"})
    # data
    data_path: str | None = field(default=None, metadata={"help": "image folder with one sub-folder per class"})
    feature_path: str | None = field(
        default=None, metadata={"help": "latent store written by extract_features.py"}
    )
    vae: str = field(default="ema", metadata={"help": "ema|mse|HUB_ID|LOCAL_DIR, or none for pixel space"})
    num_workers: int = field(default=4, metadata={"help": "data loader worker processes"})
    # optimisation (the paper's recipe by default)
    global_batch_size: int = field(
        default=256, metadata={"help": "images per optimizer step, all devices together"}
    )
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=400_000, metadata={"help": "optimizer steps to train for"})
    lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate (constant after warm-up)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear learning-rate warm-up steps"})
    lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "after warm-up: constant, or cosine decay to min_lr_frac x lr",
            "choices": ("constant", "cosine"),
        },
    )
    min_lr_frac: float = field(default=0.1, metadata={"help": "cosine schedule: final lr as a fraction of lr"})
    grad_clip: float = field(default=0.0, metadata={"help": "clip the gradient norm to this (0: off)"})
    ema_decay: float = field(default=0.9999, metadata={"help": "EMA decay"})
    ema_warmup: bool = field(default=False, metadata={"help": "EMA decay min(decay, (1+n)/(10+n)) for short runs"})
    seed: int = field(default=0, metadata={"help": "global seed"})
    # speed
    precision: str = field(default="bf16", metadata={"help": "matmul precision", "choices": PRECISIONS})
    checkpoint_blocks: str = field(
        default="none",
        metadata={"help": "activation checkpointing: none, all, every k-th block (k), or auto (fewest that fit)"},
    )
    compile: bool = field(default=False, metadata={"help": "torch.compile each DiT block"})
    attention: str = field(
        default="auto",
        metadata={
            "help": "attention kernel: auto (explicit matmuls for bf16 on CPU, else SDPA's pick), sdpa, "
            "flash, efficient, cudnn, math, explicit",
            "choices": ATTENTION_BACKENDS,
        },
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "shard weights, gradients, AdamW and EMA over the processes (FSDP2) instead of DDP"},
    )
    fused_optimizer: bool = field(default=True, metadata={"help": "fused AdamW (else foreach)"})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda (default: cuda when available)"})
    # output, checkpoints, logging
    results_dir: str = field(
        default="results/run", metadata={"help": "this run's folder: checkpoints, metrics, TensorBoard"}
    )
    resume: str | None = field(
        default=None, metadata={"help": "auto (latest in results-dir) or a checkpoint path"}
    )
    log_every: int = field(default=100, metadata={"help": "steps per log line (the only host syncs)"})
    ckpt_every: int = field(default=50_000, metadata={"help": "steps per checkpoint"})
    keep_last: int = field(default=5, metadata={"help": "checkpoints to keep (0: all)"})
    max_nonfinite: int = field(default=10, metadata={"help": "stop after this many non-finite losses in a row"})
    mfu_warmup_steps: int = field(default=3, metadata={"help": "first steps kept out of the MFU windows"})
    peak_tflops: float | None = field(default=None, metadata={"help": "override the device's peak TFLOP/s"})
    price_per_hour: float | None = field(
        default=None, metadata={"help": "device-hour price for the cost projection"}
    )
    progress: bool = field(default=False, metadata={"help": "show a progress bar with ETA on rank 0"})
    sample_every: int = field(default=0, metadata={"help": "steps per EMA sample grid in TensorBoard (0: off)"})

    def __post_init__(self):
        for name in (
            "global_batch_size",
            "grad_accum_steps",
            "max_steps",
            "log_every",
            "ckpt_every",
            "image_size",
        ):
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
        if not 0.0 <= self.ema_decay < 1.0:
            raise UserError(f"--ema-decay must be in [0, 1), got {self.ema_decay}.")

    @property
    def pixel_space(self) -> bool:
        return str(self.vae).lower() == "none"


# ------------------------------------------------------------------------------------------------------------
# Set-up helpers
# ------------------------------------------------------------------------------------------------------------


def build_accelerator(cfg: TrainConfig):
    """accelerate's Accelerator, with its two silent CPU traps closed."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is visible: drop --device or use cpu.")
    if cfg.precision == "fp16" and not use_cuda:
        # accelerate would silently run fp32 here while reporting fp16.
        raise UserError(
            "fp16 needs a CUDA device (it runs fp32 on CPU without a word): use --precision bf16 or fp32."
        )
    if use_cuda:
        tf32 = cfg.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    # A plain Accelerator() under torchrun without CUDA trains every rank alone: cpu=True selects gloo DDP.
    # Mixed precision is ours (autocast + GradScaler in the step), not accelerate's: its state is a process
    # singleton, so a second trainer (a benchmark sweep, a test) could not use another precision.
    return Accelerator(
        cpu=not use_cuda, kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
    )


def build_data(cfg: TrainConfig, dataset, device):
    """(dataset, in_channels, input_size, VAE to encode with on the fly or None) for the configured source."""
    if dataset is not None:
        x, _ = dataset[0]
        return dataset, x.shape[0], x.shape[-1], None
    if cfg.feature_path:
        from dit.data.latents import LatentStoreDataset

        ds = LatentStoreDataset(cfg.feature_path)
        x, _ = ds[0]
        ds.check_compatible(in_channels=x.shape[0], input_size=cfg.image_size // 8, num_classes=cfg.num_classes)
        return ds, x.shape[0], x.shape[-1], None
    if not cfg.data_path:
        raise UserError("no training data: pass --data-path IMAGE_FOLDER or --feature-path LATENT_STORE.")
    from dit.data.images import ImageFolderDataset

    ds = ImageFolderDataset(cfg.data_path, cfg.image_size, flip=True)
    if len(ds.classes) > cfg.num_classes:
        raise UserError(
            f"{cfg.data_path} has {len(ds.classes)} class folders but --num-classes is {cfg.num_classes}: "
            f"pass --num-classes {len(ds.classes)}."
        )
    if cfg.pixel_space:
        return ds, 3, cfg.image_size, None
    from dit import vae as vae_lib

    vae = vae_lib.load_vae(cfg.vae, device=device)
    factor = vae_lib.latent_downsample(vae)
    if cfg.image_size % factor:
        raise UserError(
            f"--image-size {cfg.image_size} is not a multiple of the VAE's downsampling factor {factor}."
        )
    return ds, int(vae.config.latent_channels), cfg.image_size // factor, vae


def build_model_config(cfg: TrainConfig, in_channels: int, input_size: int) -> DiTConfig:
    overrides = {
        k: getattr(cfg, k) for k in ("depth", "hidden_size", "num_heads", "patch_size") if getattr(cfg, k)
    }
    return model_config(
        cfg.model,
        input_size=input_size,
        in_channels=in_channels,
        num_classes=cfg.num_classes,
        class_dropout_prob=cfg.class_dropout_prob,
        learn_sigma=cfg.learn_sigma,
        **overrides,
    )


def parse_checkpoint_blocks(value: str) -> int | str:
    value = str(value).lower()
    if value in ("none", "0", "false"):
        return "none"
    if value in ("all", "true", "auto"):
        return value.replace("true", "all")
    if value.isdigit():
        return int(value)
    raise UserError(
        f"--checkpoint-blocks must be none, all, auto or an integer k (every k-th block), got {value!r}."
    )


def auto_checkpoint_blocks(
    mc: DiTConfig, batch_per_device: int, precision: str, world: int, budget_bytes, attention: str = "fused"
) -> range:
    """The fewest checkpointed blocks (the first k) whose estimated step memory fits ``budget_bytes``."""
    from dit.cost.memory import estimate_training_memory

    if budget_bytes is None:  # no device limit to fit (CPU): recompute nothing
        return range(0)
    for k in range(mc.depth + 1):
        est = estimate_training_memory(
            mc, batch_per_device, precision, checkpointed_blocks=k, world_size=world, attention=attention
        )
        if est.total <= budget_bytes:
            return range(k)
    raise UserError(
        f"{describe(mc)} at {batch_per_device} images per device does not fit in "
        f"{budget_bytes / 2**30:.1f} GiB even with every block checkpointed: lower the batch per device "
        "(raise --grad-accum-steps) or use more devices."
    )


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits at the end of the current step.

    With several processes the flag is OR-reduced every step over a gloo group on the CPU, which costs a
    few microseconds and never waits on the GPU, so all ranks stop at the same step.
    """

    def __init__(self, world_size: int):
        self.raised = None
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        self.raised = signal.Signals(signum).name

    def should_stop(self) -> bool:
        if self.group is None:
            return self.raised is not None
        flag = torch.tensor([1 if self.raised else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and not self.raised:
            self.raised = "SIGTERM (another rank)"
        return bool(flag.item())

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, dataset=None):
        self.cfg = cfg
        self.acc = build_accelerator(cfg)
        self.device = self.acc.device
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.world, self.rank = self.acc.num_processes, self.acc.process_index
        self.out = Path(cfg.results_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.sinks = MetricSinks(self.out, enabled=self.acc.is_main_process)

        ds, in_channels, input_size, self.vae = build_data(cfg, dataset, self.device)
        if self.vae is not None:
            from dit.vae import encode  # diffusers loads only for runs that encode images on the fly

            self.vae_encode = encode
        self.dataset = ds
        self.model_cfg = build_model_config(cfg, in_channels, input_size)
        self.resume_from = self._find_resume()
        ckpt = load_checkpoint(self.resume_from) if self.resume_from else None
        if ckpt is not None:
            self._check_resume_config(ckpt)

        torch.manual_seed(cfg.seed)
        self.model = DiT.from_config(self.model_cfg).to(self.device).set_attention(cfg.attention)
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.attention = attention_kernel(cfg.attention, self.device.type, amp_dtype or torch.float32)
        # The T x T matrix is kept (explicit, math) or recomputed in backward (the fused kernels).
        self.fused_attention = self.attention not in ("explicit", "math")
        self.ckpt_policy = parse_checkpoint_blocks(cfg.checkpoint_blocks)
        if self.ckpt_policy == "auto":
            budget = None
            if self.device.type == "cuda":  # leave 10% for the allocator's fragmentation and the CUDA context
                budget = 0.9 * torch.cuda.get_device_properties(self.device).total_memory
            micro = cfg.global_batch_size // (self.world * cfg.grad_accum_steps)
            self.ckpt_policy = auto_checkpoint_blocks(
                self.model_cfg,
                micro,
                cfg.precision,
                self.world,
                budget,
                "fused" if self.fused_attention else "explicit",
            )
        self.model.set_checkpointing(self.ckpt_policy)
        if ckpt is not None:
            self.model.load_weights(ckpt["model"], source=str(self.resume_from))
        self.ema = EMA(self.model, cfg.ema_decay, cfg.ema_warmup)
        if ckpt is not None:
            self.ema.load_state_dict(ckpt["ema"], ckpt["ema_updates"])
        self.sharded = cfg.fsdp and self.world > 1
        if self.sharded:  # weights are loaded whole on every rank first, then sharded
            shard(self.model)
            shard(self.ema.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        impl = {"fused": True} if cfg.fused_optimizer else {"foreach": True}
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **impl)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
        self.step = 0
        if ckpt is not None:
            load_optimizer_state(self.model, self.opt, ckpt["optimizer"], self.sharded)
            self.step = int(ckpt["step"])
            if self.scaler is not None and ckpt.get("scaler"):
                self.scaler.load_state_dict(ckpt["scaler"])
            rng = ckpt.get("rng", {}).get(str(self.rank))
            if rng is not None:
                torch.set_rng_state(rng["cpu"])
                if rng.get("cuda") is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
        if cfg.compile:
            for block in self.model.blocks:
                block.compile()
        self.ddp_model = self.model if self.sharded else self.acc.prepare(self.model)
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
        )
        self.diffusion = create_diffusion(
            "", noise_schedule=cfg.noise_schedule, learn_sigma=cfg.learn_sigma, predict_xstart=cfg.predict_xstart
        )
        self.diffusion.tables(self.device)
        self.order = StepOrder(
            len(ds), cfg.global_batch_size, self.world, self.rank, cfg.grad_accum_steps, cfg.seed, self.step
        )
        self.loader = DataLoader(
            SeededItems(ds, cfg.seed),
            batch_sampler=self.order,
            num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
        )
        self.micro = self.order.micro
        self.rand_gen = torch.Generator(device=self.device)
        self._setup_cost()

    # ---- resume -------------------------------------------------------------------------------------------

    def _find_resume(self):
        r = self.cfg.resume
        if not r:
            if latest_checkpoint(self.ckpt_dir) is not None:
                raise UserError(
                    f"{self.ckpt_dir} already holds checkpoints: pass --resume auto to continue that run, "
                    "or a new --results-dir; nothing was overwritten."
                )
            return None
        if r == "auto":
            return latest_checkpoint(self.ckpt_dir)
        return Path(r)

    def _check_resume_config(self, ckpt: dict):
        saved = ckpt.get("model_config")
        if saved is None:
            raise UserError(f"{self.resume_from} is not a dit-ledger training checkpoint (no model_config).")
        if DiTConfig(**saved) != self.model_cfg:
            raise UserError(
                f"{self.resume_from} was trained as {describe(DiTConfig(**saved))}, but this run builds "
                f"{describe(self.model_cfg)}: pass the same --model, --image-size, --num-classes and data."
            )
        batch = ckpt.get("config", {}).get("global_batch_size")
        if batch is not None and batch != self.cfg.global_batch_size:
            raise UserError(
                f"{self.resume_from} used --global-batch-size {batch}; resuming with "
                f"{self.cfg.global_batch_size} would change the data order: pass --global-batch-size {batch}."
            )

    # ---- cost accounting ------------------------------------------------------------------------------------

    def _setup_cost(self):
        from dit.cost.analytic import forward_macs, training_flops_per_image
        from dit.cost.measured import measure_flops
        from dit.cost.memory import estimate_training_memory
        from dit.cost.meter import CostMeter
        from dit.cost.peaks import peak_for_current_device, resolve_peak

        mc, cfg = self.model_cfg, self.cfg
        ckpt_blocks = self.model.num_checkpointed_blocks
        self.flops = training_flops_per_image(
            mc, checkpointed_blocks=ckpt_blocks, fused_attention=self.fused_attention
        )
        measured = measure_flops(mc, batch_size=1, train=True, checkpointed_blocks=ckpt_blocks)
        self.measured_flops_per_image = float(measured["train_flops_per_image"])
        # The meta-device count has no fused-attention recompute: compare it with the same analytic count.
        comparable = training_flops_per_image(mc, checkpointed_blocks=ckpt_blocks, fused_attention=False).hardware
        if self.device.type == "cuda":
            self.peak = peak_for_current_device(cfg.precision, cfg.peak_tflops)
        else:
            self.peak = resolve_peak("cpu", cfg.precision, cfg.peak_tflops)
        self.meter = CostMeter(self.flops.model, self.flops.hardware, mc.tokens, self.peak, world_size=self.world)
        mem = estimate_training_memory(
            mc,
            self.cfg.global_batch_size // (self.world * self.cfg.grad_accum_steps),
            cfg.precision,
            checkpointed_blocks=ckpt_blocks,
            ema=True,
            sharding="fsdp" if self.sharded else "ddp",
            world_size=self.world,
            gradient_as_bucket_view=True,
            attention="fused" if self.fused_attention else "explicit",
        )
        n_params = sum(p.numel() for p in self.model.parameters())
        fwd = 2 * forward_macs(mc).total
        gap = self.measured_flops_per_image / comparable - 1
        s = self.sinks
        s.info(f"dit-ledger: {describe(mc)}; {n_params:,} parameters; {self.world} process(es) on {self.device}")
        s.info(
            f"FLOPs per image (2 per multiply-add): forward {fwd / 1e9:.4g} G, training (3x forward, for MFU) "
            f"{self.flops.model / 1e9:.4g} G, hardware (with {ckpt_blocks} recomputed blocks, for HFU) "
            f"{self.flops.hardware / 1e9:.4g} G; measured on the meta device {self.measured_flops_per_image / 1e9:.4g} G "
            f"({gap:+.3%} vs the analytic count of the same ops: backward skips the input gradients)"
        )
        s.info(
            f"memory estimate per device: {mem.total / 2**30:.3g} GiB ({cfg.precision}, {ckpt_blocks} blocks "
            f"checkpointed, {self.attention} attention)"
        )
        s.info(
            f"peak: {self.peak.flops / 1e12:.4g} TFLOP/s for {cfg.precision} on {self.peak.device} ({self.peak.source})"
        )
        s.text("config", "\n".join(f"{k}: {v}" for k, v in to_dict(cfg).items()))
        self.projected = False

    # ---- one step -------------------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
            return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        return cfg.lr

    def _randomness(self, step: int, shape):
        """Timesteps, noise and class dropout of the whole global batch for this step (identical on every rank)."""
        g = self.rand_gen.manual_seed(mix_seed(self.cfg.seed, 1, step))
        b = self.cfg.global_batch_size
        t = torch.randint(0, self.diffusion.num_timesteps, (b,), generator=g, device=self.device)
        noise = torch.randn((b, *shape), generator=g, device=self.device)
        drop = (torch.rand(b, generator=g, device=self.device) < self.cfg.class_dropout_prob).long()
        return t, noise, drop

    def _model_fn(self, x, t, **kwargs):
        """The (DDP-wrapped) model under autocast, returning float32 so the loss math stays in float32."""
        with self.autocast():
            return self.ddp_model(x, t, **kwargs).float()

    def train_step(self, batches, log_step: bool):
        cfg, acc = self.cfg, self.acc
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        total = None
        shape = (self.model_cfg.in_channels, self.model_cfg.input_size, self.model_cfg.input_size)
        t_all, noise_all, drop_all = self._randomness(self.step, shape)
        for m, (x, y) in enumerate(batches):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            if self.vae is not None:
                with torch.no_grad():
                    x = self.vae_encode(self.vae, x)
            lo = (self.rank * cfg.grad_accum_steps + m) * self.micro
            sl = slice(lo, lo + self.micro)
            kwargs = dict(y=y)
            if self.model_cfg.class_dropout_prob > 0:
                kwargs["force_drop_ids"] = drop_all[sl]
            last = m == len(batches) - 1
            if self.sharded:
                self.model.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if last else acc.no_sync(self.ddp_model)
            with ctx:
                terms = self.diffusion.training_losses(self._model_fn, x, t_all[sl], kwargs, noise=noise_all[sl])
                loss = terms["loss"].mean() / cfg.grad_accum_steps
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        bad = ~torch.isfinite(total)
        if self.world > 1:  # one rank's NaN reaches every rank's gradients: all must skip together
            bad = bad.int()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            bad = bad.bool()
        grad_norm = None
        if cfg.grad_clip > 0 or log_step:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            params = [p for p in self.model.parameters() if p.grad is not None]
            if cfg.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skips non-finite steps on the device
            self.scaler.update()
        elif cfg.fused_optimizer:
            self.opt.found_inf = bad.float()  # the fused kernel skips the update (and its step count)
            self.opt.step()
        else:
            if bad.item():  # foreach AdamW cannot skip on the device: this path syncs every step
                self.opt.zero_grad(set_to_none=True)
            else:
                self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model, apply=(~bad).float())
        self.nonfinite_total += bad.long()
        self.nonfinite_streak = (self.nonfinite_streak + 1) * bad.long()
        self.loss_sum = self.loss_sum + torch.where(bad, torch.zeros_like(total), total)
        self.loss_count = self.loss_count + (~bad).long()
        return grad_norm

    # ---- checkpoints ------------------------------------------------------------------------------------------

    def save(self):
        state = {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        gathered = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(gathered, state)
        else:
            gathered = [state]
        model_state = full_model_state(self.model, self.sharded)  # collective under FSDP
        ema_state = full_model_state(self.ema.model, self.sharded)
        opt_state = full_optimizer_state(self.model, self.opt, self.sharded)
        if self.acc.is_main_process:
            payload = {
                "model": model_state,
                "ema": ema_state,
                "ema_updates": self.ema.num_updates,
                "optimizer": opt_state,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "data_position": {"step": self.step, "epoch": self.order.epoch_of(self.step)},
                "rng": {str(r): s for r, s in enumerate(gathered)},
                "config": {**to_dict(self.cfg), "vae": None if self.cfg.pixel_space else self.cfg.vae},
                "model_config": self.model_cfg.to_dict(),
            }
            path = save_training_checkpoint(self.ckpt_dir, self.step, payload, self.cfg.keep_last)
            self.sinks.info(f"saved checkpoint {path}")
        self.acc.wait_for_everyone()

    # ---- the loop ----------------------------------------------------------------------------------------------

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _log(self, grad_norm):
        stats = torch.stack(
            [
                self.loss_sum.float(),
                self.loss_count.float(),
                self.nonfinite_total.float(),
                self.nonfinite_streak.float(),
            ]
        )
        stats = self.acc.reduce(stats, reduction="sum") if self.world > 1 else stats
        values = stats.tolist()  # the one host sync of this window
        self._sync()
        now = time.perf_counter()
        window = self.meter.window(now)
        loss = values[0] / max(values[1], 1)
        rate = window["images_per_sec_per_device"]
        metrics = {
            "step": self.step,
            "epoch": self.order.epoch_of(self.step - 1),
            "loss": loss if values[1] > 0 else float("nan"),
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if grad_norm is not None
            else None,
            "lr": self.lr_at(self.step - 1),
            **window,
            "measured_tflops_per_device": rate * self.measured_flops_per_image / 1e12,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None,
            "loss_scale": float(self.scaler.get_scale()) if self.scaler is not None else None,
            "nonfinite_steps": int(values[2]),
            "in_warmup": self.step <= self.warmup_until,
        }
        self.sinks.log(metrics)
        self.loss_sum.zero_()
        self.loss_count.zero_()
        if not self.projected and self.step > self.warmup_until and window["steps_per_sec"] > 0:
            self._project(window)
        return int(values[3] / self.world)

    def _project(self, window):
        remaining = self.cfg.max_steps - self.step
        hours = remaining / window["steps_per_sec"] / 3600
        msg = (
            f"projection at measured MFU {window['mfu']:.1%}: {remaining:,} steps left, {hours:.2f} h wall-clock, "
            f"{hours * self.world:.2f} device-hours"
        )
        if self.cfg.price_per_hour:
            msg += (
                f", {hours * self.world * self.cfg.price_per_hour:,.2f} at {self.cfg.price_per_hour}/device-hour"
            )
        self.sinks.info(msg)
        self.projected = True

    @contextlib.contextmanager
    def _outside_mfu(self):
        """Checkpointing and sampling time is kept out of the MFU window."""
        self._sync()
        self.meter.pause()
        try:
            yield
        finally:
            self._sync()
            self.meter.resume()

    def reset_counters(self):
        """Device-side loss and non-finite counters, read only at log steps."""
        self.nonfinite_total = torch.zeros((), dtype=torch.long, device=self.device)
        self.nonfinite_streak = torch.zeros((), dtype=torch.long, device=self.device)
        self.loss_sum = torch.zeros((), device=self.device)
        self.loss_count = torch.zeros((), dtype=torch.long, device=self.device)

    def run(self) -> dict:
        cfg = self.cfg
        self.reset_counters()
        self.warmup_until = self.step + cfg.mfu_warmup_steps
        stop = StopFlag(self.world)
        it = iter(self.loader)
        self.model.train()
        bar = None
        if cfg.progress and self.acc.is_main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", dynamic_ncols=True)
        self.meter.reset_clock(time.perf_counter())
        status = "finished"
        try:
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                try:
                    batches = [next(it) for _ in range(cfg.grad_accum_steps)]
                except UserError:  # an unreadable image: keep the work done so far, then say which file
                    if self.world == 1:  # with several processes the others are mid-step: no collective save
                        self.save()
                    raise
                wait = time.perf_counter() - t0
                log_step = (self.step + 1) % cfg.log_every == 0 or self.step + 1 == cfg.max_steps
                grad_norm = self.train_step(batches, log_step)
                self.step += 1
                self.meter.step(self.micro * cfg.grad_accum_steps, data_wait_s=wait)
                if bar is not None:
                    bar.update(1)
                if log_step:
                    streak = self._log(grad_norm)
                    if streak >= cfg.max_nonfinite:
                        with self._outside_mfu():
                            self.save()
                        raise UserError(
                            f"the loss was non-finite for {streak} steps in a row (step {self.step}); the last good "
                            "state is saved. Lower --lr, set --grad-clip, or use --precision bf16/fp32."
                        )
                if self.step == self.warmup_until:  # after this step's log: MFU windows start here
                    self._sync()
                    self.meter.reset_clock(time.perf_counter())
                if self.step % cfg.ckpt_every == 0 and self.step < cfg.max_steps:
                    with self._outside_mfu():
                        self.save()
                if cfg.sample_every and self.step % cfg.sample_every == 0:
                    with self._outside_mfu():
                        self._sample_grid()
                if stop.should_stop():
                    status = f"stopped by {stop.raised}"
                    break
            self.save()
        finally:
            stop.restore()
            if bar is not None:
                bar.close()
        self.sinks.info(f"{status} at step {self.step}; results in {self.out}")
        self.sinks.close()
        return {"status": status, "step": self.step, "results_dir": str(self.out)}

    def _sample_grid(self):
        """A grid from the EMA weights (DDIM-50, guidance 4) for TensorBoard, one image per class shown."""
        ema = self.ema.model
        if self.sharded:  # sample from a whole copy on rank 0; gathering it is collective
            state = full_model_state(ema, sharded=True)
            if self.acc.is_main_process:
                ema = DiT.from_config(self.model_cfg).to(self.device).eval()
                ema.load_state_dict(state)
        if not self.acc.is_main_process:
            return
        from torchvision.utils import make_grid

        from dit.engine.sampling import SamplingModel, generate, make_diffusion

        vae_spec = None if self.vae is None else self.cfg.vae
        cfg = self.cfg
        sm = SamplingModel(ema, "ema", cfg.image_size, self.vae, vae_spec, cfg.noise_schedule, cfg.predict_xstart)
        labels = list(range(min(self.model_cfg.num_classes, 16)))
        seeds = [mix_seed(self.cfg.seed, 2, i) for i in range(len(labels))]
        images = generate(sm, make_diffusion(sm, 50), labels, seeds, sampler="ddim", cfg_scale=4.0)
        self.sinks.image("samples/ema", make_grid((images + 1) / 2, nrow=min(len(labels), 8)), self.step)


def train(cfg: TrainConfig, dataset=None) -> dict:
    """Train with ``cfg``; ``dataset`` (items (image CHW in [-1, 1], label)) replaces the configured data."""
    os.makedirs(cfg.results_dir, exist_ok=True)
    return Trainer(cfg, dataset).run()
