"""Configuration in sections: small frozen dataclasses, each owned by the component that reads it.

A section checks itself once, when it is built: every field's type (an int is not 2.5, a switch is not
"maybe"), finite numbers, ranges and choices from the field's ``option``, then its own ``check`` for
combinations. A ``Face`` (one command line) composes the sections it needs; flags are generated from the
fields (``max_steps`` -> ``--max-steps``), so a YAML key, its flag and its check can never drift apart, and
two faces that share a section share its flags, defaults and checks. Values come from the field defaults,
then a record (a resumed run's own settings), then a ``--config`` YAML preset, then the flags. A check
names fields as ``{field}``; the face spells them as the user wrote them (``--lr``, or the preset's key).
This module imports no torch: ``dit-cost`` answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import operator
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from dit.io.errors import UserError
from dit.io.launcher import launcher_precision
from dit.io.userfiles import read_text

_REQUIRED = dataclasses.MISSING


def option(
    default=_REQUIRED,
    help: str | Callable[[], str] = "",
    *,
    choices=None,
    aliases: tuple[str, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    positional: bool = False,
):
    """A section field that becomes a flag: ``option(8, "images per step", ge=1)``; no default = required.

    ``help`` may be a function, called when the parser is made (a list read from a registry at that time);
    ``choices`` and the bounds are checked when the section is built (for every element of a tuple field);
    ``aliases`` are other spellings of the flag (the official scripts', such as ``--cfg-scale``)."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "aliases": tuple(aliases),
            "ge": ge, "gt": gt, "le": le, "lt": lt, "positional": positional}  # fmt: skip
    if isinstance(default, (list, tuple)):
        default = tuple(default)
    return dataclasses.field(default=default, metadata=meta)


class FieldError(UserError):
    """A value that fails its section's check. ``message`` names fields as ``{name}``: a face shows them as its
    flags or preset keys (``spelled``), library callers see the field names (``str``)."""

    def __init__(self, message: str):
        self.template = message
        super().__init__(self.spelled(lambda name: name))

    def spelled(self, spell: Callable[[str], str]) -> str:
        return self.template.format_map(_Spelling(spell))


class _Spelling(dict):
    def __init__(self, spell):
        super().__init__()
        self.spell = spell

    def __missing__(self, key: str) -> str:
        return self.spell(key)


@functools.cache
def _hints(cls: type) -> dict:
    """A section's field types, resolved once per class (resolving them is most of the time a parse takes)."""
    return typing.get_type_hints(cls)


def _unwrap(tp):
    """``float | None`` -> (float, True); ``tuple[int, ...]`` -> (tuple[int, ...], False)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), type(
            None
        ) in typing.get_args(tp)
    return tp, False


def number_or_word(tp) -> bool:
    """``float | str``: a number, or one of the field's ``choices`` (``--time-shift 3`` or ``auto``)."""
    return set(typing.get_args(tp)) == {float, str}


def _checked(name: str, tp, value, meta: Mapping):
    """``value`` as field ``name`` of type ``tp`` holds it, or a FieldError."""
    tp, nullable = _unwrap(tp)
    if value is None:
        if nullable:
            return None
        raise FieldError(f"{{{name}}} must be set, got nothing.")
    if number_or_word(tp):
        words = meta.get("choices") or ()
        if isinstance(value, str) and value in words:
            return value
        try:
            return _checked(name, float, value, {**meta, "choices": None})
        except FieldError:
            raise FieldError(
                f"{{{name}}} must be a finite number{_bounds(meta)} or {' or '.join(words)}, got {value!r}."
            ) from None
    if typing.get_origin(tp) is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = (value,)
        (element,) = typing.get_args(tp)[:1]
        return tuple(_checked(name, element, v, meta) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(f"{{{name}}} must be true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(f"{{{name}}} must be an integer, got {value!r}.")
    elif tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(f"{{{name}}} must be a number, got {value!r}.")
        value = float(value)
        if not math.isfinite(value):
            raise FieldError(f"{{{name}}} must be a finite number, got {value}.")
    elif tp is str:
        if not isinstance(value, str):
            raise FieldError(f"{{{name}}} must be a string, got {value!r}.")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise FieldError(f"{{{name}}} must be one of {', '.join(map(str, choices))}, got {value!r}.")
    for key, ok, words in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                           ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):  # fmt: skip
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            raise FieldError(f"{{{name}}} must be {words} {bound:g}, got {value}.")
    return value


def _bounds(meta: Mapping) -> str:
    """A field's bounds in words (" > 0"), for a message that names them all at once."""
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return "".join(f" {w} {meta[k]:g}" for k, w in words.items() if meta.get(k) is not None)


@dataclass(frozen=True)
class Section:
    """The base of every configuration section: type, range and choice checks of each field when built,
    then ``check`` (the section's combinations). Values are normalised once (an int given for a float
    field becomes a float, a list a tuple) and never change after."""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(f.name, hints[f.name], getattr(self, f.name), f.metadata))
        for cls in reversed(type(self).__mro__):  # every section a class is made of checks its part, once
            if "check" in cls.__dict__:
                cls.__dict__["check"](self)

    def check(self) -> None:
        """Combinations of fields; raise ``FieldError`` naming them as ``{field}``. A section composed of
        others (dit-cost's commands) runs each of their checks: no ``super().check()`` needed."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def flatten_record(saved: Mapping) -> dict:
    """A run's record as flat options, whichever layout: nested by section (``{"model": {"image_size":
    256}, ...}``, the keys already flat names) or flat (checkpoints written before the sections)."""
    flat = {}
    for key, value in (saved or {}).items():
        if isinstance(value, Mapping):
            flat.update(value)
        else:
            flat[key] = value
    return flat


# --------------------------------------------------------------------------------------------------------
# Faces: sections -> flags, YAML presets and records -> sections
# --------------------------------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their lines (a docstring's examples stay one per line), and a flag's default is
    shown once: not where the help already speaks of it, nor where there is none (None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, tuple):
            return f"{text} (default: {' '.join(map(str, action.default))})"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a UserError (one ``error:`` line from the face), not its usage dump."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help).")


@dataclass(frozen=True)
class Parsed:
    """A face's sections, built; ``explicit``: the flat names set by a flag, the preset or the launcher."""

    sections: dict
    explicit: frozenset[str]
    command: str | None = None


class Face:
    """One command line: ``sections`` maps an attribute name to a Section class, or to (class, prefix) for a
    section embedded under a prefix (train.py's ``eval_`` sampling flags). ``commands``: subcommands.
    ``outputs``: the options naming what it writes (``{"out": "file"}``), checked before any work starts;
    ``inputs``: the options naming what it reads, ``"folder"`` for a folder read whole (an image folder, a
    latent store: nothing may be written inside it) or ``"file"`` for a path read by name (a checkpoint, a
    model folder: it must not be written over). See ``check_apart``."""

    def __init__(self, prog: str, description: str = "", sections: dict | None = None,
                 commands: dict[str, Face] | None = None, renamed: dict[str, str] | None = None,
                 outputs: Mapping[str, str] | None = None, inputs: Mapping[str, str] | None = None):  # fmt: skip
        self.prog, self.description, self.commands = prog, description, commands or {}
        self.renamed = renamed or {}  # old record/preset keys -> flat names (records written before a rename)
        self.outputs = dict(outputs or {})  # flat name -> "file" or "folder": what this command writes there
        self.inputs = dict(inputs or {})  # flat name -> "folder" (read whole) or "file" (read by name)
        self.sections = {k: v if isinstance(v, tuple) else (v, "") for k, v in (sections or {}).items()}
        self.fields: dict[str, tuple[str, dataclasses.Field]] = {}  # flat name -> (section, field)
        for attr, (cls, prefix) in self.sections.items():
            for f in dataclasses.fields(cls):
                flat = prefix + f.name
                if flat in self.fields:
                    raise TypeError(f"{prog}: {flat} is in sections {self.fields[flat][0]} and {attr}")
                self.fields[flat] = (attr, f)
        for kind, names in (("outputs", self.outputs), ("inputs", self.inputs)):
            if set(names) - set(self.fields) or set(names.values()) - {"file", "folder"}:
                raise TypeError(f"{prog}: {kind} {names} must map its options to 'file' or 'folder'")

    # ---- flags ----------------------------------------------------------------------------------------

    def flag(self, flat: str) -> str:
        return "--" + flat.replace("_", "-")

    def spelled(self, flat: str) -> str:
        """A flag as an error names it: with its first alias, the official spelling users may have typed."""
        if flat not in self.fields:
            return flat
        attr, f = self.fields[flat]
        prefix = self.sections[attr][1].replace("_", "-")
        aliases = [a.replace("--", "--" + prefix, 1) for a in f.metadata["aliases"]]
        return f"{self.flag(flat)} ({aliases[0]})" if aliases else self.flag(flat)

    def of(self, **flat) -> dict:
        """The sections from flat options (``max_steps=10``), for library callers; an unknown name is a
        TypeError, a bad value one line naming its flag."""
        unknown = sorted(set(flat) - set(self.fields))
        if unknown:
            raise TypeError(f"{self.prog}: unknown options {', '.join(unknown)}")
        return self.build(flat)

    def parser(self) -> argparse.ArgumentParser:
        parser = Parser(prog=self.prog, description=self.description, formatter_class=HelpFormatter)
        if self.commands:
            sub = parser.add_subparsers(dest="command", required=True)
            for name, face in self.commands.items():
                p = sub.add_parser(name, help=face.description, description=face.description,
                                   formatter_class=HelpFormatter)  # fmt: skip
                face._add_arguments(p)
            return parser
        parser.add_argument("--config", help="YAML preset whose values replace the defaults; flags override it")
        self._add_arguments(parser)
        return parser

    def _add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for flat, (attr, f) in self.fields.items():
            cls, prefix = self.sections[attr]
            hint, _ = _unwrap(_hints(cls)[f.name])
            meta = f.metadata
            help_text = meta.get("help", "")
            help_text = (help_text() if callable(help_text) else help_text).replace("%", "%%")  # argparse: %
            default = f.default
            if meta.get("positional"):
                many = typing.get_origin(hint) is tuple
                optional = {"nargs": "?", "default": default} if default is not _REQUIRED else {}
                kw = {"nargs": "*", "default": default} if many else optional
                parser.add_argument(flat, choices=meta.get("choices") if not many else None, help=help_text, **kw)
                continue
            flags = [
                self.flag(flat),
                *(a.replace("--", "--" + prefix.replace("_", "-"), 1) for a in meta["aliases"]),
            ]
            kw = {"dest": flat, "help": help_text}
            if default is _REQUIRED:
                kw["required"] = True
            else:
                kw["default"] = default
            if hint is bool:
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
                continue
            if typing.get_origin(hint) is tuple:
                hint, kw["nargs"] = typing.get_args(hint)[0], "+"
            choices = (
                None if number_or_word(hint) else meta.get("choices")
            )  # a number is no choice: checked by the section
            parser.add_argument(*flags, type=hint if hint in (int, float, str) else str, metavar=flat.upper(),
                                choices=choices, **kw)  # fmt: skip

    def record(self, sections: Mapping) -> dict:
        """The sections as plain data, nested by section with flat option names (what config.yaml and every
        checkpoint keep; tuples as lists, for YAML and JSON)."""
        return {
            attr: {prefix + f.name: _plain(getattr(sections[attr], f.name)) for f in dataclasses.fields(cls)}
            for attr, (cls, prefix) in self.sections.items()
        }

    # ---- parsing --------------------------------------------------------------------------------------

    def parse(self, argv: list[str] | None = None, record: Mapping | None = None) -> Parsed:
        """Build the sections from the defaults, then ``record`` (flat or nested by section), then the
        ``--config`` preset, then ``argv``; a check that fails names the flag or preset key at fault."""
        argv = list(argv) if argv is not None else None
        if self.commands:
            argv = sys.argv[1:] if argv is None else argv
            if not argv or argv[0] not in self.commands:
                self.parser().parse_args(argv)  # --help, or the error naming the commands
            return dataclasses.replace(self.commands[argv[0]].parse(argv[1:]), command=argv[0])
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, _ = pre.parse_known_args(argv)
        preset = self.flatten(load_preset(known.config), str(known.config)) if known.config else {}
        base = {**(self.flatten(record, "the run's record", strict=False) if record else {}), **preset}
        parser = self.parser()
        given = vars(parser.parse_args(argv))
        flags = _given(parser, argv)
        # The flags given win; then the preset and the record; then the fields' defaults (argparse's defaults
        # are the fields', so that a preset's string is checked by its section, not converted by argparse).
        ns = {k: given[k] if k in flags or k not in base else base[k] for k in self.fields}
        explicit = flags | set(preset)
        launcher = launcher_precision() if "precision" in self.fields else None
        if launcher is not None and ns["precision"] != launcher:
            if "precision" in explicit:
                raise UserError(
                    f"accelerate launch asks for {launcher} (--mixed_precision) and this run for --precision "
                    f"{ns['precision']}: drop one of them (--precision alone decides under torchrun)."
                )
            ns["precision"] = launcher
            explicit.add("precision")

        def spell(flat: str) -> str:
            if flat in preset and flat not in flags:
                return f"{known.config}: {flat}"
            return self.spelled(flat)

        return Parsed(self.build(ns, spell), frozenset(explicit))

    def build(self, values: Mapping, spell: Callable[[str], str] | None = None) -> dict:
        """The sections from flat ``values`` (missing fields: their defaults); errors spelled by ``spell``."""
        spell = spell or self.spelled
        for flat, kind in self.outputs.items():  # first: a section's own check may stat the path
            path = values.get(flat, self.fields[flat][1].default)
            if isinstance(path, str):
                check_output(path, kind, spell(flat))
        given = {flat: values.get(flat, self.fields[flat][1].default) for flat in (*self.outputs, *self.inputs)}
        for out_flat in self.outputs:
            for in_flat, kind in self.inputs.items():
                sources = given[in_flat] if isinstance(given[in_flat], (tuple, list)) else (given[in_flat],)
                for source in sources:
                    if isinstance(given[out_flat], str) and isinstance(source, str):
                        check_apart(given[out_flat], spell(out_flat), source, spell(in_flat), kind)
        out = {}
        for attr, (cls, prefix) in self.sections.items():
            kw = {f.name: values[prefix + f.name] for f in dataclasses.fields(cls) if prefix + f.name in values}
            try:
                out[attr] = cls(**kw)
            except FieldError as e:
                raise UserError(e.spelled(lambda name, p=prefix: spell(p + name))) from None
        return out

    def flatten(self, data: Mapping | None, source: str, strict: bool = True) -> dict:
        """Flat names from a preset or a record: ``key: value`` or ``section: {key: value}`` (the layout
        config.yaml is written in); an unknown key is an error in a preset and ignored in a record."""
        flat = {}
        for key, value in (data or {}).items():
            key = str(key).replace("-", "_")
            if key in self.sections and isinstance(value, Mapping):
                prefix = self.sections[key][1]
                for k, v in value.items():
                    k = str(k).replace("-", "_")
                    flat[k if k.startswith(prefix) else prefix + k] = v
            else:
                flat[key] = value
        flat = {self.renamed.get(k, k): v for k, v in flat.items()}
        unknown = sorted(set(flat) - set(self.fields))
        if unknown and strict:
            raise UserError(
                f"unknown option(s) {', '.join(unknown)} in {source}; valid options: {', '.join(sorted(self.fields))}."
            )
        return {k: v for k, v in flat.items() if k in self.fields}


def _given(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations ``argv`` names: parsed again with every default suppressed."""
    saved = {a.dest: a.default for a in parser._actions}
    required = {a.dest: a.required for a in parser._actions}
    try:
        for a in parser._actions:
            a.default, a.required = argparse.SUPPRESS, False
        return set(vars(parser.parse_known_args(argv)[0])) - {"config", "help"}
    finally:
        for a in parser._actions:
            a.default, a.required = saved[a.dest], required[a.dest]


def load_preset(path: str | Path) -> dict:
    text = read_text(path, "config file", "pass a YAML preset such as configs/DiT-XL-2-256.yaml")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:  # its own text spans lines (the offending one, a caret under it)
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise UserError(
            f"config file {path} is not valid YAML ({problem}{where}): fix it or pass another preset."
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option names to values.")
    return data


def check_output(path: str, kind: str, flag: str) -> None:
    """Before the expensive work: ``path`` (a ``"file"`` or a ``"folder"``) can be created or written here.

    A name longer than the file system takes, a folder given for a file (or a file for a folder), and a
    parent that cannot be written (no permission, a read-only file system) are one line naming the flag,
    not an OSError once the work is done."""
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
    """Before any work: ``output`` is not the input ``source``, nor inside it where it is a folder read whole.

    A latent store or a run folder written inside the image folder became an extra class on the next scan
    (and then refused the resume of the extraction that wrote it); an output file equal to an input file
    writes over what is being read. Both paths are compared with their links resolved. The other way round
    is allowed: an input inside an output folder (the images kept under a results folder) is never touched,
    since a command writes only its own names there and deletes only files it wrote (its temporary files,
    checkpoints past ``--keep-last``). A ``source`` that does not exist is not a path here (a hub id, the
    name ``ema``) or is missing, which its reader reports."""
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


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest folder above that exists (``.`` for a relative path none of which exists)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path
