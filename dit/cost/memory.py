"""Training memory per device: an analytic estimate, and a trace of one real step on fake tensors with torch's
``MemTracker``, which tests hold the estimate to."""

from __future__ import annotations

from dataclasses import dataclass

from dit.cost.analytic import option_params, param_counts
from dit.io.errors import UserError
from dit.model.config import DiTConfig, describe
from dit.model.options import chosen

_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtype names; torch loads lazily
MEMORY_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# "fused": SDPA's flash, memory-efficient and cuDNN kernels; "explicit": the T x T matrix is kept (explicit, math)
ATTENTION_KINDS = ("fused", "explicit")

# Bytes saved for backward per (image x token x hidden) element, from what each op keeps (docs/cost_model.md).
_FINAL_SAVED = {"fp32": 12, "tf32": 12, "bf16": 10, "fp16": 10}  # final layer: x, LN, modulated input
_CHECKPOINT_SAVED = 4  # a checkpointed block keeps its fp32 input, and (torch 2.14.1) until backward ends
_BACKWARD_WORKING = 16  # activation gradients in flight in backward: ~4 fp32 tensors


def _block_saved(cfg: DiTConfig, precision: str) -> float:
    """Bytes a block keeps per (image x token x hidden) element: the official block's 12 + 2r tensors (80 in fp32,
    48 under autocast: docs/cost_model.md) plus its options' terms; new q and k count once."""
    half = precision in _AUTOCAST
    options = chosen(cfg)
    tensors = 12 + sum(o.saved(cfg) for o in options)
    saved = 4 * tensors if not half else 4 * 4 + 2 * (tensors - 4)
    if any(o.new_qk for o in options):
        saved += 2 * (2 if half else 4)
    return saved + sum(o.saved_fp32(cfg) for o in options)


def _attention_matrix(cfg: DiTConfig, precision: str, attention: str, tokens: int | None = None) -> int:
    """Bytes per image of one block's softmax probabilities over ``tokens``: explicit attention's only."""
    if attention not in ATTENTION_KINDS:
        raise UserError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}.")
    if attention == "fused":
        return 0
    tokens = cfg.tokens if tokens is None else tokens
    return cfg.num_heads * tokens**2 * (2 if precision in _AUTOCAST else 4)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the peak of a training step, by part, and the phase that sets the peak."""

    parts: dict[str, int]
    phase: str  # "backward start", "last checkpointed block" or "optimizer step"

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def estimate_training_memory(
    cfg: DiTConfig,
    batch_per_device: int,
    precision: str = "fp32",
    checkpointed_blocks: int = 0,
    ema: bool = True,
    sharding: str = "ddp",
    world_size: int = 1,
    gradient_as_bucket_view: bool = False,
    ema_profiles: int = 0,
    attention: str = "fused",
    ratio: float | None = None,
) -> MemoryEstimate:
    """Analytic peak memory of a step: the largest of backward's start, the last recomputed block, AdamW's step."""
    if batch_per_device < 1:
        raise UserError(f"batch_per_device must be >= 1, got {batch_per_device}.")
    if precision not in MEMORY_PRECISIONS:
        raise UserError(f"memory precision must be one of {', '.join(MEMORY_PRECISIONS)}, got {precision!r}.")
    if not 0 <= checkpointed_blocks <= cfg.depth:
        raise UserError(f"checkpointed_blocks must be in 0..{cfg.depth} (the depth), got {checkpointed_blocks}.")
    if sharding not in ("ddp", "fsdp"):
        raise UserError(f"sharding must be 'ddp' or 'fsdp', got {sharding!r}.")
    if world_size < 1:
        raise UserError(f"world_size must be >= 1, got {world_size}.")
    counts = param_counts(cfg)
    shard = world_size if sharding == "fsdp" else 1
    total_params, trainable = -(-counts.total // shard), -(-counts.trainable // shard)
    sprint = cfg.token_drop and cfg.token_drop_layout == "sprint"  # its fusion: a 2D -> D linear, keeping 2 x fp32
    d, p = cfg.hidden_size, cfg.patch_size  # matmul weights: what autocast keeps 16-bit copies of
    block_matmul = 4 * d * d + sum(o.macs(cfg) for o in chosen(cfg)) + 6 * d * d
    rest = (
        p * p * cfg.in_channels * d + cfg.frequency_embedding_size * d + 3 * d * d + (2 * d * d if sprint else 0)
    )
    all_matmul = cfg.depth * block_matmul + rest + d * p * p * cfg.out_channels
    # a block's parameters: attention and adaLN with their biases, and its options'
    block_params = (4 * d * d + 4 * d) + option_params(cfg) + (6 * d * d + 6 * d)
    elems = batch_per_device * cfg.tokens * cfg.hidden_size
    tokens = cfg.block_tokens(ratio)  # each block's elements: elems x its tokens / all tokens
    plain, kept = sum(tokens[checkpointed_blocks:]) / cfg.tokens, sum(tokens[:checkpointed_blocks]) / cfg.tokens
    autocast = precision in _AUTOCAST
    attn_matrix = batch_per_device * _attention_matrix(cfg, precision, attention)
    block_saved = _block_saved(cfg, precision)

    static = {"params": 4 * total_params, "optimizer": 8 * trainable, "ema": 4 * total_params if ema else 0}
    if ema_profiles:
        static["ema_profiles"] = 4 * total_params * ema_profiles
    if sharding == "fsdp" and world_size > 1:
        static["fsdp_unsharded"] = 2 * 2 * 4 * block_params  # two blocks in flight: weights and gradients
    if sharding == "ddp" and world_size > 1:
        static["ddp_buckets"] = 4 * trainable
    grads = 0 if (sharding == "ddp" and world_size > 1 and gradient_as_bucket_view) else 4 * trainable

    copies = 2 * (all_matmul - checkpointed_blocks * block_matmul) if autocast else 0
    backward_start = {
        "activations": int(elems * (plain * block_saved + kept * _CHECKPOINT_SAVED + (2 * 4 if sprint else 0))),
        "autocast_weight_copies": copies,
        "final_layer": elems * _FINAL_SAVED[precision],
        "backward_working": elems * _BACKWARD_WORKING,
    }
    if attn_matrix:
        kept_matrices = sum(_attention_matrix(cfg, precision, attention, t) for t in tokens[checkpointed_blocks:])
        backward_start["attention_matrices"] = batch_per_device * kept_matrices
        backward_start["backward_working"] += 2 * attn_matrix  # dP and dS of the block in backward
    phases = {"backward start": backward_start}
    if checkpointed_blocks:
        phases["last checkpointed block"] = {
            "gradients": grads,
            "activations": int(elems * kept * _CHECKPOINT_SAVED),
            "recomputed_block": int(elems * block_saved) + attn_matrix + (2 * block_matmul if autocast else 0),
            "backward_working": elems * _BACKWARD_WORKING + 2 * attn_matrix,
        }
    phases["optimizer step"] = {"gradients": grads, "optimizer_step_temp": 4 * trainable}
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    return MemoryEstimate(parts={**static, **phases[phase]}, phase=phase)


def snapshot_disk(cfg: DiTConfig, profiles: int, steps: int, every: int) -> tuple[int, int]:
    """A run's post-hoc EMA snapshots, one every ``every`` steps and at the end: (how many, bytes each)."""
    count = steps // every + (1 if steps % every else 0)
    return count, 4 * param_counts(cfg).total * profiles


def max_batch_that_fits(cfg: DiTConfig, memory_bytes: int, **estimate_kwargs) -> int:
    """Largest batch per device whose analytic peak fits in ``memory_bytes`` (0 if not even one image)."""
    if memory_bytes <= 0:
        raise UserError(f"device memory must be positive, got {memory_bytes} bytes.")

    def fits(batch: int) -> bool:
        return estimate_training_memory(cfg, batch, **estimate_kwargs).total <= memory_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low) and not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def usable_memory(capacity_bytes: int, reserve_gib: float | None = None) -> int:
    """What a step may use of a device: all but ``reserve_gib``, by default 10% and at least 2 GiB."""
    reserve = reserve_gib * 2**30 if reserve_gib is not None else max(2 * 2**30, 0.1 * capacity_bytes)
    return int(capacity_bytes - reserve)


def fit_checkpointing(
    cfg: DiTConfig,
    batch_per_device: int,
    budget_bytes: int,
    checkpointed_blocks: int | str = "auto",
    **estimate_kwargs,
) -> tuple[int, MemoryEstimate]:
    """The blocks to recompute and their estimate: as given, or for "auto" the fewest that fit (else all)."""
    candidates = range(cfg.depth + 1) if checkpointed_blocks == "auto" else (checkpointed_blocks,)
    for blocks in candidates:
        estimate = estimate_training_memory(cfg, batch_per_device, checkpointed_blocks=blocks, **estimate_kwargs)
        if estimate.total <= budget_bytes:
            break
    return blocks, estimate


def fewest_checkpointed_blocks(cfg: DiTConfig, batch_per_device: int, budget_bytes: int, **estimate_kwargs) -> int:
    """The fewest activation-checkpointed blocks whose estimated step memory fits ``budget_bytes``."""
    blocks, estimate = fit_checkpointing(cfg, batch_per_device, budget_bytes, "auto", **estimate_kwargs)
    if estimate.total <= budget_bytes:
        return blocks
    raise UserError(
        f"{describe(cfg)} at {batch_per_device} images per device does not fit in {budget_bytes / 2**30:.1f} GiB "
        "even with every block checkpointed: lower the batch per device (raise --grad-accum-steps) or use "
        "more devices."
    )


@dataclass(frozen=True)
class MemoryTrace:
    peak_bytes: int
    at_peak: dict[str, int]  # MemTracker's categories (Parameter, Gradient, Activation, ...) at the peak


def trace_training_memory(
    cfg: DiTConfig,
    batch_per_device: int,
    precision: str = "fp32",
    checkpointed_blocks: int = 0,
    ema: bool = True,
    attention: str = "fused",
) -> MemoryTrace:
    """Peak memory of one steady-state step, traced on fake tensors (CPU autocast, AdamW ``foreach``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from dit.model.dit import DiT
    from dit.objectives.gaussian import create_diffusion

    class PeakOnlyMemTracker(MemTracker):
        """MemTracker without its per-module peaks, which cost O(modules) per op."""

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = DiT.from_config(cfg).set_checkpointing(checkpointed_blocks).train()
        _attention_matrix(cfg, precision, attention)  # validates the name
        model.set_attention("sdpa" if attention == "fused" else "explicit")
        trainable = [p for p in model.parameters() if p.requires_grad]
        # MemTracker fails on the frozen pos_embed: it takes a gradient here (docs/cost_model.md)
        model.pos_embed.requires_grad_(True)
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, foreach=True)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema_model = DiT.from_config(cfg).requires_grad_(False) if ema else None
        diffusion = create_diffusion("")

        tracker = PeakOnlyMemTracker()
        tracker.track_external(model, optimizer, ema_model)
        with tracker:
            n, side = batch_per_device, cfg.input_size
            x = torch.randn(n, cfg.in_channels, side, side)
            y = torch.randint(0, max(cfg.num_classes, 1), (n,))
            t = torch.randint(0, diffusion.num_timesteps, (n,))
            with torch.autocast(
                "cpu", dtype=getattr(torch, _AUTOCAST.get(precision, "float32")), enabled=precision in _AUTOCAST
            ):
                loss = diffusion.training_losses(model, x, t, {"y": y})["loss"].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema_model is not None:
                with torch.no_grad():
                    torch._foreach_lerp_(list(ema_model.parameters()), list(model.parameters()), 1e-4)
        snapshot = tracker.get_tracker_snapshot("peak")
    (at_peak,) = snapshot.values()
    parts = {str(getattr(k, "value", k)): v for k, v in at_peak.items() if v and k != "Total"}
    return MemoryTrace(peak_bytes=at_peak["Total"], at_peak=parts)
