"""The small files a user names (presets, calibrations, class names, a VAE's config.json), read at one point:
a missing one, a folder, a binary file (a PNG given as YAML) or malformed JSON is one line naming the file and
the fix, never a UnicodeDecodeError or an IsADirectoryError from deep inside; and the named float arrays of an
``.npz`` another face wrote (kept features), checked on reading. Torch-free, as dit.io.config is."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dit.io.errors import UserError


def read_text(path: str | os.PathLike, what: str, fix: str) -> str:
    """The text of ``path``, described as ``what`` ("config file"), or a UserError ending with ``fix``."""
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder, not a file: {fix}.")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist: {fix}.") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}. {fix[0].upper() + fix[1:]}.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} {path} is not a text file (byte {data[e.start]:#04x} at offset {e.start}): {fix}."
        ) from None


def read_json(path: str | os.PathLike, what: str, fix: str):
    """``path`` parsed as JSON, or one line saying where it stops being JSON (an empty or truncated file)."""
    text = read_text(path, what, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path} is not valid JSON ({e}): {fix}.") from None


def inside(
    folder: str | os.PathLike, name, source: str | os.PathLike, entry: str, fix: str, one_name: bool = False
) -> Path:
    """``folder / name``, where ``name`` comes out of the file ``source`` (a manifest's shard, a record's parent,
    a branch name): refused unless it stays inside ``folder`` once links are resolved, so that a file edited or
    planted with ``../other``, an absolute path or a link out of the folder never has anything outside read,
    moved or deleted. ``one_name``: ``name`` must be a single name in ``folder`` (a branch's folder), not a path.
    The one check every reader of paths from files calls; its error names the file, the entry and the folder."""
    root = Path(folder).resolve()
    if isinstance(name, str) and name and not (one_name and (os.sep in name or name in (".", ".."))):
        path = (root / name).resolve()
        if path != root and path.is_relative_to(root):
            return Path(folder) / name
        where = f" (to {path})"
    else:
        where = ""
    raise UserError(
        f"{source}: {entry} {name!r} is not a name inside {folder}{where}; nothing was touched: {fix}."
    )


def read_matrices(
    path: str | os.PathLike, what: str, fix: str, widths: Mapping[str, int], rows: int | None = None
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` named in ``widths``, each a finite float matrix of that many columns (and of
    ``rows`` rows, when given), read without pickle. A missing, truncated or foreign file (an ``.npy``, object
    arrays, another width, a NaN) is one line naming the file and the fix."""
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder, not a file: {fix}.")
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist: {fix}.")
    if not zipfile.is_zipfile(path):
        raise UserError(f"{what} {path} is not an .npz archive (another format, or cut short): {fix}.")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in widths if k not in f.files]
            if missing:
                held = ", ".join(sorted(f.files)) or "nothing"
                raise UserError(f"{what} {path} has no {', '.join(missing)} (it holds {held}): {fix}.")
            arrays = {k: f[k] for k in widths}
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise UserError(f"{what} {path} is damaged or holds more than arrays ({e}): {fix}.") from None
    for key, a in arrays.items():
        shape = f"{rows if rows is not None else 'N'} x {widths[key]}"
        if not np.issubdtype(a.dtype, np.floating):
            problem = f"is {a.dtype}, not floating point"
        elif a.ndim != 2 or a.shape[1] != widths[key] or rows not in (None, a.shape[0]):
            problem = f"is {' x '.join(map(str, a.shape))}, not {shape}"
        elif not np.isfinite(a).all():
            problem = f"holds {np.count_nonzero(~np.isfinite(a)):,} non-finite values"
        else:
            continue
        raise UserError(f"{what} {path}: {key} {problem}: {fix}.")
    return arrays
