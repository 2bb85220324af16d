"""The latent store: VAE posterior moments of every image (and of its flip), sharded, checksummed, memory-mapped.

A store folder holds
  manifest.json                    what made the store and what it holds (docs/latent_store.md)
  shard-00000.safetensors          ``moments`` [n, views, 2 (mean, std), C, H, W], ``labels`` [n], metadata
  shard-00000.safetensors.sha256   a ``sha256sum -c`` line, written after its shard: the shard's completion mark

Shard k holds the decodable images among source files [k * shard_size, (k + 1) * shard_size) of the sorted
folder scan, and batches never straddle shards, so the bytes never depend on how many processes wrote them.
Storing moments rather than one frozen sample lets the reader draw a fresh posterior sample at every access,
as on-the-fly encoding does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from dit.atomic import atomic_write_bytes
from dit.data.images import ImageFolderDataset, refuse_skipped, to_model_range
from dit.errors import UserError
from dit.vae import (
    encode_moments,
    latent_downsample,
    load_vae,
    sample_latents,
    scaling_factor,
    vae_id_and_config_hash,
    weights_sha256,
)

FORMAT = "dit-ledger-latent-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors dtype tag -> numpy dtype to view the bytes as; numpy has no bfloat16, so read it as raw uint16.
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


# --------------------------------------------------------------------------------------------------------
# Files: atomic writes, checksums, safetensors headers
# --------------------------------------------------------------------------------------------------------


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_header(path: str) -> tuple[dict, int]:
    """A safetensors file's JSON header and the byte offset where its tensor data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _expected_sha256(folder: str, index: int) -> str | None:
    try:
        with open(os.path.join(folder, shard_file(index) + ".sha256")) as f:
            return f.read().split()[0]
    except (FileNotFoundError, IndexError):
        return None


def shard_is_complete(folder: str, index: int) -> bool:
    """True only if the shard and its checksum file exist and the shard's bytes hash to the recorded sha256."""
    expected = _expected_sha256(folder, index)
    path = os.path.join(folder, shard_file(index))
    return expected is not None and os.path.isfile(path) and sha256_file(path) == expected


# --------------------------------------------------------------------------------------------------------
# What a store is: its spec, manifest, shards
# --------------------------------------------------------------------------------------------------------


@dataclass
class StoreSpec:
    """Everything that decides a store's bytes; a rerun may add to an existing store only if all of it matches.

    ``vae_id`` is the exception: it is a label (a folder may move, a hub model may be copied locally); the two
    hashes are the VAE's identity.
    """

    vae_id: str
    vae_config_sha256: str
    vae_weights_sha256: str
    scaling_factor: float
    image_size: int
    latent_shape: list[int]
    encode_precision: str
    storage_dtype: str
    flips_stored: bool
    shard_size: int
    class_to_index: dict[str, int]
    sources_sha256: str
    num_sources: int
    crop: str = "adm_center_crop"
    moments: str = "mean,std"

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_sources / self.shard_size)


def sources_sha256(samples: list[tuple[str, int]]) -> str:
    """A digest of the ordered (path, label) list: a store is only resumable from the same source files."""
    return hashlib.sha256("\n".join(f"{label}\t{path}" for path, label in samples).encode()).hexdigest()


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(
            f"no latent store at {folder} (no {MANIFEST}). Create one with "
            f"`python extract_features.py --data-path IMAGES --features-path {folder}`."
        )
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest (format={manifest.get('format')!r}, "
            f"version={manifest.get('version')!r}). Re-extract with this version of extract_features.py."
        )
    return manifest


def check_existing_store(folder: str, spec: StoreSpec) -> None:
    """Refuse (before anything is written) to add to a store made with another VAE, image size, dtype or data."""
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        if os.path.isdir(folder) and any(name.startswith("shard-") for name in os.listdir(folder)):
            raise UserError(
                f"{folder} holds shard files but no {MANIFEST}, so it cannot be resumed safely. "
                "Nothing was overwritten. Use an empty --features-path, or delete those files."
            )
        return
    old = read_manifest(folder)
    new = json.loads(json.dumps(asdict(spec)))  # tuples to lists, as the manifest holds them
    diffs = [
        f"{key}: store has {old.get(key)!r}, this run has {value!r}"
        for key, value in new.items()
        if key != "vae_id" and old.get(key) != value
    ]
    if diffs:
        if any(d.startswith("vae_") for d in diffs):
            diffs.insert(0, f"VAE: store was made with {old.get('vae_id')!r}, this run uses {spec.vae_id!r}")
        if any(d.startswith(("sources_", "num_sources", "class_to_index")) for d in diffs):
            diffs.insert(0, "the image folder's contents differ from those the store was made from")
        raise UserError(
            f"{folder} already holds a latent store made differently: {'; '.join(diffs)}. Nothing was "
            "overwritten. Use another --features-path, pass the same settings as before, or delete the folder."
        )


def begin_store(folder: str, spec: StoreSpec) -> None:
    """Mark the store incomplete (readers refuse it until finalize_store) and clear temp files of killed runs."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if ".tmp-" in name and name.startswith(("shard-", MANIFEST)):
            os.remove(os.path.join(folder, name))
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "complete": False, **asdict(spec)}
    atomic_write_bytes(os.path.join(folder, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


def write_shard(
    folder: str,
    index: int,
    spec: StoreSpec,
    moments: torch.Tensor,
    labels: torch.Tensor,
    files: list[str],
    skipped: list[tuple[str, str]],
) -> None:
    """Write shard ``index`` (moments [n, views, 2, C, H, W]) atomically, then its checksum file."""
    stored = moments.to(STORAGE_DTYPES[spec.storage_dtype]).contiguous()
    if not torch.isfinite(stored).all():
        raise UserError(
            f"shard {index}: posterior moments are not finite in {spec.storage_dtype}. "
            "Use --storage-dtype bf16 or fp32 (wider range), or check the VAE."
        )
    # One metadata key: safetensors orders several keys by a randomly seeded hash map, which breaks byte-identity.
    info = json.dumps({"format": FORMAT, "shard": index, "files": files, "skipped": skipped}, sort_keys=True)
    tensors = {"moments": stored, "labels": labels.to(torch.int64).contiguous()}
    data = safetensors.torch.save(tensors, metadata={"dit_ledger": info})
    name = shard_file(index)
    atomic_write_bytes(os.path.join(folder, name), data)
    atomic_write_bytes(
        os.path.join(folder, name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {name}\n".encode()
    )


def finalize_store(folder: str, spec: StoreSpec, scan_skipped: list[tuple[str, str]]) -> dict:
    """Gather every shard's count, size, checksum and skipped files into the final manifest (written atomically)."""
    shards, skipped = [], [tuple(s) for s in scan_skipped]
    for index in range(spec.num_shards):
        path = os.path.join(folder, shard_file(index))
        header, _ = read_header(path)
        skipped += [tuple(s) for s in json.loads(header["__metadata__"]["dit_ledger"])["skipped"]]
        shards.append(
            {
                "file": shard_file(index),
                "num_images": header["labels"]["shape"][0],
                "bytes": os.path.getsize(path),
                "sha256": _expected_sha256(folder, index),
            }
        )
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "complete": True,
        "num_images": sum(s["num_images"] for s in shards),
        "num_skipped": len(skipped),
        "total_bytes": sum(s["bytes"] for s in shards),
        **asdict(spec),
        "skipped": [{"path": path, "reason": reason} for path, reason in sorted(skipped)],
        "shards": shards,
    }
    atomic_write_bytes(os.path.join(folder, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def write_moments_store(
    folder: str,
    moments: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    scale: float = 0.18215,
    storage_dtype: str = "fp16",
    shard_size: int = 2048,
    source: str = "in-memory moments",
) -> dict:
    """A store from moments computed elsewhere ([N, views, 2, C, H, W]); for benchmarks, tests and imports.

    Its VAE fields record only ``source``, so it can never be mistaken for (or resumed as) a VAE-made store.
    """
    n, views, _, c, h, w = moments.shape
    names = [f"{source}/{i}" for i in range(n)]
    spec = StoreSpec(
        vae_id=source,
        vae_config_sha256=hashlib.sha256(source.encode()).hexdigest(),
        vae_weights_sha256=hashlib.sha256(source.encode()).hexdigest(),
        scaling_factor=scale,
        image_size=8 * h,
        latent_shape=[c, h, w],
        encode_precision="n/a",
        storage_dtype=storage_dtype,
        flips_stored=views == 2,
        shard_size=shard_size,
        class_to_index={str(i): i for i in range(num_classes)},
        sources_sha256=sources_sha256(list(zip(names, labels.tolist()))),
        num_sources=n,
        crop="n/a",
    )
    check_existing_store(folder, spec)
    begin_store(folder, spec)
    for k in range(spec.num_shards):
        part = slice(k * shard_size, (k + 1) * shard_size)
        write_shard(folder, k, spec, moments[part], labels[part], names[part], [])
    return finalize_store(folder, spec, [])


def verify_store(folder: str) -> dict:
    """Hash every shard against the manifest (or, for an interrupted store, its checksum files).

    Returns the manifest; raises a UserError listing every missing, truncated or corrupted shard.
    """
    manifest = read_manifest(folder)
    problems = (
        [] if manifest["complete"] else ["manifest.json marks the store incomplete (extraction interrupted)"]
    )
    num_shards = math.ceil(manifest["num_sources"] / manifest["shard_size"])
    recorded = {s["file"]: s for s in manifest.get("shards", [])}
    for index in range(num_shards):
        name, path = shard_file(index), os.path.join(folder, shard_file(index))
        expected = recorded[name]["sha256"] if name in recorded else _expected_sha256(folder, index)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif expected is None:
            problems.append(f"{name} has no checksum (its write was interrupted)")
        elif sha256_file(path) != expected:
            size = f" ({os.path.getsize(path)} bytes, manifest says {recorded[name]['bytes']})" if recorded else ""
            problems.append(f"{name} fails its sha256 check{size}")
    if problems:
        raise UserError(
            f"latent store {folder} failed verification: {'; '.join(problems)}. Rerun extract_features.py "
            "with the same arguments: it redoes exactly the bad or missing shards."
        )
    return manifest


# --------------------------------------------------------------------------------------------------------
# Extraction: images -> VAE moments -> shards, on 1..N processes
# --------------------------------------------------------------------------------------------------------


@dataclass
class ExtractConfig:
    """The settings of extract_features.py (one field per flag)."""

    data_path: str
    features_path: str
    image_size: int = 256
    vae: str = "ema"
    batch_size: int = 32
    precision: str = "fp32"
    storage_dtype: str = "fp16"
    no_flip: bool = False
    shard_size: int = 2048
    num_workers: int = 4
    strict: bool = False


def config_from_flags(**flags) -> ExtractConfig:
    names = {f.name for f in fields(ExtractConfig)}
    return ExtractConfig(**{k: v for k, v in flags.items() if k in names})


class _SourceImages(Dataset):
    """Source files by global position; an undecodable file comes back as its error, so the run can skip it."""

    def __init__(self, images: ImageFolderDataset):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        try:
            return index, self.images.load_uint8(index), ""
        except UserError as e:  # the reason names the file relative to the data folder, as the manifest does
            reason = str(e.__cause__ or e).replace(os.path.join(self.images.root, ""), "")
            return index, None, f"corrupt image: {reason}"


def _collate(items):
    good = [(i, image) for i, image, _ in items if image is not None]
    bad = [(i, error) for i, image, error in items if image is None]
    return [i for i, _ in good], (torch.stack([image for _, image in good]) if good else None), bad


def _init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun process group if there is one (nccl on GPUs, gloo on CPUs); rank, world, device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Long timeout: after a resume, ranks can wait at the final barrier for a slower rank's last shard.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=6))
    return (dist.get_rank(), dist.get_world_size(), device) if world > 1 else (0, 1, device)


def _barrier(world: int, device: torch.device) -> None:
    if world > 1:
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def _encode_views(vae, images_uint8: torch.Tensor, device, flips: bool, precision: str) -> torch.Tensor:
    """Moments [B, views, 2, C, H, W] float32 of a uint8 batch and (if ``flips``) its mirror image."""
    x = to_model_range(images_uint8.to(device, non_blocking=True))
    if flips:
        x = torch.cat([x, x.flip(-1)])
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        mean, std = encode_moments(vae, x)
    moments = torch.stack([mean.float(), std.float()], dim=1)
    return moments.unflatten(0, (2 if flips else 1, len(images_uint8))).transpose(0, 1)


def extract_features(cfg: ExtractConfig) -> dict:
    """Build or resume the store at ``cfg.features_path``; returns a summary of the store and this rank's work."""
    if cfg.precision not in ("fp32", "bf16") or cfg.storage_dtype not in STORAGE_DTYPES:
        raise UserError(
            f"--precision must be fp32|bf16 and --storage-dtype fp32|bf16|fp16, got {cfg.precision!r} and "
            f"{cfg.storage_dtype!r}."
        )
    if cfg.image_size % 8 or cfg.batch_size < 1 or cfg.shard_size < 1:
        raise UserError(
            f"need --image-size a multiple of 8 and positive --batch-size/--shard-size, got {cfg.image_size}, "
            f"{cfg.batch_size}, {cfg.shard_size}."
        )
    rank, world, device = _init_distributed()
    try:
        return _extract(cfg, rank, world, device)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _extract(cfg: ExtractConfig, rank: int, world: int, device: torch.device) -> dict:
    started = time.perf_counter()
    images = ImageFolderDataset(cfg.data_path, cfg.image_size, flip=False)
    scan_skipped = [(os.path.relpath(path, cfg.data_path), reason) for path, reason in images.skipped]
    if cfg.strict:
        refuse_skipped(images.skipped, cfg.data_path)
    vae = load_vae(cfg.vae, device)
    # "fp32" means fp32: TF32 convolutions would change the stored bytes with the GPU generation.
    torch.backends.cudnn.allow_tf32 = cfg.precision != "fp32"
    torch.backends.cudnn.deterministic = True
    vae_id, config_sha = vae_id_and_config_hash(vae, cfg.vae)
    down = latent_downsample(vae)
    latent = cfg.image_size // down
    spec = StoreSpec(
        vae_id=vae_id,
        vae_config_sha256=config_sha,
        vae_weights_sha256=weights_sha256(vae),
        scaling_factor=scaling_factor(vae),
        image_size=cfg.image_size,
        latent_shape=[vae.config.latent_channels, latent, latent],
        encode_precision=cfg.precision,
        storage_dtype=cfg.storage_dtype,
        flips_stored=not cfg.no_flip,
        shard_size=cfg.shard_size,
        class_to_index={name: i for i, name in enumerate(images.classes)},
        sources_sha256=sources_sha256(images.samples),
        num_sources=len(images.samples),
    )
    if world > 1:  # a folder still being copied into could give ranks different source lists
        digests = [None] * world
        dist.all_gather_object(digests, spec.sources_sha256)
        if len(set(digests)) > 1:
            raise UserError(
                f"the ranks found different files under {cfg.data_path}. Is it still being written? "
                "Wait until it is complete, then rerun."
            )
    out = cfg.features_path
    check_existing_store(out, spec)  # every rank reads the same files, so every rank agrees
    _barrier(world, device)
    if rank == 0:
        begin_store(out, spec)
    _barrier(world, device)

    # Verify what a previous run left (each rank hashes a slice), then share the remaining work out evenly.
    done = [k for k in range(rank, spec.num_shards, world) if shard_is_complete(out, k)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, done)
        done = [k for part in gathered for k in part]
    todo = sorted(set(range(spec.num_shards)) - set(done))[rank::world]

    batches = []
    for k in todo:
        end = min((k + 1) * cfg.shard_size, spec.num_sources)
        batches += [
            list(range(b, min(b + cfg.batch_size, end))) for b in range(k * cfg.shard_size, end, cfg.batch_size)
        ]
    loader = DataLoader(
        _SourceImages(images),
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
    )
    bar = tqdm(
        total=sum(len(b) for b in batches), unit="img", disable=rank != 0, desc=f"encoding (rank 0 of {world})"
    )
    parts, labels, files, skipped, encoded = [], [], [], [], 0
    for batch, (good, uint8, bad) in zip(batches, loader):
        skipped += [(images.samples[i][0], error) for i, error in bad]
        if bad and cfg.strict:
            raise UserError(f"{bad[0][1]} ({images.samples[bad[0][0]][0]}). Remove it, or run without --strict.")
        if good:
            parts.append(_encode_views(vae, uint8, device, spec.flips_stored, cfg.precision).cpu())
            labels += [images.samples[i][1] for i in good]
            files += [images.samples[i][0] for i in good]
            encoded += len(good)
        k = batch[0] // cfg.shard_size
        if batch[-1] == min((k + 1) * cfg.shard_size, spec.num_sources) - 1:  # the shard's last batch
            views = 2 if spec.flips_stored else 1
            moments = torch.cat(parts) if parts else torch.zeros(0, views, 2, *spec.latent_shape)
            write_shard(out, k, spec, moments, torch.tensor(labels, dtype=torch.int64), files, skipped)
            parts, labels, files, skipped = [], [], [], []
        bar.update(len(batch))
        if world > 1:
            bar.set_postfix_str(f"all ranks ~{(bar.format_dict['rate'] or 0) * world:.1f} img/s", refresh=False)
    bar.close()

    _barrier(world, device)
    if rank == 0:
        finalize_store(out, spec, scan_skipped)
    _barrier(world, device)
    manifest = read_manifest(out)
    seconds = time.perf_counter() - started
    summary = {
        "num_images": manifest["num_images"],
        "num_skipped": manifest["num_skipped"],
        "num_shards": spec.num_shards,
        "reused_shards": len(done),
        "written_shards": spec.num_shards - len(done),
        "encoded_images": encoded,
        "seconds": seconds,
        "total_bytes": manifest["total_bytes"],
    }
    if rank == 0:
        print(
            f"latent store {out}: {summary['num_images']} images in {spec.num_shards} shards "
            f"({summary['total_bytes'] / 2**20:.1f} MiB), {summary['num_skipped']} skipped; "
            f"wrote {summary['written_shards']} shards, reused {len(done)} verified ones; "
            f"{seconds:.1f} s, {encoded / seconds:.1f} img/s on rank 0"
        )
    return summary


# --------------------------------------------------------------------------------------------------------
# Reading: a Dataset over a finished store
# --------------------------------------------------------------------------------------------------------


def _map_shard(file: str) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy (moments, labels) views of a shard. safetensors' own API copies each slice it returns; batched
    random reads need the whole file mapped. torch.from_file maps lazily (MAP_PRIVATE) and keeps no descriptor."""
    header, start = read_header(file)
    raw = torch.from_file(file, shared=False, size=os.path.getsize(file), dtype=torch.uint8).numpy()
    views = []
    for name in ("moments", "labels"):
        begin, end = header[name]["data_offsets"]
        views.append(
            raw[start + begin : start + end]
            .view(_NUMPY_DTYPES[header[name]["dtype"]])
            .reshape(header[name]["shape"])
        )
    return views[0], views[1]


class LatentStoreDataset(Dataset):
    """(latent x scaling factor as float32 CxHxW, label) from a finished store.

    Every access draws a fresh posterior sample (``sample_posterior``) and a random flip (``flip``): the stored
    flip if the store has one, otherwise a mirror of the latent (an approximation; the VAE is not exactly
    flip-equivariant). Randomness comes from torch's global RNG, which DataLoader reseeds per worker.
    Shards are memory-mapped lazily in each process; ``__getitems__`` serves a whole batch in one pass.
    """

    def __init__(self, path: str, flip: bool = True, sample_posterior: bool = True):
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
        self.path, self.manifest = path, manifest
        self.flip, self.sample_posterior = flip, sample_posterior
        self.scale = float(manifest["scaling_factor"])
        self.latent_shape = tuple(manifest["latent_shape"])
        self.classes = sorted(manifest["class_to_index"], key=manifest["class_to_index"].get)
        self.offsets = np.cumsum([0] + [s["num_images"] for s in manifest["shards"]])
        self._shards = None  # per process: memory maps do not survive pickling to spawned workers
        self.labels = np.concatenate([labels for _, labels in self._open()] or [np.zeros(0, np.int64)])

    def _open(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(moments, labels) numpy views over each memory-mapped shard, opened once per process."""
        if self._shards is None or self._shards[0] != os.getpid():
            self._shards = (
                os.getpid(),
                [_map_shard(os.path.join(self.path, s["file"])) for s in self.manifest["shards"]],
            )
        return self._shards[1]

    def __getstate__(self):
        return {**self.__dict__, "_shards": None}

    @property
    def flip_mode(self) -> str:
        """'stored' (flipped image's own moments), 'latent' (mirror of the latent) or 'none'."""
        return "none" if not self.flip else ("stored" if self.manifest["flips_stored"] else "latent")

    def check_compatible(self, in_channels: int, input_size: int, num_classes: int) -> None:
        """Refuse to train a model whose latent channels, latent size or class count differ from the store's."""
        c, h, _ = self.latent_shape
        down = self.manifest["image_size"] // h
        problems = []
        if in_channels != c:
            problems.append(f"{c} latent channels but the model takes {in_channels} (set in_channels={c})")
        if input_size != h:
            problems.append(
                f"{h}x{h} latents ({self.manifest['image_size']} px images) but the model's input size is "
                f"{input_size} (pass --image-size {self.manifest['image_size']}, or re-extract the store with "
                f"--image-size {input_size * down})"
            )
        if num_classes != len(self.classes):
            problems.append(
                f"{len(self.classes)} classes but the model has {num_classes} (pass --num-classes {len(self.classes)})"
            )
        if problems:
            raise UserError(f"latent store {self.path} does not fit the model: {'; '.join(problems)}.")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list[tuple[torch.Tensor, int]]:
        """A batch in one pass: gather stored moments, then sample and flip all of them with a few tensor ops."""
        index = np.asarray(indices, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"latent store index out of range [0, {len(self)}): {indices}")
        shards = self._open()
        shard = np.searchsorted(self.offsets, index, side="right") - 1
        local = index - self.offsets[shard]
        stored_flip = self.flip_mode == "stored"
        view = torch.randint(0, 2, (len(index),)).numpy() if stored_flip else np.zeros(len(index), np.int64)
        moments = np.empty((len(index), *shards[0][0].shape[2:]), dtype=shards[0][0].dtype)
        for row, (s, j, v) in enumerate(zip(shard.tolist(), local.tolist(), view.tolist())):
            moments[row] = shards[s][0][j, v]
        moments = torch.from_numpy(moments).view(STORAGE_DTYPES[self.manifest["storage_dtype"]])
        mean, std = moments[:, 0], moments[:, 1]
        latents = sample_latents(mean, std, self.scale) if self.sample_posterior else mean.float() * self.scale
        if self.flip_mode == "latent":
            mirror = torch.rand(len(index)) < 0.5
            latents[mirror] = latents[mirror].flip(-1)
        return list(zip(latents.unbind(0), self.labels[index].tolist()))
