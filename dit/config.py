"""One dataclass per face, filled from a YAML preset (``--config``) and then from command-line flags.

Flags are generated from the dataclass fields (``max_steps`` -> ``--max-steps``), so a preset key and its
flag can never drift apart, and faces that share a field share its flag name, help and checks. The help
text, choices and any aliases (the official scripts' spellings, such as ``--cfg-scale``) are the field's
metadata, written with ``option``. This module imports no torch: ``dit-cost`` answers in a fraction of a
second.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path

import yaml

from dit.errors import UserError
from dit.launcher import launcher_precision

_REQUIRED = dataclasses.MISSING


def option(default=_REQUIRED, help: str = "", choices=None, aliases: tuple[str, ...] = (), **metadata):
    """A dataclass field that becomes a flag: ``option(8, "images per step")``; no default = required."""
    meta = {"help": help, "choices": choices, "aliases": tuple(aliases), **metadata}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _unwrap(tp):
    """``float | None`` -> float; ``list[int] | None`` -> list[int]."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


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


def add_arguments(parser: argparse.ArgumentParser, cls, preset: dict | None = None) -> None:
    """One flag per field of ``cls``; ``preset`` values replace the dataclass defaults."""
    preset = preset or {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if f.metadata.get("positional"):
            many = typing.get_origin(_unwrap(hints[f.name])) is list
            kw = {"nargs": "*"} if many else {}
            parser.add_argument(f.name, choices=f.metadata.get("choices"), help=help_text, **kw)
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kw = {"dest": f.name, "help": help_text}
        if f.name in preset:
            kw["default"] = preset[f.name]
        elif f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = f.default_factory()
        else:
            kw["required"] = True
        tp = _unwrap(hints[f.name])
        if tp is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            continue
        if typing.get_origin(tp) is list:
            (tp,) = typing.get_args(tp)
            kw["nargs"] = "+"
        parser.add_argument(
            *flags, type=tp if tp in (int, float, str) else str, choices=f.metadata.get("choices"), **kw
        )


def _preset(argv: list[str] | None, cls) -> dict:
    """The ``--config FILE`` values, checked against ``cls``'s options."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    preset = load_preset(known.config) if known.config else {}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(preset) - names)
    if unknown:
        raise UserError(
            f"unknown option(s) {unknown} in {known.config}; valid options: {', '.join(sorted(names))}."
        )
    return preset


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their lines (a docstring's examples stay one per line), and a flag's default is
    shown once: not where the help already speaks of it, nor where there is none (None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _build(cls, ns: argparse.Namespace, explicit: frozenset[str] = frozenset()):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    cfg = cls(**{k: v for k, v in vars(ns).items() if k in names})
    object.__setattr__(cfg, "_explicit", frozenset(explicit) & names)
    return cfg


def explicit_options(cfg) -> frozenset[str]:
    """The fields of a parsed config that the user set (a flag or a ``--config`` key), not left at defaults."""
    return getattr(cfg, "_explicit", frozenset())


def _explicit(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations ``argv`` names, parsed again with every default suppressed."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_known_args(argv)[0]))
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]


def parse_config(cls, argv: list[str] | None, description: str = "", prog: str | None = None):
    """Build ``cls`` from defaults, then ``--config FILE`` values, then explicit flags."""
    preset = _preset(argv, cls)
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.add_argument("--config", help="YAML preset whose values replace the defaults; flags override it")
    add_arguments(parser, cls, preset)
    ns = parser.parse_args(argv)
    explicit = _explicit(parser, argv) | set(preset)
    _launcher_precision(ns, explicit)
    return _build(cls, ns, explicit)


def _launcher_precision(ns: argparse.Namespace, explicit: set[str]) -> None:
    """``accelerate launch --mixed_precision X`` sets the precision a run did not set itself, and is refused
    where the run set another one (so that no run trains in a precision nobody asked for)."""
    launcher = launcher_precision() if hasattr(ns, "precision") else None
    if launcher is None or ns.precision == launcher:
        return
    if "precision" in explicit:
        raise UserError(
            f"accelerate launch asks for {launcher} (--mixed_precision) and this run for --precision {ns.precision}: "
            "drop one of them (--precision alone decides under torchrun)."
        )
    ns.precision = launcher
    explicit.add("precision")


def parse_command(commands: dict[str, tuple[type, str]], argv: list[str] | None, prog: str, description: str = ""):
    """``prog COMMAND --flags``: (command name, its dataclass) for ``commands`` = {name: (class, help)}."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        add_arguments(p, cls)
    ns = parser.parse_args(argv)
    return ns.command, _build(commands[ns.command][0], ns)


def to_dict(cfg) -> dict:
    """The config as a plain dict: what checkpoints and metrics store."""
    return dataclasses.asdict(cfg)


def check_positive(cfg, *names: str) -> None:
    """Each named field, where set, must be > 0: one line naming the flag otherwise."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}.")


def check_writable_file(path: str, flag: str) -> None:
    """Before the expensive work: ``path`` must name a file (not a folder) in a folder we can create or write."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {path} is a folder: pass a file name, e.g. {target / 'out.png'}.")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: {parent} is not a writable folder; pass a path you can write.")
