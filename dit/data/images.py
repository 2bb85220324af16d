"""Images as DiT sees them: ADM's centre crop, random flips, CHW float32 in [-1, 1], from an ImageNet-style folder
(labels: the sorted class folder names, as in the official release) or from uint8 arrays."""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from dit.io.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# What a broken or mislabelled file makes PIL raise while opening or decoding it.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def center_crop_arr(pil_image: Image.Image, image_size: int) -> Image.Image:
    """ADM's centre crop: box-halve while >= 2x the target, bicubic-resize, cut the centre square."""
    while min(pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(s // 2 for s in pil_image.size), resample=Image.BOX)
    scale = image_size / min(pil_image.size)
    pil_image = pil_image.resize(tuple(round(s * scale) for s in pil_image.size), resample=Image.BICUBIC)
    left, top = (pil_image.width - image_size) // 2, (pil_image.height - image_size) // 2
    return pil_image.crop((left, top, left + image_size, top + image_size))


def to_model_range(images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] to float32 [-1, 1] (the normalisation the SD VAE and pixel-space DiT expect)."""
    return images_uint8.float().div_(127.5).sub_(1.0)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """NCHW images as uint8: floats in [-1, 1] quantised as the official sample_ddp.py writes its PNGs."""
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise UserError(f"images must be uint8 in [0, 255] or floats in [-1, 1], got {images.dtype}.")
    return torch.clamp(127.5 * images.float() + 128.0, 0, 255).to(torch.uint8)


def _random_flip(image: torch.Tensor) -> torch.Tensor:
    # torch's RNG, not numpy's: DataLoader reseeds it per worker, so workers do not repeat each other's flips.
    return image.flip(-1) if torch.rand(()) < 0.5 else image


def to_rgb(image: Image.Image, path: str = "") -> Image.Image:
    """8-bit RGB: wide integer images scaled first (PIL's ``convert`` clips them); float images refused."""
    if image.mode == "F" or image.mode.startswith("F;"):
        raise UserError(
            f"image {path} holds 32-bit floats, whose range (0-1 or 0-255) the file does not say: convert it "
            "to 8 or 16 bits per channel (PNG or JPEG), or remove it."
        )
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        wide = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else next(
            t for t in (255.0, 65535.0, 2.0**31 - 1) if wide.max() <= t
        )  # fmt: skip
        image = Image.fromarray(np.clip(np.round(wide * (255.0 / top)), 0, 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


def describe_skipped(skipped: list[tuple[str, str]], root: str) -> str | None:
    """One line for the log about what a folder scan left out, or None when it left out nothing."""
    if not skipped:
        return None
    listing = "; ".join(f"{path} ({reason})" for path, reason in skipped[:5])
    more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
    return f"skipped {len(skipped)} unusable entries under {root}: {listing}{more}"


def read_image(path: str, image_size: int | None) -> torch.Tensor:
    """Decode, convert to RGB and centre-crop (``image_size`` None: keep the size) one file to a uint8 CHW tensor;
    UserError if it cannot be decoded."""
    try:
        with Image.open(path) as image:
            image = to_rgb(image, path)
            image = center_crop_arr(image, image_size) if image_size else image
    except DECODE_ERRORS as e:
        raise UserError(f"cannot decode image {path}: {e}. Remove or replace the file.") from e
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


@dataclass
class FolderScan:
    """What an image folder holds. Paths are relative to ``root``, in the order that fixes the global index."""

    classes: list[str]
    samples: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


HIDDEN = "hidden (a name starting with '.'), ignored"  # .DS_Store, .ipynb_checkpoints, .git: never data


def scan_image_folder(root: str) -> FolderScan:
    """List ``root/CLASS/**/IMAGE`` sorted, reporting what it cannot use (empty, hidden, Unicode twins, loops)."""
    if not os.path.isdir(root):
        raise UserError(
            f"data folder {root} does not exist or is not a folder. Pass --data-path pointing to an "
            "ImageNet-style folder: one sub-folder per class, images inside."
        )
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    hidden = [e for e in entries if e.name.startswith(".")]
    entries = [e for e in entries if not e.name.startswith(".")]
    classes = [e.name for e in entries if e.is_dir()]
    if not classes:
        raise UserError(
            f"data folder {root} has no class sub-folders. Expected ROOT/CLASS_NAME/IMAGE.JPEG; for unlabelled "
            "images, put them all in one sub-folder."
        )
    scan = FolderScan(classes=classes)
    scan.skipped += [(e.name, HIDDEN) for e in hidden]
    scan.skipped += [(e.name, "not inside a class folder") for e in entries if not e.is_dir()]
    scan.skipped += _normal_form_twins(classes)
    for label, name in enumerate(classes):
        found, walked = 0, set()
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, name), followlinks=True):
            st = os.stat(dirpath)
            walked.add((st.st_dev, st.st_ino))
            keep = []
            for d in sorted(dirnames):
                rel = os.path.relpath(os.path.join(dirpath, d), root)
                if d.startswith("."):
                    scan.skipped.append((rel, HIDDEN))
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, d))
                except OSError as e:  # a dangling link
                    scan.skipped.append((rel, f"cannot be read: {e.strerror}"))
                    continue
                if (st.st_dev, st.st_ino) in walked:
                    scan.skipped.append((rel, "a link to a folder already walked"))
                    continue
                walked.add((st.st_dev, st.st_ino))
                keep.append(d)
            dirnames[:] = keep
            for filename in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, filename), root)
                if filename.startswith("."):
                    scan.skipped.append((rel, HIDDEN))
                elif filename.lower().endswith(IMAGE_EXTENSIONS):
                    scan.samples.append((rel, label))
                    found += 1
                else:
                    scan.skipped.append((rel, "not an image file"))
        if not found:
            scan.skipped.append((name, "empty class folder"))
    if not scan.samples:
        raise UserError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {root}. Check --data-path.")
    return scan


def _normal_form(name: str) -> str:
    return next((form for form in ("NFC", "NFD") if unicodedata.is_normalized(form, name)), "mixed")


def _normal_form_twins(classes: list[str]) -> list[tuple[str, str]]:
    """(class, reason) for each class folder named as an earlier one in another Unicode normal form."""
    first, twins = {}, []
    for name in classes:
        other = first.setdefault(unicodedata.normalize("NFC", name), name)
        if other != name:
            twins.append((name, (
                f"the name of class folder {other} in another Unicode form ({_normal_form(name)}, that one "
                f"{_normal_form(other)}): kept as a class of its own; rename one, or move its images into the other"
            )))  # fmt: skip
    return twins


def refuse_skipped(skipped: list[tuple[str, str]], root: str) -> None:
    """The --strict rule: any unusable entry but a hidden one fails the run, listing them."""
    skipped = [entry for entry in skipped if entry[1] != HIDDEN]
    if skipped:
        raise UserError(
            f"{describe_skipped(skipped, root).removeprefix('skipped ')}. "
            "Remove or fix them, or run without --strict to skip and report them."
        )


class ImageFolderDataset(Dataset):
    """(CHW float32 in [-1, 1], label) from an ImageNet-style folder, ADM-cropped, randomly flipped."""

    def __init__(self, root: str, image_size: int, flip: bool = True, strict: bool = False):
        scan = scan_image_folder(root)
        if strict:
            refuse_skipped(scan.skipped, root)
        self.root, self.image_size, self.flip = root, image_size, flip
        self.classes, self.samples = scan.classes, scan.samples
        self.skipped = [(os.path.join(root, path), reason) for path, reason in scan.skipped]

    def __len__(self) -> int:
        return len(self.samples)

    def load_uint8(self, index: int) -> torch.Tensor:
        """The cropped, unflipped image as uint8 CHW (4x less to move between processes than float)."""
        return read_image(os.path.join(self.root, self.samples[index][0]), self.image_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.load_uint8(index)
        return to_model_range(_random_flip(image) if self.flip else image), self.samples[index][1]


class ArrayImageDataset(Dataset):
    """(CHW float32 in [-1, 1], label) from uint8 NHW or NHWC arrays, ADM-cropped once, up front."""

    def __init__(self, images: np.ndarray, labels, image_size: int, flip: bool = True):
        images = np.asarray(images)
        labels = np.asarray(labels).astype(np.int64).reshape(-1)
        if images.dtype != np.uint8 or images.ndim not in (3, 4) or len(images) != len(labels):
            raise UserError(
                f"expected uint8 images shaped NHW or NHWC with one label each, got {images.dtype} "
                f"{images.shape} and {len(labels)} labels. Convert with .astype(np.uint8)."
            )
        if images.ndim == 4 and images.shape[3] == 1:
            images = images[..., 0]
        if images.ndim == 4 and images.shape[3] != 3:
            raise UserError(f"NHWC images need 1 or 3 channels, got {images.shape[3]}.")
        if images.shape[1:3] != (image_size, image_size):
            mode = "L" if images.ndim == 3 else "RGB"
            images = np.stack(
                [np.asarray(center_crop_arr(Image.fromarray(im, mode), image_size)) for im in images]
            )
        self.images = torch.from_numpy(images.reshape(*images.shape[:3], -1)).permute(0, 3, 1, 2).contiguous()
        self.labels = torch.from_numpy(labels)
        self.flip = flip
        self.classes = [str(i) for i in range(int(labels.max()) + 1)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        return to_model_range(_random_flip(image) if self.flip else image), int(self.labels[index])
