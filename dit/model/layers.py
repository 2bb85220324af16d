"""The DiT's blocks, embedders, attention and MLPs, with the official module names and numerics; with every block
option (``dit.model.options``) off, the block is the official one."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.model.options import MLPS, NORMS, SWITCHES


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """[sin | cos] of positions times dim/2 frequencies 1/10000^(i/(dim/2)), in float64."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.outer(positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, grid_size: int) -> np.ndarray:
    """(grid_size**2, dim) in row-major token order: the column in the first half, the row in the second."""
    rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
    return np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)


def rope_2d(head_dim: int, grid_size: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """Axial RoPE cos and sin tables: a head's first half turns with the column, the second with the row."""
    quarter = head_dim // 4
    omega = theta ** (-np.arange(quarter, dtype=np.float64) / quarter)
    rows, cols = np.divmod(np.arange(grid_size * grid_size), grid_size)
    angles = np.concatenate([np.outer(pos, omega) for pos in (cols, cols, rows, rows)], axis=1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each feature pair of x (..., tokens, heads, head_dim) in float32, the tables' dtype."""
    first, second = x.unflatten(-1, (2, 2, -1)).unbind(-2)
    rotated = torch.stack((-second, first), dim=-2).flatten(-3)
    return (x * cos + rotated * sin).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[cos | sin] of the raw timestep times dim/2 frequencies exp(-ln(max_period) i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1))


class PatchEmbed(nn.Module):
    """Strided-conv patchify to (N, T, D), with timm's ``proj`` key but not its size assertion."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # token-major: a transposed view would make every LayerNorm and Linear copy its input
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_embedding_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class table with one extra row, index ``num_classes``, for the unconditional (CFG) label."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None):
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            if force_drop_ids is None:
                drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            else:
                drop = force_drop_ids == 1
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


# "sdpa": PyTorch picks; the next four pin a kernel; "explicit": matmuls that keep the T x T softmax for backward
_PINNED_SDPA = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_BACKENDS = ("auto", "sdpa", *_PINNED_SDPA, "explicit")


def attention_kernel(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The kernel ``backend`` runs here; auto: explicit matmuls for bf16 on CPU, else sdpa."""
    if backend not in ATTENTION_BACKENDS:
        raise UserError(f"unknown attention backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}.")
    if backend != "auto":
        return backend
    return "explicit" if device_type == "cpu" and dtype == torch.bfloat16 else "sdpa"


def attention_context(backend: str):
    """The SDPA kernel pin of ``backend``, entered around the blocks, never inside one: an ``sdpa_kernel`` context
    in a compiled block makes AOTAutograd's cache refuse the graph (pytorch issue 194007)."""
    return sdpa_kernel(_PINNED_SDPA[backend]) if backend in _PINNED_SDPA else nullcontext()


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(dh)) v as batched matmuls; the scale rides in baddbmm's alpha."""
    n, h, t, dh = q.shape
    q, k, v = (z.reshape(n * h, t, dh) for z in (q, k, v))
    scores = torch.baddbmm(q.new_zeros(()), q, k.transpose(1, 2), beta=0.0, alpha=dh**-0.5)
    return torch.bmm(scores.softmax(-1), v).view(n, h, t, dh)


class _RMSNormWeighted(torch.autograd.Function):
    """w * x / rms(x) over the last dim in float32, saving only x (kept by attention anyway) and 1/rms, where
    torch's composite RMSNorm keeps two float32 copies (docs/recipes.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        math = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (gradcheck)
        xf = x.to(math)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.to(math)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed, g = x.to(rstd.dtype) * rstd, grad.to(rstd.dtype)
        grad_normed = g * weight.to(rstd.dtype)
        # d/dx of x r(x): r (g' - x_hat mean(g' x_hat)), with g' = g w and x_hat = x r
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_weight = (g * normed).sum(dim=tuple(range(x.dim() - 1)))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's features with a learned weight (QK-norm), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormWeighted.apply(x, self.weight, self.eps)


class Attention(nn.Module):
    """Multi-head self-attention: a fused qkv, timm's keys (``qkv``, ``q_norm``/``k_norm``, ``proj``), kernels."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        dim, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.backend = "auto"
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        # None, not nn.Identity, when off: the official module tree has no such entries.
        self.q_norm = SWITCHES["qk_norm"].build(cfg) if cfg.qk_norm else None
        self.k_norm = SWITCHES["qk_norm"].build(cfg) if cfg.qk_norm else None
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        n, t, d = x.shape
        # unbind on the (n, t, 3, h, dh) layout: backward stacks the three gradients straight into qkv's
        q, k, v = self.qkv(x).view(n, t, 3, self.num_heads, d // self.num_heads).unbind(2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if attention_kernel(self.backend, q.device.type, q.dtype) == "explicit":
            x = explicit_attention(q, k, v)
        else:  # a pinned kernel is the caller's attention_context (DiT.forward's), outside any compiled block
            x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(n, t, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """w3(silu(gate) * value), [gate | value] = w12(x) (Shazeer 2020; xformers' names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


class DiTBlock(nn.Module):
    """adaLN-Zero block: (shift, scale, gate) for attention, then for the MLP, from one Linear on c."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        hidden_size = cfg.hidden_size
        self.norm1 = NORMS[cfg.norm].build(cfg)
        self.attn = Attention(cfg)
        self.norm2 = NORMS[cfg.norm].build(cfg)
        self.mlp = MLPS[cfg.mlp].build(cfg)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.checkpointed = False  # recompute this block's forward in backward (DiT.set_checkpointing)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Checkpointing sits inside the block, so that compiling it compiles the recomputation."""
        if not (self.checkpointed and torch.is_grad_enabled()):
            return self._forward(x, c, rope)
        if torch.compiler.is_compiling():  # the recomputation is traced into the graph, under the trace's pin
            return checkpoint(self._forward, x, c, rope, use_reentrant=False)
        pin = self.attn.backend  # eager: the recomputation in backward runs outside DiT.forward's pin; re-enter it
        contexts = lambda: (attention_context(pin), attention_context(pin))  # noqa: E731
        return checkpoint(self._forward, x, c, rope, use_reentrant=False, context_fn=contexts)

    def _forward(self, x: torch.Tensor, c: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, 1)
        x = torch.addcmul(x, gate_msa.unsqueeze(1), self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope))
        x = torch.addcmul(x, gate_mlp.unsqueeze(1), self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)))
        return x


class FinalLayer(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        hidden_size, patch_size = cfg.hidden_size, cfg.patch_size
        self.norm_final = NORMS[cfg.norm].build(cfg)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * cfg.out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))
