"""The Diffusion Transformer (Peebles & Xie 2022), built from one ``DiTConfig``. Its module tree and parameter
names are the official release's (its checkpoints load with ``strict=True``), and so are its numerics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dit.io.errors import UserError
from dit.model.config import DiTConfig, describe, model_config, model_names
from dit.model.layers import (
    DiTBlock,
    FinalLayer,
    LabelEmbedder,
    PatchEmbed,
    TimestepEmbedder,
    attention_context,
    attention_kernel,
    sincos_2d,
)
from dit.model.options import SWITCHES
from dit.model.tokendrop import TokenDrop, gather_tokens, kept_rope


def extrapolate(strong: torch.Tensor, weak: torch.Tensor, scale: float, channels: int) -> torch.Tensor:
    """``weak + scale (strong - weak)`` on the first ``channels`` channels, the rest ``strong``'s."""
    weak_part = weak[:, :channels]
    return torch.cat([weak_part + scale * (strong[:, :channels] - weak_part), strong[:, channels:]], dim=1)


class DiT(nn.Module):
    """Class-conditional latent (or pixel) diffusion transformer; any combination of sizes builds."""

    def __init__(self, config: DiTConfig | None = None, **fields):
        """``DiT(cfg)``, or the official keyword arguments (any ``DiTConfig`` field): ``DiT(input_size=32)``."""
        super().__init__()
        cfg = self.config = config if config is not None else DiTConfig(**fields)
        d = cfg.hidden_size
        self.in_channels, self.out_channels, self.patch_size = cfg.in_channels, cfg.out_channels, cfg.patch_size
        self.num_heads, self.input_size, self.num_classes = cfg.num_heads, cfg.input_size, cfg.num_classes

        self.x_embedder = PatchEmbed(cfg.patch_size, cfg.in_channels, d)
        self.t_embedder = TimestepEmbedder(d, cfg.frequency_embedding_size)
        # An unconditional model (num_classes 0) has no label table: its conditioning is the timestep alone.
        self.y_embedder = LabelEmbedder(cfg.num_classes, d, cfg.class_dropout_prob) if cfg.num_classes else None
        # Frozen, but a Parameter (not a buffer) so that it is in the state dict as in the official release.
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.tokens, d), requires_grad=False)
        self.attention = "auto"  # the blocks' attention kernel (set_attention)
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg)
        # Only a model configured to drop tokens has the mask token and fusion: at R = 0 the official tree.
        self.token_drop = TokenDrop(cfg) if cfg.token_drop else None
        if cfg.rope:  # fixed tables, rebuilt from the config: not in the state dict
            for name, table in zip(("rope_cos", "rope_sin"), SWITCHES["rope"].build(cfg)):
                self.register_buffer(name, torch.tensor(table, dtype=torch.float32).unsqueeze(1), persistent=False)
        self.initialize_weights()

    @classmethod
    def from_config(cls, cfg: DiTConfig) -> DiT:
        return cls(cfg)

    def initialize_weights(self):
        """Xavier linears, fixed sin-cos positions, N(0, 0.02) embedders, and zeroed adaLN and output."""
        if self.pos_embed.is_meta:
            return
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        table = sincos_2d(self.config.hidden_size, self.config.grid)
        self.pos_embed.data.copy_(torch.from_numpy(table).float().unsqueeze(0))
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        final = self.final_layer
        for layer in [*(b.adaLN_modulation[-1] for b in (*self.blocks, final)), final.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        if self.token_drop is not None:
            nn.init.normal_(self.token_drop.mask_token, std=0.02)

    def set_checkpointing(self, blocks: str | int | bool | Iterable[int] | None = "all"):
        """Recompute blocks' forward in backward: "all"/True, "none"/False/None/0, the first n, or some indices."""
        depth = len(self.blocks)
        if blocks is True or blocks == "all":
            chosen = set(range(depth))
        elif blocks in (None, False, "none"):
            chosen = set()
        elif isinstance(blocks, int):
            if not 0 <= blocks <= depth:
                raise ValueError(f"cannot checkpoint {blocks} blocks of a depth-{depth} model")
            chosen = set(range(blocks))
        else:
            chosen = {int(i) for i in blocks}
            bad = sorted(i for i in chosen if not 0 <= i < depth)
            if bad:
                raise ValueError(f"checkpoint block indices {bad} are outside 0..{depth - 1}")
        for i, block in enumerate(self.blocks):
            block.checkpointed = i in chosen
        return self

    @property
    def checkpoint_mask(self) -> list[bool]:
        return [block.checkpointed for block in self.blocks]

    def set_attention(self, backend: str = "auto"):
        """Attention kernel for every block: one of ``ATTENTION_BACKENDS`` (see ``attention_kernel``)."""
        attention_kernel(backend, "cpu", torch.float32)  # validates the name
        for block in self.blocks:
            block.attn.backend = backend
        self.attention = backend
        return self

    @property
    def num_checkpointed_blocks(self) -> int:
        return sum(self.checkpoint_mask)

    def _check_input(self, x: torch.Tensor):
        """A shape bug keeps its traceback (ValueError): user data is checked where it is loaded."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"DiT expects input of shape (N, {self.in_channels}, {self.input_size}, {self.input_size}), "
                f"got {tuple(x.shape)}"
            )
        if x.shape[-2:] != (self.input_size, self.input_size):
            raise ValueError(f"DiT was built for {self.input_size}x{self.input_size} inputs, got {tuple(x.shape)}")

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, p*p*C) -> (N, C, H, W); the output features are ordered (p, q, c)."""
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        force_drop_ids: torch.Tensor | None = None,
        return_hidden_at: int | None = None,
        kept: torch.Tensor | None = None,
        path_drop: bool = False,
    ):
        """x (N, C, H, W), t (N,) timesteps, y (N,) labels; ``force_drop_ids`` (1: null label) replaces class
        dropout; ``return_hidden_at=k`` also returns block k's tokens; ``kept``, ``path_drop``: token drop."""
        self._check_input(x)
        if return_hidden_at is not None and not 1 <= return_hidden_at <= len(self.blocks):
            raise ValueError(f"return_hidden_at must be in 1..{len(self.blocks)}, got {return_hidden_at}")
        if (kept is not None or path_drop) and self.token_drop is None:
            raise ValueError("kept tokens and path drop need a model built with token_drop > 0")
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y, self.training, force_drop_ids)
        rope = (self.rope_cos, self.rope_sin) if self.config.rope else None
        with attention_context(self.attention):
            x, hidden = self._blocks(x, c, rope, kept, path_drop, return_hidden_at)
        out = self.unpatchify(self.final_layer(x, c))
        return out if return_hidden_at is None else (out, hidden)

    def _blocks(self, x, c, rope, kept, path_drop: bool, hidden_at: int | None):
        """Dense blocks on every token, sparse ones on the kept tokens (or skipped), re-entering by the layout."""
        seen = {}

        def run(indices: range, x: torch.Tensor, rope) -> torch.Tensor:
            for i in indices:
                x = self.blocks[i](x, c, rope)
                if i + 1 == hidden_at:
                    seen["hidden"] = x
            return x

        sparse = self.config.sparse_blocks() if self.token_drop is not None else range(0)
        x = run(range(sparse.start), x, rope)
        if self.token_drop is not None:
            dense = x
            if kept is not None:
                x, rope_kept = gather_tokens(x, kept), kept_rope(rope, kept)
            middle = None if path_drop else run(sparse, x, rope if kept is None else rope_kept)
            x = self._reenter(dense, middle, kept)
        x = run(range(sparse.stop, len(self.blocks)), x, rope)
        return x, seen.get("hidden")

    def _reenter(
        self, dense: torch.Tensor, middle: torch.Tensor | None, kept: torch.Tensor | None
    ) -> torch.Tensor:
        """The sparse output at every position: fused by SPRINT, mask-token-filled by MaskDiT."""
        if self.config.token_drop_layout == "sprint":
            return self.token_drop.reenter(dense, middle, kept)
        if middle is None:
            raise ValueError("path drop needs the sprint layout (MaskDiT has no dense path to keep)")
        return middle if kept is None else self.token_drop.pad(middle, kept, dense.shape[1], fill=self.pos_embed)

    def forward_with_cfg(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        cfg_scale: float,
        cfg_channels: int | str = 3,
        path_drop: bool = False,
    ) -> torch.Tensor:
        """Classifier-free guidance on [cond; uncond] sharing the first half's noise, on ``cfg_channels`` (3: the
        official), never the variance; ``path_drop``: the second half skips the sparse blocks."""
        guided = self.guided_channels(cfg_channels)
        n = len(x) // 2
        half = x[:n]
        if path_drop:
            out = torch.cat([self.forward(half, t[:n], y[:n]), self.forward(half, t[n:], y[n:], path_drop=True)])
        else:
            out = self.forward(torch.cat([half, half]), t, y)
        cond, uncond = out.chunk(2)
        guided_half = extrapolate(cond, uncond, cfg_scale, guided)
        return torch.cat([guided_half, torch.cat([guided_half[:, :guided], uncond[:, guided:]], dim=1)])

    def guided_channels(self, cfg_channels: int | str = 3) -> int:
        """The leading channels guidance moves (the noise's, or its first ``cfg_channels``), never the variance."""
        return self.in_channels if cfg_channels == "all" else min(int(cfg_channels), self.in_channels)

    def load_weights(self, state_dict: dict, source: str = "checkpoint"):
        """Strict load whose error lists every missing, unexpected and mis-shaped key."""
        state_dict = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state_dict.items()}
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        shapes = [
            f"{k}: {tuple(state_dict[k].shape)} in {source}, {tuple(own[k].shape)} in model"
            for k in own
            if k in state_dict and tuple(state_dict[k].shape) != tuple(own[k].shape)
        ]
        if missing or unexpected or shapes:
            parts = []
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
                if keys:
                    shown = "; ".join(keys[:8]) + (f"; ... ({len(keys)} in all)" if len(keys) > 8 else "")
                    parts.append(f"{label}: {shown}")
            raise UserError(
                f"{source} does not fit this model ({describe(self.config)}). "
                + " | ".join(parts)
                + ". Pass the --model, --image-size and --num-classes the checkpoint was trained with."
            )
        self.load_state_dict(state_dict, strict=True)
        return self


class _Registry(Mapping):
    """``DiT_models``: a builder per registry name, the names read from the registry at each use."""

    def __getitem__(self, name: str):
        if name not in model_names():
            raise KeyError(name)

        def build(**kwargs) -> DiT:
            return DiT(model_config(name, **kwargs))

        build.__name__ = name.replace("-", "_").replace("/", "_")
        return build

    def __iter__(self):
        return iter(model_names())

    def __len__(self) -> int:
        return len(model_names())


# The official drop-in: DiT_models["DiT-XL/2"](input_size=32, num_classes=1000).
DiT_models = _Registry()
