"""FID sample sets: images 0..N-1 as PNGs, then one ``.npz`` for the ADM evaluator; image i's label and noise
depend on (seed, i) alone, so any world size and resume give the same set."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from dit.checkpoint import find_checkpoint, official_release
from dit.data.images import to_uint8
from dit.data.store import sha256_file
from dit.io.atomic import CannotWrite, atomic_write, stale_temp_files
from dit.io.errors import UserError
from dit.io.progress import progress
from dit.model.config import registry_name
from dit.objectives.samplers import settings_record
from dit.runtime import Runtime
from dit.sample.config import FidConfig
from dit.sample.cost import SamplingCost, device_peak, measure_cost, timed
from dit.sample.generate import Sampler, SamplingModel, noise_seed, sample_latents, to_images
from dit.sample.guide import load_guide
from dit.sample.labels import labels_record, resumed_mode, set_labels
from dit.sample.loading import load_weights


@dataclass
class FidReport:
    folder: Path
    npz: Path | None  # written by rank 0 only
    generated: int  # images this rank made in this run (0 when everything was already there)
    labels: str  # the set's label mode: balanced or random
    cost: SamplingCost | None = field(default=None)


def png_path(folder: Path, index: int) -> Path:
    return folder / f"{index:06d}.png"


def sample_folder_name(c: FidConfig, sm: SamplingModel, sampler: Sampler) -> str:
    """The official folder name plus what else changes the set: the sampler, guided channels, N and the batch."""
    name = (registry_name(sm.config) or "custom").replace("/", "-")
    vae = Path(sm.vae_spec).name if sm.vae_spec else "none"
    s, f, g = c.sampling, c.fid, sampler.guidance
    guided = "" if str(s.guidance_channels) == "3" else f"-cfgch-{s.guidance_channels}"
    if g.interval is not None:
        guided += "-gi-" + "-".join(f"{v:g}" for v in g.interval)
    if c.guide.ckpt is not None:
        guided += f"-guide-{Path(c.guide.ckpt).stem}" + ("" if c.guide.ema else "-raw")
    return (
        f"{name}-{Path(c.weights.ckpt).stem}-size-{sm.image_size}-vae-{vae}-cfg-{g.scale}{guided}"
        f"-seed-{f.seed}-{sampler.describe().replace(' ', '-')}{s.num_sampling_steps}"
        f"-n{f.num_fid_samples}-b{f.batch_size}"
    )


def _set_identity(
    c: FidConfig, sm: SamplingModel, ckpt_sha256: str, sampler: Sampler, labels: str, guide_sha256: str | None
) -> dict:
    """Everything that decides the set (weights by content, model, sampler, N, batch, labels), not the world."""
    # keys as before the sections: old sets stay valid
    s, f, interval = c.sampling, c.fid, sampler.guidance.interval
    guide = {"ckpt_sha256": guide_sha256, "weights": "ema" if c.guide.ema else "model"}
    return {
        **({"guidance_interval": list(interval)} if interval is not None else {}),  # only when set
        **({"guide": guide} if guide_sha256 else {}),
        **({"time_shift": sampler.time_shift} if sampler.time_shift != 1 else {}),
        "ckpt_sha256": ckpt_sha256,
        "num_fid_samples": f.num_fid_samples,
        "per_proc_batch_size": f.batch_size,
        "weights": sm.weights,
        "model_config": sm.config.to_dict(),
        "image_size": sm.image_size,
        "vae": sm.vae_spec,
        "guidance_scale": sampler.guidance.scale,
        "guidance_channels": str(s.guidance_channels),
        "sampler": sampler.describe(),
        **settings_record(sampler.kind, sampler.method, s.diffusion_form, s.last_step, s.atol, s.rtol),
        "transport": sampler.sm.objective.manifest(sampler.sample_eps),
        "num_sampling_steps": s.num_sampling_steps,
        "global_seed": f.seed,
        "precision": c.runtime.precision,
        **labels_record(labels, f.seed, f.num_fid_samples, sm.config.num_classes),
    }


def png_complete(path: Path) -> bool:
    """A PNG that ends in its IEND chunk: one cut short (a full disk, a copy interrupted) does not count as done."""
    try:
        with open(path, "rb") as f:
            f.seek(-12, 2)
            return f.read(12)[4:8] == b"IEND"
    except OSError:
        return False


def write_png(path: Path, image: np.ndarray) -> None:
    atomic_write(path, lambda f: Image.fromarray(image).save(f, format="PNG"))


def batches(num_samples: int, batch_size: int, rank: int, world: int) -> list[range]:
    """Rank r's global batches b = r, r+W, ...: an image's batch, hence its numerics, is the same for any W."""
    starts = range(0, num_samples, batch_size)
    return [range(s, min(s + batch_size, num_samples)) for s in starts][rank::world]


def pack_npz(
    folder: Path, num_samples: int, path: Path, labels: list[int] | None = None, label_mode: str | None = None
) -> Path:
    """Stream PNGs 0..N-1 into ``path`` (``arr_0``, ``arr_1`` labels, ``label_mode``), one member at a time."""
    missing = [i for i in range(num_samples) if not png_complete(png_path(folder, i))]
    if missing:
        raise UserError(
            f"{len(missing)} of {num_samples} samples are missing from {folder} (first: {missing[:5]}): "
            "run the same command again to finish the set."
        )
    first = np.asarray(Image.open(png_path(folder, 0)).convert("RGB"))
    header = {"descr": "|u1", "fortran_order": False, "shape": (num_samples, *first.shape)}

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for i in range(num_samples):
                    image = np.asarray(Image.open(png_path(folder, i)).convert("RGB"), dtype=np.uint8)
                    if image.shape != first.shape:
                        raise UserError(
                            f"{png_path(folder, i)} is {image.shape}, not {first.shape}: delete it and rerun."
                        )
                    member.write(image.tobytes())
            if labels is not None:
                with zf.open("arr_1.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asarray(labels, dtype=np.int64))
            if label_mode is not None:
                with zf.open("label_mode.npy", "w") as member:
                    np.lib.format.write_array(member, np.asarray(label_mode))

    atomic_write(path, write)
    return path


def write_fid_samples(c: FidConfig, runtime: Runtime) -> FidReport:
    """Write images 0..N-1 as PNGs (skipping batches already on disk), then pack them into ``{folder}.npz``."""
    rank, device = runtime.rank, runtime.device
    w = c.weights.replace(ckpt=str(find_checkpoint(c.weights.ckpt or official_release(c.weights.image_size))))
    c = dataclasses.replace(c, weights=w)
    sm = load_weights(w, device, sd_decoder="ema")  # the official sample_ddp.py decodes with ema
    sampler = Sampler.from_options(sm, c.sampling, load_guide(c.guide, sm, device))
    folder = Path(c.fid.sample_dir) / sample_folder_name(c, sm, sampler)
    files = (w.ckpt, c.guide.ckpt)
    ckpt_sha256, guide_sha256 = runtime.gather_objects(
        [f and sha256_file(f) for f in files] if rank == 0 else None
    )[0]
    manifest = folder / "sample_set.json"
    recorded = json.loads(manifest.read_text()) if manifest.is_file() else None
    if recorded is not None:
        recorded = {"labels": "random", **recorded}  # a set recorded before the modes drew random labels
    mode = resumed_mode(c.fid.labels, recorded and recorded["labels"], folder, "another --sample-dir")
    identity = _set_identity(c, sm, ckpt_sha256, sampler, mode, guide_sha256)
    if recorded is not None and recorded != identity:
        raise UserError(
            f"{folder} holds samples made with other settings or other weights (see {manifest}): pass another "
            "--sample-dir or delete the folder."
        )
    # One sampling run per set: a second one would write the same files.
    lock = runtime.lock_folder(folder, "sampling run", "wait for it, or pass another --sample-dir")
    try:
        if rank == 0:
            for stale in stale_temp_files(folder):  # PNGs half-written when a previous run was killed
                stale.unlink(missing_ok=True)
            if not manifest.is_file():
                atomic_write(manifest, lambda f: f.write(json.dumps(identity, indent=1).encode()))
        runtime.barrier()
        f = c.fid
        peak = device_peak(device, c.runtime.precision, c.runtime.peak_tflops) if rank == 0 else (None, "")
        mine = batches(f.num_fid_samples, f.batch_size, rank, runtime.world)
        todo = [b for b in mine if not all(png_complete(png_path(folder, i)) for i in b)]
        total, generated = sum(len(b) for b in mine), sum(len(b) for b in todo)
        desc, enabled = f"sampling (rank 0 of {runtime.world})", rank == 0 and f.progress
        bar = progress(total, desc, initial=total - generated, unit="img", enabled=enabled)
        dit_s, decode_s, classes = 0.0, 0.0, sm.config.num_classes
        every_label = set_labels(mode, f.seed, f.num_fid_samples, classes)
        for batch in todo:
            labels = [every_label[i] for i in batch]
            seeds = [noise_seed(f.seed, i) for i in batch]
            samples, denoising = timed(
                runtime, sample_latents, sm, sampler, labels, seeds, precision=runtime.precision
            )
            images, decoding = timed(runtime, to_images, sm, samples)
            dit_s, decode_s = dit_s + denoising, decode_s + decoding
            for i, image in zip(batch, to_uint8(images).permute(0, 2, 3, 1).numpy()):  # NHWC, as PNGs hold them
                write_png(png_path(folder, i), image)
            bar.update(len(batch))
        bar.close()
        cost = measure_cost(sm, sampler, generated, dit_s, decode_s, peak) if rank == 0 and generated else None
        runtime.barrier()
        npz = folder.with_name(folder.name + ".npz") if rank == 0 else None
        if npz is not None:
            pack_npz(folder, f.num_fid_samples, npz, every_label if classes else None, mode if classes else None)
        runtime.barrier()
        return FidReport(folder, npz, generated, mode, cost)
    except CannotWrite as e:  # a full disk: the PNGs written are whole, and a rerun skips them
        raise e.keeping(
            f"every complete sample in {folder} is kept and the same command continues from them"
        ) from None
    finally:
        if lock is not None:
            lock.release()
