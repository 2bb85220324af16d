"""DINOv2 ViT-L/14, the second judge of ImageNet-scale sets (FD_DINOv2, as dgm-eval and EDM2 compute it)."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from dit.data.store import sha256_file
from dit.eval.feature_net import FeatureNet, check_nchw, read_state_dict
from dit.io.errors import UserError, require

DINOV2_ARCH = "vit_large_patch14_dinov2.lvd142m"
DINOV2_SIZE = 224
DINOV2_WHERE = (
    "timm's vit_large_patch14_dinov2.lvd142m (huggingface.co/timm/vit_large_patch14_dinov2.lvd142m, "
    "model.safetensors) or Meta's https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth"
)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def create_dinov2(arch: str = DINOV2_ARCH) -> nn.Module:
    """timm's DINOv2 ViT at 224 px without a head, randomly initialised (``load_dinov2`` loads weights)."""
    timm = require("timm", "repa", "FD_DINOv2 (--dinov2-weights)")
    return timm.create_model(arch, pretrained=False, num_classes=0, img_size=DINOV2_SIZE)


def _dinov2_pos_embed(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """The 518 px checkpoint's position embeddings at ``grid`` x ``grid`` patches, as DINOv2's own
    ``interpolate_pos_encoding`` does it on every forward of the hub model dgm-eval runs: bicubic, no
    antialiasing, scale factor (grid + 0.1) / old grid; the class token's embedding kept as it is."""
    cls, patches = pos_embed[:, :1], pos_embed[:, 1:]
    old = math.isqrt(patches.shape[1])
    if old == grid:
        return pos_embed
    x = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    scale = (grid + 0.1) / old
    x = F.interpolate(x, scale_factor=(scale, scale), mode="bicubic", antialias=False)
    return torch.cat([cls, x.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos_embed.dtype)], dim=1)


class DINOv2Features(FeatureNet):
    """DINOv2's CLS token after the final LayerNorm (1024-d for ViT-L/14), as dgm-eval computes FD_DINOv2
    (dgm_eval/models/dinov2.py): bicubic antialiased resize of the uint8 image to 224, [0, 1], ImageNet's
    mean and std."""

    num_classes, input_size = 0, DINOV2_SIZE

    def __init__(self, model: nn.Module, name: str):
        super().__init__()
        self.name, self.model, self.pool_dim = name, model, model.embed_dim
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2.functional import resize

        check_nchw(images_uint8, None, "DINOv2")
        if images_uint8.shape[1] == 1:
            images_uint8 = images_uint8.expand(-1, 3, -1, -1)
        if tuple(images_uint8.shape[2:]) != (DINOV2_SIZE, DINOV2_SIZE):
            size = [DINOV2_SIZE, DINOV2_SIZE]
            images_uint8 = resize(images_uint8, size, InterpolationMode.BICUBIC, antialias=True)
        x = (images_uint8.float() / 255 - self.mean) / self.std
        return {"pool": self.model.forward_features(x)[:, 0]}


def load_dinov2(
    weights: str | None, device: str | torch.device = "cpu", arch: str = DINOV2_ARCH
) -> DINOv2Features:
    """DINOv2 with timm's or Meta's weights (read with weights_only), named by the file's sha256."""
    if weights is None or not os.path.isfile(weights):
        given = f" {weights}: no such file" if weights is not None else " is needed"
        raise UserError(f"--dinov2-weights{given}. FD_DINOv2 runs offline from a weights file: {DINOV2_WHERE}.")
    from timm.models.vision_transformer import checkpoint_filter_fn

    model = create_dinov2(arch)
    state = read_state_dict(weights, "--dinov2-weights")
    if "pos_embed" in state:
        state["pos_embed"] = _dinov2_pos_embed(state["pos_embed"], model.patch_embed.grid_size[0])
    try:
        model.load_state_dict(checkpoint_filter_fn(state, model))
    except (RuntimeError, KeyError) as e:
        raise UserError(
            f"--dinov2-weights {weights} does not fit {arch} ({str(e).splitlines()[0][:200]}): pass {DINOV2_WHERE}."
        ) from None
    net = DINOv2Features(model, f"dinov2-{arch}-sha256:{sha256_file(weights)[:16]}")
    return net.to(device).eval().requires_grad_(False)
