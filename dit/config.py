"""One dataclass per face, filled from a YAML preset (``--config``) and then from command-line flags.

Flags are generated from the dataclass fields (``max_steps`` -> ``--max-steps``), so a preset key and its
flag can never drift apart; the help text is the field's ``metadata["help"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path

import yaml

from dit.errors import UserError


def _scalar_type(tp):
    """The parser for a field annotated ``int``, ``float | None``, ``str``, ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    return tp if tp in (int, float, str) else str


def load_preset(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"config file {path} does not exist: pass a YAML preset such as configs/DiT-XL-2-256.yaml."
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option names to values.")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_config(cls, argv: list[str] | None, description: str = ""):
    """Build ``cls`` from defaults, then ``--config FILE`` values, then explicit flags."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    preset = load_preset(known.config) if known.config else {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(preset) - set(fields))
    if unknown:
        raise UserError(
            f"unknown option(s) {unknown} in {known.config}; valid options: {', '.join(sorted(fields))}."
        )

    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", help="YAML preset whose values replace the defaults; flags override it")
    for name, f in fields.items():
        default = preset.get(name, f.default if f.default is not dataclasses.MISSING else None)
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if hints[name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(
                flag, type=_scalar_type(hints[name]), default=default, choices=choices, help=help_text
            )
    ns = parser.parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if k in fields}
    return cls(**values)


def to_dict(cfg) -> dict:
    """The config as a plain dict: what checkpoints and metrics store."""
    return dataclasses.asdict(cfg)
