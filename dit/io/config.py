"""Configuration sections: small frozen dataclasses, each owned by the component that reads it.

A section checks itself once, when it is built: every field's type, finite numbers, and the ranges and
choices of its ``option``; then its own ``check`` for combinations. A check names fields as ``{field}``, for
a face (``dit.io.face``) to spell as the user wrote them. No torch: ``dit-cost`` answers at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dit.io.errors import UserError

_REQUIRED = dataclasses.MISSING
_BOUNDS = dict(ge=(operator.ge, ">="), gt=(operator.gt, ">"), le=(operator.le, "<="), lt=(operator.lt, "<"))


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
        return re.sub(r"\{(\w+)\}", lambda m: spell(m.group(1)), self.template)


@functools.cache
def _hints(cls: type) -> dict:
    """A section's field types, resolved once per class (resolving them is most of the time a parse takes)."""
    return typing.get_type_hints(cls)


def _unwrap(tp):
    """``float | None`` -> (float, True); ``tuple[int, ...]`` -> (tuple[int, ...], False)."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return tp, False
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), type(None) in typing.get_args(tp)


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
        except FieldError:  # every bound in words (" > 0"), to name them all at once
            bounds = "".join(f" {w} {meta[k]:g}" for k, (_, w) in _BOUNDS.items() if meta.get(k) is not None)
            raise FieldError(
                f"{{{name}}} must be a finite number{bounds} or {' or '.join(words)}, got {value!r}."
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
    for key, (ok, words) in _BOUNDS.items():
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            raise FieldError(f"{{{name}}} must be {words} {bound:g}, got {value}.")
    return value


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
