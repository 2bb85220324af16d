"""Block options: one entry each, carrying its module builder, its cost terms and its memory terms.

``norm`` and ``mlp`` choose an entry of ``NORMS`` and ``MLPS``; a ``SWITCHES`` entry is on when the
``DiTConfig`` field of its name is true. The first entry of each registry, and every switch off, is the
official DiT. ``dit.cost`` reads the terms of the entries a config has (``chosen``) and never their names,
so a new option is an entry here (and its module, and for a switch its ``DiTConfig`` field): no edit to
``dit/cost/`` or the docs (``python -m dit.model.options`` prints the table). No torch at import: the
builders import it when called, and ``dit-cost`` reads the terms without it.

Cost terms, per block, as ``dit.cost`` counts them (docs/cost_model.md): ``macs`` are forward
multiply-accumulates per token in matmuls (which are also the weights autocast keeps 16-bit copies of);
``params`` are weights and biases; ``saved`` is what backward keeps, in D-wide tensors of the activation
dtype per token, and ``saved_fp32`` in float32 bytes per (token x D) element; ``new_qk``: the option makes
new q and k, which attention keeps instead of views of qkv's output (two tensors, once however many do).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


def _zero(cfg, *_) -> int:
    return 0


@dataclass(frozen=True)
class BlockOption:
    brief: str  # in the flag's help: "layernorm (DiT)"
    doc: str  # what it does, for the table
    build: Callable  # cfg -> the module (or tables) it adds
    macs: Callable = _zero
    params: Callable = _zero
    saved: Callable = _zero
    saved_fp32: Callable = _zero
    new_qk: bool = False
    width: Callable | None = None  # an MLP's: its hidden width from the GELU width, D x mlp_ratio


def swiglu_width(gelu_width: int) -> int:
    """2/3 of a GELU MLP's width, to the nearest multiple of 8: the SwiGLU of (about) its parameters."""
    return max(8, 8 * round(2 * gelu_width / 3 / 8))


def _norm(kind: str):
    def build(cfg):  # affine-free: adaLN supplies the scale and shift
        from torch import nn

        if kind == "rmsnorm":
            return nn.RMSNorm(cfg.hidden_size, eps=1e-6, elementwise_affine=False)
        return nn.LayerNorm(cfg.hidden_size, elementwise_affine=False, eps=1e-6)

    return build


def _mlp(kind: str):
    def build(cfg):
        from dit.model import layers

        return (layers.SwiGLU if kind == "swiglu" else layers.Mlp)(cfg.hidden_size, cfg.mlp_hidden)

    return build


def _mlp_terms(matrices: int, saved_widths: int) -> dict:
    """An MLP of ``matrices`` D x h matrices (h = ``mlp_hidden``), biases on all but its D-wide inputs, keeping
    ``saved_widths`` h-wide tensors for backward."""
    return dict(
        macs=lambda cfg: matrices * cfg.hidden_size * cfg.mlp_hidden,
        params=lambda cfg: matrices * cfg.hidden_size * cfg.mlp_hidden + (matrices - 1) * cfg.mlp_hidden
        + cfg.hidden_size,
        saved=lambda cfg: saved_widths * cfg.mlp_hidden / cfg.hidden_size,
    )  # fmt: skip


def _head_norm(cfg):
    from dit.model.layers import HeadRMSNorm

    return HeadRMSNorm(cfg.head_dim)


def _rope_tables(cfg):
    from dit.model.layers import rope_2d

    return rope_2d(cfg.head_dim, cfg.input_size // cfg.patch_size)


NORMS = {
    "layernorm": BlockOption("layernorm (DiT)", "the official affine-free LayerNorm", _norm("layernorm")),
    "rmsnorm": BlockOption(
        "rmsnorm (no mean subtracted)",
        "RMSNorm (Zhang & Sennrich 2019): the three affine-free LayerNorms (before attention, before the MLP, in "
        "the final layer) become affine-free RMSNorms, x / rms(x); adaLN still supplies the scale and shift",
        _norm("rmsnorm"),
    ),
}
MLPS = {
    # fc1 and GELU outputs are kept: two h-wide tensors
    "gelu": BlockOption(
        "gelu (DiT)", "the official tanh-GELU MLP, h = D x mlp_ratio", _mlp("gelu"), width=int, **_mlp_terms(2, 2)
    ),  # fmt: skip
    # w12's output (2h), SiLU's and the product (h each)
    "swiglu": BlockOption(
        "swiglu (2/3 the width: the same weights and FLOPs at S/B/XL)",
        "SwiGLU (Shazeer 2020): w3(silu(gate) * value), [gate, value] = w12(x) in one matmul, at h = 2/3 of the "
        "GELU width to a multiple of 8: 3 D h weights against GELU's 2 D 4D",
        _mlp("swiglu"),
        width=swiglu_width,
        **_mlp_terms(3, 4),
    ),
}
SWITCHES = {
    "rope": BlockOption(
        "2-D axial rotary embeddings on q and k (the sin-cos table stays)",
        "2-D axial RoPE (Su et al. 2021; axial as in EVA-02 and LightningDiT): a head's first half of features "
        "turns with the token's column, the second with its row; keeps only its tables",
        _rope_tables,
        new_qk=True,
    ),
    "qk_norm": BlockOption(
        "per-head RMSNorm with a learned weight on q and k",
        "QK-norm (as timm's qk_norm): an RMSNorm with a learned weight on each head's q and k, before RoPE, in "
        "float32; keeps 1/rms per head and token",
        _head_norm,
        params=lambda cfg: 2 * cfg.head_dim,
        saved_fp32=lambda cfg: 2 * 4 / cfg.head_dim,
        new_qk=True,
    ),
}
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


def markdown() -> str:
    """The table of every option: its field, its value, what it does."""
    rows = [f"| `{f}={name!r}` | {o.doc} |" for f, reg in CHOICES.items() for name, o in reg.items()]
    rows += [f"| `{name}=True` | {o.doc} |" for name, o in SWITCHES.items()]
    return "\n".join(["| field | what it does |", "|---|---|", *rows])


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
