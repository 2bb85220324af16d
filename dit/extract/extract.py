"""Extraction: images -> VAE posterior moments -> a latent store, on 1..N processes (docs/latent_store.md); shards
hold fixed ranges of the sorted sources, so the bytes do not depend on the process count."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.utils.data import DataLoader, Dataset

from dit.data.images import ImageFolderDataset, refuse_skipped, to_model_range
from dit.data.store import (
    STORAGE_DTYPES,
    StoreSpec,
    begin_store,
    check_existing_store,
    finalize_store,
    read_manifest,
    shard_is_complete,
    sources_sha256,
    write_shard,
)
from dit.data.vae import (
    encode_moments,
    latent_downsample,
    load_vae,
    scaling_factor,
    shift_factor,
    vae_id_and_config_hash,
    weights_sha256,
)
from dit.io.atomic import CannotWrite
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.io.progress import progress
from dit.model.repa_config import RepaEncoderSection
from dit.runtime import Runtime, default_workers
from dit.runtime.stop import close_workers, ignore_stop_signals


@dataclass(frozen=True)
class ExtractConfig(Section):
    """extract_features.py's settings."""

    feature_path: str = option(
        help="the store folder (created, resumed or verified)", aliases=("--features-path",)
    )
    data_path: str | None = option(None, "ImageNet-style folder: one sub-folder per class")
    image_size: int = option(256, "ADM centre-crop size in pixels (a multiple of 8)", ge=8)
    vae: str = option("ema", "ema | mse | a Hugging Face hub id | a local folder")
    batch_size: int = option(
        32, "images per encoder call on each process", ge=1, aliases=("--per-proc-batch-size",)
    )
    precision: str = option(
        "fp32",
        "encoder arithmetic; fp32 by default: the latents are encoded once and read by every run",
        choices=("fp32", "bf16"),
    )
    storage_dtype: str = option("fp16", "dtype of the stored moments", choices=tuple(STORAGE_DTYPES))
    flip: bool = option(True, "also store the moments of mirrored images (--no-flip: do not)")
    shard_size: int = option(2048, "source images per shard", ge=1)
    num_workers: int = option(
        default_workers(), "image-decoding processes per rank (default: the cores, at most 4)", ge=0
    )
    strict: bool = option(False, "fail on corrupt/non-image files and empty classes")
    verify: bool = option(False, "only check every shard's sha256 and exit")
    stats: bool = option(
        False,
        "only write each latent channel's mean and std (for train.py --latent-norm channel) into the "
        "manifest of a store made without them, after checking every shard's sha256, and exit",
    )
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")
    progress: bool = option(True, "show the progress on rank 0 (plain lines when not on a terminal)")

    def check(self) -> None:
        if os.path.exists(self.feature_path) and not os.path.isdir(self.feature_path):
            raise FieldError(f"{{feature_path}} {self.feature_path} is a file: pass a folder for the store.")
        if self.image_size % 8:
            raise FieldError(f"{{image_size}} must be a multiple of 8, got {self.image_size}.")


EXTRACT_FACE = Face(
    "extract_features.py",
    "Pre-extract VAE latents (and REPA's encoder features) into a sharded, checksummed, resumable latent store "
    "(docs/latent_store.md).",
    sections={"extract": ExtractConfig, "repa_encoder": (RepaEncoderSection, "repa_")},
    outputs={"feature_path": "folder"},
    inputs={"data_path": "folder", "vae": "file", "repa_encoder_weights": "file"},
)


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


def _encode_views(
    vae, images_uint8: torch.Tensor, runtime: Runtime, flips: bool, encoder=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Moments [B, views, 2, C, H, W] of a batch (and its mirror), and REPA's features [B, views, T, D]."""
    x = to_model_range(images_uint8.to(runtime.device, non_blocking=True))
    if flips:
        x = torch.cat([x, x.flip(-1)])
    with runtime.precision.frozen():
        mean, std = encode_moments(vae, x)
        features = encoder.features(x).float() if encoder is not None else None
    views = (2 if flips else 1, len(images_uint8))
    moments = torch.stack([mean.float(), std.float()], dim=1)
    if features is not None:
        features = features.unflatten(0, views).transpose(0, 1)
    return moments.unflatten(0, views).transpose(0, 1), features


def extract_features(cfg: ExtractConfig, repa: RepaEncoderSection | None = None) -> dict:
    """Build or resume the store (fp32: no TF32, deterministic cuDNN); a summary of it and this rank's work."""
    repa = repa or RepaEncoderSection()
    if repa.encoder and not cfg.flip:
        raise UserError(
            "--repa-encoder stores the features of both flips (training flips each image, and a mirrored "
            "latent has no features of its own): drop --no-flip."
        )
    if not cfg.data_path:
        raise UserError("--data-path is required to extract (only --verify works without it).")
    # Long timeout: after a resume, ranks can wait at the final barrier for a slower rank's last shard.
    with Runtime(cfg.device, cfg.precision, deterministic=True, timeout=timedelta(hours=6)) as runtime:
        return _extract(cfg, repa, runtime)


def _extract(cfg: ExtractConfig, repa: RepaEncoderSection, runtime: Runtime) -> dict:
    started = time.perf_counter()
    world, device = runtime.world, runtime.device
    images = ImageFolderDataset(cfg.data_path, cfg.image_size, flip=False)
    scan_skipped = [(os.path.relpath(path, cfg.data_path), reason) for path, reason in images.skipped]
    if cfg.strict:
        refuse_skipped(images.skipped, cfg.data_path)
    vae = load_vae(cfg.vae, device)
    vae_id, config_sha = vae_id_and_config_hash(vae, cfg.vae)
    latent = cfg.image_size // latent_downsample(vae)
    encoder = features = None
    if repa.encoder:  # REPA's features, by default on the token grid of a /2 DiT
        from dit.cost.analytic import vit_forward_macs
        from dit.data.encoder import Encoder, resolve_input_size

        size = resolve_input_size(repa.encoder, repa.input_size, latent // 2)
        encoder = Encoder(repa.encoder, repa.encoder_weights, size, device)
        features = {**encoder.identity(), "forward_flops": 2 * vit_forward_macs(encoder.shape)}
    spec = StoreSpec(
        vae_id=vae_id,
        vae_config_sha256=config_sha,
        vae_weights_sha256=weights_sha256(vae),
        scaling_factor=scaling_factor(vae),
        shift_factor=shift_factor(vae),
        image_size=cfg.image_size,
        latent_shape=[vae.config.latent_channels, latent, latent],
        encode_precision=cfg.precision,
        storage_dtype=cfg.storage_dtype,
        flips_stored=cfg.flip,
        shard_size=cfg.shard_size,
        class_to_index={name: i for i, name in enumerate(images.classes)},
        sources_sha256=sources_sha256(images.samples),
        num_sources=len(images.samples),
        vae_config={k: v for k, v in dict(vae.config).items() if not k.startswith("_")},
        features=features,
    )
    # a folder still being copied into could give ranks different source lists
    if world > 1 and len(set(runtime.gather_objects(spec.sources_sha256))) > 1:
        raise UserError(
            f"the ranks found different files under {cfg.data_path}. Is it still being written? "
            "Wait until it is complete, then rerun."
        )
    out = cfg.feature_path
    # One extraction per store: begin_store clears temp files that another run's writes would still own.
    lock = runtime.lock_folder(out, "extraction", "wait for it, or pass another --feature-path")
    try:
        done, batches = _share_shards(cfg, runtime, spec)  # this rank's share of the shards the store lacks
        encoded, encode_seconds = _encode_shards(cfg, runtime, spec, vae, images, batches, encoder)
        runtime.barrier()
        if runtime.rank == 0:
            finalize_store(out, spec, scan_skipped)
        runtime.barrier()
        return _summary(cfg, runtime, spec, len(done), encoded, time.perf_counter() - started, encode_seconds)
    except CannotWrite as e:  # a full disk: the shards written are whole, and a rerun keeps them
        raise e.keeping(
            f"every complete shard in {out} is kept and the same command continues from them"
        ) from None
    finally:
        if lock is not None:
            lock.release()


def _share_shards(cfg: ExtractConfig, runtime: Runtime, spec: StoreSpec) -> tuple[list[int], list[list[int]]]:
    """The shards already complete (each rank verifies a slice), and this rank's batches of the others."""
    rank, world, out = runtime.rank, runtime.world, cfg.feature_path
    check_existing_store(out, spec)  # every rank reads the same files, so every rank agrees
    runtime.barrier()
    if rank == 0:
        begin_store(out, spec)
    runtime.barrier()
    done = [k for k in range(rank, spec.num_shards, world) if shard_is_complete(out, k)]
    done = [k for part in runtime.gather_objects(done) for k in part]
    todo = sorted(set(range(spec.num_shards)) - set(done))[rank::world]
    batches = []
    for k in todo:
        end = min((k + 1) * cfg.shard_size, spec.num_sources)
        batches += [
            list(range(b, min(b + cfg.batch_size, end))) for b in range(k * cfg.shard_size, end, cfg.batch_size)
        ]
    return done, batches


def _encode_shards(cfg: ExtractConfig, runtime: Runtime, spec: StoreSpec, vae, images, batches, encoder):
    """Encode ``batches``, writing each shard when its last batch is done: (images encoded, seconds encoding)."""
    world = runtime.world
    loader = DataLoader(
        _SourceImages(images),
        batch_sampler=batches,
        num_workers=cfg.num_workers,
        collate_fn=_collate,
        pin_memory=runtime.device.type == "cuda",
        worker_init_fn=ignore_stop_signals,
    )
    desc = f"encoding (rank 0 of {world}; all ranks about {world}x its rate)" if world > 1 else "encoding"
    bar = progress(sum(len(b) for b in batches), desc, unit="img", enabled=runtime.rank == 0 and cfg.progress)
    shard, encoded = _Shard(), 0
    encoding = time.perf_counter()  # the bar's rate counts from here; the summary gives both
    loaded = iter(loader)
    try:
        for batch, (good, uint8, bad) in zip(batches, loaded):
            shard.skipped += [(images.samples[i][0], error) for i, error in bad]
            if bad and cfg.strict:
                raise UserError(
                    f"{bad[0][1]} ({images.samples[bad[0][0]][0]}). Remove it, or run without --strict."
                )
            if good:
                moments, features = _encode_views(vae, uint8, runtime, spec.flips_stored, encoder)
                shard.moments.append(moments.cpu())
                shard.features += [features.cpu()] if features is not None else []
                shard.labels += [images.samples[i][1] for i in good]
                shard.files += [images.samples[i][0] for i in good]
                encoded += len(good)
            k = batch[0] // cfg.shard_size
            if batch[-1] == min((k + 1) * cfg.shard_size, spec.num_sources) - 1:  # the shard's last batch
                shard.write(cfg.feature_path, k, spec, with_features=encoder is not None)
                shard = _Shard()
            bar.update(len(batch))
    finally:
        close_workers(loaded)  # workers ignore SIGTERM: tell them to exit (dit.runtime.stop)
    bar.close()
    return encoded, time.perf_counter() - encoding


@dataclass
class _Shard:
    """What one shard holds so far: its batches' moments (and encoder features), labels, files, skipped files."""

    moments: list = field(default_factory=list)
    features: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    files: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def write(self, out, k: int, spec: StoreSpec, with_features: bool) -> None:
        views = 2 if spec.flips_stored else 1
        moments = torch.cat(self.moments) if self.moments else torch.zeros(0, views, 2, *spec.latent_shape)
        features = None
        if with_features:
            f = spec.features
            features = torch.cat(self.features) if self.features else torch.zeros(0, views, f["tokens"], f["dim"])
        labels = torch.tensor(self.labels, dtype=torch.int64)
        write_shard(out, k, spec, moments, labels, self.files, self.skipped, features)


def _summary(cfg, runtime: Runtime, spec: StoreSpec, reused: int, encoded: int, seconds: float, encode_seconds):
    """The store's numbers and this run's (printed on rank 0)."""
    out = cfg.feature_path
    manifest = read_manifest(out)
    summary = {
        "num_images": manifest["num_images"],
        "num_skipped": manifest["num_skipped"],
        "num_shards": spec.num_shards,
        "reused_shards": reused,
        "written_shards": spec.num_shards - reused,
        "encoded_images": encoded,
        "seconds": seconds,
        "encode_seconds": encode_seconds,
        "total_bytes": manifest["total_bytes"],
    }
    if runtime.rank == 0:
        print(
            f"latent store {out}: {summary['num_images']} images in {spec.num_shards} shards "
            f"({summary['total_bytes'] / 2**20:.1f} MiB), {summary['num_skipped']} skipped; "
            f"wrote {summary['written_shards']} shards, reused {reused} verified ones; "
            f"{seconds:.1f} s; on rank 0 {encoded / seconds:.1f} img/s overall (start-up included), "
            f"{encoded / max(encode_seconds, 1e-9):.1f} img/s encoding"
        )
    return summary
