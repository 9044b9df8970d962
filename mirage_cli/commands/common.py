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


# Target GPUs of generated code: the kernels need sm_80 features (cp.async, bf16 mma).
ARCHS = ("sm_80", "sm_90")


def codegen_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--name`` and ``--arch``, shared by ``codegen``, ``opt`` and ``search``."""
    f = click.option("--arch", type=click.Choice(ARCHS), default="sm_90", show_default=True,
                     help="Target GPU architecture (the plan and the cost model follow it).")(f)
    return click.option("--name", metavar="NAME",
                        help="Entry-point name (default: mirage_<program>_<shapes>, so two "
                             "instantiations link into one binary).")(f)


def _set_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    from mirage_cli.console import set_verbosity

    if value:
        set_verbosity(-1)


def _set_verbose(ctx: click.Context, param: click.Parameter, value: int) -> None:
    from mirage_cli.console import set_verbosity, verbosity

    if value:
        set_verbosity(max(verbosity(), 0) + value)


def verbosity_params() -> list[click.Parameter]:
    """``-q``/``-v`` for a subcommand, so they work after it as well as before."""
    return [click.Option(["-q", "--quiet"], is_flag=True, expose_value=False,
                         callback=_set_quiet, help="Only errors on stderr."),
            click.Option(["-v", "--verbose"], count=True, expose_value=False,
                         callback=_set_verbose, help="More detail on stderr.")]
