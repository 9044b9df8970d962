"""`mirage parse X.mir [-D n=v] [-o X.ugraph.json]`: a program to its µGraph file."""

from __future__ import annotations

import click

from mirage_cli import serialize
from mirage_cli.commands.common import defines_option, parse_defines, write_output
from mirage_cli.console import info
from mirage_cli.parser import parse_file


@click.command()
@click.argument("program", metavar="X.mir")
@defines_option
@click.option("-o", "--output", metavar="X.ugraph.json",
              help="Write the µGraph here (default: stdout).")
def command(program: str, defines: tuple[str, ...], output: str | None) -> None:
    """Parse and check a .mir program; print its canonical .ugraph.json."""
    g = parse_file(program, parse_defines(defines))
    text = serialize.dumps(g)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        info(f"wrote {output}")
