"""Training data: the source (image folder, latent store, or data set) and its order, keyed by (seed, step) and
each item by (seed, epoch, index), so that a resume or another world size sees the same samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dit.data.vae import ChannelNorm
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.runtime import Runtime, Stream, default_workers, mix_seed
from dit.runtime.stop import ignore_stop_signals


@dataclass(frozen=True)
class DataSection(Section):
    """What the run trains on: an image folder (encoded on the fly by ``vae``, or pixels) or a latent store."""

    data_path: str | None = option(None, "image folder with one sub-folder per class")
    feature_path: str | None = option(
        None, "latent store written by extract_features.py", aliases=("--features-path",)
    )
    vae: str = option("ema", "ema|mse|HUB_ID|LOCAL_DIR, or none for pixel space")
    num_workers: int = option(
        default_workers(), "data loader worker processes (default: the cores, at most 4)", ge=0
    )
    latent_norm: str = option(
        "scalar", "how latents are scaled for the model: scalar, the VAE's factor (0.18215 for SD: DiT's), or "
        "channel, (z - mean_c) / std_c with the latent store's per-channel statistics (LightningDiT's)",
        choices=("scalar", "channel"),
    )  # fmt: skip

    RECIPE = ("latent_norm",)  # what a resume may change when --allow-changes names it

    def check(self) -> None:
        if self.latent_norm == "channel" and self.pixel_space and not self.feature_path:
            raise FieldError(
                "{latent_norm} channel normalises a latent store's channels; pixel space ({vae} none, the digits "
                "quick start) has no latents: keep --latent-norm scalar, or train on a store ({feature_path})."
            )

    @property
    def pixel_space(self) -> bool:
        return self.vae.lower() == "none"


def micro_batch(global_batch: int, world_size: int, grad_accum: int) -> int:
    """Images per rank per forward; a global batch that does not split evenly is a user error."""
    if global_batch % (world_size * grad_accum):
        raise UserError(
            f"global batch size {global_batch} is not divisible by {world_size} processes x "
            f"{grad_accum} accumulation steps: choose a multiple of {world_size * grad_accum}."
        )
    return global_batch // (world_size * grad_accum)


class StepOrder(Sampler):
    """Yields, from ``start_step`` on, this rank's micro-batches as lists of (epoch, index) keys."""

    def __init__(self, dataset_len, global_batch, world_size, rank, grad_accum, seed, start_step=0):
        self.micro = micro_batch(global_batch, world_size, grad_accum)
        if dataset_len < global_batch:
            raise UserError(
                f"the data set has {dataset_len} items, fewer than one global batch ({global_batch}): "
                "lower --global-batch-size or add data."
            )
        self.n, self.batch, self.rank = dataset_len, global_batch, rank
        self.accum, self.seed, self.start_step = grad_accum, seed, start_step
        self.steps_per_epoch = dataset_len // global_batch  # the ragged tail of each epoch is dropped

    def __iter__(self):
        step, epoch, perm = self.start_step, None, None
        while True:
            e = step // self.steps_per_epoch
            if e != epoch:
                g = torch.Generator().manual_seed(mix_seed(Stream.EPOCH, self.seed, e))
                epoch, perm = e, torch.randperm(self.n, generator=g)
            base = (step % self.steps_per_epoch) * self.batch + self.rank * self.micro * self.accum
            for m in range(self.accum):
                idx = perm[base + m * self.micro : base + (m + 1) * self.micro].tolist()
                yield [(epoch, i) for i in idx]
            step += 1


class SeededItems(Dataset):
    """Item (epoch, index) reseeds torch's CPU generator alone (docs/architecture.md), restored in-process."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        gen = torch.default_generator
        state = None if torch.utils.data.get_worker_info() is not None else gen.get_state()
        gen.manual_seed(mix_seed(Stream.ITEM, self.seed, epoch, index))
        try:
            return self.dataset[index]
        finally:
            if state is not None:
                gen.set_state(state)


@dataclass
class TrainData:
    """What the loop trains on: the data set, the shape it yields, and the VAE that encodes it on the fly."""

    dataset: Dataset
    in_channels: int
    input_size: int
    vae: torch.nn.Module | None = None  # encodes each batch inside the step (images given, latents trained)
    vae_spec: str | None = None  # the VAE the latents come from (None: pixel space)
    vae_config: dict | None = None  # its diffusers config, for the cost of encoding
    store_manifest: dict | None = None  # a latent store's manifest (the encode was paid at extraction)
    latent_norm: ChannelNorm | None = None  # --latent-norm channel: the store's; None: the scalar rule
    notes: list[str] = field(default_factory=list)  # lines for the log (what a folder scan skipped)

    def loader(self, optim, workers: int, runtime: Runtime, start_step: int) -> DataLoader:
        """This rank's micro-batches from ``start_step`` on, in the order of ``optim``'s batch and seed."""
        if hasattr(self.dataset, "verify_once"):  # a latent store: hashed once per node, before workers start
            self.dataset.verify_once(runtime)
        o, rt = optim, runtime
        order = StepOrder(
            len(self.dataset), o.global_batch_size, rt.world, rt.rank, o.grad_accum_steps, o.seed, start_step
        )
        return DataLoader(
            SeededItems(self.dataset, optim.seed),
            batch_sampler=order,
            num_workers=workers,
            pin_memory=runtime.device.type == "cuda",
            persistent_workers=workers > 0,
            worker_init_fn=ignore_stop_signals,
        )


def build_data(
    data: DataSection,
    image_size: int,
    num_classes: int,
    dataset: Dataset | None,
    device: torch.device,
    features: bool = False,
) -> TrainData:
    """The configured source (``dataset``, a latent store, or a folder), checked against the model."""
    if data.latent_norm == "channel" and (dataset is not None or not data.feature_path):  # pixels: the section's
        raise UserError(
            "--latent-norm channel uses a latent store's per-channel statistics, and latents encoded on the fly "
            "(an image folder, or a data set given to train()) have none: extract a store (python "
            "extract_features.py --data-path IMAGES --feature-path STORE) and train on it with --feature-path "
            "STORE, or keep --latent-norm scalar."
        )
    if dataset is not None:
        x, _ = dataset[0]
        return TrainData(dataset, x.shape[0], x.shape[-1])
    if data.feature_path:
        from dit.data.reader import LatentStoreDataset

        ds = LatentStoreDataset(data.feature_path, features=features, latent_norm=data.latent_norm)
        c, h, _ = ds.latent_shape
        ds.check_compatible(in_channels=c, input_size=image_size // ds.downsample, num_classes=num_classes or None)
        m = ds.manifest
        notes = [ds.channel.describe()] if ds.channel else []
        return TrainData(ds, c, h, vae_spec=m["vae_id"], vae_config=m.get("vae_config"), store_manifest=m,
                         latent_norm=ds.channel, notes=notes)  # fmt: skip
    if not data.data_path:
        raise UserError("no training data: pass --data-path IMAGE_FOLDER or --feature-path LATENT_STORE.")
    from dit.data.images import ImageFolderDataset, describe_skipped

    ds = ImageFolderDataset(data.data_path, image_size, flip=True)
    notes = [line] if (line := describe_skipped(ds.skipped, data.data_path)) else []
    if num_classes and len(ds.classes) > num_classes:  # 0: unconditional, the folders are ignored
        raise UserError(
            f"{data.data_path} has {len(ds.classes)} class folders but --num-classes is {num_classes}: "
            f"pass --num-classes {len(ds.classes)}."
        )
    if data.pixel_space:
        return TrainData(ds, 3, image_size, notes=notes)
    from dit.data import vae as vae_lib

    vae = vae_lib.load_vae(data.vae, device=device)
    factor = vae_lib.latent_downsample(vae)
    if image_size % factor:
        raise UserError(f"--image-size {image_size} is not a multiple of the VAE's downsampling factor {factor}.")
    channels = int(vae.config.latent_channels)
    return TrainData(ds, channels, image_size // factor, vae, data.vae, dict(vae.config), notes=notes)
