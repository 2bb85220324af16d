"""DCP's pickled ``.metadata`` read safely: each (module, name) looked up in an exact table, nothing imported, and
any entry but the tensors we write refused, before DCP reads the shards (docs/reliability.md, Security)."""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path

import torch

from dit.io.errors import UserError

_DCP = "torch.distributed.checkpoint"
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")  # the only files DCP's writer names in storage_data


def _allowed() -> dict[tuple[str, str], object]:
    """(module, name) -> object for every global DCP's ``.metadata`` pickles; paths come back pure."""
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], object] = {
        (f"{_DCP}.metadata", cls.__name__): cls
        for cls in (
            metadata.Metadata,
            metadata.TensorStorageMetadata,
            metadata.BytesStorageMetadata,  # read, so that ``_check`` names the entry it refuses
            metadata.ChunkStorageMetadata,
            metadata.TensorProperties,
            metadata._MEM_FORMAT_ENCODING,
            metadata.MetadataIndex,
            metadata.StorageMeta,
        )
    }
    table[(f"{_DCP}.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table.update({("torch", name): getattr(torch, name) for name in _DTYPES})
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 pickles paths under pathlib._local
        table[(module, "PosixPath")] = pathlib.PurePosixPath
        table[(module, "WindowsPath")] = pathlib.PureWindowsPath
    return table


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.table = _allowed()

    def find_class(self, module: str, name: str):
        found = self.table.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")
        return found


def read(path: Path, roots: tuple[str, ...]) -> object:
    """``path``'s DCP metadata once it holds only our untransformed tensor entries; else the one-line error."""
    folder = path.parent
    try:
        metadata = _Unpickler(path.read_bytes()).load()
        _check(metadata, folder, roots)
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{folder} is not a checkpoint folder dit-ledger wrote ({path.name}: {why}); nothing in it was "
            "loaded. Load only folders your own runs wrote; to share weights, send the one file that "
            "`python -m dit.checkpoint export` writes (read with weights_only), with its .sha256."
        ) from None
    return metadata


def _check(metadata, folder: Path, roots: tuple[str, ...]) -> None:
    """Raise ValueError unless ``metadata`` describes what ``dit.checkpoint.sharded.write`` writes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    entries, paths = metadata.state_dict_metadata, metadata.planner_data
    if not isinstance(entries, dict) or not isinstance(paths, dict) or paths.keys() != entries.keys():
        raise ValueError("its entries and their paths do not match")
    for key, entry in entries.items():
        path = paths[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"entry {key!r} is a {type(entry).__name__}, not a tensor")
        ours = isinstance(path, tuple) and path and all(isinstance(p, str) for p in path) and ".".join(path) == key
        if not ours or not (path[0] in roots or path[:2] == ("optimizer", "state")):
            raise ValueError(f"entry {key!r} is none of the model, EMA, projector or optimizer state")
    shards = {p.name for p in folder.iterdir() if _SHARD.match(p.name)}
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError("it does not say where its tensors are stored")
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and index.fqn in entries and isinstance(info, _StorageInfo)):
            raise ValueError(f"it stores {index!r}, which is no entry of it")
        if info.relative_path not in shards or getattr(info, "transform_descriptors", None):
            raise ValueError(
                f"{index.fqn!r} is stored in {info.relative_path!r}, not in a shard file of the folder"
            )
