"""Data parallelism in one place: a ``Parallelism`` (one process, DDP or FSDP2) the trainer calls without naming
it, and state dicts keyed by parameter name, so that a run resumes with or without FSDP on any device count."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from dit.cost.memory import estimate_training_memory, fit_checkpointing, max_batch_that_fits, usable_memory
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.model.config import ACTIVATION_CHECKPOINTING_HELP, DiTConfig, describe, parse_activation_checkpointing
from dit.model.dit import DiT
from dit.model.layers import ATTENTION_BACKENDS


@dataclass(frozen=True)
class ParallelSection(Section):
    """How a step runs on the devices: DDP or FSDP, compiled blocks, the attention kernel, recomputation."""

    fsdp: bool = option(False, "shard weights, gradients, AdamW and EMA over the processes (FSDP2) instead of DDP")
    compile: bool = option(False, "torch.compile each DiT block")
    attention: str = option(
        "auto",
        "attention kernel: auto (explicit matmuls for bf16 on CPU, else SDPA's pick), sdpa, flash, efficient, "
        "cudnn, math, explicit",
        choices=ATTENTION_BACKENDS,
    )
    activation_checkpointing: str = option(
        "auto", ACTIVATION_CHECKPOINTING_HELP + "; a fixed count that does not fit stops the run before step 1"
    )
    memory_reserve_gib: float | None = option(
        None, "device memory the start-up's fit check keeps free (default: 10%, at least 2 GiB)", ge=0
    )
    ddp_bf16_grads: bool = option(
        False, "DDP: all-reduce gradients as bf16 (half the traffic; sums rounded to 8 bits), not float32"
    )

    def check(self) -> None:
        parse_activation_checkpointing(self.activation_checkpointing)
        if self.fsdp and self.ddp_bf16_grads:
            raise FieldError("{ddp_bf16_grads} is for DDP; {fsdp} reduce-scatters gradients in float32: pass one.")


def data_parallel(model: nn.Module, device: torch.device, bf16_grads: bool = False) -> nn.Module:
    """DDP with gradient buckets as views and no buffer broadcast (the RoPE tables are alike everywhere)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, broadcast_buffers=False)
    if bf16_grads:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    return ddp


def parallelize(
    model: DiT, checkpointed: int, compile: bool, sharded: bool, param_dtype: torch.dtype | None
) -> DiT:
    """The DiT ready to train, in torchtitan's order: checkpointing, compiled blocks, then FSDP2."""
    model.set_checkpointing(checkpointed)
    if compile:
        if next(model.parameters()).device.type == "cpu":
            pin_cpu_simd_width()
        for block in model.blocks:
            block.compile(fullgraph=True)
    if sharded:
        shard(model, param_dtype)
    return model


def pin_cpu_simd_width() -> None:
    """Pin inductor's CPU SIMD width: its config is in the FX graph cache key and ``ATEN_CPU_CAPABILITY`` is not,
    so an AVX-512 cache would hand an AVX2 process loops that leave half their outputs unwritten."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is None:
        config.cpp.simdlen = pick_vec_isa().bit_width()  # 0 without a vector ISA: scalar loops


def shard(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard each block, then the rest (float32, as under DDP's autocast); the last block stays gathered."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    blocks = list(getattr(model, "blocks", ()))
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model)
    return model


def local(tensors) -> list[torch.Tensor]:
    """Each tensor's local shard (a plain tensor stays as it is): for foreach ops across two sharded models."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _rekeyed(state: dict, key) -> dict:
    """An optimizer state with each parameter's key mapped by ``key`` (id to name, as FSDP's full state dict is
    keyed, or back)."""
    return {
        "state": {key[k]: s for k, s in state["state"].items()},
        "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]],
    }


def model_state(model: nn.Module, sharded: bool) -> dict:
    """The whole state dict on CPU, or when ``sharded`` this rank's shards as they are (nothing gathered)."""
    if not sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def load_model_state(model: nn.Module, state: dict, sharded: bool, source: str = "checkpoint") -> None:
    """A full state dict into ``model`` (strict, every differing key named), or a sharded checkpoint's shards."""
    if not sharded:
        if hasattr(model, "load_weights"):  # the DiT names every differing key
            model.load_weights(state, source=source)
        else:
            model.load_state_dict(state, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=_whole(state), strict=True))


def optimizer_state(model: nn.Module, optimizer, sharded: bool) -> dict:
    if not sharded:
        return _rekeyed(optimizer.state_dict(), _trainable_names(model))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state(model: nn.Module, optimizer, state: dict, sharded: bool):
    if not sharded:
        optimizer.load_state_dict(_rekeyed(state, {n: i for i, n in enumerate(_trainable_names(model))}))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    whole = _whole([t for s in state["state"].values() for t in s.values()])
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=whole))


def _whole(tensors) -> bool:
    """Whether a state holds whole tensors (a file's), not DTensor shards (a sharded checkpoint's)."""
    from torch.distributed.tensor import DTensor

    values = tensors.values() if isinstance(tensors, dict) else tensors
    return not any(isinstance(t, DTensor) for t in values)


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def parallelism(section: ParallelSection, runtime) -> Parallelism:
    """The run's parallelism: one process, DDP, or (``--fsdp`` on several processes) FSDP2."""
    if runtime.world == 1:
        return Single(section, runtime)
    return (FSDP if section.fsdp else DDP)(section, runtime)


class Parallelism:
    """How the step runs over the processes, so that the trainer names none; this class is one process."""

    split = False  # FSDP: weights, gradients and optimizer state are split over the ranks, each saves its own
    memory_layout = "ddp"  # the memory model's name for it (one process counts as DDP on one)

    def __init__(self, section: ParallelSection, runtime):
        self.section, self.runtime = section, runtime
        self.module: nn.Module | None = None  # what the step calls, set by ``wrap``

    def wrap(self, model: DiT, trained: nn.Module, ema: list[nn.Module], checkpointed: int) -> nn.Module:
        """Parallelize ``model`` and place the ``ema`` copies; return what the step calls for ``trained``."""
        parallelize(model, checkpointed, self.section.compile, self.split, self.runtime.precision.amp_dtype)
        self.module = trained
        return trained

    def fit(
        self, cfg: DiTConfig, micro: int, grad_accum: int, attention: str, ema_profiles: int = 0
    ) -> tuple[int, str | None]:
        """(blocks to recompute, why or None), checked against device memory before anything is built."""
        section, runtime = self.section, self.runtime
        try:
            policy = parse_activation_checkpointing(section.activation_checkpointing, cfg.depth)
        except FieldError as e:
            raise UserError(e.spelled(lambda name: "--" + name.replace("_", "-"))) from None
        capacity = runtime.memory_capacity()
        usable = usable_memory(capacity, section.memory_reserve_gib)
        options = dict(
            precision=runtime.precision.name, world_size=runtime.world, sharding=self.memory_layout,
            gradient_as_bucket_view=True, attention="explicit" if attention in ("explicit", "math") else "fused",
            **({"ema_profiles": ema_profiles} if ema_profiles else {}),
        )  # fmt: skip
        blocks, estimate = fit_checkpointing(cfg, micro, usable, policy, **options)
        self.memory_estimate = estimate.total  # per device, for the ledger's start-up line
        gpu = runtime.device.type == "cuda"
        where = f"{runtime.device}'s {_gib(capacity)}" if gpu else f"the host's {_gib(capacity)}"
        if estimate.total > usable:
            raise UserError(
                f"{describe(cfg)} at {micro} images per {'GPU' if gpu else 'process'} needs an estimated "
                f"{_gib(estimate.total)} per step with {blocks} of {cfg.depth} blocks checkpointed "
                f"({runtime.precision.name}, dit.cost.memory), over the {_gib(usable)} usable of {where}: "
                f"{self._fixes(cfg, micro, grad_accum, usable, policy, options)}."
            )
        if policy != "auto" or blocks == 0:
            return blocks, None
        plain = estimate_training_memory(cfg, micro, **options).total
        return blocks, (
            f"activation checkpointing (auto): the first {blocks} of {cfg.depth} blocks, the fewest that fit: "
            f"without them the step needs an estimated {_gib(plain)} per device (dit.cost.memory), over the "
            f"{_gib(usable)} usable of {where}; with them {_gib(estimate.total)}"
        )

    def _fixes(self, cfg: DiTConfig, micro: int, grad_accum: int, usable: int, policy, options: dict) -> str:
        """What would fit: checkpointing chosen by ``auto``, fewer images per pass, or more GPUs."""
        fixes = []
        if policy != "auto":
            blocks, estimate = fit_checkpointing(cfg, micro, usable, "auto", **options)
            if estimate.total <= usable:
                fixes.append(f"--activation-checkpointing auto (it fits with {blocks} blocks)")
        kept = cfg.depth if policy == "auto" else policy  # auto: at most every block
        most = max_batch_that_fits(cfg, usable, checkpointed_blocks=kept, **options) if usable > 0 else 0
        split = next((n for n in range(2, micro + 1) if micro % n == 0 and micro // n <= most), None)
        if split is not None:
            fixes.append(f"--grad-accum-steps {grad_accum * split} ({micro // split} images per pass)")
        more = "spread the batch over more GPUs" + ("" if self.split else " (--fsdp also shards the weights)")
        return f"pass {', '.join(fixes)}, or {more}" if fixes else more

    def sync_gradients(self, last: bool):
        """The context of one micro-batch: gradients are reduced on the ``last`` only."""
        return contextlib.nullcontext()

    def whole(self, model: DiT, every_rank: bool = True) -> DiT | None:
        """``model`` whole: under FSDP a gathered copy on every rank (or rank 0 only); collective."""
        return model

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over the whole model from this rank's view of it."""
        return norm


Single = Parallelism  # one process: the base's no-ops


class DDP(Parallelism):
    def wrap(self, model, trained, ema, checkpointed):
        super().wrap(model, trained, ema, checkpointed)
        self.module = data_parallel(trained, self.runtime.device, self.section.ddp_bf16_grads)
        return self.module

    def sync_gradients(self, last):
        return contextlib.nullcontext() if last else self.module.no_sync()


class FSDP(Parallelism):
    split, memory_layout = True, "fsdp"

    def wrap(self, model, trained, ema, checkpointed):
        super().wrap(model, trained, ema, checkpointed)  # every rank built the same weights: each keeps its part
        self.reduced = [model]  # the modules whose gradients are reduce-scattered
        for copy in ema:
            shard(copy)
        projector = getattr(trained, "projector", None)
        if projector is not None:
            shard(projector)
            self.reduced.append(projector)
        return trained

    def sync_gradients(self, last):
        for module in self.reduced:
            module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def whole(self, model, every_rank=True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)  # offload: rank 0 only
        weights = get_model_state_dict(model, options=options)
        if not (every_rank or self.runtime.is_main):
            return None
        with torch.device("meta"):  # no throwaway random weights: the gathered ones are taken as they are
            whole = DiT.from_config(model.config)
        whole.load_state_dict(weights, assign=True)
        for name, table in model.named_buffers():  # the fixed tables outside the state dict (RoPE's)
            if name not in weights:
                owner, _, attr = name.rpartition(".")
                setattr(whole.get_submodule(owner), attr, table)
        return whole.to(self.runtime.device).eval()

    def global_norm(self, norm):
        return norm.full_tensor()  # a collective: every rank's shards
