"""Options and helpers shared by several commands (-D overrides, output files,
--max-memory)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph


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
    """Write a command's output file atomically (``-``: standard output); an unwritable
    path is bad input (exit 2), not an internal error."""
    from mirage_cli.util import write_atomic

    if path == "-":
        stream = sys.stdout.buffer
        stream.write(data if isinstance(data, bytes) else data.encode("utf-8"))
        stream.flush()
        return
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


def plan_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--plan PINS.json``: knob pins of the kernel plans, one object per custom kernel."""
    return click.option("--plan", "plan_pins", metavar="PINS.json",
                        help="Pin plan knobs: a JSON list with one object of knob values per "
                             "custom kernel (see 'mirage plan').")(f)


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


def default_max_memory() -> int:
    """Half of physical memory or 8 GiB, whichever is smaller."""
    import os

    cap = 8 << 30
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return cap
    return min(cap, phys // 2) if phys > 0 else cap


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str | None) -> int:
    """``--max-memory``: bytes, or a number with K/M/G/T (powers of 1024); default
    :func:`default_max_memory`."""
    import re

    if text is None:
        return default_max_memory()
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise MirageError(f"--max-memory {text}: expected a size such as 512M, 8G or "
                          f"1073741824")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise MirageError(f"--max-memory {text}: the limit must be positive")
    return n


def max_memory_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--max-memory", "max_memory", metavar="SIZE", default=None,
                        help="Refuse programs estimated to need more memory than this "
                             "(e.g. 512M, 8G) [default: half of physical memory, at "
                             "most 8G].")(f)


def check_graph_memory(graphs: list[tuple[Graph, str]], limit: int, what: str,
                       itemsize: int = 8) -> None:
    """:func:`mirage_cli.interp.check_memory`, with the source text for the excerpt."""
    from mirage_cli import interp
    from mirage_cli.loading import STDIN, display_name, read_text

    try:
        interp.check_memory([(g, display_name(f)) for g, f in graphs], limit, what, itemsize)
    except MirageError as e:
        for _, file in graphs:
            if e.span is not None and file != STDIN and e.span.file == file:
                e.with_source(read_text(file))
        raise
