"""Sharded checkpoints (FSDP): every rank writes its shards of a step's folder with DCP, then ``record.pt`` and
``manifest.json`` (sha256s, last), and the folder is renamed into place once every rank is done."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

import dit.checkpoint.dcp_metadata as dcp_metadata
from dit import __version__
from dit.data.store import sha256_file
from dit.io.atomic import TEMP_MARK, atomic_write, atomic_write_bytes
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format
from dit.io.userfiles import inside

FOLDER_FORMAT = "dit-ledger-dcp/1"
MANIFEST, RECORD = "manifest.json", "record.pt"
# with the optimizer's per-parameter state: the sharded part (a post-hoc EMA snapshot holds the profiles alone)
TENSORS = ("model", "ema", "repa_projector", "ema_profiles")
_VERIFIED: dict[tuple, bool] = {}


def temp_folder(final: Path) -> Path:
    """The one name every rank writes a step into, agreed without a message."""
    return final.with_name(f"{final.name}{TEMP_MARK}dcp")


def split(payload: dict) -> tuple[dict, dict]:
    """(the tensors DCP shards, the record rank 0 writes): the optimizer's state goes with the tensors."""
    tensors = {k: payload[k] for k in TENSORS if k in payload}
    record = {k: v for k, v in payload.items() if k not in tensors}
    if "optimizer" in payload:
        tensors["optimizer"] = {"state": payload["optimizer"]["state"]}
        record["optimizer"] = {"param_groups": payload["optimizer"]["param_groups"]}
    return tensors, record


def merge(record: dict, tensors: dict) -> dict:
    if "optimizer" not in record:
        return {**record, **tensors}
    return {**record, **tensors, "optimizer": {**record["optimizer"], **tensors.get("optimizer", {})}}


def write(folder: Path, tensors: dict, group=None, background: bool = False):
    """Every rank's shards of ``tensors`` into ``folder`` (collective); in the background a future to wait on."""
    import torch.distributed.checkpoint as dcp

    if background:
        return dcp.async_save(tensors, storage_writer=_writer(folder), process_group=group)
    dcp.save(tensors, storage_writer=_writer(folder))
    return None


class _KeepsError:
    """A file whose refused write (an ``OSError``) is kept on ``owner.error`` as it passes."""

    def __init__(self, f, owner):
        self._f, self._owner = f, owner

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self._owner.error = e
            raise

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _writer(folder: Path):
    """DCP's file writer, whose failure is a refused write's OS error, not torch's ``unexpected pos``."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Keeping(FileSystem):
        error: OSError | None = None

        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _KeepsError(stream, self)

    class Writer(FileSystemWriter):
        def __init__(self, path):
            super().__init__(path)
            self.fs = Keeping()

        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except RuntimeError:
                if self.fs.error is None:
                    raise
                raise self.fs.error from None

    return Writer(folder)


def own_digests(folder: Path, rank: int) -> dict[str, str]:
    """The sha256 of the shard files this rank wrote (``__RANK_I.distcp``), hashed in parallel by every rank."""
    return {p.name: sha256_file(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}


def seal(folder: Path, final: Path, step: int, record: dict, digests: dict[str, str]) -> Path:
    """Rank 0, once every rank wrote and hashed its shards: the record, the manifest last, then the rename."""
    atomic_write(folder / RECORD, lambda f: torch.save(record, f))
    files = {p.name: digests.get(p.name) or sha256_file(p) for p in sorted(folder.iterdir())}
    manifest = {"format": FOLDER_FORMAT, WRITER_KEY: __version__, "step": step, "files": files}
    atomic_write_bytes(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    if final.exists():  # a step saved again (a stop right after a resume): the new one is the same state
        shutil.rmtree(final)
    os.replace(folder, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself durable
    finally:
        os.close(fd)
    return final


def verify(folder: Path) -> bool:
    """Whether every file the manifest lists still has its saved content; a newer format is refused."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    refuse_newer_format(folder, "checkpoint", manifest.get("format"), FOLDER_FORMAT, manifest.get(WRITER_KEY))
    files = manifest.get("files")
    for name in files if isinstance(files, dict) else ():  # a name out of the folder: refused before any hashing
        inside(folder, name, folder / MANIFEST, "file", "a checkpoint folder lists its own files; re-save it")
    try:
        key = (os.path.abspath(folder), *((n, *_stamp(folder / n)) for n in sorted(files)))
        if key not in _VERIFIED:  # a resume reads the record, then the state: the folder is hashed once
            _VERIFIED[key] = all(sha256_file(folder / name) == digest for name, digest in files.items())
        return _VERIFIED[key]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def read_record(folder: Path) -> dict:
    record = torch.load(folder / RECORD, map_location="cpu", weights_only=True)
    if not isinstance(record, dict):
        raise UserError(f"{folder / RECORD} holds a {type(record).__name__}, not a checkpoint record.")
    return record


def read(folder: Path) -> dict:
    """The folder as one process's whole payload: DCP joins the shards, with no process group."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    tensors: dict = {}
    _load_state_dict(tensors, _reader(folder), no_dist=True, planner=_EmptyStateDictLoadPlanner())
    return merge(read_record(folder), tensors)


def read_into(folder: Path, tensors: dict) -> None:
    """DCP's shards into ``tensors`` in place, resharded to this run's shards (collective on every rank)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(tensors, storage_reader=_reader(folder))


def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    dcp_metadata.read(folder / ".metadata", TENSORS)  # refused here, before DCP (which wraps every error)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self._get_metadata_path(kwargs.get("rank")))  # a rank's own, or the one
            metadata = dcp_metadata.read(path, TENSORS)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)
