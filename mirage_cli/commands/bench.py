"""`mirage bench --gpu N`: correctness and speed of the examples' fused µGraphs
against the unfused lowering, PyTorch eager and torch.compile (DESIGN.md §7)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from mirage_cli.codegen.bench import Row, discover, markdown, rows_json, run_bench
from mirage_cli.diagnostics import MirageError
from mirage_cli.util import write_atomic


def _us(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def _x(base: float | None, us: float | None) -> str:
    return "-" if base is None or us is None else f"{base / us:.2f}x"


def table(rows: list[Row]) -> Table:
    t = Table("benchmark", "batch", "µGraph", "fused µs", "unfused µs", "eager µs",
              "compile µs", "floor µs", "vs unfused", "vs eager", "vs compile", "% floor",
              "rel err", title="mirage bench (median µs per call)")
    for r in rows:
        b = r.baselines
        t.add_row(r.benchmark, str(r.batch), r.variant if r.ok and not r.reason else
                  f"{r.variant} ({r.reason})" if r.ok else f"{r.variant} FAIL: {r.reason}",
                  _us(r.us), _us(b.get("unfused")), _us(b.get("eager")), _us(b.get("compile")),
                  f"{r.floor_us:.1f}", _x(b.get("unfused"), r.us), _x(b.get("eager"), r.us),
                  _x(b.get("compile"), r.us),
                  "-" if r.us is None else f"{100 * r.floor_us / r.us:.0f}%",
                  "-" if r.rel_err is None or math.isnan(r.rel_err) else f"{r.rel_err:.1e}")
    return t


@click.command()
@click.option("--gpu", "gpu", type=int, required=True, metavar="N", help="CUDA device ordinal.")
@click.option("--batch", "batches", default="1,8,16", show_default=True,
              help="Comma-separated batch sizes (-D batch=...).")
@click.option("--only", multiple=True, metavar="NAME", help="Only these example programs.")
@click.option("--root", default=".", show_default=True, help="Directory holding examples/.")
@click.option("--replays", type=int, default=30, show_default=True,
              help="CUDA-graph replays per measurement (the median is reported).")
@click.option("--no-torch", is_flag=True, help="Skip the PyTorch baselines.")
@click.option("--no-compile", is_flag=True, help="Skip the torch.compile baseline.")
@click.option("--json", "json_path", metavar="FILE", help="Write the results as JSON ('-': stdout).")
@click.option("--markdown", "md_path", metavar="FILE", help="Write the table as Markdown.")
def command(gpu: int, batches: str, only: tuple[str, ...], root: str, replays: int,
            no_torch: bool, no_compile: bool, json_path: str | None, md_path: str | None
            ) -> None:
    """Check and time every example's fused µGraphs on GPU N."""
    from mirage_cli.codegen.runner import Device

    try:
        bs = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise MirageError(f"--batch {batches}: expected comma-separated integers") from None
    pairs = [p for p in discover(Path(root)) if not only or p[0].stem in only]
    if not pairs:
        raise MirageError(f"no example programs under {root}/examples"
                          + (f" named {', '.join(only)}" if only else ""))
    dev = Device(gpu)
    rows = run_bench(dev, pairs, bs, replays, not no_torch, not no_compile)
    Console(highlight=False, width=200).print(table(rows))
    if json_path:
        text = json.dumps(rows_json(dev, rows, "mirage bench " + " ".join(sys.argv[2:])),
                          indent=2, sort_keys=True) + "\n"
        if json_path == "-":
            click.echo(text, nl=False)
        else:
            write_atomic(json_path, text)
    if md_path:
        write_atomic(md_path, markdown(rows_json(dev, rows, "")))
    if not all(r.ok for r in rows):
        sys.exit(1)
