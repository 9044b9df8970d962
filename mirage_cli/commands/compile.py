"""`mirage compile prog.cu --arch sm_90 -o prog.cubin`: NVRTC, no toolkit needed."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from mirage_cli.codegen.nvrtc import ARCHS, compile_cuda
from mirage_cli.console import info
from mirage_cli.loading import read_text
from mirage_cli.util import write_atomic


@click.command()
@click.argument("file", metavar="prog.cu")
@click.option("--arch", type=click.Choice(ARCHS), default="sm_90", show_default=True,
              help="Target GPU architecture.")
@click.option("-o", "--output", metavar="prog.cubin", help="Default: FILE with .cubin.")
@click.option("--resource-usage", is_flag=True,
              help="Print registers, shared memory, stack and spills per kernel.")
@click.option("--json", "as_json", is_flag=True, help="Resource usage as JSON on stdout.")
def command(file: str, arch: str, output: str | None, resource_usage: bool,
            as_json: bool) -> None:
    """Compile generated CUDA to a cubin with NVRTC."""
    src = read_text(file)
    compiled = compile_cuda(src, file, arch)
    out = output or str(Path(file).with_suffix(".cubin"))
    write_atomic(out, compiled.cubin)
    info(f"wrote {out} ({len(compiled.cubin)} bytes, {arch})")
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in compiled.resources], indent=2, sort_keys=True))
    elif resource_usage:
        from rich.console import Console

        t = Table("kernel", "registers", "static smem (B)", "stack (B)", "spill stores (B)",
                  "spill loads (B)")
        for r in compiled.resources:
            t.add_row(r.kernel, str(r.registers), str(r.smem_static), str(r.stack),
                      str(r.spill_stores), str(r.spill_loads))
        Console(highlight=False).print(t)
