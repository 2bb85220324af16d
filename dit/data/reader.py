"""Reading a finished latent store: a memory-mapped ``Dataset`` that draws a fresh posterior sample per access."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dit.data.store import (
    NUMPY_DTYPES,
    REPAIR,
    STORAGE_DTYPES,
    read_header,
    read_manifest,
    sha256_file,
    sha256_files,
)
from dit.data.vae import ChannelNorm
from dit.data.vae import sample_posterior as draw_posterior
from dit.io.errors import UserError

_TAGS = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}  # storage dtype -> safetensors tag


def _stamp(file: str) -> tuple[int, int]:
    """What a verified shard must still have for its hash to be trusted: its size and modification time."""
    st = os.stat(file)
    return st.st_size, st.st_mtime_ns


def _map_shard(file: str) -> dict[str, np.ndarray]:
    """Zero-copy views of a shard's tensors (``torch.from_file``; safetensors' API copies each slice)."""
    try:
        header, start = read_header(file)
        raw = torch.from_file(file, shared=False, size=os.path.getsize(file), dtype=torch.uint8).numpy()
        views = {}
        for name in ("moments", "labels", "features"):
            if name == "features" and name not in header:
                continue
            begin, end = header[name]["data_offsets"]
            flat = raw[start + begin : start + end].view(NUMPY_DTYPES[header[name]["dtype"]])
            views[name] = flat.reshape(header[name]["shape"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a damaged header: before any checksum
        raise UserError(f"{file} is damaged (its header cannot be read: {e}). {REPAIR}.") from None
    return views


def channel_norm(manifest: dict, path: str) -> ChannelNorm:
    """The store's ``--latent-norm channel``, refused for a store written before it recorded its statistics."""
    if "latent_stats" not in manifest:
        raise UserError(
            f"latent store {path} records no per-channel statistics, which --latent-norm channel needs: write them "
            f"with `python extract_features.py --feature-path {path} --stats`, or train with --latent-norm scalar."
        )
    if not all(s > 0 for s in manifest["latent_stats"]["std"]):
        raise UserError(
            f"latent store {path} has a latent channel of std 0 (constant), which --latent-norm channel cannot "
            "divide by: train with --latent-norm scalar."
        )
    return ChannelNorm.of(manifest["latent_stats"])


class LatentStoreDataset(Dataset):
    """((latent - shift) x scale, or per-channel normalised, float32 CxHxW, label) from a finished store, each
    access a fresh posterior sample and flip; ``features`` adds the view's REPA features."""

    def __init__(
        self,
        path: str,
        flip: bool = True,
        sample_posterior: bool = True,
        features: bool = False,
        latent_norm: str = "scalar",
    ):
        manifest = read_manifest(path)
        if not manifest["complete"]:
            raise UserError(
                f"latent store {path} is incomplete (its extraction was interrupted). Rerun extract_features.py "
                "with the same arguments to finish it."
            )
        for shard in manifest["shards"]:
            file = os.path.join(path, shard["file"])
            if not os.path.isfile(file) or os.path.getsize(file) != shard["bytes"]:
                raise UserError(
                    f"latent store {path}: {shard['file']} is missing or truncated. Rerun extract_features.py with "
                    "the same arguments to redo it (`extract_features.py --verify` checks every shard)."
                )
        if features and manifest.get("features") is None:
            raise UserError(
                f"latent store {path} holds no encoder features for REPA: re-extract it with extract_features.py "
                "--repa-encoder NAME."
            )
        if features and flip and not manifest["flips_stored"]:  # a mirrored latent has no stored features
            raise UserError(
                f"latent store {path} has features but no flipped views: re-extract it without --no-flip."
            )
        self.path, self.manifest = path, manifest
        self.flip, self.sample_posterior, self.features = flip, sample_posterior, features
        self.scale = float(manifest["scaling_factor"])
        self.shift = float(manifest.get("shift_factor", 0.0))
        self.channel = channel_norm(manifest, path) if latent_norm == "channel" else None
        self.latent_shape = tuple(manifest["latent_shape"])
        self.classes = sorted(manifest["class_to_index"], key=manifest["class_to_index"].get)
        self.offsets = np.cumsum([0] + [s["num_images"] for s in manifest["shards"]])
        self._shards = None  # per process: memory maps do not survive pickling to spawned workers
        self._verified: dict[str, tuple[int, int]] = {}  # file -> stamp when hashed; loader workers inherit it
        self.labels = np.concatenate(
            [_map_shard(os.path.join(path, s["file"]))["labels"].copy() for s in manifest["shards"]]
            or [np.zeros(0, np.int64)]
        )

    def _shard(self, index: int) -> dict[str, np.ndarray]:
        """Shard ``index``'s tensors, mapped once per process, hashed first unless ``verify_once`` did."""
        if self._shards is None or self._shards[0] != os.getpid():
            self._shards = (os.getpid(), {})
        mapped = self._shards[1]
        if index not in mapped:
            entry = self.manifest["shards"][index]
            file = os.path.join(self.path, entry["file"])
            if self._verified.get(file) != _stamp(file) and sha256_file(file) != entry["sha256"]:
                raise UserError(self._corrupt([entry["file"]]))
            mapped[index] = _map_shard(file)
        return mapped[index]

    def _corrupt(self, names: list[str]) -> str:
        fail = "fails its sha256 check (its bytes" if len(names) == 1 else "fail their sha256 checks (their bytes"
        return (
            f"latent store {self.path}: {', '.join(names)} {fail} changed after extraction). {REPAIR}: python "
            f"extract_features.py --data-path IMAGES --feature-path {self.path} (python extract_features.py "
            f"--feature-path {self.path} --verify lists every bad shard)."
        )

    def verify_once(self, runtime) -> None:
        """Before the loaders start: local rank 0 hashes every shard once per node; the ranks trust the stamps."""
        error, stamps = None, None
        if runtime.local_rank == 0:
            files = [os.path.join(self.path, s["file"]) for s in self.manifest["shards"]]
            stamps = {f: _stamp(f) for f in files}  # before hashing: a write during it leaves a stale stamp
            digests = sha256_files(files)
            bad = [s["file"] for s, d in zip(self.manifest["shards"], digests) if d != s["sha256"]]
            error = self._corrupt(bad) if bad else None
        found = runtime.gather_objects((error, stamps))  # also the barrier: no loader starts before the check
        if errors := [e for e, _ in found if e]:
            raise UserError(errors[0])
        node = found[runtime.rank - runtime.local_rank][1]  # torchrun numbers a node's ranks contiguously
        self._verified = dict(node or {})  # a rank that found none (another layout) hashes lazily, as before

    def __getstate__(self):
        return {**self.__dict__, "_shards": None}

    @property
    def flip_mode(self) -> str:
        """'stored' (flipped image's own moments), 'latent' (mirror of the latent) or 'none'."""
        return "none" if not self.flip else ("stored" if self.manifest["flips_stored"] else "latent")

    @property
    def downsample(self) -> int:
        """Image pixels per latent pixel along a side (8 for the SD VAE)."""
        return self.manifest["image_size"] // self.latent_shape[1]

    def check_compatible(self, in_channels: int, input_size: int, num_classes: int | None) -> None:
        """Refuse to train a model whose latent channels, latent size or class count differ from the store's."""
        c, h, _ = self.latent_shape
        problems = []
        if in_channels != c:
            problems.append(f"{c} latent channels but the model takes {in_channels} (set in_channels={c})")
        if input_size != h:
            problems.append(
                f"{h}x{h} latents ({self.manifest['image_size']} px images) but the model's input size is "
                f"{input_size} (pass --image-size {self.manifest['image_size']}, or re-extract the store with "
                f"--image-size {input_size * self.downsample})"
            )
        if num_classes is not None and num_classes != len(self.classes):  # None: unconditional
            problems.append(
                f"{len(self.classes)} classes but the model has {num_classes} (pass --num-classes {len(self.classes)})"
            )
        if problems:
            raise UserError(f"latent store {self.path} does not fit the model: {'; '.join(problems)}.")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list[tuple]:
        """A batch in one pass: gather stored moments, then sample and flip all of them with a few tensor ops."""
        index = np.asarray(indices, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"latent store index out of range [0, {len(self)}): {indices}")
        shard = np.searchsorted(self.offsets, index, side="right") - 1
        local = index - self.offsets[shard]
        stored_flip = self.flip_mode == "stored"
        view = torch.randint(0, 2, (len(index),)).numpy() if stored_flip else np.zeros(len(index), np.int64)
        c, h, w = self.latent_shape
        dtype = NUMPY_DTYPES[_TAGS[self.manifest["storage_dtype"]]]
        moments = np.empty((len(index), 2, c, h, w), dtype=dtype)
        if self.features:
            f = self.manifest["features"]
            features = np.empty((len(index), f["tokens"], f["dim"]), dtype=dtype)
        for row, (s, j, v) in enumerate(zip(shard.tolist(), local.tolist(), view.tolist())):
            tensors = self._shard(s)
            moments[row] = tensors["moments"][j, v]
            if self.features:
                features[row] = tensors["features"][j, v]  # the same view as the latent
        storage = STORAGE_DTYPES[self.manifest["storage_dtype"]]
        moments = torch.from_numpy(moments).view(storage)
        mean, std = moments[:, 0], moments[:, 1]
        if self.channel is not None:  # the unscaled draw (x 1 - 0: exact), normalised per channel
            unscaled = draw_posterior(mean, std, 1.0) if self.sample_posterior else mean.float()
            latents = self.channel.normalize(unscaled)
        elif self.sample_posterior:
            latents = draw_posterior(mean, std, self.scale, shift=self.shift)
        else:
            latents = (mean.float() - self.shift) * self.scale
        if self.flip_mode == "latent":
            mirror = torch.rand(len(index)) < 0.5
            latents[mirror] = latents[mirror].flip(-1)
        items = [latents.unbind(0), self.labels[index].tolist()]
        if self.features:
            items.append(torch.from_numpy(features).view(storage).float().unbind(0))
        return list(zip(*items))
