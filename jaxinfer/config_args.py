"""Command-line flags made from EngineConfig, so a new engine setting needs no CLI change.

    add_engine_args(parser)          # one flag per EngineConfig field
    EngineConfig(**engine_kwargs(parser.parse_args()))

Each field `some_name` becomes `--some-name`: its type from the annotation (int, float, str, or
one of them `| None`), its choices from a `Literal[...]`, its help from the comment on the field's
line in jaxinfer/config.py, or else the comment lines just above it. A bool becomes a pair of
switches, `--some-name` / `--no-some-name`; an `enable_x` field is also `--x` / `--no-x`
(`--no-prefix-caching`). Every flag defaults to None, so `engine_kwargs` holds only the flags
actually given and a preset (a TOML file of EngineConfig fields) is overridden by nothing else.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, Iterable

from jaxinfer.config import EngineConfig, literal_choices

_SCALARS = (int, float, str)
_GIVEN_FIELDS = "engine_config_fields"  # argparse dest: the fields add_engine_args added


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    """How one EngineConfig field appears on the command line."""

    field: str  # the EngineConfig field (and the argparse dest)
    option_strings: tuple[str, ...]  # ("--page-size",); a bool: ("--x", "--no-x"), more for enable_x
    type: type  # int | float | str | bool
    choices: tuple | None  # a Literal's values, without None (None is "not given")
    default: Any  # EngineConfig's default (None when it has none), for the help text
    help: str


def engine_flags(config: type = EngineConfig) -> list[EngineFlag]:
    """One EngineFlag per field of `config` (EngineConfig, or a dataclass extending it), in field
    order. TypeError names a field whose type has no command-line form."""
    hints = typing.get_type_hints(config)
    comments = field_comments(config)
    flags = []
    for field in dataclasses.fields(config):
        scalar, choices = _scalar_type(config, field.name, hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        if scalar is bool:
            names = [flag]
            if field.name.startswith("enable_"):
                names.append("--" + field.name[len("enable_"):].replace("_", "-"))
            option_strings = tuple(names) + tuple("--no-" + n[2:] for n in names)
        else:
            option_strings = (flag,)
        default = None if field.default is dataclasses.MISSING else field.default
        flags.append(EngineFlag(field.name, option_strings, scalar, choices, default,
                                comments.get(field.name, "")))
    return flags


def add_engine_args(parser: argparse.ArgumentParser, *, exclude: Iterable[str] = ()) -> None:
    """Adds the "engine" argument group: every EngineConfig field but those in `exclude` (a
    command whose own flag of the same name means something else)."""
    excluded = set(exclude)
    unknown = excluded - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"exclude={sorted(unknown)} must name EngineConfig fields")
    group = parser.add_argument_group("engine", "EngineConfig settings (jaxinfer/config.py)")
    flags = [f for f in engine_flags() if f.field not in excluded]
    parser.set_defaults(**{_GIVEN_FIELDS: tuple(f.field for f in flags)})
    for flag in flags:
        if flag.type is bool:
            group.add_argument(*flag.option_strings, dest=flag.field, default=None,
                               action=_SwitchPair, help=_help(flag))
        else:
            group.add_argument(*flag.option_strings, dest=flag.field, type=flag.type,
                               choices=flag.choices, default=None, help=_help(flag))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (flags left out are not in the dict;
    nor are a command's own flags of an excluded field's name)."""
    fields = vars(args).get(_GIVEN_FIELDS, ())
    return {name: getattr(args, name) for name in fields if getattr(args, name) is not None}


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the source of `cls` (and of the dataclasses it extends): the
    comment on the field's line, else the comment lines just above it (no blank line between),
    joined with spaces."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_own_field_comments(klass))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    comment_at: dict[int, str] = {}  # line (1-based) -> comment text
    code_lines: set[int] = set()  # lines holding anything but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    (class_def,) = ast.parse(source).body
    comments = {}
    for node in class_def.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = comment_at.get(node.end_lineno)
        if trailing is not None:
            comments[node.target.id] = trailing
            continue
        above = []
        line = node.lineno - 1
        while line in comment_at and line not in code_lines:
            above.insert(0, comment_at[line])
            line -= 1
        if above:
            comments[node.target.id] = " ".join(above)
    return comments


class _SwitchPair(argparse.Action):
    """`--x` stores True and `--no-x` False (argparse.BooleanOptionalAction, less its
    "(default: ...)" suffix, which would show None)."""

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _scalar_type(config: type, name: str, annotation) -> tuple[type, tuple | None]:
    """(int | float | str | bool, Literal choices or None) of a field's annotation."""
    choices = literal_choices(annotation)
    if choices is not None:
        values = tuple(c for c in choices if c is not None)
        kinds = {type(c) for c in values}
        if len(kinds) != 1 or not kinds <= set(_SCALARS):
            raise TypeError(f"{config.__name__}.{name}: {annotation} mixes choice types {kinds}")
        return kinds.pop(), values
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS:
            return args[0], None
    elif annotation is bool or annotation in _SCALARS:
        return annotation, None
    raise TypeError(f"{config.__name__}.{name}: {annotation} has no command-line form; give it "
                    "one in jaxinfer/config_args.py")


def _help(flag: EngineFlag) -> str:
    text = flag.help
    if flag.default is not None and "default" not in text:
        text = f"{text} (default: {flag.default})" if text else f"default: {flag.default}"
    return text.replace("%", "%%")  # argparse %-formats help strings
