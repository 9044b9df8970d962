"""`mirage fmt FILE [--check | -i | -o OUT] [--index N]`: a µGraph as canonical `.mir`.

FILE may be a `.mir` program (its comments are kept, see :mod:`mirage_cli.comments`),
a `.ugraph.json` file or a Mirage checkpoint (see :mod:`mirage_cli.loading`). With
``--check`` nothing is printed: the exit code says whether a `.mir` file already is in
canonical form (0) or not (1). ``-o`` writes the text to a file and ``-i`` rewrites a
`.mir` file in place (both atomically). FILE ``-`` is standard input (a program unless
it starts with ``{`` or ``[``); ``-o -`` is standard output.
"""

from __future__ import annotations

import click

from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.commands.common import write_output
from mirage_cli.comments import format_source
from mirage_cli.console import console
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.loading import (
    STDIN,
    display_name,
    graphs_from_text,
    is_program,
    pick,
    read_text,
)
from mirage_cli.printer import print_graph


@click.command(short_help="Print a µGraph as canonical .mir.")
@click.argument("file", metavar="FILE")
@click.option("--check", is_flag=True,
              help="Exit 1 if the .mir FILE is not in canonical form; print nothing.")
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
@click.option("-o", "--output", metavar="OUT.mir", help="Write here instead of stdout.")
@click.option("-i", "--in-place", is_flag=True, help="Rewrite the .mir FILE itself.")
@click.option("--plan", "with_plan", is_flag=True,
              help="Append each custom kernel's plan (the thread level) as comments.")
@click.option("--arch", default=DEFAULT_ARCH, show_default=True,
              help="Target of the printed plans (with --plan).")
def command(file: str, check: bool, index: int | None, output: str | None,
            in_place: bool, with_plan: bool, arch: str) -> None:
    """Print FILE (.mir, .ugraph.json or Mirage checkpoint) as canonical .mir."""
    if with_plan and (check or in_place):
        raise MirageError("--plan prints plans: it excludes --check and --in-place")
    if in_place and file == STDIN:
        raise MirageError("--in-place needs a file, not standard input")
    if sum((check, in_place, output is not None)) > 1:
        raise MirageError("--check, --in-place and -o exclude each other")
    source = read_text(file)  # once: standard input cannot be read twice
    if (check or in_place) and not is_program(file, source):
        flag = "--check" if check else "--in-place"
        raise MirageError(f"{flag} applies to .mir files only", file=display_name(file))
    text = _formatted(file, source, index)
    if with_plan:
        text += _plan_comments(pick(graphs_from_text(source, file), file, index), arch)
    if check:
        if source != text:
            name = display_name(file)
            console.print(f"{name}: not in canonical form (run 'mirage fmt {name}' to see "
                          f"it)", markup=False, highlight=False, soft_wrap=True)
            raise SystemExit(1)
    elif in_place or (output is not None and output != "-"):
        target = file if in_place else str(output)
        if not (in_place and source == text):
            write_output(target, text)
    else:
        click.echo(text, nl=False)


def _plan_comments(g: Graph, arch: str) -> str:
    """The plans of ``g``'s custom kernels as ``#`` comment lines (the text stays .mir)."""
    from mirage_cli.commands.plan import plan_report, plan_text

    doc = plan_report(g, arch)
    if not doc:
        return "\n# no custom kernel: nothing to plan\n"
    return "\n" + "".join(f"# {line}\n" for line in plan_text(doc).splitlines())


def _formatted(file: str, source: str, index: int | None) -> str:
    name = display_name(file)
    if not is_program(file, source):
        return print_graph(pick(graphs_from_text(source, file), file, index))
    if index not in (None, 0):
        raise MirageError(f"--index {index} is out of range: a program is one graph",
                          file=name)
    return format_source(source, name)

