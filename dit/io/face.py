"""A face: one command line made from the sections it takes (``dit.io.config``).

Flags are generated from the fields (``max_steps`` -> ``--max-steps``), so a YAML key, its flag and its check
never drift apart, and two faces that share a section share its flags, defaults and checks. Values come from
the field defaults, then a record (a resumed run's own settings), then a ``--config`` YAML preset, then the
flags; an error names the field as the user wrote it (``--lr``, or the preset's key).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from dit.io.config import _REQUIRED, FieldError, Section, _hints, _unwrap, number_or_word
from dit.io.errors import UserError
from dit.io.userfiles import check_paths, read_text


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
    """A face's sections, built; ``command``: the subcommand that built them."""

    sections: dict
    command: str | None = None


@dataclass(frozen=True)
class Values:
    """A face's flat values before any section is built: the defaults, then a record, then the ``--config``
    preset (from ``config``), then the flags; ``given``: the flat names the flags set."""

    values: dict
    given: frozenset[str]
    preset: dict
    config: str | None = None

    def under(self, layer: Mapping) -> Values:
        """These values over ``layer`` (flat names): it sets what no flag or preset set (a run's record)."""
        asked = self.given | set(self.preset)
        taken = {k: v for k, v in layer.items() if k in self.values and k not in asked}
        return dataclasses.replace(self, values={**self.values, **taken})


class Face:
    """One command line: ``sections`` maps an attribute name to a Section class, or to (class, prefix) for a
    section embedded under a prefix (train.py's ``eval_`` sampling flags). ``commands``: subcommands.
    ``outputs``: the options naming what it writes (``{"out": "file"}``), checked before any work starts;
    ``inputs``: the options naming what it reads, ``"folder"`` for a folder read whole (an image folder, a
    latent store: nothing may be written inside it) or ``"file"`` for a path read by name (a checkpoint, a
    model folder: it must not be written over). See ``check_apart``."""

    def __init__(
        self,
        prog: str,
        description: str = "",
        sections: dict | None = None,
        commands: dict[str, Face] | None = None,
        renamed: dict[str, str] | None = None,
        outputs: Mapping[str, str] | None = None,
        inputs: Mapping[str, str] | None = None,
    ):
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

    def options(self, flat: str) -> list[str]:
        """A field's option strings: its flag, then its aliases under its section's prefix (``--eval-cfg-scale``)."""
        attr, f = self.fields[flat]
        prefix = "--" + self.sections[attr][1].replace("_", "-")
        return [self.flag(flat), *(a.replace("--", prefix, 1) for a in f.metadata["aliases"])]

    def spelled(self, flat: str) -> str:
        """A flag as an error names it: with its first alias, the official spelling users may have typed."""
        if flat not in self.fields:
            return flat
        flags = self.options(flat)
        return f"{flags[0]} ({flags[1]})" if len(flags) > 1 else flags[0]

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
                p = sub.add_parser(
                    name, help=face.description, description=face.description, formatter_class=HelpFormatter
                )
                face._add_arguments(p)
            return parser
        parser.add_argument("--config", help="YAML preset whose values replace the defaults; flags override it")
        self._add_arguments(parser)
        return parser

    def _add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for flat, (attr, f) in self.fields.items():
            hint, _ = _unwrap(_hints(self.sections[attr][0])[f.name])
            meta = f.metadata
            help_text = (meta["help"]() if callable(meta["help"]) else meta["help"]).replace("%", "%%")
            default = f.default
            if meta.get("positional"):
                many = typing.get_origin(hint) is tuple
                optional = {"nargs": "?", "default": default} if default is not _REQUIRED else {}
                kw = {"nargs": "*", "default": default} if many else optional
                parser.add_argument(flat, choices=meta.get("choices") if not many else None, help=help_text, **kw)
                continue
            flags = self.options(flat)
            kw = {"dest": flat, "help": help_text}
            kw.update({"required": True} if default is _REQUIRED else {"default": default})
            if hint is bool:
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
                continue
            if typing.get_origin(hint) is tuple:
                hint, kw["nargs"] = typing.get_args(hint)[0], "+"
            choices = None if number_or_word(hint) else meta.get("choices")  # number or word: the section checks
            parser.add_argument(
                *flags,
                type=hint if hint in (int, float, str) else str,
                metavar=flat.upper(),
                choices=choices,
                **kw,
            )

    def record(self, sections: Mapping) -> dict:
        """The sections as plain data, nested by section with flat option names (what config.yaml and every
        checkpoint keep; tuples as lists, for YAML and JSON)."""
        return {
            attr: {prefix + f.name: plain(getattr(sections[attr], f.name)) for f in dataclasses.fields(cls)}
            for attr, (cls, prefix) in self.sections.items()
        }

    # ---- parsing --------------------------------------------------------------------------------------

    def parse(self, argv: list[str] | None = None) -> Parsed:
        """The sections from the defaults, then the ``--config`` preset, then ``argv``; a check that fails names
        the flag or preset key at fault."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if self.commands:
            if not argv or argv[0] not in self.commands:
                self.parser().parse_args(argv)  # --help, or the error naming the commands
            return dataclasses.replace(self.commands[argv[0]].parse(argv[1:]), command=argv[0])
        v = self.values(argv)
        return Parsed(self.build(v.values, self.speller(v)))

    def values(self, argv: list[str] | None = None) -> Values:
        """The flat values ``parse`` builds: the flags given win; then the preset; then the fields' defaults
        (argparse's defaults are the fields', so that a preset's string is checked by its section, not
        converted by argparse)."""
        argv = list(sys.argv[1:] if argv is None else argv)
        parsed, given = vars(self.parser().parse_args(argv)), self.given(argv)
        config = parsed["config"]
        preset = self.flatten(load_preset(config), str(config)) if config else {}
        values = {k: parsed[k] if k in given or k not in preset else preset[k] for k in self.fields}
        return Values(values, frozenset(given), preset, config)

    def given(self, argv: list[str]) -> set[str]:
        """The flat names ``argv``'s options set, as argparse reads them: a flag, an alias, ``--no-x``, a unique
        abbreviation (``--max-st``), ``--flag=value``; nothing after ``--``. Positionals are not counted."""
        names: dict[str, str | None] = {"--config": None, "--help": None}  # argparse's own, for abbreviations
        for flat, (attr, f) in self.fields.items():
            if f.metadata["positional"]:
                continue
            switch = _unwrap(_hints(self.sections[attr][0])[f.name])[0] is bool  # BooleanOptionalAction's --no-x
            names.update({s: flat for s in self.options(flat)})
            names.update({"--no-" + s[2:]: flat for s in self.options(flat) if switch})
        out = set()
        for token in argv[: argv.index("--")] if "--" in argv else argv:
            word = token.split("=", 1)[0]
            hits = {names[word]} if word in names else {flat for s, flat in names.items() if s.startswith(word)}
            if token.startswith("--") and len(hits) == 1:
                out |= hits
        return out - {None}

    def speller(self, v: Values) -> Callable[[str], str]:
        """How errors name a field: by the preset's key where the preset set it, else by its flag."""
        return lambda flat: (
            f"{v.config}: {flat}" if flat in v.preset and flat not in v.given else self.spelled(flat)
        )

    def build(self, values: Mapping, spell: Callable[[str], str] | None = None) -> dict:
        """The sections from flat ``values`` (missing fields: their defaults); errors spelled by ``spell``."""
        spell = spell or self.spelled
        paths = {flat: values.get(flat, self.fields[flat][1].default) for flat in (*self.outputs, *self.inputs)}
        check_paths(self.outputs, self.inputs, paths, spell)  # first: a section's own check may stat a path
        return {attr: self.section(attr, values, spell) for attr in self.sections}

    def section(self, attr: str, values: Mapping, spell: Callable[[str], str] | None = None) -> Section:
        """One section from flat ``values`` (train.py reads its checkpoint section first, to find a record)."""
        cls, prefix = self.sections[attr]
        try:
            return cls(
                **{f.name: values[prefix + f.name] for f in dataclasses.fields(cls) if prefix + f.name in values}
            )
        except FieldError as e:
            raise UserError(e.spelled(lambda name: (spell or self.spelled)(prefix + name))) from None

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


def plain(value):
    return list(value) if isinstance(value, tuple) else value
