"""`mirage parse X.mir [-D n=v] [-o X.ugraph.json]`: a program to its µGraph file.

Any file that :func:`mirage_cli.loading.load_graph` reads is accepted (a `.ugraph.json`
file or a Mirage checkpoint, with ``--index`` for one candidate), so `parse` also
converts checkpoints to the canonical `.ugraph.json`. ``-`` as the input reads standard
input; ``-o -`` is standard output (the default).
"""

from __future__ import annotations

import click

from mirage_cli import serialize
from mirage_cli.commands.common import defines_option, parse_defines, write_output
from mirage_cli.console import info
from mirage_cli.loading import load_graph


@click.command()
@click.argument("program", metavar="X.mir")
@defines_option
@click.option("-o", "--output", metavar="X.ugraph.json",
              help="Write the µGraph here (default: stdout).")
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
def command(program: str, defines: tuple[str, ...], output: str | None,
            index: int | None) -> None:
    """Parse and check a .mir program; print its canonical .ugraph.json."""
    g = load_graph(program, parse_defines(defines), index)
    text = serialize.dumps(g)
    if output is None or output == "-":
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        info(f"wrote {output}")
