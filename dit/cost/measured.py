"""FLOPs counted by running the real model on the meta device, once (tests, ``dit-cost flops --measure``): the
check on ``dit.cost.analytic`` (on CPU, torch counts the flash kernel as 0: docs/cost_model.md)."""

from __future__ import annotations

import math
import re
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from dit.io.errors import require
from dit.model.config import DiTConfig
from dit.model.dit import DiT

# The CPU kernels counted as torch counts the CUDA fused ones (forward 2 bmm, backward 5: QK^T recomputed)
CPU_SDPA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *_, **__: sdpa_backward_flop_count(g, q, k, v)
    ),
}

# Module (block index starred) -> component; attention's own share is its total less its two linears
_MODULE_COMPONENTS = {
    "x_embedder": "patch_embed",
    "t_embedder": "timestep_embedder",
    "blocks.*.adaLN_modulation": "adaln_modulation",
    "blocks.*.attn.qkv": "qkv",
    "blocks.*.attn": "attention",
    "blocks.*.attn.proj": "attention_out_proj",
    "blocks.*.mlp": "mlp",
    "token_drop.fuse": "token_fusion",
    "final_layer.adaLN_modulation": "final_adaln",
    "final_layer.linear": "final_linear",
}


def _inputs(cfg: DiTConfig, batch_size: int, device: str):
    x = torch.randn(batch_size, cfg.in_channels, cfg.input_size, cfg.input_size, device=device)
    t = torch.randint(0, 1000, (batch_size,), device=device)
    y = torch.randint(0, max(cfg.num_classes, 1), (batch_size,), device=device)
    return x, t, y


def measure_flops(
    cfg: DiTConfig,
    batch_size: int = 1,
    train: bool = True,
    checkpointed_blocks: int = 0,
    device: str = "meta",
    ratio: float | None = None,
) -> dict:
    """Count the real DiT forward (and backward) with ``FlopCounterMode``: on "meta" the model convention, on "cpu"
    (tiny configs) the fused kernels' formulas, recompute included."""
    if device not in ("meta", "cpu"):
        raise ValueError(f"device must be 'meta' or 'cpu', got {device!r}")
    with torch.device(device):
        model = DiT.from_config(cfg)
    model.set_checkpointing(checkpointed_blocks).train()
    mapping = CPU_SDPA_FORMULAS if device == "cpu" else {}
    inputs, ratio = _inputs(cfg, batch_size, device), cfg.token_drop if ratio is None else ratio
    # a token drop's ``kept``: each sample's first K tokens (counts depend on K only)
    kept = {"kept": torch.arange(cfg.kept_tokens(ratio), device=device).expand(batch_size, -1)} if ratio else {}

    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd_counter, torch.no_grad():
        model(*inputs, **kept)
    components = dict.fromkeys(_MODULE_COMPONENTS.values(), 0)  # QK^T and A.V together as "attention"
    for name, ops in fwd_counter.get_flop_counts().items():
        key = re.sub(r"^blocks\.\d+\.", "blocks.*.", name.removeprefix("DiT."))
        if key in _MODULE_COMPONENTS:
            components[_MODULE_COMPONENTS[key]] += sum(ops.values())
    components["attention"] -= components["qkv"] + components["attention_out_proj"]
    result = {
        "batch_size": batch_size,
        "device": device,
        "forward_flops": fwd_counter.get_total_flops(),
        "forward_flops_per_image": fwd_counter.get_total_flops() / batch_size,
        "forward_components": {k: v / batch_size for k, v in components.items()},
    }
    if train:
        with FlopCounterMode(display=False, custom_mapping=mapping) as train_counter:
            model(*inputs, **kept).float().square().mean().backward()
        total = train_counter.get_total_flops()
        result.update(
            checkpointed_blocks=checkpointed_blocks, train_flops=total, train_flops_per_image=total / batch_size
        )
    return result


def _sdpa_macs(inputs, outputs) -> int:
    """fvcore handle for aten::scaled_dot_product_attention: QK^T plus A.V, in MACs (fvcore's unit)."""
    from fvcore.nn.jit_handles import get_shape

    q, k, v = (get_shape(inputs[i]) for i in range(3))
    return math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])


def fvcore_forward_macs(cfg: DiTConfig, batch_size: int = 1, sdpa_handle: bool = True) -> dict:
    """fvcore's forward MACs per image, with the SDPA handle it lacks; its LayerNorm and skipped ops apart."""
    require("fvcore", "fvcore", "the fvcore cross-check (--fvcore)")
    with warnings.catch_warnings():  # fvcore warns on import about its own deprecated dependencies
        warnings.simplefilter("ignore")
        from fvcore.nn import FlopCountAnalysis

    model = DiT.from_config(cfg).eval()
    analysis = FlopCountAnalysis(model, _inputs(cfg, batch_size, "cpu"))
    if sdpa_handle:
        analysis.set_op_handle("aten::scaled_dot_product_attention", _sdpa_macs)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace deprecation chatter
        by_op = dict(analysis.by_operator())
        total = analysis.total()
    return {
        "total": total / batch_size,
        "layer_norm": by_op.get("layer_norm", 0) / batch_size,
        "attention": by_op.get("scaled_dot_product_attention", 0) / batch_size,
        "by_operator": {k: v / batch_size for k, v in by_op.items()},
        "unsupported": dict(analysis.unsupported_ops()),
    }
