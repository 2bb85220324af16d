"""The small files a user names (presets, calibrations, class names, a VAE's config.json), read at one point:
a missing one, a folder, a binary file (a PNG given as YAML) or malformed JSON is one line naming the file and
the fix, never a UnicodeDecodeError or an IsADirectoryError from deep inside. Torch-free, as dit.io.config is."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
