"""Frozen image encoders for REPA, built with timm: any timm ViT by name or ours (``digits-mae``), normalised as
pretrained, by default at the input size whose patch grid is the DiT's token grid."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from dit.cost.analytic import ViTShape
from dit.data.store import sha256_file
from dit.io.errors import UserError, require

WEIGHTS = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True)
class LocalEncoder:
    """An encoder of ours: a timm architecture with our sizes, and committed weights beside their JSON report."""

    architecture: str
    kwargs: dict
    weights: Path
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def report(self) -> Path:
        return self.weights.with_suffix(".json")


# The digit encoder (studies/train_digit_encoder.py): patch 4 on 28x28 digits is the quick start's 7x7 grid.
LOCAL_ENCODERS = {
    "digits-mae": LocalEncoder(
        architecture="vit_tiny_patch16_224",
        kwargs=dict(img_size=28, patch_size=4, in_chans=1, embed_dim=128, depth=4, num_heads=4),
        weights=WEIGHTS / "digits_mae.safetensors",
        mean=(0.5,),
        std=(0.5,),
    ),
}


def _timm(purpose: str = "REPA's encoder (--repa-encoder)"):
    return require("timm", "repa", purpose)


def check_encoder_name(name: str) -> None:
    """One line for a name that is neither ours nor a timm model."""
    if name in LOCAL_ENCODERS:
        return
    if not _timm().is_model(name):
        raise UserError(
            f"--repa-encoder {name!r} is neither a timm model nor one of ours ({', '.join(LOCAL_ENCODERS)}): pass "
            "a timm ViT name such as vit_base_patch14_dinov2.lvd142m (timm.list_models('*dinov2*') lists them)."
        )


def create_encoder_model(
    name: str, device="cpu", input_size: int | None = None, pretrained: dict | bool = False
) -> nn.Module:
    """timm.create_model for ``name`` without a head; ``pretrained``: False, True, or a config overlay."""
    timm = _timm()
    local = LOCAL_ENCODERS.get(name)
    kwargs = dict(local.kwargs) if local else {}
    if input_size is not None:
        kwargs["img_size"] = input_size
    overlay = pretrained if isinstance(pretrained, dict) else None
    with torch.device(device):
        architecture = local.architecture if local else name
        model = timm.create_model(
            architecture, pretrained=bool(pretrained), pretrained_cfg_overlay=overlay, num_classes=0, **kwargs
        )
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise UserError(
            f"--repa-encoder {name!r} is a {type(model).__name__}, not a timm VisionTransformer: REPA here aligns "
            "with ViT patch tokens (vit_*, deit*, the DINOv2 models)."
        )
    return model


def vit_shape(model: nn.Module) -> ViTShape:
    """The FLOP-relevant shape of a built timm VisionTransformer (on any device, meta included)."""
    mlp = model.blocks[0].mlp
    hidden = next(m for m in reversed(list(mlp.modules())) if isinstance(m, nn.Linear)).in_features
    macs = sum(m.in_features * m.out_features for m in mlp.modules() if isinstance(m, nn.Linear))
    if macs not in (2 * model.embed_dim * hidden, 3 * model.embed_dim * hidden):
        raise UserError(
            f"{type(mlp).__name__} is neither a two-matrix MLP nor a gated one: its FLOPs are not modelled."
        )
    size, embed = model.patch_embed.img_size, model.patch_embed
    return ViTShape(
        depth=len(model.blocks),
        width=model.embed_dim,
        mlp_hidden=hidden,
        patch_size=embed.patch_size[0],
        in_channels=embed.proj.in_channels,
        input_size=size[0] if isinstance(size, (tuple, list)) else int(size),
        prefix_tokens=model.num_prefix_tokens,
        gated=macs == 3 * model.embed_dim * hidden,
    )


def resolve_input_size(name: str, input_size: int | None, grid: int) -> int:
    """``input_size``, or the one whose patch grid is the DiT's ``grid`` (REPA: 16 x 14 = 224 px)."""
    patch = encoder_shape(name, None).patch_size
    size = input_size or grid * patch
    if size % patch:
        raise UserError(f"--repa-input-size {size} is not a multiple of {name}'s patch size {patch}.")
    return size


def encoder_shape(name: str, input_size: int | None) -> ViTShape:
    """The encoder's shape at ``input_size``, from timm's config on the meta device (what ``dit-cost`` needs)."""
    check_encoder_name(name)
    return vit_shape(create_encoder_model(name, "meta", input_size, False))


def upstream_flops(name: str) -> float | None:
    """FLOPs spent training the encoder itself, when we trained it (its JSON report says); None otherwise."""
    local = LOCAL_ENCODERS.get(name)
    if local is None or not local.report.is_file():
        return None
    return float(json.loads(local.report.read_text())["train_flops"])


class Encoder:
    """A frozen timm ViT with its normalisation and input size (no ``nn.Module``: it never trains or saves)."""

    def __init__(self, name: str, weights: str | None, input_size: int, device: torch.device | str = "cpu"):
        check_encoder_name(name)
        local = LOCAL_ENCODERS.get(name)
        if weights is not None and not Path(weights).is_file():
            raise UserError(f"--repa-encoder-weights {weights}: no such file; pass the encoder's weights file.")
        file = str(local.weights) if local and weights is None else weights
        if local and not local.weights.is_file() and weights is None:
            raise UserError(
                f"{name}'s weights {local.weights} are missing: reinstall dit-ledger, or run "
                "studies/train_digit_encoder.py to make them."
            )
        if file is not None:
            pretrained = {"file": file, "num_classes": 0}
            if local:  # timm would otherwise adapt the 1-channel patch weights to its default 3-channel input
                c = local.kwargs["in_chans"]
                pretrained.update(input_size=(c, input_size, input_size), mean=local.mean, std=local.std)
            self.weights_id = f"sha256:{sha256_file(file)}"
        else:
            pretrained = True
            self.weights_id = f"timm:{name}"
        try:
            model = create_encoder_model(name, "cpu", input_size, pretrained)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as e:
            # offline, no such weights, a file that does not fit, or an empty, truncated or foreign one
            why = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise UserError(
                f"--repa-encoder {name}: its weights could not be loaded ({why}); offline, pass "
                "--repa-encoder-weights FILE (a timm state dict, .safetensors or .pth; an empty or truncated file "
                "is damaged: copy it again)."
            ) from None
        self.name, self.input_size = name, input_size
        self.model = model.to(device).eval().requires_grad_(False)
        config = _timm().data.resolve_model_data_config(model)
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(config["mean"], device=device).view(shape)
        self.std = torch.tensor(config["std"], device=device).view(shape)
        self.interpolation = "bicubic" if config.get("interpolation") == "bicubic" else "bilinear"
        self.shape = vit_shape(model)
        self.upstream_flops = upstream_flops(name)

    @property
    def grid(self) -> int:
        return self.shape.grid

    @property
    def dim(self) -> int:
        return self.shape.width

    def identity(self) -> dict:
        """What a latent store records of the encoder its features came from, and a run checks."""
        return {
            "encoder": self.name,
            "input_size": self.input_size,
            "weights": self.weights_id,
            "tokens": self.grid**2,
            "dim": self.dim,
        }

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens of images in [-1, 1], resized and normalised as the encoder was trained."""
        x = (images.float() + 1) / 2
        want = self.shape.in_channels
        if x.shape[1] != want:
            if x.shape[1] != 1:
                raise UserError(
                    f"--repa-encoder {self.name} takes {want}-channel images, the data has {x.shape[1]} channels."
                )
            x = x.expand(-1, want, -1, -1)
        if x.shape[-1] != self.input_size or x.shape[-2] != self.input_size:
            size = (self.input_size, self.input_size)
            x = F.interpolate(x, size=size, mode=self.interpolation, align_corners=False, antialias=True)
        x = (x - self.mean) / self.std
        return self.model.forward_features(x)[:, self.model.num_prefix_tokens :]
