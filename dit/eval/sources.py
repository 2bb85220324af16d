"""Image sets to evaluate or make reference statistics from, read in batches by global position: an ``.npz`` sample
set, an image folder, or a latent store decoded through its VAE."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import torch

from dit.data.images import IMAGE_EXTENSIONS, read_image, to_uint8
from dit.data.reader import LatentStoreDataset
from dit.data.vae import decode, load_vae, weights_sha256
from dit.io.errors import UserError
from dit.io.userfiles import read_json


class NpzImages:
    """``arr_0`` of an ``.npz``, streamed from the archive (50,000 images at 256 px are 9.8 GB)."""

    def __init__(self, path: str, key: str = "arr_0"):
        if not os.path.isfile(path):
            raise UserError(f"{path}: no such file.")
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
            names = set(self._zip.namelist())
            if f"{key}.npy" not in names:
                raise UserError(f"{path} has no {key} (it holds {sorted(n[:-4] for n in names)}).")
            self._member = self._zip.open(f"{key}.npy")
            major, _ = np.lib.format.read_magic(self._member)
            if major not in (1, 2):
                raise ValueError(f".npy format version {major}")
            read_header = (
                np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(self._member)
        except UserError:
            raise
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
            raise UserError(
                f"{path} is not a readable .npz file ({e}): copy it again, or write it again."
            ) from None
        if dtype != np.uint8 or fortran or len(shape) not in (3, 4) or shape[3:] not in ((), (1,), (3,)):
            raise UserError(
                f"{path}: {key} must be uint8 images (N, H, W, 3), (N, H, W, 1) or (N, H, W) as the ADM evaluator "
                f"reads them, got {dtype} {shape}."
            )
        self._shape = shape if len(shape) == 4 else (*shape, 1)
        self._offset = self._member.tell()
        expected = self._offset + int(np.prod(self._shape))
        if self._zip.getinfo(f"{key}.npy").file_size != expected:
            raise UserError(
                f"{path}: {key} holds {self._zip.getinfo(f'{key}.npy').file_size:,} bytes, but its header says "
                f"{shape} ({expected:,} bytes): the file was cut short or damaged; write it again."
            )
        self.key = key
        self.labels = self._labels(names)
        self.label_mode = self._label_mode(names)

    def verify(self) -> None:
        """Read every byte once, so that a damaged member fails its CRC before any image is embedded."""
        try:
            with self._zip.open(f"{self.key}.npy") as member:
                while member.read(1 << 24):
                    pass
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            raise self._damaged(e) from None

    def _damaged(self, e: Exception) -> UserError:
        return UserError(f"{self.path} is damaged ({e}): copy it again, or write the sample set again.")

    def _load(self, key: str, what: str) -> np.ndarray:
        try:
            with np.load(self.path, allow_pickle=False) as f:
                return f[key]
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
            raise UserError(f"{self.path}: its {what} cannot be read ({e}); write the sample set again.") from None

    def _labels(self, names: set[str]) -> np.ndarray | None:
        if "arr_1.npy" not in names:
            return None
        labels = self._load("arr_1", "labels arr_1")
        if labels.shape != (len(self),) or not np.issubdtype(labels.dtype, np.integer):
            raise UserError(
                f"{self.path}: arr_1 must hold one integer class label per image ({len(self)}), got "
                f"{labels.dtype} {labels.shape}."
            )
        return labels.astype(np.int64)

    def _label_mode(self, names: set[str]) -> str | None:
        """The recorded label mode; labels without a record are random (older sets, ADM's); None without labels."""
        if "label_mode.npy" not in names:
            return None if self.labels is None else "random"
        mode = self._load("label_mode", "label_mode")
        if mode.shape != () or mode.dtype.kind != "U":
            raise UserError(f"{self.path}: label_mode must be one string, got {mode.dtype} {mode.shape}.")
        return str(mode)

    def __len__(self) -> int:
        return self._shape[0]

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        row = int(np.prod(self._shape[1:]))
        try:
            self._member.seek(self._offset + start * row)
            data = self._member.read((stop - start) * row)
        except (zipfile.BadZipFile, EOFError, OSError) as e:  # changed after it was verified
            raise self._damaged(e) from None
        images = np.frombuffer(data, np.uint8).reshape(stop - start, *self._shape[1:])
        labels = None if self.labels is None else torch.from_numpy(self.labels[start:stop])
        return torch.from_numpy(images.copy()).permute(0, 3, 1, 2), labels

    def describe(self) -> str:
        return f"npz {os.path.abspath(self.path)} ({len(self)} images {'x'.join(map(str, self._shape[1:]))})"


class FolderImages:
    """Every image file under a folder, recursively in sorted order, as RGB; ``image_size`` centre-crops them."""

    def __init__(self, root: str, image_size: int | None = None):
        if not os.path.isdir(root):
            raise UserError(f"{root} is not a folder of images.")
        self.root, self.image_size = root, image_size
        self.files = sorted(
            os.path.join(folder, name)
            for folder, _, names in os.walk(root)
            for name in names
            if name.lower().endswith(IMAGE_EXTENSIONS)
        )
        if not self.files:
            raise UserError(f"{root} holds no image files ({', '.join(IMAGE_EXTENSIONS)}).")
        self._size = None if image_size else read_image(self.files[0], None).shape[1:]
        # a sample set's folder: its record's label mode (random before the record had one); None otherwise
        manifest, fix = os.path.join(root, "sample_set.json"), "write the sample set again, or remove that file"
        record = read_json(manifest, "sample set record", fix) if os.path.isfile(manifest) else None
        self.labels = None
        self.label_mode = str(record.get("labels", "random")) if isinstance(record, dict) else None

    def __len__(self) -> int:
        return len(self.files)

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, None]:
        images = [read_image(path, self.image_size) for path in self.files[start:stop]]
        for path, image in zip(self.files[start:stop], images):
            if self._size is not None and image.shape[1:] != self._size:
                raise UserError(
                    f"{path} is {image.shape[2]}x{image.shape[1]}, the folder's first image "
                    f"{self._size[1]}x{self._size[0]}: pass --image-size to centre-crop every image to one size."
                )
        return torch.stack(images), None

    def describe(self) -> str:
        return f"folder {os.path.abspath(self.root)} ({len(self)} images)"


class LatentStoreImages:
    """A store's images, decoded: the posterior mean through the store's VAE (its weights checked)."""

    def __init__(self, path: str, vae_spec: str | None = None, device: str | torch.device = "cpu"):
        self.store = LatentStoreDataset(path, flip=False, sample_posterior=False)
        manifest = self.store.manifest
        self.vae_spec = vae_spec or manifest["vae_id"]
        self.vae = load_vae(self.vae_spec, device)
        if manifest.get("vae_weights_sha256") and weights_sha256(self.vae) != manifest["vae_weights_sha256"]:
            raise UserError(
                f"VAE {self.vae_spec!r} is not the one that made latent store {path} (weights differ): pass "
                f"--vae with the store's VAE ({manifest['vae_id']})."
            )
        self.path, self.device = path, torch.device(device)
        self.labels = np.asarray(self.store.labels)
        self.label_mode = None  # the data's own classes, not a sampled set's

    def __len__(self) -> int:
        return len(self.store)

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        latents = torch.stack([latent for latent, _ in self.store.__getitems__(range(start, stop))])
        images = decode(self.vae, latents.to(self.device))
        return to_uint8(images).cpu(), torch.from_numpy(self.labels[start:stop])

    def describe(self) -> str:
        return f"latent store {os.path.abspath(self.path)} decoded by {self.vae_spec} ({len(self)} images)"


def open_images(path: str, image_size: int | None = None) -> NpzImages | FolderImages:
    """An ``.npz`` sample set or an image folder, by what ``path`` is."""
    if os.path.isdir(path):
        return FolderImages(path, image_size)
    if path.endswith(".npz"):
        if image_size:
            raise UserError("--image-size applies to image folders; an .npz set is evaluated as it is.")
        images = NpzImages(path)
        images.verify()
        return images
    raise UserError(f"{path} is neither an .npz sample set nor a folder of images.")
