"""The one checkpoint format: atomic writes, safe loads, and reading official DiT files.

A dit-ledger checkpoint is a ``torch.save`` of a dict holding only tensors, numbers, strings, lists and
dicts (so ``weights_only=True`` loads it), with ``format == FORMAT`` (and the dit-ledger version that wrote
it under ``WRITER_KEY``: every load refuses a newer format, naming it), the model config under
``model_config``, the run config under ``config``, and ``model``/``ema`` state dicts. Official releases
are bare state dicts; official ``train.py`` files hold ``{model, ema, opt, args}`` with an
``argparse.Namespace``, which we allow (and only it) instead of unpickling arbitrary objects.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dit import __version__
from dit.atomic import atomic_write, atomic_write_bytes, stale_temp_files
from dit.config import FieldError, Section, option
from dit.errors import WRITER_KEY, UserError, refuse_newer_format

FORMAT = "dit-ledger/1"
_STEP_FILE = re.compile(r"^(\d{7,})\.pt$")


@dataclass(frozen=True)
class CheckpointSection(Section):
    """Where a run keeps its state and what it starts from: a fresh start, a resume, or other weights."""

    results_dir: str = option("results/run", "this run's folder: checkpoints, config.yaml, metrics, TensorBoard")
    resume: str | None = option(
        None,
        "auto (the latest of the branch that ran last in --results-dir) or a checkpoint path (another: a new branch)",
    )
    init_from: str | None = option(
        None,
        "fine-tune: start a fresh run from these weights (an official release, an official train.py file, or ours)",
    )
    init_from_weights: str = option("ema", "which weights of --init-from", choices=("ema", "model"))
    allow_changes: tuple[str, ...] | None = option(
        None, "on --resume, recipe fields that may differ from the checkpoint's (lr, weight_decay, ...)"
    )
    ckpt_every: int = option(50_000, "steps per checkpoint file", ge=1)
    keep_last: int = option(5, "checkpoint files to keep (0: all)", ge=0)

    # What a resumed run does not take from its record: how this start was asked for.
    START_ONLY = ("resume", "init_from", "init_from_weights", "allow_changes")

    def check(self) -> None:
        if self.init_from and self.resume:
            raise FieldError(
                "{init_from} starts a new run from other weights and {resume} continues one: pass one of them "
                "(a fine-tune started with {init_from} is continued with {resume} auto alone)."
            )
        if Path(self.results_dir).exists() and not Path(self.results_dir).is_dir():
            raise FieldError(
                f"{{results_dir}} {self.results_dir} is a file: pass a folder (it is created if missing)."
            )

    @property
    def folder(self) -> Path:
        return Path(self.results_dir) / "checkpoints"

    def resume_path(self) -> Path | None:
        """The checkpoint a resume continues (None: a fresh run, also for auto in an empty folder)."""
        if not self.resume:
            return None
        if self.resume != "auto":
            return Path(self.resume)
        from dit.train.lineage import follow

        path, bad = follow(self.folder)
        if bad:
            names = ", ".join(p.name for p in bad)
            if path is None:
                raise UserError(
                    f"no checkpoint in {self.folder} matches its checksum ({names} changed since they were "
                    "saved): restore one from a copy, or start a new run in another --results-dir."
                )
            if names not in _TOLD:
                _TOLD.add(names)
                print(f"--resume auto: {names} fail their checksum (changed since saved); resuming from "
                      f"{path.name}", file=sys.stderr, flush=True)  # fmt: skip
        return path


class _Hashing:
    """A file that hashes what passes through it, and keeps the OS error that torch's writer turns into
    ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` (a full disk)."""

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
    """``torch.save`` that never leaves a partial file under ``path``, and ``path.sha256`` beside it (the
    format of ``sha256sum``), hashed as the bytes are written: 0.9 GB/s here, about 12 s of an XL/2 training
    checkpoint's (10.8 GB). A full disk is the ``UserError`` of any other write."""
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
    atomic_write_bytes(checksum_path(path), f"{hashing.digest.hexdigest()}  {path.name}\n".encode())
    return path


def checksum_path(path: str | os.PathLike) -> Path:
    return Path(f"{path}.sha256")


def verify_checkpoint(path: str | os.PathLike) -> bool | None:
    """Whether ``path`` still has the content its save hashed: None when there is no ``.sha256`` (a file
    from before checksums, or an official one), False for a changed, truncated or empty file."""
    sums = checksum_path(path)
    if not sums.is_file():
        return None
    try:
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, sums.stat().st_mtime_ns)
        if key in _VERIFIED:  # a resume reads the record, then the state: the file is hashed once
            return _VERIFIED[key]
        expected = sums.read_text().split()[0]
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    except (OSError, IndexError):
        return False
    _VERIFIED[key] = digest.hexdigest() == expected
    return _VERIFIED[key]


_VERIFIED: dict[tuple, bool] = {}
_TOLD: set[str] = set()  # fallbacks already reported


# The official releases (bare EMA state dicts), where the official scripts download them from. DiT publishes
# no checksums for them; a download is checked instead by loading it (weights_only) and by the model's strict
# key and shape check, and its sha256 is printed so that it can be compared across machines.
OFFICIAL_RELEASES = {
    f"DiT-XL-2-{size}x{size}.pt": f"https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-{size}x{size}.pt"
    for size in (256, 512)
}


def official_release(image_size: int | None) -> str:
    """The official DiT-XL/2 release for an image size (256 by default), as the official sample.py picks it."""
    size = image_size or 256
    return f"DiT-XL-2-{size}x{size}.pt"


def find_checkpoint(name: str | os.PathLike) -> Path:
    """A checkpoint path; an official release name that is no file here is looked up in torch hub's cache
    and downloaded there when missing (as the official sample.py does). Offline, the error says where to
    put the file."""
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


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False) -> dict:
    """Load a checkpoint of any supported kind with ``weights_only=True``; official args become a dict.
    ``mmap``: map the tensors instead of reading them (to read a record without loading the weights)."""
    path = find_checkpoint(path)
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


def model_weights(ckpt: dict, use_ema: bool = True) -> tuple[dict, str]:
    """The state dict to sample with, and which one it is: EMA if present (and wanted), else the raw model.

    Bare state dicts (the official releases, which hold the EMA weights) are returned as they are.
    """
    if "model" in ckpt or "ema" in ckpt:
        if use_ema and ckpt.get("ema") is not None:
            return ckpt["ema"], "ema"
        if "model" in ckpt:
            return ckpt["model"], "model"
        raise UserError("checkpoint has EMA weights only; drop --no-ema.")
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return ckpt, "state_dict"
    raise UserError(f"checkpoint holds neither a state dict nor model/ema weights (keys: {sorted(ckpt)[:10]}).")


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"{step:07d}.pt"


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first; temp files are not listed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def load_training_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """A checkpoint to resume from: ours, of this format version; anything else is refused with the reason."""
    ckpt = load_checkpoint(path, mmap=mmap)
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
    """Delete the temporary files of saves a killed run never finished; (files, bytes) removed.

    Only the holder of the run folder's lock may call this: another run's save in progress looks the same."""
    files = stale_temp_files(folder)
    size = sum(p.stat().st_size for p in files if p.exists())
    for p in files:
        p.unlink(missing_ok=True)
    return len(files), size


def save_training_checkpoint(folder: str | os.PathLike, step: int, payload: dict, keep_last: int = 0) -> Path:
    """Atomically write ``payload`` as step ``step``; keep it and the newest ``keep_last`` - 1 older ones (0 keeps
    all), and delete any partial file a killed save left (the caller holds the run folder's lock)."""
    record = {"format": FORMAT, WRITER_KEY: __version__, "step": step, **payload}
    path = atomic_torch_save(record, checkpoint_path(folder, step))
    for old in expired_checkpoints(folder, step, keep_last):
        old.unlink(missing_ok=True)
        checksum_path(old).unlink(missing_ok=True)
    remove_partial_checkpoints(folder)
    return path


def expired_checkpoints(folder: str | os.PathLike, step: int, keep_last: int) -> list[Path]:
    """What ``keep_last`` lets go once step ``step`` is saved: the checkpoints older than it beyond the newest
    ``keep_last`` - 1. Newer files are no part of the line that reached ``step`` (ones a resume passed over for a
    failed checksum; a rollback moves the others aside first): never counted, never deleted."""
    if keep_last <= 0:
        return []
    older = [p for s, p in list_checkpoints(folder) if s < step]
    return older[: max(0, len(older) - (keep_last - 1))]  # a negative bound would count from the end
