"""`mirage opt PROG.mir -o prog.cu`: the whole pipeline (DESIGN.md §2, §6).

Stages, each a function from the previous stage's file to the next (named by file
extension, as in the design's pipeline)::

    prog.mir --parse--> prog.ugraph.json --search--> prog.cands.ugraph.json
             --select--> prog.best.ugraph.json --codegen--> prog.cu + prog.h

``--save-temps DIR`` keeps every intermediate file in DIR; ``-MD`` writes a Make
dependency file next to the output (``prog.d``), ``-MF FILE`` names it. Every output
is written atomically. Search options are those of ``mirage search``. The chosen
µGraph is the best verified candidate; the code generator is
:mod:`mirage_cli.codegen` (``lower`` then ``emit``).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from mirage_cli import serialize
from mirage_cli.commands.common import defines_option, parse_defines
from mirage_cli.commands.search import options_from, search_options
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.search.display import progress_display
from mirage_cli.search.driver import Outcome, cached_search
from mirage_cli.util import write_atomic


def stage_parse(path: str, defines: dict[str, int]) -> Graph:
    return load_graph(path, defines)


def stage_search(program: Graph, kw: dict) -> Outcome:  # type: ignore[type-arg]
    with progress_display() as show:
        return cached_search(program, options_from(kw), kw["budget"], kw["jobs"],
                             not kw["no_cache"], show)


def stage_select(out: Outcome) -> Graph:
    if not out.candidates:
        raise NoCandidate()
    return out.candidates[0][0]


def stage_codegen(best: Graph, name: str) -> tuple[str, str]:
    """CUDA source and header of ``best`` (entry point ``name``)."""
    import dataclasses

    try:
        from mirage_cli.codegen.emit import emit
        from mirage_cli.codegen.lower import lower
    except ImportError:
        raise MirageError("the code generator (mirage_cli.codegen) is not installed in "
                          "this build; use --save-temps to keep the chosen µGraph") from None
    return emit(lower(dataclasses.replace(best, name=name)))


class NoCandidate(Exception):
    """The search found no verified µGraph (exit 1)."""


@click.command("opt")
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("-o", "output", required=True, type=click.Path(dir_okay=False),
              help="The .cu file to write (its .h is written beside it).")
@defines_option
@search_options
@click.option("--save-temps", "save_temps", type=click.Path(file_okay=False),
              help="Keep every intermediate file in this directory.")
@click.option("-MD", "make_deps", is_flag=True, help="Write a Make dependency file.")
@click.option("-MF", "dep_file", type=click.Path(dir_okay=False),
              help="Name of the dependency file (implies -MD).")
def command(program: str, output: str, defines: tuple[str, ...], save_temps: str | None,
            make_deps: bool, dep_file: str | None, **kw: object) -> None:
    """Optimise PROGRAM end to end: parse, search, verify, rank, generate CUDA."""
    if not output.endswith(".cu"):
        raise MirageError(f"-o {output}: the output file must end in .cu")
    stem = Path(output).with_suffix("")
    header = str(stem) + ".h"
    temps = Path(save_temps) if save_temps else None
    base = Path(program).name.split(".")[0]
    g = stage_parse(program, parse_defines(defines))
    if temps is not None:
        write_atomic(temps / f"{base}.ugraph.json", serialize.dumps(g))
    out = stage_search(g, kw)
    if temps is not None:
        write_atomic(temps / f"{base}.cands.ugraph.json", out.text)
    try:
        best = stage_select(out)
    except NoCandidate:
        info("opt: the search found no verified µGraph")
        raise SystemExit(1) from None
    if temps is not None:
        write_atomic(temps / f"{base}.best.ugraph.json", serialize.dumps(best))
    cu, h = stage_codegen(best, _c_name(stem.name))
    write_atomic(output, cu)
    write_atomic(header, h)
    if make_deps or dep_file:
        write_atomic(dep_file or str(stem) + ".d", _depfile(output, header, program))
    info(f"opt: wrote {output} and {header} ({best.name}: "
         f"{sum(1 for op in best.ops)} kernel(s))")


def _c_name(stem: str) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    return name if name and not name[0].isdigit() else f"prog_{name}"


def _depfile(output: str, header: str, program: str) -> str:
    """Make rule: both outputs depend on the program file."""
    def esc(p: str) -> str:
        return p.replace(" ", "\\ ")
    return f"{esc(output)} {esc(header)}: {esc(os.path.normpath(program))}\n"
