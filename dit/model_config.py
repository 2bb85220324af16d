"""The shapes of a DiT, with no torch import: what the cost planner and the registry share.

``dit.models`` builds modules from a ``DiTConfig``; ``dit.cost`` only reads it, so ``dit-cost`` answers
without loading torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dit.config import FieldError, Section, option
from dit.errors import UserError


@dataclass(frozen=True)
class DiTConfig:
    """Everything that fixes a DiT's shapes and compute; the cost package reads only this."""

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

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    @property
    def tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def to_dict(self) -> dict:
        return asdict(self)


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
            learn_sigma=self.learn_sigma if self.learn_sigma is not None else learn_sigma, **sizes,
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
    return f"{name}, input {cfg.in_channels}x{cfg.input_size}x{cfg.input_size}, {cfg.num_classes} classes"


def model_config_from_shapes(shapes: dict[str, tuple[int, ...]], num_heads: int | None = None) -> DiTConfig:
    """The DiT a state dict's shapes imply: official releases are bare state dicts with no config.

    Depth, width, patch, input size, channels, classes, learned sigma and the MLP ratio are read from the
    tensors; the head count is not in any shape (qkv is D x 3D for every head count), so it is the
    registry's for that depth and width, else ``num_heads``; without either it is asked for (a guess of
    64-wide heads rebuilt a 2-head width-64 model 6% off its outputs). A bare table of C + 1 rows is C
    classes and the null class, as every official release has."""
    try:
        hidden, in_channels, patch, _ = shapes["x_embedder.proj.weight"]
        tokens = shapes["pos_embed"][1]
        depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        out_channels = shapes["final_layer.linear.weight"][0] // (patch * patch)
        mlp_hidden = shapes["blocks.0.mlp.fc1.weight"][0]
        frequencies = shapes["t_embedder.mlp.0.weight"][1]
    except (KeyError, ValueError, IndexError):
        raise UserError(
            "the weights are not a DiT state dict (x_embedder, pos_embed, blocks.N, final_layer missing): pass "
            "an official DiT release, an official train.py checkpoint, or a dit-ledger checkpoint."
        ) from None
    grid = round(tokens**0.5)
    table = shapes.get("y_embedder.embedding_table.weight")
    registry = {(d, h): heads for d, h, heads in _SIZES.values()}
    heads = num_heads or registry.get((depth, hidden))
    if heads is None:
        raise UserError(
            f"the weights are a DiT of depth {depth} and width {hidden}, which no registry size has, and a state "
            "dict does not record its head count: pass --num-heads (the number the model was trained with)."
        )
    return DiTConfig(
        depth=depth,
        hidden_size=hidden,
        num_heads=heads,
        patch_size=patch,
        input_size=grid * patch,
        in_channels=in_channels,
        num_classes=table[0] - 1 if table else 0,
        learn_sigma=out_channels == 2 * in_channels,
        class_dropout_prob=0.1 if table else 0.0,
        mlp_ratio=mlp_hidden / hidden,
        frequency_embedding_size=frequencies,
    )
