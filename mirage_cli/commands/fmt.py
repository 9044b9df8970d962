"""`mirage fmt FILE [--check] [--index N]`: print a µGraph as canonical `.mir`.

FILE may be a `.mir` program (its comments are kept, see :mod:`mirage_cli.comments`),
a `.ugraph.json` file or a Mirage checkpoint (see :mod:`mirage_cli.loading`). With ``--check`` nothing is printed: the exit code says
whether a `.mir` file already is in canonical form (0) or not (1).
"""

from __future__ import annotations

import click

from mirage_cli.console import console
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import load_graph, read_text
from mirage_cli.comments import format_source
from mirage_cli.printer import print_graph


@click.command()
@click.argument("file", metavar="FILE")
@click.option("--check", is_flag=True,
              help="Exit 1 if the .mir FILE is not in canonical form; print nothing.")
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
def command(file: str, check: bool, index: int | None) -> None:
    """Print FILE (.mir, .ugraph.json or Mirage checkpoint) as canonical .mir."""
    if check and not file.endswith(".mir"):
        raise MirageError("--check applies to .mir files only", file=file)
    if file.endswith(".mir"):
        if index not in (None, 0):
            raise MirageError(f"--index {index} is out of range: a program is one graph",
                              file=file)
        text = format_source(read_text(file), file)
    else:
        text = print_graph(load_graph(file, None, index))
    if not check:
        click.echo(text, nl=False)
        return
    if read_text(file) != text:
        console.print(f"{file}: not in canonical form (run 'mirage fmt {file}' to see it)",
                      markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(1)
