"""The latent store's format: VAE posterior moments of every image (and of its flip) in checksummed
safetensors shards, with a manifest that says what made them (docs/latent_store.md, "Format"). A shard's
``.sha256`` file, written after it, is its completion mark; a shard's bytes never depend on how many
processes wrote the store.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields

import numpy as np
import safetensors.torch
import torch

from dit import __version__
from dit.data.stats import latent_stats, stats_problem
from dit.io.atomic import atomic_write_bytes, stale_temp_files
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format
from dit.io.userfiles import inside

FORMAT = "dit-ledger-latent-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HEAD = {"format": FORMAT, "version": FORMAT_VERSION, WRITER_KEY: __version__}  # every manifest's first keys
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors dtype tag -> numpy dtype to view the bytes as; numpy has no bfloat16, so read it as raw uint16.
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_path(folder: str, name: str, index: int) -> str:
    """Shard ``index``'s file as the manifest (or, for an interrupted store, the writer) names it, refused
    unless it lies in the store's folder, links resolved: every reader and ``--verify`` open this one path."""
    fix = "a store's shards lie in its own folder; re-extract it with extract_features.py, or move the files there"
    return str(inside(folder, name, os.path.join(folder, MANIFEST), f"shard {index}'s file", fix))


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_files(paths: list[str]) -> list[str]:
    """Each file's sha256, several at once: hashlib releases the GIL while it hashes, so threads add up (a store
    is hundreds of shards)."""
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


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
    path = shard_path(folder, shard_file(index), index)  # a link planted out of the store is refused, not read
    return expected is not None and os.path.isfile(path) and sha256_file(path) == expected


@dataclass
class StoreSpec:
    """Everything that decides a store's bytes; a rerun may add to a store only if all of it matches, but
    ``vae_id``, a label (a folder may move): the two hashes are the VAE's identity."""

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
    shift_factor: float = 0.0  # latents are (z - shift) x scale (SD3/FLUX VAEs); 0 for the SD VAEs
    vae_config: dict | None = None  # the AutoencoderKL config, for the cost of encoding (its hash is above)
    features: dict | None = None  # REPA: the encoder whose patch features the shards carry; None: latents only

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_sources / self.shard_size)


def sources_sha256(samples: list[tuple[str, int]]) -> str:
    """A digest of the ordered (path, label) list: a store is only resumable from the same source files."""
    return hashlib.sha256("\n".join(f"{label}\t{path}" for path, label in samples).encode()).hexdigest()


# What a manifest must hold, and of which type, before anything reads a shard (``validate_manifest``).
_SCHEMA = {
    "format": str, "version": int, "complete": bool, "image_size": int, "latent_shape": list,
    "scaling_factor": (int, float), "storage_dtype": str, "flips_stored": bool, "shard_size": int,
    "class_to_index": dict, "num_sources": int, "vae_id": str,
}  # fmt: skip
_COMPLETE_SCHEMA = {"num_images": int, "shards": list, "total_bytes": int}
REPAIR = "Rerun extract_features.py with the same arguments: it redoes exactly the bad or missing parts"


def manifest_sha256(manifest: dict) -> str:
    """The checksum a manifest carries of itself: its canonical JSON without the checksum field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: str, manifest: dict) -> None:
    """Atomically, with its own checksum: a hand edit (a scaling factor, a count) is caught on reading."""
    manifest = {**manifest, "manifest_sha256": manifest_sha256(manifest)}
    atomic_write_bytes(os.path.join(folder, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(folder: str) -> dict:
    """The manifest, checked against its checksum and its schema; any damage is one line naming the repair."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(
            f"no latent store at {folder} (no {MANIFEST}). Create one with "
            f"`python extract_features.py --data-path IMAGES --feature-path {folder}`."
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): the manifest is damaged. {REPAIR}.") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path} is not a latent-store manifest (not a JSON object). {REPAIR}.")
    if manifest.get("format") == FORMAT:
        refuse_newer_format(
            path, "latent store", manifest.get("version"), FORMAT_VERSION, manifest.get(WRITER_KEY)
        )
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} manifest (format={manifest.get('format')!r}, "
            f"version={manifest.get('version')!r}). Re-extract with this version of extract_features.py."
        )
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_sha256(manifest):
        raise UserError(
            f"{path} was changed after it was written (its checksum fails): values such as the scaling factor or "
            f"the counts can no longer be trusted. {REPAIR}, or restore the file."
        )
    validate_manifest(manifest, path)
    return manifest


def validate_manifest(manifest: dict, path: str) -> None:
    # The checksum is required: a manifest without one could be edited at will.
    schema = {**_SCHEMA, **(_COMPLETE_SCHEMA if manifest.get("complete") else {}), "manifest_sha256": str}
    problems = [f"{k} is missing" for k in schema if k not in manifest]
    problems += [
        f"{k} is a {type(manifest[k]).__name__}"
        for k, t in schema.items()
        if k in manifest and not isinstance(manifest[k], t)
    ]
    if not problems:
        if not manifest["scaling_factor"] > 0 or manifest["storage_dtype"] not in STORAGE_DTYPES:
            problems.append(
                f"scaling_factor {manifest['scaling_factor']} / storage_dtype {manifest['storage_dtype']!r}"
            )
        shape = manifest["latent_shape"]
        if len(shape) != 3 or not all(isinstance(n, int) and n >= 1 for n in shape):
            problems.append(f"latent_shape {shape} is not three positive integers")
        if manifest["shard_size"] < 1 or manifest["image_size"] < 1:
            problems.append("shard_size or image_size is out of range")
        if not isinstance(manifest.get("shift_factor", 0.0), (int, float)):
            problems.append(f"shift_factor {manifest['shift_factor']!r} is not a number")
        if "latent_stats" in manifest and (problem := stats_problem(manifest["latent_stats"], shape[0])):
            problems.append(problem)
        feats = manifest.get("features")
        if feats is not None and not (
            isinstance(feats, dict)
            and isinstance(feats.get("encoder"), str)
            and all(isinstance(feats.get(k), int) for k in ("input_size", "tokens", "dim"))
        ):
            problems.append("features is not an encoder record (encoder, input_size, tokens, dim)")
        if manifest.get("complete"):
            shards = manifest["shards"]
            types = {"file": str, "num_images": int, "bytes": int, "sha256": str}
            if not all(isinstance(sh, dict) and types.keys() <= sh.keys() for sh in shards):
                problems.append(f"a shard entry lacks one of {sorted(types)}")
            elif not all(isinstance(sh[k], t) for sh in shards for k, t in types.items()):
                problems.append("a shard entry has a value of the wrong type (file, num_images, bytes, sha256)")
            elif sum(sh["num_images"] for sh in shards) != manifest["num_images"]:
                problems.append(f"num_images {manifest['num_images']} is not the shards' sum")
            elif len(shards) != math.ceil(manifest["num_sources"] / manifest["shard_size"]):
                problems.append(f"{len(shards)} shards listed for {manifest['num_sources']} sources")
    if problems:
        raise UserError(f"{path} is not a valid latent-store manifest: {'; '.join(problems)}. {REPAIR}.")
    for index, shard in enumerate(manifest["shards"] if manifest.get("complete") else []):
        shard_path(os.path.dirname(path), shard["file"], index)


def check_existing_store(folder: str, spec: StoreSpec) -> None:
    """Refuse (before anything is written) to add to a store made with another VAE, image size, dtype or data."""
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        if os.path.isdir(folder) and any(name.startswith("shard-") for name in os.listdir(folder)):
            raise UserError(
                f"{folder} holds shard files but no {MANIFEST}, so it cannot be resumed safely. "
                "Nothing was overwritten. Use an empty --feature-path, or delete those files."
            )
        return
    old = read_manifest(folder)
    new = json.loads(json.dumps(asdict(spec)))  # tuples to lists, as the manifest holds them
    defaults = {f.name: f.default for f in fields(StoreSpec)}  # a store older than a field has its default
    diffs = [
        f"{key}: store has {old.get(key, defaults.get(key))!r}, this run has {value!r}"
        for key, value in new.items()
        if key not in ("vae_id", "vae_config") and old.get(key, defaults.get(key)) != value
    ]
    if diffs:
        if any(d.startswith("vae_") for d in diffs):
            diffs.insert(0, f"VAE: store was made with {old.get('vae_id')!r}, this run uses {spec.vae_id!r}")
        if any(d.startswith(("sources_", "num_sources", "class_to_index")) for d in diffs):
            diffs.insert(0, "the image folder's contents differ from those the store was made from")
        raise UserError(
            f"{folder} already holds a latent store made differently: {'; '.join(diffs)}. Nothing was "
            "overwritten. Use another --feature-path, pass the same settings as before, or delete the folder."
        )


def begin_store(folder: str, spec: StoreSpec) -> None:
    """Mark the store incomplete (readers refuse it until finalize_store) and clear temp files of killed runs."""
    os.makedirs(folder, exist_ok=True)
    for path in stale_temp_files(folder):  # the caller holds the store's lock
        path.unlink(missing_ok=True)
    write_manifest(folder, {**HEAD, "complete": False, **asdict(spec)})


def write_shard(
    folder: str,
    index: int,
    spec: StoreSpec,
    moments: torch.Tensor,
    labels: torch.Tensor,
    files: list[str],
    skipped: list[tuple[str, str]],
    features: torch.Tensor | None = None,
) -> None:
    """Write shard ``index`` (moments [n, views, 2, C, H, W]; REPA's features [n, views, tokens, width] when the
    spec has them) atomically, then its checksum file."""
    if (features is None) != (spec.features is None):
        raise ValueError(f"shard {index}: the spec {'has' if spec.features else 'has no'} encoder features")
    dtype = STORAGE_DTYPES[spec.storage_dtype]
    tensors = {"moments": moments.to(dtype).contiguous(), "labels": labels.to(torch.int64).contiguous()}
    if features is not None:
        tensors["features"] = features.to(dtype).contiguous()
    for key, what in (("moments", "posterior moments"), ("features", "the encoder's features")):
        if key in tensors and not torch.isfinite(tensors[key]).all():
            more = ", or check the VAE" if key == "moments" else ""
            raise UserError(
                f"shard {index}: {what} are not finite in {spec.storage_dtype}. Use --storage-dtype bf16 or fp32 "
                f"(wider range){more}."
            )
    # one metadata key: safetensors orders several by a randomly seeded hash map (docs/latent_store.md)
    info = json.dumps({"format": FORMAT, "shard": index, "files": files, "skipped": skipped}, sort_keys=True)
    data = safetensors.torch.save(tensors, metadata={"dit_ledger": info})
    name = shard_file(index)
    atomic_write_bytes(os.path.join(folder, name), data)
    atomic_write_bytes(
        os.path.join(folder, name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {name}\n".encode()
    )


def finalize_store(folder: str, spec: StoreSpec, scan_skipped: list[tuple[str, str]]) -> dict:
    """Gather every shard's count, size, checksum and skipped files, and the latents' per-channel statistics
    (``dit.data.stats``), into the final manifest (written atomically)."""
    shards, skipped = [], [tuple(s) for s in scan_skipped]
    for index in range(spec.num_shards):
        path = os.path.join(folder, shard_file(index))
        header, _ = read_header(path)
        skipped += [tuple(s) for s in json.loads(header["__metadata__"]["dit_ledger"])["skipped"]]
        shard = {"file": shard_file(index), "num_images": header["labels"]["shape"][0]}
        shards.append({**shard, "bytes": os.path.getsize(path), "sha256": _expected_sha256(folder, index)})
    manifest = {
        **HEAD,
        "complete": True,
        "num_images": sum(s["num_images"] for s in shards),
        "num_skipped": len(skipped),
        "total_bytes": sum(s["bytes"] for s in shards),
        **asdict(spec),
        "skipped": [{"path": path, "reason": reason} for path, reason in sorted(skipped)],
        "shards": shards,
    }
    paths = [os.path.join(folder, s["file"]) for s in shards]
    if (stats := latent_stats(paths, spec.latent_shape[0])) is not None:
        manifest["latent_stats"] = stats
    write_manifest(folder, manifest)
    return read_manifest(folder)


def write_moments_store(
    folder: str,
    moments: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    scale: float = 0.18215,
    storage_dtype: str = "fp16",
    shard_size: int = 2048,
    source: str = "in-memory moments",
    vae_config: dict | None = None,
    features: torch.Tensor | None = None,
    encoder: dict | None = None,
) -> dict:
    """A store from moments computed elsewhere ([N, views, 2, C, H, W]) for benchmarks, tests and imports; its
    VAE fields record only ``source``, so it is never taken for a VAE-made store. ``vae_config``: the cost of
    encoding, if known; ``features`` ([N, views, tokens, width]): REPA's, made by ``encoder``."""
    n, views, _, c, h, w = moments.shape
    names = [f"{source}/{i}" for i in range(n)]
    digest = hashlib.sha256(source.encode()).hexdigest()
    spec = StoreSpec(
        vae_id=source,
        vae_config_sha256=digest,
        vae_weights_sha256=digest,
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
        vae_config=vae_config,
        features=encoder if features is not None else None,
    )
    check_existing_store(folder, spec)
    begin_store(folder, spec)
    for k in range(spec.num_shards):
        part = slice(k * shard_size, (k + 1) * shard_size)
        part_features = features[part] if features is not None else None
        write_shard(folder, k, spec, moments[part], labels[part], names[part], [], part_features)
    return finalize_store(folder, spec, [])


def verify_store(folder: str) -> dict:
    """The manifest, once every shard hashes to its sha256 (an interrupted store's: its checksum files); else
    a UserError listing every missing, truncated or corrupted shard."""
    manifest = read_manifest(folder)
    problems = [] if manifest["complete"] else [f"{MANIFEST} marks the store incomplete (extraction interrupted)"]
    num_shards = math.ceil(manifest["num_sources"] / manifest["shard_size"])
    recorded = manifest["shards"] if manifest["complete"] else []
    to_hash = {}  # name -> (path, expected sha256): the files the manifest names, as the reader opens them
    for index in range(num_shards):
        name = recorded[index]["file"] if recorded else shard_file(index)
        path = shard_path(folder, name, index)
        expected = recorded[index]["sha256"] if recorded else _expected_sha256(folder, index)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif expected is None:
            problems.append(f"{name} has no checksum (its write was interrupted)")
        else:
            to_hash[name] = (path, expected)
    digests = sha256_files([path for path, _ in to_hash.values()])
    sizes = {s["file"]: s["bytes"] for s in recorded}
    for (name, (path, expected)), digest in zip(to_hash.items(), digests):
        if digest != expected:
            size = f" ({os.path.getsize(path)} bytes, manifest says {sizes[name]})" if recorded else ""
            problems.append(f"{name} fails its sha256 check{size}")
    if problems:
        raise UserError(
            f"latent store {folder} failed verification: {'; '.join(problems)}. Rerun extract_features.py "
            "with the same arguments: it redoes exactly the bad or missing shards."
        )
    return manifest
