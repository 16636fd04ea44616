"""Settings: the fields of a config dataclass as a user sets them (TOML keys, command-line flags).

A config dataclass is the one definition of its fields: the type (a ``Literal`` lists the allowed values),
the default and the docstring written under each field. :func:`settings` reads them back, :func:`adopt`
gives another config dataclass the fields of this one (TrainConfig and SimConfig take SchedulerConfig's
this way, so none of its defaults, allowed values or docs is copied), and :func:`add_flag` turns a setting
into an argparse flag.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from april_ext.errors import InvalidArgumentError

T = TypeVar("T")

MAX_SEED = 2**63 - 1
"""The largest seed a config takes: torch.manual_seed takes up to 2**64 - 1, and this leaves room for the seeds
derived from it (seed + 1, seed + index)."""
MAX_GROUP_TIMEOUT_S = 6e8
"""The longest timeout a process group or weight-sync group takes, in seconds (19 years): torch.distributed
keeps it in int64 milliseconds."""
_DOC = "april_ext.doc"  # field metadata key: the docs of an adopted field


@dataclass(frozen=True)
class Setting:
    """One field of a config dataclass."""

    name: str
    kind: type
    """bool, int, float, str or tuple (of strings): what a value is made of."""
    optional: bool
    """None is allowed (the string "none" in TOML and on the command line)."""
    choices: tuple[str, ...]
    """The allowed values of a Literal field; () when any value of ``kind`` may be given."""
    default: Any
    doc: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str) -> Any:
        """A command-line value of this setting (validation is the dataclass's)."""
        if self.kind is tuple:
            return tuple(part.strip() for part in text.split(",") if part.strip())
        if self.optional and text.lower() == "none":
            return None
        try:
            return self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a valid {self.kind.__name__}" + (" (or none)" if self.optional else "")) from None


def _kind(hint: Any) -> tuple[type, bool, tuple[str, ...]]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return str, False, tuple(args)
    if origin is tuple:
        return tuple, False, ()
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        kind, _, choices = _kind(rest[0])
        return kind, len(rest) < len(args), choices
    return hint, False, ()


def _source_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field in the class body (whitespace collapsed)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def settings(cls: type) -> dict[str, Setting]:
    """Every field of the config dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    docs = _source_docs(cls)
    out = {}
    for f in fields(cls):
        kind, optional, choices = _kind(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = Setting(f.name, kind, optional, choices, default, f.metadata.get(_DOC, docs.get(f.name, "")))
    return out


def adopt(source: type, *, exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
          docs: Mapping[str, str] | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator, placed under ``@dataclass``: the class gets every field of the dataclass ``source``
    (type, default, docs) that it does not declare itself and that is not in ``exclude``. ``defaults`` and
    ``docs`` replace the source's for this class only."""
    exclude, defaults, docs = frozenset(exclude), dict(defaults or {}), dict(docs or {})
    unknown = sorted((exclude | set(defaults) | set(docs)) - {f.name for f in fields(source)})
    if unknown:
        raise InvalidArgumentError(f"adopt({source.__name__}): {unknown} are not fields of {source.__name__}")
    hints = typing.get_type_hints(source)
    source_settings = settings(source)

    def apply(cls: type[T]) -> type[T]:
        annotations = dict(inspect.get_annotations(cls))
        for f in fields(source):
            if f.name in exclude or f.name in annotations:
                continue
            annotations[f.name] = hints[f.name]
            doc = docs.get(f.name, source_settings[f.name].doc)
            if f.name in defaults:
                new = dataclasses.field(default=defaults[f.name], metadata={_DOC: doc})
            elif f.default_factory is not dataclasses.MISSING:
                new = dataclasses.field(default_factory=f.default_factory, metadata={_DOC: doc})
            else:
                new = dataclasses.field(default=f.default, metadata={_DOC: doc})
            setattr(cls, f.name, new)
        cls.__annotations__ = annotations
        return cls

    return apply


def add_flag(group: Any, setting: Setting, aliases: Iterable[str] = ()) -> None:
    """Adds ``setting``'s flag (``--no-...`` too for a bool), and ``aliases`` (other flag names of the same
    setting), to an argparse parser or group. The flag stays out of the parsed namespace unless given, so
    that the dataclass's default applies."""
    # "%%": argparse formats help strings with %.
    text = f"{setting.doc} (default: {setting.default!r})".strip().replace("%", "%%")
    if setting.kind is bool:
        group.add_argument(setting.flag, *aliases, dest=setting.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        return
    metavar = ("{" + ",".join(setting.choices) + "}" if setting.choices
               else "VALUE,..." if setting.kind is tuple else setting.kind.__name__.upper())
    group.add_argument(setting.flag, *aliases, dest=setting.name, type=setting.parse, default=argparse.SUPPRESS,
                       metavar=metavar, help=text)


__all__ = ["Setting", "add_flag", "adopt", "settings"]
