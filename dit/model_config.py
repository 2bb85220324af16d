"""The shapes of a DiT, with no torch import: what the cost planner and the registry share.

``dit.models`` builds modules from a ``DiTConfig``; ``dit.cost`` only reads it, so ``dit-cost`` answers
without loading torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dit.config import FieldError, Section, option
from dit.errors import UserError

# The block options (docs/recipes.md); the first of each is the official DiT's.
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class DiTConfig:
    """Everything that fixes a DiT's shapes and compute; the cost package reads only this.

    The last four fields are block options, all off by default (the official DiT): ``norm`` "rmsnorm"
    replaces the three affine-free LayerNorms per block and final layer by affine-free RMSNorms; ``mlp``
    "swiglu" is a SwiGLU of about the GELU MLP's parameters (``mlp_hidden``); ``rope`` adds 2-D axial
    rotary embeddings to q and k (the absolute sin-cos table stays); ``qk_norm`` is a per-head RMSNorm with
    a learned weight on q and k. A config saved before they existed builds with the defaults.
    """

    depth: int = 28
    hidden_size: int = 1152
    num_heads: int = 16
    patch_size: int = 2
    input_size: int = 32
    in_channels: int = 4
    num_classes: int = 1000
    learn_sigma: bool = True
    class_dropout_prob: float = 0.1
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 256
    norm: str = "layernorm"
    mlp: str = "gelu"
    rope: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        for name in ("depth", "hidden_size", "num_heads", "patch_size", "input_size", "in_channels"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"DiT {name} must be positive, got {getattr(self, name)}.")
        if self.num_classes < 0:
            raise UserError(f"num_classes must be >= 0 (0: unconditional), got {self.num_classes}.")
        if self.num_classes == 0 and self.class_dropout_prob > 0:  # no labels to drop: no guidance either
            object.__setattr__(self, "class_dropout_prob", 0.0)
        if self.input_size % self.patch_size:
            raise UserError(
                f"input size {self.input_size} is not divisible by patch size {self.patch_size}: "
                f"choose an input size that is a multiple of {self.patch_size} (for a VAE, image size / 8)."
            )
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_heads} heads: "
                "pick a head count that divides it."
            )
        if self.hidden_size % 4:
            raise UserError(
                f"hidden size {self.hidden_size} must be a multiple of 4 for the 2-D sin-cos embedding."
            )
        if self.norm not in NORMS:
            raise UserError(f"unknown norm {self.norm!r}: choose one of {', '.join(NORMS)}.")
        if self.mlp not in MLPS:
            raise UserError(f"unknown mlp {self.mlp!r}: choose one of {', '.join(MLPS)}.")
        for name in ("rope", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.rope and self.head_dim % 4:
            raise UserError(
                f"2-D RoPE needs a head size divisible by 4 (half per axis, in pairs); {self.hidden_size} / "
                f"{self.num_heads} heads = {self.head_dim}: pick another head count or turn RoPE off."
            )

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    @property
    def tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: hidden x mlp_ratio for GELU; for SwiGLU 2/3 of that, to a multiple of 8.

        SwiGLU has three matrices (value, gate, out) where GELU has two, so 2/3 of the width keeps the
        weights equal (3 D h = 2 D 4D at h = 8D/3); the multiple of 8 keeps matmuls aligned. For every
        registry width but L's (1024 -> 2728, 8 D / 3 = 2730.7) the weights are exactly equal, and the biases
        are 2h - 4D = h/2 more per block (docs/recipes.md)."""
        width = int(self.hidden_size * self.mlp_ratio)
        return width if self.mlp == "gelu" else swiglu_width(width)

    @property
    def mlp_matrices(self) -> int:
        """Hidden-width matrices in the MLP (each D x ``mlp_hidden``): fc1, fc2; or SwiGLU's value, gate, out."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def block_options(self) -> list[str]:
        """The options that differ from the official block, as ``describe`` names them."""
        return [
            name
            for name, on in (
                (self.norm, self.norm != "layernorm"),
                (self.mlp, self.mlp != "gelu"),
                ("rope", self.rope),
                ("qk-norm", self.qk_norm),
            )
            if on
        ]

    def to_dict(self) -> dict:
        return asdict(self)


def swiglu_width(gelu_width: int) -> int:
    """2/3 of a GELU MLP's width, to the nearest multiple of 8: the SwiGLU of (about) its parameters."""
    return max(8, 8 * round(2 * gelu_width / 3 / 8))


# (depth, hidden size, heads) per size; the patch size is the number after the slash.
_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
MODEL_NAMES = tuple(f"DiT-{s}/{p}" for s in ("XL", "L", "B", "S") for p in (2, 4, 8))


def model_config(name: str, **overrides) -> DiTConfig:
    """The registry config called ``name`` ("DiT-XL/2"), with any field overridden."""
    try:
        size, patch = name.removeprefix("DiT-").split("/")
        depth, hidden, heads = _SIZES[size]
        if int(patch) not in (2, 4, 8):
            raise KeyError(name)
    except (KeyError, ValueError):
        raise UserError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}.") from None
    base = dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=int(patch))
    return DiTConfig(**{**base, **overrides})


ACTIVATION_CHECKPOINTING_HELP = (
    "recompute block activations in backward to save memory: none, all, N (the first N blocks), or auto "
    "(the fewest blocks whose estimated step memory fits the device)"
)


def parse_activation_checkpointing(value: str, depth: int | None = None) -> int | str:
    """``--activation-checkpointing``: "none" -> 0, "all" (the depth, where given), "auto", or a block count
    N (the first N blocks recomputed in backward). The one parser: train.py, dit-cost and the benchmarks."""
    text = str(value).lower()
    blocks = 0 if text == "none" else text if text in ("all", "auto") else int(text) if text.isdigit() else None
    if blocks is None:
        raise FieldError(
            f"{{activation_checkpointing}} must be none, all, auto or a block count N, got {value!r}."
        )
    if depth is not None:
        blocks = depth if blocks == "all" else blocks
        if isinstance(blocks, int) and blocks > depth:
            raise FieldError(f"{{activation_checkpointing}} {blocks} exceeds the depth ({depth}).")
    return blocks


@dataclass(frozen=True)
class ModelSection(Section):
    """The DiT to build: a registry name with any size overridden, the images it makes and its classes.

    Read by the trainer and ``dit-cost`` alike; the data decide the input channels and size (a VAE's latents
    or the pixels) and the objective whether the variance is learned (``dit_config``)."""

    model: str = option("DiT-XL/2", "registry name, e.g. DiT-XL/2 (sizes S/B/L/XL, patch 2/4/8)")
    depth: int | None = option(None, "custom size: override the registry depth", ge=1)
    hidden_size: int | None = option(None, "custom size: override the hidden size", ge=4)
    num_heads: int | None = option(None, "custom size: override the head count", ge=1)
    patch_size: int | None = option(None, "custom size: override the patch size", ge=1)
    image_size: int = option(256, "image size in pixels (latents are image_size / the VAE's downsampling)", ge=1)
    num_classes: int = option(1000, "number of classes (the null class is added); 0: an unconditional model", ge=0)
    class_dropout_prob: float = option(0.1, "label dropout for classifier-free guidance, in [0, 1)", ge=0, lt=1)
    learn_sigma: bool | None = option(
        None, "learn the variance (the hybrid loss), as DiT does (default: on for diffusion; flow models never do)"
    )
    norm: str = option("layernorm", "block norms: layernorm (DiT) or rmsnorm (no mean subtracted)", choices=NORMS)
    mlp: str = option("gelu", "MLP: gelu (DiT) or swiglu (2/3 the width: the same weights and FLOPs at S/B/XL)",
                      choices=MLPS)  # fmt: skip
    rope: bool = option(False, "2-D axial rotary embeddings on q and k (the sin-cos table stays)")
    qk_norm: bool = option(False, "per-head RMSNorm with a learned weight on q and k")

    def check(self) -> None:
        try:
            model_config(self.model)
        except UserError as e:
            raise FieldError("{model}: " + str(e)) from None

    def dit_config(self, in_channels: int, input_size: int, learn_sigma: bool = True) -> DiTConfig:
        """The DiT for data of ``in_channels`` x ``input_size``^2; ``learn_sigma``: the objective's default."""
        sizes = {
            k: getattr(self, k) for k in ("depth", "hidden_size", "num_heads", "patch_size") if getattr(self, k)
        }
        return model_config(
            self.model, input_size=input_size, in_channels=in_channels, num_classes=self.num_classes,
            class_dropout_prob=self.class_dropout_prob,
            learn_sigma=self.learn_sigma if self.learn_sigma is not None else learn_sigma, norm=self.norm,
            mlp=self.mlp, rope=self.rope, qk_norm=self.qk_norm, **sizes,
        )  # fmt: skip


def registry_name(cfg: DiTConfig) -> str | None:
    """The registry name whose depth, width, heads and patch match ``cfg``, if any."""
    for name in MODEL_NAMES:
        ref = model_config(name)
        if (ref.depth, ref.hidden_size, ref.num_heads, ref.patch_size) == (
            cfg.depth,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.patch_size,
        ):
            return name
    return None


def describe(cfg: DiTConfig) -> str:
    name = registry_name(cfg) or f"custom (depth {cfg.depth}, hidden {cfg.hidden_size}, patch {cfg.patch_size})"
    options = "".join(f", {o}" for o in cfg.block_options)
    return f"{name}, input {cfg.in_channels}x{cfg.input_size}x{cfg.input_size}, {cfg.num_classes} classes{options}"


def model_config_from_shapes(shapes: dict[str, tuple[int, ...]], num_heads: int | None = None) -> DiTConfig:
    """The DiT a state dict's shapes imply: official releases are bare state dicts with no config.

    Depth, width, patch, input size, channels, classes, learned sigma and the MLP ratio are read from the
    tensors, and so are a SwiGLU MLP (``w12``/``w3`` keys) and QK-norm (``q_norm`` weights, whose size is
    the head size). RMSNorm (no weights) and RoPE (no weights) leave no trace in a state dict: a model with
    them loads from a checkpoint that records its config (every dit-ledger checkpoint does). Without
    QK-norm the head count is not in any shape (qkv is D x 3D for every head count), so it is the
    registry's for that depth and width, else ``num_heads``; without either it is asked for (a guess of
    64-wide heads rebuilt a 2-head width-64 model 6% off its outputs). A bare table of C + 1 rows is C
    classes and the null class, as every official release has."""
    try:
        hidden, in_channels, patch, _ = shapes["x_embedder.proj.weight"]
        tokens = shapes["pos_embed"][1]
        depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        out_channels = shapes["final_layer.linear.weight"][0] // (patch * patch)
        swiglu = "blocks.0.mlp.w3.weight" in shapes
        mlp_hidden = shapes["blocks.0.mlp.w3.weight"][1] if swiglu else shapes["blocks.0.mlp.fc1.weight"][0]
        frequencies = shapes["t_embedder.mlp.0.weight"][1]
    except (KeyError, ValueError, IndexError):
        raise UserError(
            "the weights are not a DiT state dict (x_embedder, pos_embed, blocks.N, final_layer missing): pass "
            "an official DiT release, an official train.py checkpoint, or a dit-ledger checkpoint."
        ) from None
    grid = round(tokens**0.5)
    table = shapes.get("y_embedder.embedding_table.weight")
    qk_norm = shapes.get("blocks.0.attn.q_norm.weight")
    registry = {(d, h): heads for d, h, heads in _SIZES.values()}
    if qk_norm:
        heads = hidden // qk_norm[0]
    else:
        heads = num_heads or registry.get((depth, hidden))
    if heads is None:
        raise UserError(
            f"the weights are a DiT of depth {depth} and width {hidden}, which no registry size has, and a state "
            "dict does not record its head count: pass --num-heads (the number the model was trained with)."
        )
    ratio = mlp_hidden / hidden
    if swiglu:  # its width is 2/3 of hidden x mlp_ratio, rounded: the ratio that gives it (checked below)
        ratio = 4.0 if swiglu_width(4 * hidden) == mlp_hidden else 1.5 * ratio
    cfg = DiTConfig(
        depth=depth,
        hidden_size=hidden,
        num_heads=heads,
        patch_size=patch,
        input_size=grid * patch,
        in_channels=in_channels,
        num_classes=table[0] - 1 if table else 0,
        learn_sigma=out_channels == 2 * in_channels,
        class_dropout_prob=0.1 if table else 0.0,
        mlp_ratio=ratio,
        frequency_embedding_size=frequencies,
        mlp="swiglu" if swiglu else "gelu",
        qk_norm=bool(qk_norm),
    )
    if swiglu and cfg.mlp_hidden != mlp_hidden:
        raise UserError(
            f"the SwiGLU MLP is {mlp_hidden} wide, which no mlp_ratio gives (dit-ledger rounds 2/3 of hidden x "
            "ratio to a multiple of 8): load it from a checkpoint that records its model config."
        )
    return cfg
