"""The interface of a feature network (uint8 NCHW images in, a dict of per-image features out, a ``name`` that
identifies architecture *and* weights, so two networks' statistics are never compared), and its input checks."""

from __future__ import annotations

import copy
import math

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dit.data.images import to_uint8
from dit.io.errors import UserError
from dit.runtime.precision import reference


def check_nchw(images: torch.Tensor, size: int | None, net: str) -> None:
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise UserError(f"{net} takes NCHW images with 1 or 3 channels, got shape {tuple(images.shape)}.")
    if size is not None and tuple(images.shape[2:]) != (size, size):
        raise UserError(f"{net} takes {size}x{size} images, got {images.shape[2]}x{images.shape[3]}.")


FLOAT_SLACK = 0.5  # a VAE's decode overshoots [-1, 1] a little (the clamp handles it); [0, 255] is far beyond


def _check_float_range(images: torch.Tensor) -> None:
    """Float images must be in [-1, 1]: [0, 255] would score as all white and [0, 1] as grey, without a word."""
    low, high = torch.aminmax(images.detach())
    low, high = low.item(), high.item()
    if not (math.isfinite(low) and math.isfinite(high)) or high > 1 + FLOAT_SLACK or low < -1 - FLOAT_SLACK:
        raise UserError(
            f"float images must be in [-1, 1], got values in [{low:g}, {high:g}]: pass uint8 images in [0, 255], "
            "or x / 127.5 - 1."
        )
    if low >= 0 and images.numel() > 1:
        raise UserError(
            f"float images must be in [-1, 1], and this batch has none below 0 ([{low:g}, {high:g}]): images in "
            "[0, 1]? Pass 2 x - 1, or uint8 images in [0, 255]."
        )


class FeatureNet(nn.Module):
    """The interface the evaluator relies on; subclasses set the attributes and implement ``features``."""

    name: str
    pool_dim: int  # FID and precision/recall features
    num_classes: int  # logits (IS); 0 for a judge, which gives pool features only
    spatial_dim: int | None = None  # sFID features, if any
    labels_are_classes: bool = False  # True if logit i is the class a generator's label i asks for (accuracy)
    input_size: int  # the image side the FLOPs are counted at

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.is_floating_point():
            _check_float_range(images)
        # IEEE float32, autocast off, in every run's precision: the reference evaluators' arithmetic.
        with reference(images.device.type):
            return {k: v.float() for k, v in self.features(to_uint8(images)).items()}

    def flops_per_image(self) -> int:
        """Forward FLOPs of one image at ``input_size``, counted on a meta-device copy (no compute, no memory)."""
        meta = copy.deepcopy(self).to("meta")
        example = torch.zeros(1, 3, self.input_size, self.input_size, dtype=torch.uint8, device="meta")
        with FlopCounterMode(display=False) as counter:
            meta.features(example)
        return int(counter.get_total_flops())


def read_state_dict(path: str, flag: str) -> dict:
    """A state dict from .safetensors or a torch file, never unpickling anything but tensors."""
    try:
        if path.endswith(".safetensors"):
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"cannot read {flag} {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}."
        ) from e
