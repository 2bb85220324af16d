"""The files a user names (presets, calibrations, class names, configs, ``.npz`` features), read as one line per
problem naming the file and the fix, and the paths a face will write, checked before any work. Torch-free."""

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
    """``folder / name`` for a ``name`` read from ``source``, refused unless it stays inside ``folder``."""
    root, where = Path(folder).resolve(), ""
    if isinstance(name, str) and name and not (one_name and (os.sep in name or name in (".", ".."))):
        path = (root / name).resolve()
        if path != root and path.is_relative_to(root):
            return Path(folder) / name
        where = f" (to {path})"
    raise UserError(
        f"{source}: {entry} {name!r} is not a name inside {folder}{where}; nothing was touched: {fix}."
    )


def read_matrices(
    path: str | os.PathLike, what: str, fix: str, widths: Mapping[str, int], rows: int | None = None
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` named in ``widths``, each a finite float matrix of that width, no pickle."""
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


def check_output(path: str, kind: str, flag: str) -> None:
    """Before the work: ``path`` (a "file" or "folder") can be written here, or one line naming the flag."""
    target = Path(path)
    try:
        name_max = os.pathconf(_existing_ancestor(target), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    long = next((part for part in target.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise UserError(
            f"{flag} {path}: the name {long[:24]}... is {len(os.fsencode(long))} bytes, longer than the file "
            f"system takes ({name_max}): pass a shorter name."
        )
    if kind == "file" and os.path.isdir(target):
        raise UserError(f"{flag} {path} is a folder: pass a file name, e.g. {target / 'out.png'}.")
    if kind == "folder" and os.path.exists(target) and not os.path.isdir(target):
        raise UserError(f"{flag} {path} is a file: pass a folder.")
    folder = _existing_ancestor(target if kind == "folder" else target.parent)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {folder} is not a writable folder; pass a path you can write.")


def check_apart(output: str, output_flag: str, source: str, source_flag: str, kind: str) -> None:
    """Before any work: ``output`` is not the input ``source``, nor inside it where it is read whole."""
    if not os.path.exists(source):
        return
    out, src = Path(output).resolve(), Path(source).resolve()
    if out == src:
        raise UserError(
            f"{output_flag} {output} is {source_flag} {source}, which this command reads: pass another {output_flag}."
        )
    if kind == "folder" and src in out.parents:
        raise UserError(
            f"{output_flag} {output} is inside {source_flag} {source}, a folder read whole: what is written there "
            f"would be read as part of it (an image folder's extra class); pass a {output_flag} outside {source}."
        )


def check_paths(outputs: Mapping[str, str], inputs: Mapping[str, str], paths: Mapping, spell) -> None:
    """Before any work: each of a face's ``outputs`` can be written and lies apart from each of its ``inputs``
    (option -> ``"file"`` or ``"folder"``); ``paths``: each option's value, ``spell``: how an error names it."""
    for name, kind in outputs.items():
        if isinstance(paths[name], str):
            check_output(paths[name], kind, spell(name))
    for out in outputs:
        for name, kind in inputs.items():
            for source in paths[name] if isinstance(paths[name], (tuple, list)) else (paths[name],):
                if isinstance(paths[out], str) and isinstance(source, str):
                    check_apart(paths[out], spell(out), source, spell(name), kind)


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest folder above that exists (``.`` for a relative path none of which exists)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path
