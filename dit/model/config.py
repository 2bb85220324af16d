"""The shapes of a DiT, with no torch import: ``DiTConfig``'s fields are the one list of the model's fields, and
the flags (``ModelSection``, ``dit-cost``'s) come from the ones made with ``_flag``."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import asdict, dataclass, field

from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.model.options import CHOICES, MLPS, NORMS, SWITCHES, choices_help, swiglu_width

_UNSET = object()
DENSE_BLOCKS = 2  # blocks at each dense end of a token-drop layout: SPRINT's encoder and decoder depths
DROP_MIN_DEPTH = {"sprint": 2 * DENSE_BLOCKS + 1, "maskdit": DENSE_BLOCKS + 1}


def _flag(default, help: str, flag_default=_UNSET, **checks):
    """A field that is also a ``ModelSection`` flag; ``flag_default``: the flag's default where it differs."""
    meta = dict(help=help, default=default if flag_default is _UNSET else flag_default, checks=checks)
    return field(default=default, metadata={"flag": meta})


@dataclass(frozen=True)
class DiTConfig:
    """Everything that fixes a DiT's shapes and compute; the block options come last, the official by default."""

    depth: int = _flag(28, "custom size: override the registry depth", None, ge=1)
    hidden_size: int = _flag(1152, "custom size: override the hidden size", None, ge=4)
    num_heads: int = _flag(16, "custom size: override the head count", None, ge=1)
    patch_size: int = _flag(2, "custom size: override the patch size", None, ge=1)
    input_size: int = 32
    in_channels: int = 4
    num_classes: int = _flag(1000, "number of classes (the null class is added); 0: an unconditional model", ge=0)
    class_dropout_prob: float = _flag(0.1, "label dropout for classifier-free guidance, in [0, 1)", ge=0, lt=1)
    learn_sigma: bool = _flag(
        True, "learn the variance (the hybrid loss), as DiT does (default: on for diffusion; flow models never do)",
        None,
    )  # fmt: skip
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 256
    norm: str = _flag("layernorm", choices_help("block norms", NORMS), choices=NORMS)
    mlp: str = _flag("gelu", choices_help("MLP", MLPS), choices=MLPS)
    rope: bool = _flag(False, SWITCHES["rope"].brief)
    qk_norm: bool = _flag(False, SWITCHES["qk_norm"].brief)
    token_drop: float = _flag(
        0.0, "fraction R of the tokens the sparse blocks drop in training, in [0, 1) (0: every block sees every "
        "token, today's model; > 0 adds the layout's mask token and fusion: dit/model/tokendrop.py)", ge=0, lt=1,
    )  # fmt: skip
    token_drop_layout: str = _flag(
        "sprint", "token-drop layout: sprint (dense, sparse middle, dense, with a fusion) or maskdit (dropped at "
        "the input, the last blocks dense)", choices=("sprint", "maskdit"),
    )  # fmt: skip

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
                f"input size {self.input_size} is not divisible by patch size {self.patch_size}: choose a patch "
                f"size that divides it, or an image size whose latent side (image size / the VAE's downsampling) "
                f"is a multiple of {self.patch_size}."
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
        for name, registry in CHOICES.items():
            if getattr(self, name) not in registry:
                raise UserError(f"unknown {name} {getattr(self, name)!r}: choose one of {', '.join(registry)}.")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        if self.rope and self.head_dim % 4:
            raise UserError(
                f"2-D RoPE needs a head size divisible by 4 (half per axis, in pairs); {self.hidden_size} / "
                f"{self.num_heads} heads = {self.head_dim}: pick another head count or turn RoPE off."
            )

        check_drop_depth(self.depth, self.token_drop, self.token_drop_layout)

    def kept_tokens(self, ratio: float | None = None) -> int:
        """Tokens the sparse blocks keep at drop ratio ``ratio`` (default: the config's), at least one."""
        ratio = self.token_drop if ratio is None else ratio
        return max(1, round(self.tokens * (1 - ratio)))

    def sparse_blocks(self) -> range:
        """The blocks that see only the kept tokens when dropping: SPRINT's middle, or MaskDiT's all but the last."""
        first = DENSE_BLOCKS if self.token_drop_layout == "sprint" else 0
        return range(first, self.depth - DENSE_BLOCKS)

    def block_tokens(self, ratio: float | None = None) -> list[int]:
        """Tokens each block sees at drop ratio ``ratio`` (default: the config's; 0: every block all)."""
        ratio = self.token_drop if ratio is None else ratio
        sparse = self.sparse_blocks() if ratio else range(0)
        return [self.kept_tokens(ratio) if i in sparse else self.tokens for i in range(self.depth)]

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    @property
    def tokens(self) -> int:
        return self.grid**2

    @property
    def grid(self) -> int:
        return self.input_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """hidden x mlp_ratio for GELU; for SwiGLU 2/3 of it (to a multiple of 8): the same weights."""
        return MLPS[self.mlp].width(int(self.hidden_size * self.mlp_ratio))

    @property
    def block_options(self) -> list[str]:
        """The options that differ from the official block, as ``describe`` names them."""
        return [getattr(self, f) for f, reg in CHOICES.items() if getattr(self, f) != next(iter(reg))] + [
            name.replace("_", "-") for name in SWITCHES if getattr(self, name)
        ]

    def to_dict(self) -> dict:
        return asdict(self)


# (depth, hidden size, heads) per size, smallest first; the patch size is the number after the slash.
_SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
PATCH_SIZES = (1, 2, 4, 8)  # 2, 4, 8: DiT's; 1: LightningDiT's and SR-DiT's, on 16x-downsampling VAEs


def model_names() -> tuple[str, ...]:
    """Every registry name, largest size first: each size in ``_SIZES`` at each patch in ``PATCH_SIZES``."""
    return tuple(f"DiT-{s}/{p}" for s in reversed(_SIZES) for p in PATCH_SIZES)


def check_drop_depth(depth: int, ratio: float, layout: str) -> None:
    """A token-drop layout needs its dense blocks and at least one sparse block."""
    if ratio and depth < DROP_MIN_DEPTH[layout]:
        raise FieldError(
            f"{{token_drop}} needs a depth of at least {DROP_MIN_DEPTH[layout]} for the {layout} layout "
            f"({DENSE_BLOCKS} dense blocks at each dense end and one sparse block), got {depth}: pick a deeper "
            "model or {token_drop} 0."
        )


def check_path_drop(path_drop: bool, cfg: DiTConfig) -> None:
    """Path-drop guidance needs a SPRINT model: one trained with sparse middle blocks to skip."""
    if path_drop and not (cfg.token_drop and cfg.token_drop_layout == "sprint"):
        raise UserError(
            "--guidance-path-drop skips the sparse middle blocks of a model trained with token drop (--token-drop "
            f"R, the sprint layout); this one is {describe(cfg)}: leave --guidance-path-drop out."
        )


def model_config(name: str, **overrides) -> DiTConfig:
    """The registry config called ``name`` ("DiT-XL/2"), with any field overridden."""
    try:
        size, patch = name.removeprefix("DiT-").split("/")
        depth, hidden, heads = _SIZES[size]
        if int(patch) not in PATCH_SIZES:
            raise KeyError(name)
    except (KeyError, ValueError):
        raise UserError(f"unknown model {name!r}; valid names: {', '.join(model_names())}.") from None
    base = dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=int(patch))
    return DiTConfig(**{**base, **overrides})


ACTIVATION_CHECKPOINTING_HELP = (
    "recompute block activations in backward to save memory: none, all, N (the first N blocks), or auto "
    "(the fewest blocks whose estimated step memory fits the device)"
)


def parse_activation_checkpointing(value: str, depth: int | None = None) -> int | str:
    """``--activation-checkpointing``: none -> 0, all -> the depth (where given), auto, or a block count N."""
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


def _section_fields():
    """``ModelSection``'s fields: the registry name, the flagged fields, ``image_size`` for ``input_size``."""
    hints = typing.get_type_hints(DiTConfig)
    yield "model", str, option("DiT-XL/2", lambda: f"registry name: {', '.join(model_names())}")
    for f in dataclasses.fields(DiTConfig):
        if f.name == "input_size":
            yield "image_size", int, option(256, "image size in pixels (latents are image_size / the VAE's "
                                             "downsampling)", ge=1)  # fmt: skip
        elif "flag" in f.metadata:
            meta = f.metadata["flag"]
            tp = hints[f.name] if meta["default"] is not None else hints[f.name] | None
            yield f.name, tp, option(meta["default"], meta["help"], **meta["checks"])


def _with_flags(cls):
    cls.__annotations__ = {}
    for name, tp, f in _section_fields():
        cls.__annotations__[name] = tp
        setattr(cls, name, f)
    return dataclass(frozen=True)(cls)


@_with_flags
class ModelSection(Section):
    """The DiT to build: a registry name, sizes overridden, its image size and classes (``dit_config``)."""

    def check(self) -> None:
        try:
            model_config(self.model)
        except UserError as e:
            raise FieldError("{model}: " + str(e)) from None
        depth = self.depth or model_config(self.model).depth
        check_drop_depth(depth, self.token_drop, self.token_drop_layout)

    def dit_fields(self) -> dict:
        """The DiTConfig fields this section sets (None: the registry's size, or the objective's choice)."""
        return {k: v for k in DITCONFIG_FLAGS if (v := getattr(self, k)) is not None}

    def dit_config(self, in_channels: int, input_size: int, learn_sigma: bool = True) -> DiTConfig:
        """The DiT for data of ``in_channels`` x ``input_size``^2; ``learn_sigma``: the objective's default."""
        fields = {"learn_sigma": learn_sigma, **self.dit_fields()}
        return model_config(self.model, input_size=input_size, in_channels=in_channels, **fields)


DITCONFIG_FLAGS = tuple(f.name for f in dataclasses.fields(DiTConfig) if "flag" in f.metadata)


def registry_name(cfg: DiTConfig) -> str | None:
    """The registry name whose depth, width, heads and patch match ``cfg``, if any."""
    shape = lambda c: (c.depth, c.hidden_size, c.num_heads, c.patch_size)  # noqa: E731
    return next((name for name in model_names() if shape(model_config(name)) == shape(cfg)), None)


def describe(cfg: DiTConfig) -> str:
    name = registry_name(cfg) or f"custom (depth {cfg.depth}, hidden {cfg.hidden_size}, patch {cfg.patch_size})"
    options = "".join(f", {o}" for o in cfg.block_options)
    if cfg.token_drop:
        options += f", token-drop {cfg.token_drop:g} ({cfg.token_drop_layout})"
    return f"{name}, input {cfg.in_channels}x{cfg.input_size}x{cfg.input_size}, {cfg.num_classes} classes{options}"


def model_config_from_shapes(shapes: dict[str, tuple[int, ...]], num_heads: int | None = None) -> DiTConfig:
    """The DiT a bare state dict's shapes imply (RMSNorm and RoPE leave no trace); without QK-norm the head count
    is the registry's for the depth and width, else ``num_heads``."""
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
    heads = hidden // qk_norm[0] if qk_norm else num_heads or registry.get((depth, hidden))
    if heads is None:
        raise UserError(
            f"the weights are a DiT of depth {depth} and width {hidden}, which no registry size has, and a state "
            "dict does not record its head count: pass --num-heads (the number the model was trained with)."
        )
    ratio = mlp_hidden / hidden
    if swiglu:  # its width is 2/3 of hidden x mlp_ratio, rounded: the ratio that gives it (checked below)
        ratio = 4.0 if swiglu_width(4 * hidden) == mlp_hidden else 1.5 * ratio
    cfg = DiTConfig(
        depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch, input_size=grid * patch,
        in_channels=in_channels, num_classes=table[0] - 1 if table else 0, learn_sigma=out_channels == 2 * in_channels,
        class_dropout_prob=0.1 if table else 0.0, mlp_ratio=ratio, frequency_embedding_size=frequencies,
        mlp="swiglu" if swiglu else "gelu", qk_norm=bool(qk_norm),
    )  # fmt: skip
    if swiglu and cfg.mlp_hidden != mlp_hidden:
        raise UserError(
            f"the SwiGLU MLP is {mlp_hidden} wide, which no mlp_ratio gives (dit-ledger rounds 2/3 of hidden x "
            "ratio to a multiple of 8): load it from a checkpoint that records its model config."
        )
    return cfg
