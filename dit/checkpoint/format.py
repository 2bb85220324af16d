"""The one checkpoint format: atomic writes, ``weights_only`` loads, listing, retention, official DiT files (bare
state dicts, or train.py's with an ``argparse.Namespace``, the one object allowed); FSDP's folder: ``sharded``."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch

import dit.checkpoint.sharded as sharded
from dit import __version__
from dit.data.store import sha256_file
from dit.io.atomic import CannotWrite, atomic_write, atomic_write_bytes, stale_temp_files
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format

FORMAT = "dit-ledger/1"
_STEP = re.compile(r"^(\d{7,})(\.pt)?$")  # a file NNNNNNN.pt, or a sharded folder NNNNNNN


class _Hashing:
    """A file that hashes what passes through it and keeps the OS error torch's writer hides (a full disk)."""

    def __init__(self, f):
        self.f, self.digest, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.digest.update(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def atomic_torch_save(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` that never leaves a partial file, with ``path.sha256`` hashed as the bytes are written."""
    hashing = None

    def write(f):
        nonlocal hashing
        hashing = _Hashing(f)
        try:
            torch.save(obj, hashing)
        except RuntimeError:
            if hashing.error is not None:
                raise hashing.error from None
            raise

    path = atomic_write(path, write)
    try:
        atomic_write_bytes(checksum_path(path), f"{hashing.digest.hexdigest()}  {path.name}\n".encode())
    except CannotWrite:
        path.unlink()  # a checkpoint is its file and its checksum: one without the other is not kept
        raise
    return path


def checksum_path(path: str | os.PathLike) -> Path:
    return Path(f"{path}.sha256")


def verify_checkpoint(path: str | os.PathLike) -> bool | None:
    """Whether ``path`` has the content its save hashed; None without a ``.sha256`` (older or official files)."""
    if Path(path).is_dir():
        return sharded.verify(Path(path))
    sums = checksum_path(path)
    if not sums.is_file():
        return None
    try:
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, sums.stat().st_mtime_ns)
        if key in _VERIFIED:  # a resume reads the record, then the state: the file is hashed once
            return _VERIFIED[key]
        expected = sums.read_text().split()[0]
        digest = sha256_file(path)
    except (OSError, IndexError):
        return False
    _VERIFIED[key] = digest == expected
    return _VERIFIED[key]


_VERIFIED: dict[tuple, bool] = {}


# The official releases (bare EMA state dicts), without published checksums: a download's sha256 is printed
OFFICIAL_RELEASES = {
    f"DiT-XL-2-{size}x{size}.pt": f"https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-{size}x{size}.pt"
    for size in (256, 512)
}


def official_release(image_size: int | None) -> str:
    """The official DiT-XL/2 release for an image size (256 by default), as the official sample.py picks it."""
    size = image_size or 256
    return f"DiT-XL-2-{size}x{size}.pt"


def find_checkpoint(name: str | os.PathLike) -> Path:
    """A checkpoint path; an official release name is found in (or downloaded to) torch hub's cache."""
    path = Path(name)
    if path.is_file() or path.name not in OFFICIAL_RELEASES or str(path) != path.name:
        return path
    cached = Path(torch.hub.get_dir()) / "checkpoints" / path.name
    if not cached.is_file():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            print(f"downloading {path.name} from {OFFICIAL_RELEASES[path.name]} to {cached}", flush=True)
            torch.hub.download_url_to_file(OFFICIAL_RELEASES[path.name], str(cached), progress=True)
        except Exception as e:  # no network, a proxy, a full disk: all the same to the user
            raise UserError(
                f"cannot download {path.name} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): "
                f"fetch {OFFICIAL_RELEASES[path.name]} elsewhere and put it at {cached}, or pass --ckpt /path/to/it."
            ) from None
        digest = hashlib.sha256(cached.read_bytes()).hexdigest()
        print(f"{cached}: sha256 {digest}", flush=True)
    return cached


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False, weights: bool = True) -> dict:
    """Load any supported checkpoint with ``weights_only=True`` (official args become a dict); ``mmap`` maps it,
    and a sharded folder is read whole or (``mmap`` or not ``weights``) its record alone, marked ``SHARDED``."""
    path = find_checkpoint(path)
    if path.is_dir():
        return _load_folder(path, weights and not mmap)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass the path of a .pt file (--ckpt).")
    if path.stat().st_size == 0:
        raise UserError(f"checkpoint {path} is empty (0 bytes): pass another checkpoint.")
    if verify_checkpoint(path) is False:
        raise UserError(
            f"checkpoint {path} does not match its checksum ({checksum_path(path).name}): it changed after it "
            "was saved (a flipped byte, a truncated copy); use another checkpoint of the run."
        )
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated file, or a pickle holding something other than tensors
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if len(reason) > 200:  # whole words, marked as cut
            reason = reason[:200].rsplit(" ", 1)[0] + " ..."
        raise UserError(
            f"cannot read checkpoint {path} safely ({type(e).__name__}: {reason}). It may be truncated or not "
            "a torch file; only tensor checkpoints are loaded (weights_only=True): re-save it as a state dict."
        ) from None
    if not isinstance(ckpt, dict):
        raise UserError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a dict of weights.")
    refuse_newer_format(path, "checkpoint", ckpt.get("format"), FORMAT, ckpt.get(WRITER_KEY))
    if isinstance(ckpt.get("args"), argparse.Namespace):
        ckpt["args"] = vars(ckpt["args"])
    return ckpt


SHARDED = "sharded_folder"  # never saved: where a record read without its weights came from


def _load_folder(path: Path, weights: bool) -> dict:
    if not (path / sharded.MANIFEST).is_file():
        raise UserError(
            f"{path} is a folder without {sharded.MANIFEST}: pass a checkpoint file or folder of a run."
        )
    if not sharded.verify(path):
        raise UserError(
            f"checkpoint {path} does not match its {sharded.MANIFEST} (a shard changed, is missing or was "
            "truncated after it was saved): use another checkpoint of the run."
        )
    record = sharded.read(path) if weights else sharded.read_record(path)
    refuse_newer_format(path, "checkpoint", record.get("format"), FORMAT, record.get(WRITER_KEY))
    return record if weights else {**record, SHARDED: str(path)}


def model_weights(ckpt: dict, use_ema: bool = True) -> tuple[dict, str]:
    """The state dict to sample with and its name: EMA if present and wanted, else the model, or a bare one."""
    if "model" in ckpt or "ema" in ckpt:
        if use_ema and ckpt.get("ema") is not None:
            return ckpt["ema"], "ema"
        if "model" in ckpt:
            return ckpt["model"], "model"
        raise UserError("checkpoint has EMA weights only; drop --no-ema.")
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return ckpt, "state_dict"
    raise UserError(f"checkpoint holds neither a state dict nor model/ema weights (keys: {sorted(ckpt)[:10]}).")


def checkpoint_path(folder: str | os.PathLike, step: int, sharded: bool = False) -> Path:
    return Path(folder) / (f"{step:07d}" if sharded else f"{step:07d}.pt")


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` (files and sharded folders) as (step, path), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _STEP.match(p.name)) and (p.is_file() if m.group(2) else p.is_dir())]  # fmt: skip
    return sorted(found)


def read_record(path: Path) -> dict:
    """A checkpoint's record without its weights; {} for a damaged one (judged by its step alone)."""
    try:
        ckpt = (
            sharded.read_record(path)
            if path.is_dir()
            else torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        )
    except Exception:
        return {}
    return ckpt if isinstance(ckpt, dict) else {}


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def kept_checkpoints(folder: str | os.PathLike) -> str:
    """The line a run stopped by a refused write ends with: its newest complete checkpoint."""
    found = list_checkpoints(folder)
    if not found:
        return "no checkpoint was kept"
    return f"the newest checkpoint kept is {found[-1][1].name} ({len(found)} in {folder})"


def load_training_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """A checkpoint to resume from: ours, of this format version; anything else is refused with the reason."""
    ckpt = load_checkpoint(path, mmap=mmap, weights=False)
    if ckpt.get("format") != FORMAT or "model_config" not in ckpt:
        kind = (
            "an official DiT file" if "args" in ckpt or "model" not in ckpt else f"format {ckpt.get('format')!r}"
        )
        raise UserError(
            f"{path} is not a {FORMAT} training checkpoint ({kind}): --resume continues a dit-ledger run; "
            "to start from other weights, pass them to train.py --init-from (a fine-tune), or sample with sample.py."
        )
    return ckpt


def remove_partial_checkpoints(folder: str | os.PathLike) -> tuple[int, int]:
    """Delete what saves a killed run never finished, (files, bytes); only the run folder's lock holder may."""
    found = stale_temp_files(folder)
    files = [f for p in found for f in ([p] if not p.is_dir() else [q for q in p.rglob("*") if q.is_file()])]
    size = sum(p.stat().st_size for p in files if p.exists())
    for p in found:
        remove_checkpoint(p)
    return len(files), size


def remove_checkpoint(path: Path) -> None:
    """A checkpoint file with its checksum, or a sharded folder."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)


def save_training_checkpoint(
    folder: str | os.PathLike, step: int, payload: dict, keep_last: int = 0, keep_every: int = 0
) -> Path:
    """Atomically write ``payload`` as step ``step``, then ``retire`` (the caller holds the run folder's lock)."""
    path = atomic_torch_save(stamped(step, payload), checkpoint_path(folder, step))
    retire(folder, step, keep_last, keep_every)
    return path


def stamped(step: int, payload: dict) -> dict:
    """What every checkpoint records first: its format, the version that wrote it, its step."""
    return {"format": FORMAT, WRITER_KEY: __version__, "step": step, **payload}


def retire(folder: str | os.PathLike, step: int, keep_last: int, keep_every: int = 0) -> None:
    """After step ``step`` is saved: delete what ``keep_last`` lets go, and any partial save a killed run left."""
    for old in expired_checkpoints(folder, step, keep_last, keep_every):
        remove_checkpoint(old)
    remove_partial_checkpoints(folder)


def expired_checkpoints(folder: str | os.PathLike, step: int, keep_last: int, keep_every: int = 0) -> list[Path]:
    """What ``keep_last`` lets go once ``step`` is saved: older checkpoints beyond the newest ``keep_last`` - 1,
    milestones (steps divisible by ``keep_every``) aside; newer files are off this line, never deleted."""
    if keep_last <= 0:
        return []
    older = [(s, p) for s, p in list_checkpoints(folder) if s < step]
    beyond = older[: max(0, len(older) - (keep_last - 1))]  # a negative bound would count from the end
    return [p for s, p in beyond if not (keep_every and s % keep_every == 0)]
