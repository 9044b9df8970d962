"""`mirage compile prog.cu --arch sm_90 -o prog.cubin`: NVRTC, no toolkit needed.

``--arch sm_90`` builds for sm_90a, the arch-specific target of the same GPUs, so that
the kernels' wgmma paths are compiled (``nvrtc.machine_arch``); the message names it.

``--resource-usage`` adds each kernel's dynamic shared memory, which ptxas cannot
see: it is read from the summary comments the code generator writes at the top of
the ``.cu`` (``// kernel K: ..., N B dynamic shared memory``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
from rich.table import Table

from mirage_cli.codegen.nvrtc import ARCHS, compile_cuda, machine_arch
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.loading import read_text
from mirage_cli.util import OutputSet

_DYNAMIC = re.compile(r"^// kernel (\w+): .*?, (\d+) B dynamic shared memory$", re.MULTILINE)


def dynamic_smem(source: str) -> dict[str, int]:
    """Dynamic shared memory per kernel, from the generated summary comments."""
    return {m[1]: int(m[2]) for m in _DYNAMIC.finditer(source)}


@click.command()
@click.argument("file", metavar="prog.cu")
@click.option("--arch", type=click.Choice(ARCHS), default="sm_90", show_default=True,
              help="Target GPU architecture.")
@click.option("-o", "--output", metavar="prog.cubin",
              help="Default: FILE with .cubin; '-' for stdout (not a terminal).")
@click.option("--resource-usage", is_flag=True,
              help="Print registers, shared memory, stack and spills per kernel.")
@click.option("--json", "as_json", is_flag=True, help="Resource usage as JSON on stdout.")
def command(file: str, arch: str, output: str | None, resource_usage: bool,
            as_json: bool) -> None:
    """Compile generated CUDA to a cubin with NVRTC."""
    src = read_text(file)
    out = output or str(Path(file).with_suffix(".cubin"))
    if out == "-":
        if sys.stdout.isatty() or as_json or resource_usage:
            raise MirageError("-o -: a cubin is binary; send stdout to a file or a pipe "
                              "(and drop --json/--resource-usage)")
        sys.stdout.buffer.write(compile_cuda(src, file, arch).cubin)
        sys.stdout.flush()
        return
    with OutputSet([out], inputs=[file]) as outputs:
        compiled = compile_cuda(src, file, arch)
        outputs.commit({out: compiled.cubin})
    info(f"wrote {out} ({len(compiled.cubin)} bytes, {machine_arch(arch)})")
    dyn = dynamic_smem(src)
    rows = [{**r.__dict__, "smem_dynamic": dyn.get(r.kernel, 0)} for r in compiled.resources]
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
    elif resource_usage:
        from rich.console import Console

        t = Table("kernel", "registers", "static smem (B)", "dynamic smem (B)", "stack (B)",
                  "spill stores (B)", "spill loads (B)")
        for r in rows:
            t.add_row(r["kernel"], str(r["registers"]), str(r["smem_static"]),
                      str(r["smem_dynamic"]), str(r["stack"]), str(r["spill_stores"]),
                      str(r["spill_loads"]))
        Console(highlight=False).print(t)
