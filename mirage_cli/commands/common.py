"""Options and helpers shared by several commands (-D overrides, graph loading)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from mirage_cli.diagnostics import MirageError


def parse_defines(values: tuple[str, ...]) -> dict[str, int]:
    """``-D name=value`` pairs; a bad one is a usage error (exit 2)."""
    out: dict[str, int] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise MirageError(f"bad -D override '{item}': expected NAME=INTEGER")
        try:
            out[name] = int(value.strip(), 0)
        except ValueError:
            raise MirageError(f"bad -D override '{item}': '{value}' is not an integer") from None
    return out


def defines_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("-D", "defines", multiple=True, metavar="NAME=VALUE",
                        help="Override a program parameter (repeatable).")(f)


def write_output(path: str, data: str | bytes) -> None:
    """Write a command's output file atomically; an unwritable path is bad input (exit
    2), not an internal error."""
    from mirage_cli.util import write_atomic

    try:
        write_atomic(path, data)
    except OSError as e:
        raise MirageError(f"cannot write the output: {e.strerror or e}", file=path) from None
