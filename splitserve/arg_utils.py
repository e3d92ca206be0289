"""Options declared once, as dataclass fields, and turned into command-line flags and checked keywords.

A field declared with `option(default, help=...)` becomes `--field-name` (underscores to dashes) on
any parser its class is added to, with its help text and its default shown in `--help`. The type
comes from the annotation (`int | None` parses as int); `choices` where there are some; booleans that
default False are plain switches, other booleans (True, or None meaning "decide later") get both
`--x` and `--no-x`. The same classes check the offline API's keywords (`from_kwargs`), so the CLI,
`LLM(...)` and their defaults cannot drift apart: there is no second list to update.

Usage:

    @dataclass
    class Opts(CliOptions):
        port: int = option(8000, help="port to listen on")

    Opts.add_cli_args(parser)          # --port PORT  port to listen on (default: 8000)
    Opts.from_namespace(parser.parse_args())
    Opts.from_kwargs("f()", port=1)    # unknown keywords: TypeError naming them and the valid ones
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T", bound="CliOptions")


def option(default: Any = dataclasses.MISSING, *, help: str,
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
           default_text: str | None = None, choices: Sequence[Any] | None = None,
           aliases: Sequence[str] = (), negative_aliases: Sequence[str] = (),
           positional: bool = False, metavar: str | None = None) -> Any:
    """A dataclass field that is also a command-line option.

    default_text: what `--help` shows as the default instead of the value (for None meaning "decided
      at start-up", or a value that must not be printed, such as a key read from the environment).
    aliases: other spellings of the flag; negative_aliases: other spellings of its `--no-` form.
    positional: also an optional positional argument (`nargs="?"`), besides the flag."""
    metadata = {"help": help, "default_text": default_text, "choices": tuple(choices) if choices else None,
                "aliases": tuple(aliases), "negative_aliases": tuple(negative_aliases),
                "positional": positional, "metavar": metavar}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positional_dest(name: str) -> str:
    return f"{name}__positional"


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type a command-line string converts to, whether the annotation is a list)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"an option's type must be X or X | None, got {annotation}")
        return _base_type(args[0])
    if origin in (list, tuple):
        return typing.get_args(annotation)[0], True
    return annotation, False


def _shown_default(f: dataclasses.Field, default: Any) -> str:
    text = f.metadata["default_text"]
    if text is None:
        text = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return text


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


class CliOptions:
    """Mix-in for dataclasses whose fields are all declared with `option()`."""

    @classmethod
    def cli_title(cls) -> str:
        return cls.__name__

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, title: str | None = None) -> None:
        """Adds one option per field, in a group of their own in `--help`."""
        group = parser.add_argument_group(title or cls.cli_title())
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            md = f.metadata
            if "help" not in md:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with option(): it has no help text")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind, is_list = _base_type(hints[f.name])
            help_text = f"{_escape(md['help'])} (default: {_escape(_shown_default(f, default))})"
            kw: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
            if md["metavar"]:
                kw["metavar"] = md["metavar"]
            flags = [flag_name(f.name), *md["aliases"]]
            if md["positional"]:
                # Both `serve MODEL` and `serve --model MODEL` (vLLM takes both). The positional has a
                # dest of its own, so from_namespace can tell a conflict from a repetition.
                group.add_argument(*flags, type=kind, **kw)
                group.add_argument(_positional_dest(f.name), nargs="?", type=kind, default=argparse.SUPPRESS,
                                   metavar=md["metavar"] or f.name, help=f"the same as {flags[0]}")
                continue
            if kind is bool:
                # A switch that is off by default needs no --no- form; one that is on (or undecided)
                # does, spelled --no-<flag> like vLLM's.
                action = "store_true" if default is False else argparse.BooleanOptionalAction
                group.add_argument(*flags, action=action, **kw)
                for neg in md["negative_aliases"]:
                    # SUPPRESS: the real option above sets the default; this one must not reset it.
                    group.add_argument(neg, dest=f.name, action="store_false", default=argparse.SUPPRESS,
                                       help=f"the same as --no-{flags[0][2:]}")
                continue
            if md["negative_aliases"]:
                raise TypeError(f"{cls.__name__}.{f.name}: negative_aliases are for booleans")
            if md["choices"]:
                kw["choices"] = md["choices"]
            if is_list:
                kw["nargs"] = "*"
            group.add_argument(*flags, type=kind, **kw)

    @classmethod
    def from_namespace(cls: type[T], ns: argparse.Namespace | None) -> T:
        """The fields found on `ns` (parsed arguments, which may hold other parsers' options too);
        a field `ns` lacks keeps its default."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        for f in dataclasses.fields(cls):
            if not f.metadata.get("positional") or not hasattr(ns, _positional_dest(f.name)):
                continue
            given = getattr(ns, _positional_dest(f.name))
            flag = values.get(f.name)
            if flag is not None and flag != given:
                raise ValueError(f"{f.name} given twice, as {given!r} and as {flag_name(f.name)} {flag!r}")
            values[f.name] = given
        return cls(**values)

    @classmethod
    def from_kwargs(cls: type[T], caller: str, **kwargs: Any) -> T:
        """`cls(**kwargs)`, but an unknown keyword is a TypeError that names it, a close match, and
        every valid keyword (Python's own message names only the first and none of the valid ones)."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, valid, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{caller} got unknown keyword argument{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(hints)}; valid keywords: {', '.join(valid)}")
        return cls(**kwargs)
