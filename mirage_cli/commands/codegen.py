"""`mirage codegen FILE -o prog.cu`: emit CUDA C++ and its header (DESIGN.md §5).

``prog.cu`` and ``prog.h`` (and ``prog.hpp`` with ``--hpp``) are written together as
one :class:`~mirage_cli.util.OutputSet`; without ``-o`` (or with ``-o -``) the
``.cu`` alone goes to stdout.
"""

from __future__ import annotations

import click

from mirage_cli.codegen.emit import emit, emit_hpp
from mirage_cli.codegen.lower import lower
from mirage_cli.commands.common import codegen_options, defines_option, parse_defines, plan_option
from mirage_cli.commands.plan import pins_file, planned
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import load_graph
from mirage_cli.util import OutputSet


@click.command()
@click.argument("file", metavar="FILE")
@click.option("-o", "--output", metavar="prog.cu",
              help="Write the .cu here and the header beside it (.h); default or '-': "
                   "the .cu to stdout.")
@codegen_options
@click.option("--hpp", is_flag=True, help="Also write the typed C++ interface (.hpp).")
@plan_option
@defines_option
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
def command(file: str, output: str | None, name: str | None, arch: str, hpp: bool,
            plan_pins: str | None, defines: tuple[str, ...], index: int | None) -> None:
    """Generate CUDA for FILE (.mir, .ugraph.json or Mirage checkpoint)."""
    g = load_graph(file, parse_defines(defines), index)
    if plan_pins:
        g = planned(g, arch, pins_file(plan_pins))
    if output is None or output == "-":
        if hpp:
            raise MirageError("--hpp needs -o FILE.cu (the .hpp includes the .h beside it)")
        cu, _ = emit(lower(g, name=name, arch=arch))
        click.echo(cu, nl=False)
        return
    if not output.endswith(".cu"):
        raise MirageError(f"-o {output}: the output file must end in .cu")
    stem = output[:-len(".cu")]
    paths = [output, stem + ".h"] + ([stem + ".hpp"] if hpp else [])
    with OutputSet(paths, inputs=[file]) as out:
        prog = lower(g, name=name, arch=arch)
        cu, h = emit(prog)
        files: dict[str, str | bytes] = {paths[0]: cu, paths[1]: h}
        if hpp:
            files[paths[2]] = emit_hpp(prog, paths[1].rsplit("/", 1)[-1])
        changed = out.commit(files)
    info(f"wrote {', '.join(changed) or 'nothing (unchanged)'}: entry point {prog.name}, "
         f"{sum(map(len, prog.launch_ops))} kernel(s) in {len(prog.kernels)} launch(es), "
         f"workspace {prog.workspace_bytes} bytes")
