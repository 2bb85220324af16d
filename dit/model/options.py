"""Block options: one entry each, with its builder and its cost and memory terms, which ``dit.cost`` reads (never
the names); the first entries are the official DiT. Per block (docs/cost_model.md): ``macs`` per token in matmuls;
``params``; ``saved``/``saved_fp32``, what backward keeps per element; ``new_qk``: new q and k."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


def _zero(cfg) -> int:
    return 0


@dataclass(frozen=True)
class BlockOption:
    brief: str  # what it is, in the flag's help: "rmsnorm (no mean subtracted)"
    build: Callable  # cfg -> the module (or tables) it adds; imports torch when called
    macs: Callable = _zero
    params: Callable = _zero
    saved: Callable = _zero
    saved_fp32: Callable = _zero
    new_qk: bool = False
    width: Callable | None = None  # an MLP's: its hidden width from the GELU width, D x mlp_ratio


def swiglu_width(gelu_width: int) -> int:
    """2/3 of a GELU MLP's width, to the nearest multiple of 8: the SwiGLU of (about) its parameters."""
    return max(8, 8 * round(2 * gelu_width / 3 / 8))


def _layer(module: str, name: str, *sizes: str, **kwargs) -> Callable:
    """A builder: ``module.name(cfg.size, ..., **kwargs)``, imported when called."""
    return lambda cfg: getattr(importlib.import_module(module), name)(*(getattr(cfg, s) for s in sizes), **kwargs)


def _mlp_terms(matrices: int, saved_widths: int) -> dict:
    """An MLP of ``matrices`` D x h matrices keeping ``saved_widths`` h-wide tensors for backward."""
    return dict(
        macs=lambda cfg: matrices * cfg.hidden_size * cfg.mlp_hidden,
        params=lambda cfg: matrices * cfg.hidden_size * cfg.mlp_hidden + (matrices - 1) * cfg.mlp_hidden
        + cfg.hidden_size,
        saved=lambda cfg: saved_widths * cfg.mlp_hidden / cfg.hidden_size,
    )  # fmt: skip


# Affine-free norms (adaLN supplies the scale and shift): before attention, before the MLP, in the final layer.
NORMS = {
    "layernorm": BlockOption("layernorm (DiT)", _layer("torch.nn", "LayerNorm", "hidden_size", elementwise_affine=False, eps=1e-6)),
    "rmsnorm": BlockOption("rmsnorm (no mean subtracted)", _layer("torch.nn", "RMSNorm", "hidden_size", elementwise_affine=False, eps=1e-6)),
}  # fmt: skip
MLPS = {  # GELU keeps fc1's and GELU's outputs; SwiGLU w12's (2h), SiLU's and the product's
    "gelu": BlockOption("gelu (DiT)", _layer("dit.model.layers", "Mlp", "hidden_size", "mlp_hidden"), width=int,
                        **_mlp_terms(2, 2)),
    "swiglu": BlockOption("swiglu (2/3 the width: the same weights and FLOPs at S/B/XL)",
                          _layer("dit.model.layers", "SwiGLU", "hidden_size", "mlp_hidden"), width=swiglu_width,
                          **_mlp_terms(3, 4)),
}  # fmt: skip
SWITCHES = {  # RoPE keeps only its tables; QK-norm (computed in float32) 1/rms per head and token
    "rope": BlockOption("2-D axial rotary embeddings on q and k (the sin-cos table stays)",
                        _layer("dit.model.layers", "rope_2d", "head_dim", "grid"), new_qk=True),
    "qk_norm": BlockOption("per-head RMSNorm with a learned weight on q and k",
                           _layer("dit.model.layers", "HeadRMSNorm", "head_dim"), params=lambda cfg: 2 * cfg.head_dim,
                           saved_fp32=lambda cfg: 2 * 4 / cfg.head_dim, new_qk=True),
}  # fmt: skip
CHOICES = {"norm": NORMS, "mlp": MLPS}  # DiTConfig field -> its registry


def chosen(cfg) -> list[BlockOption]:
    """The entries ``cfg`` builds: its norm, its MLP, and the switches it turns on."""
    return [CHOICES[f][getattr(cfg, f)] for f in CHOICES] + [
        o for name, o in SWITCHES.items() if getattr(cfg, name)
    ]


def choices_help(what: str, registry: dict) -> str:
    """A choice flag's help from its entries: "block norms: layernorm (DiT) or rmsnorm (no mean subtracted)"."""
    briefs = [o.brief for o in registry.values()]
    return f"{what}: " + " or ".join([", ".join(briefs[:-1]), briefs[-1]] if len(briefs) > 1 else briefs)
