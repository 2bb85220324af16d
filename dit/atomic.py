"""Atomic file writes: every file that a crash must not corrupt (checkpoints, shards, manifests, samples,
calibrations, exported configs) is written here, so there is one implementation of the rule."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """``write(file)`` into ``NAME.tmp-*`` beside ``path``, fsync, rename over ``path``, fsync the folder.

    A crash at any point leaves the old file or the whole new one under ``path``, never a partial one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself durable
    finally:
        os.close(folder)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))
