"""A process's settings as pydantic models, and its command line built from them: each field is
the flag of its name (max_num_seqs: --max-num-seqs), with the field's type, choices, default and
description as help. The engine, the router and the operator all define their settings this way;
nothing heavy is imported, so --help and a mistyped flag are answered at once.

Where a type alone does not say how a value is written, the field's metadata does (in
``Annotated``): a ``FlagSyntax`` (a size such as ``16Mi``, a comma-separated list) and a ``Flag``
(an environment variable read when the flag is not given, a one-letter form). An environment
variable's value is the flag's default, which --help shows: never one for a secret."""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, get_args, get_origin, runtime_checkable

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

# argparse fills in the parser's own default, so the help cannot name a stale one.
DEFAULT = " (default: %(default)s)"


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line besides its own flag: ``env``, the environment
    variable read when the flag is not given (an empty one counts as not set, except for a list,
    where it is the empty list); ``short``, a one-letter form such as ``-n``;
    ``on_command_line`` False for a setting only code sets (a test's shorter timeout)."""

    env: str | None = None
    short: str | None = None
    on_command_line: bool = True


@runtime_checkable
class FlagSyntax(Protocol):
    """How values of a field are written on the command line: ``parse`` reads one (raising
    ValueError with what is wrong), ``show`` writes a default as a person would give it,
    ``metavar`` names a value in the usage ("": the flag's name), ``forms`` is appended to the
    help ("" for nothing)."""

    @property
    def metavar(self) -> str: ...

    @property
    def forms(self) -> str: ...

    def parse(self, text: str) -> Any: ...

    def show(self, value: Any) -> str: ...


class CommaList:
    """A list given as ``a,b`` (spaces and empty items ignored), the flag repeatable: each time
    it is given adds its items."""

    metavar = ""
    forms = ""

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(item.strip() for item in text.split(",") if item.strip())

    def show(self, value: Sequence[str]) -> str:
        return ",".join(value)


COMMA_LIST = CommaList()


class _Extend(argparse.Action):
    """Each occurrence adds its items to those given before it; the first replaces the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        before = getattr(namespace, self.dest, None)
        given = () if before is None or before is self.default else tuple(before)
        setattr(namespace, self.dest, (*given, *values))


def _metadata(field: FieldInfo) -> list[Any]:
    """The field's Annotated metadata, that of an Annotated member of a union (`X | None`)
    included."""
    found = list(field.metadata)
    for arg in get_args(field.annotation):
        if get_origin(arg) is Annotated:
            found += get_args(arg)[1:]
    return found


def _plain_type(annotation: Any) -> Any:
    """The annotation without None, Annotated or a union with None around it."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (types.UnionType,) or (
        args and get_origin(annotation) not in (Literal, list, tuple)
    ):
        annotation = args[0]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _flag(field: FieldInfo) -> Flag:
    return next((m for m in _metadata(field) if isinstance(m, Flag)), Flag())


def _syntax(field: FieldInfo) -> FlagSyntax | None:
    return next((m for m in _metadata(field) if isinstance(m, FlagSyntax)), None)


def _is_list(annotation: Any) -> bool:
    return get_origin(_plain_type(annotation)) in (list, tuple)


def _as_flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse's `type` for a parse function that raises ValueError: argparse then names the
    flag before the message, rather than a message of its own."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _unset(default: Any) -> bool:
    return default is None or (isinstance(default, str | tuple | list) and len(default) == 0)


def _with_default(help_text: str, default: Any) -> str:
    """A flag's help with its default appended; a flag without one (None, empty) says in its own
    words what leaving it out means."""
    return help_text if _unset(default) else (help_text + DEFAULT).strip()


def _default(field: FieldInfo, flag: Flag, syntax: FlagSyntax | None) -> Any:
    """The flag's default: the environment variable's text when it is set (argparse reads a
    text default as it reads a given value), else the field's own, written as given when it has
    a syntax; None for a field without a default (the caller resolves it)."""
    if flag.env is not None:
        text = os.environ.get(flag.env)
        if text is not None and (text or _is_list(field.annotation)):
            return text
    if field.is_required():
        return None
    default = field.get_default(call_default_factory=True)
    if syntax is not None and default is not None:
        return syntax.show(default)
    return default


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str) -> None:
    """One flag per field of a settings model, in an argument group of that title."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        flag = _flag(field)
        if not flag.on_command_line:
            continue
        syntax = _syntax(field)
        names = [f for f in (flag.short, "--" + name.replace("_", "-")) if f]
        default = _default(field, flag, syntax)
        help_text = field.description or ""
        if syntax is not None and syntax.forms:
            help_text += f"; {syntax.forms}"
        if flag.env is not None:
            help_text += f" (env {flag.env})"
        help_text = _with_default(help_text, default)
        kind = _plain_type(field.annotation)
        if syntax is not None:
            # A list's flag is repeatable: each time it is given adds its items.
            action = _Extend if _is_list(field.annotation) else "store"
            group.add_argument(*names, action=action, type=_as_flag_type(syntax.parse),
                               metavar=syntax.metavar or None, default=default,
                               help=help_text)  # fmt: skip
        elif _is_list(field.annotation):
            group.add_argument(*names, nargs="+", default=default, help=help_text)
        elif kind is bool:
            group.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif get_origin(kind) is Literal:
            choices = list(get_args(kind))
            group.add_argument(*names, type=type(choices[0]), choices=choices, default=default,
                               help=help_text)  # fmt: skip
        else:
            group.add_argument(*names, type=kind, default=default, help=help_text)


def flag_values(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The parsed flags of a settings model's fields, by field name, to build it from."""
    return {
        name: getattr(ns, name)
        for name, field in model.model_fields.items()
        if _flag(field).on_command_line
    }


def one_line(e: ValidationError) -> str:
    """A settings error as a person reads it: each flag, the value given and what is wrong with
    it, no dump. Settings fields are flags of the same name (max_num_seqs: --max-num-seqs)."""
    parts = []
    for err in e.errors():
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            parts.append(message)
            continue
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        # A number is shown as given; a string's own validator names it (a template would be
        # long), and argparse has checked choices.
        value = err.get("input")
        given = (
            f" {value}" if isinstance(value, int | float) and not isinstance(value, bool) else ""
        )
        parts.append(f"{flag}{given}: {message}")
    return "; ".join(parts)
