"""`mirage codegen FILE -o prog.cu`: emit CUDA C++ and its header (DESIGN.md §5)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.commands.common import defines_option, parse_defines
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import load_graph
from mirage_cli.util import write_atomic


@click.command()
@click.argument("file", metavar="FILE")
@click.option("-o", "--output", metavar="prog.cu",
              help="Write the .cu here and the header beside it (.h); default: .cu to stdout.")
@click.option("--name", metavar="NAME", help="Entry-point name (default: the program name).")
@defines_option
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
def command(file: str, output: str | None, name: str | None, defines: tuple[str, ...],
            index: int | None) -> None:
    """Generate CUDA for FILE (.mir, .ugraph.json or Mirage checkpoint)."""
    g = load_graph(file, parse_defines(defines), index)
    if name is not None:
        g = dataclasses.replace(g, name=name)
    prog = lower(g)
    cu, h = emit(prog)
    if output is None:
        click.echo(cu, nl=False)
        return
    if not output.endswith(".cu"):
        raise MirageError(f"-o {output}: the output file must end in .cu")
    header = str(Path(output).with_suffix(".h"))
    write_atomic(output, cu)
    write_atomic(header, h)
    info(f"wrote {output} and {header}: {len(prog.kernels)} kernel(s), "
         f"workspace {prog.workspace_bytes} bytes")
