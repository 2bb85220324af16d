"""Closed-form FLOP and parameter counts for any DiT config, per image, by component (docs/cost_model.md).
One multiply-accumulate (MAC) = 2 FLOPs; only matmuls and convolutions count, as FlopCounterMode does; attention
is bidirectional. The DiT paper's "Gflops" are GMACs. A block's options count what their registry entries say."""

from __future__ import annotations

from dataclasses import dataclass

from dit.cost.vae_facts import AUTOENCODER_KL_DEFAULTS
from dit.io.errors import UserError
from dit.model.config import DiTConfig, check_path_drop, describe, registry_name
from dit.model.options import chosen

# In forward order. adaLN modulation, the timestep MLP and the final adaLN act once per image on the
# conditioning vector, not once per token; that is why 6*N*T overcounts DiT.
COMPONENTS = (
    *("patch_embed", "timestep_embedder", "adaln_modulation", "qkv", "attention_scores", "attention_values"),
    *("attention_out_proj", "mlp", "token_fusion", "final_adaln", "final_linear"),
)
ATTENTION_COMPONENTS = ("attention_scores", "attention_values")


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward MACs per image, by component (``COMPONENTS`` order)."""

    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def flops(self) -> int:
        return 2 * self.total

    @property
    def attention(self) -> int:
        """QK^T and A.V: the part hook-based counters miss when attention goes through SDPA."""
        return sum(self.components[k] for k in ATTENTION_COMPONENTS)


@dataclass(frozen=True)
class TrainFlops:
    """FLOPs per training image. ``model`` is the MFU numerator, ``hardware`` the HFU one."""

    forward: int
    model: int
    hardware: int


@dataclass(frozen=True)
class SampleFlops:
    """FLOPs per generated image; the VAE decode is kept apart from the model's FLOPs."""

    model: float
    vae_decode: float
    forward_passes: int

    @property
    def total(self) -> float:
        return self.model + self.vae_decode


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how often they act: per token, per image (conditioning) and table lookups."""

    per_token: int
    per_sample: int
    embedding: int
    frozen: int  # the fixed sin-cos position table (a Parameter with requires_grad=False)

    @property
    def total(self) -> int:
        return self.per_token + self.per_sample + self.embedding + self.frozen

    @property
    def trainable(self) -> int:
        return self.total - self.frozen


def block_tokens(cfg: DiTConfig, ratio: float | None = None, path_drop: bool = False) -> list[int]:
    """Tokens each block sees at drop ratio ``ratio`` (default: the config's); 0 for one skipped by path drop."""
    tokens = cfg.block_tokens(ratio)
    skipped = cfg.sparse_blocks() if path_drop else range(0)
    return [0 if i in skipped else n for i, n in enumerate(tokens)]


def _block_macs(cfg: DiTConfig, t: int) -> dict[str, int]:
    """One block's forward MACs on ``t`` tokens, by component (nothing when it does not run)."""
    d = cfg.hidden_size
    return {
        "adaln_modulation": 6 * d * d if t else 0,
        "qkv": 3 * t * d * d,
        "attention_scores": t * t * d,
        "attention_values": t * t * d,
        "attention_out_proj": t * d * d,
        "mlp": t * sum(o.macs(cfg) for o in chosen(cfg)),
    }


def forward_macs(cfg: DiTConfig, ratio: float | None = None, path_drop: bool = False) -> FlopBreakdown:
    """MACs of one forward pass for one image, each block at the tokens it sees (``ratio`` 0: full tokens)."""
    t, d, p = cfg.tokens, cfg.hidden_size, cfg.patch_size
    blocks = [_block_macs(cfg, n) for n in block_tokens(cfg, ratio, path_drop)]
    per_block = {k: sum(b[k] for b in blocks) for k in blocks[0]}
    fusion = t * 2 * d * d if cfg.token_drop and cfg.token_drop_layout == "sprint" else 0
    return FlopBreakdown(
        {
            "patch_embed": t * p * p * cfg.in_channels * d,
            "timestep_embedder": cfg.frequency_embedding_size * d + d * d,
            **per_block,
            "token_fusion": fusion,
            "final_adaln": 2 * d * d,
            "final_linear": t * d * p * p * cfg.out_channels,
        }
    )


def training_flops_per_image(
    cfg: DiTConfig, checkpointed_blocks: int = 0, fused_attention: bool = True, ratio: float | None = None
) -> TrainFlops:
    """Model FLOPs (3 x forward: backward is two matmuls per forward matmul) and hardware FLOPs, which add what
    runs again: each checkpointed block's forward and, for fused attention, the backward's recompute of QK^T."""
    if not 0 <= checkpointed_blocks <= cfg.depth:
        raise UserError(f"checkpointed_blocks must be in 0..{cfg.depth} (the depth), got {checkpointed_blocks}.")
    fwd = forward_macs(cfg, ratio)
    forward = fwd.flops
    recompute = 2 * sum(sum(_block_macs(cfg, n).values()) for n in block_tokens(cfg, ratio)[:checkpointed_blocks])
    flash_recompute = 2 * fwd.components["attention_scores"] if fused_attention else 0
    return TrainFlops(forward=forward, model=3 * forward, hardware=3 * forward + recompute + flash_recompute)


def sampling_flops_per_image(
    cfg: DiTConfig,
    num_steps: float,
    guidance_scale: float,
    vae_decode_flops: float = 0.0,
    *,
    unguided_nfe: float = 0,
    path_drop: bool = False,
    guide: DiTConfig | None = None,
) -> SampleFlops:
    """Network evaluations (``num_steps``) x forward at full tokens, a guided one adding the unconditional pass
    (without the sparse blocks under ``path_drop``; ``guide``'s forward under autoguidance); ``unguided_nfe``
    of them run the conditional pass alone."""
    if num_steps < 1:
        raise UserError(f"a sampler must make at least one network evaluation per image, got {num_steps}.")
    if not 0 <= unguided_nfe <= num_steps:
        raise ValueError(f"unguided_nfe must be in [0, {num_steps}], got {unguided_nfe}")
    check_path_drop(path_drop, cfg)
    guided = num_steps - unguided_nfe if guidance_scale > 1.0 else 0
    passes = 2 * guided + (num_steps - guided)
    full = forward_macs(cfg, ratio=0).flops
    weak = forward_macs(guide if guide is not None else cfg, ratio=0, path_drop=path_drop and guide is None).flops
    model = (num_steps * full) + guided * weak
    return SampleFlops(model=float(model), vae_decode=float(vae_decode_flops), forward_passes=passes)


def param_counts(cfg: DiTConfig) -> ParamCounts:
    """Exact parameter counts of ``dit.model.dit.DiT`` built from ``cfg`` (weights and biases)."""
    d, p, depth = cfg.hidden_size, cfg.patch_size, cfg.depth
    patch = p * p * cfg.in_channels * d + d
    block_token = (3 * d * d + 3 * d) + (d * d + d) + option_params(cfg)
    final_linear = d * p * p * cfg.out_channels + p * p * cfg.out_channels
    t_embed = cfg.frequency_embedding_size * d + d + d * d + d
    adaln = depth * (6 * d * d + 6 * d) + (2 * d * d + 2 * d)
    labels = (cfg.num_classes + int(cfg.class_dropout_prob > 0)) * d if cfg.num_classes else 0
    fusion = 2 * d * d + d if cfg.token_drop and cfg.token_drop_layout == "sprint" else 0
    labels += d if cfg.token_drop else 0  # the mask token: a table row, read not multiplied
    return ParamCounts(
        per_token=patch + depth * block_token + final_linear + fusion,
        per_sample=t_embed + adaln,
        embedding=labels,
        frozen=cfg.tokens * d,
    )


def option_params(cfg: DiTConfig) -> int:
    """One block's parameters in its options: the MLP's weights and biases, QK-norm's weights."""
    return sum(o.params(cfg) for o in chosen(cfg))


def six_nt_flops(cfg: DiTConfig) -> int:
    """The LLM rule of thumb 6 * params * tokens per training image: wrong for DiT, kept to measure how wrong."""
    return 6 * param_counts(cfg).trainable * cfg.tokens


def flops_summary(
    cfg: DiTConfig, image_size: int | None = None, checkpointed_blocks: int = 0, fused_attention: bool = True
) -> dict:
    """The ``dit-cost flops --json`` record: names, sizes, per-image counts (G = 1e9) and the breakdown."""
    fwd = forward_macs(cfg)
    train = training_flops_per_image(cfg, checkpointed_blocks=checkpointed_blocks, fused_attention=fused_attention)
    params = param_counts(cfg)
    return {
        "model": registry_name(cfg) or "custom",
        "description": describe(cfg),
        "image_size": image_size,
        "latent_size": cfg.input_size,
        "in_channels": cfg.in_channels,
        "depth": cfg.depth,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_heads,
        "patch_size": cfg.patch_size,
        "tokens": cfg.tokens,
        "params": params.total,
        "params_trainable": params.trainable,
        "forward_gmacs": fwd.total / 1e9,
        "forward_gflops": fwd.flops / 1e9,
        "train_gflops_per_image": train.model / 1e9,
        "checkpointed_blocks": checkpointed_blocks,
        "hardware_gflops_per_image": train.hardware / 1e9,
        "hardware_attention": "fused" if fused_attention else "explicit",
        "attention_share": fwd.attention / fwd.total,
        "six_nt_gflops_per_image": six_nt_flops(cfg) / 1e9,
        "components": {k: v / 1e9 for k, v in fwd.components.items()},
    }


# VAE (diffusers AutoencoderKL): frozen, so reported beside the model's FLOPs and never inside them.


@dataclass(frozen=True)
class VaeFlops:
    encode: int
    decode: int
    downsample: int  # image size / latent size


def _conv(hw: int, c_in: int, c_out: int, k: int) -> int:
    return hw * c_in * c_out * k * k


def _resnet(hw: int, c_in: int, c_out: int) -> int:
    shortcut = _conv(hw, c_in, c_out, 1) if c_in != c_out else 0
    return _conv(hw, c_in, c_out, 3) + _conv(hw, c_out, c_out, 3) + shortcut


def _attention(hw: int, c: int) -> int:
    # single-head self-attention over the hw positions: q, k, v, out + QK^T + A.V
    return 4 * hw * c * c + 2 * hw * hw * c


def _mid_block(hw: int, c: int, attention: bool) -> int:
    return 2 * _resnet(hw, c, c) + (_attention(hw, c) if attention else 0)


def vae_flops(vae_config: dict, image_size: int) -> VaeFlops:
    """Encode and decode FLOPs for one image of a diffusers ``AutoencoderKL`` config (its config.json dict); an
    ``Attn`` block adds an attention after each of its resnets."""
    cfg = {**AUTOENCODER_KL_DEFAULTS, **vae_config}
    kinds = set(cfg["down_block_types"]) | set(cfg["up_block_types"])
    if not kinds <= {"DownEncoderBlock2D", "UpDecoderBlock2D", "AttnDownEncoderBlock2D", "AttnUpDecoderBlock2D"}:
        raise UserError(
            f"vae_flops counts (Attn)DownEncoderBlock2D/(Attn)UpDecoderBlock2D VAEs only, got {sorted(kinds)}: "
            "count this VAE with dit.cost.measured (FlopCounterMode on meta) instead."
        )
    chans, layers, latent = list(cfg["block_out_channels"]), cfg["layers_per_block"], cfg["latent_channels"]
    down = 2 ** (len(chans) - 1)
    if image_size % down:
        raise UserError(f"--image-size {image_size}: pass a multiple of {down}, this VAE's downsampling.")
    attn = cfg["mid_block_add_attention"]

    side, macs = image_size, _conv(image_size**2, cfg["in_channels"], chans[0], 3)
    c_in = chans[0]
    for i, c_out in enumerate(chans):
        for _ in range(layers):
            macs += _resnet(side * side, c_in, c_out)
            macs += _attention(side * side, c_out) if cfg["down_block_types"][i].startswith("Attn") else 0
            c_in = c_out
        if i < len(chans) - 1:  # stride-2 3x3 conv after asymmetric (0, 1) padding: side -> side / 2
            side //= 2
            macs += _conv(side * side, c_out, c_out, 3)
    macs += _mid_block(side * side, chans[-1], attn) + _conv(side * side, chans[-1], 2 * latent, 3)
    encode = macs + (_conv(side * side, 2 * latent, 2 * latent, 1) if cfg["use_quant_conv"] else 0)

    macs = _conv(side * side, latent, latent, 1) if cfg["use_post_quant_conv"] else 0
    macs += _conv(side * side, latent, chans[-1], 3) + _mid_block(side * side, chans[-1], attn)
    c_in = chans[-1]
    for i, c_out in enumerate(reversed(chans)):
        for _ in range(layers + 1):
            macs += _resnet(side * side, c_in, c_out)
            macs += _attention(side * side, c_out) if cfg["up_block_types"][i].startswith("Attn") else 0
            c_in = c_out
        if i < len(chans) - 1:  # nearest x2, then a 3x3 conv at the new size
            side *= 2
            macs += _conv(side * side, c_out, c_out, 3)
    decode = macs + _conv(side * side, chans[0], cfg["out_channels"], 3)
    return VaeFlops(encode=2 * encode, decode=2 * decode, downsample=down)


# REPA's auxiliary networks: the frozen encoder (forward only) and the trained projector, apart from the DiT.


@dataclass(frozen=True)
class ViTShape:
    """What fixes a ViT encoder's forward FLOPs (``dit.data.encoder.vit_shape``); ``prefix_tokens``: class and
    register tokens; ``gated`` MLPs (SwiGLU) have three matrices of ``mlp_hidden`` columns, GELU's two."""

    depth: int
    width: int
    mlp_hidden: int
    patch_size: int
    in_channels: int
    input_size: int
    prefix_tokens: int = 1
    gated: bool = False

    @property
    def grid(self) -> int:
        return self.input_size // self.patch_size

    @property
    def tokens(self) -> int:
        return self.grid**2 + self.prefix_tokens


def vit_forward_macs(shape: ViTShape) -> int:
    """MACs of one encoder forward (patch embedding and blocks; the final norm and head count nothing)."""
    t, d = shape.tokens, shape.width
    block = 4 * t * d * d + 2 * t * t * d + (3 if shape.gated else 2) * t * d * shape.mlp_hidden
    return shape.grid**2 * shape.patch_size**2 * shape.in_channels * d + shape.depth * block


def projector_forward_macs(hidden_size: int, projector_dim: int, feature_dim: int, tokens: int) -> int:
    """MACs of REPA's 3-layer MLP projector over an image's tokens."""
    return tokens * (hidden_size * projector_dim + projector_dim * projector_dim + projector_dim * feature_dim)


@dataclass(frozen=True)
class RepaFlops:
    """FLOPs per training image beside the DiT's: the frozen encoder runs forward only (its input needs no
    gradient), the projector trains (forward, and backward for its weights and for the DiT tokens it reads)."""

    encoder_forward: int
    projector_forward: int

    @property
    def projector_train(self) -> int:
        return 3 * self.projector_forward

    def per_step_image(self, features_cached: bool) -> int:
        """What a step spends per image: the projector, and the encoder unless its features were extracted."""
        return self.projector_train + (0 if features_cached else self.encoder_forward)


def repa_flops(encoder: ViTShape, dit: DiTConfig, projector_dim: int) -> RepaFlops:
    return RepaFlops(
        encoder_forward=2 * vit_forward_macs(encoder),
        projector_forward=2 * projector_forward_macs(dit.hidden_size, projector_dim, encoder.width, dit.tokens),
    )
