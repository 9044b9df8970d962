"""`mirage import-mirage`: Mirage µGraph checkpoints to canonical `.ugraph.json` files.

    mirage import-mirage CKPT.json -o DIR             # DIR/<stem>.<i>.ugraph.json, each candidate
    mirage import-mirage CKPT.json -o F --index N     # candidate N only, to F
    mirage import-mirage CKPT.json [--index N]        # to stdout (a candidate list, or one graph)

A summary (candidates, kernels and custom kernels per candidate) goes to stderr, or to
stdout as JSON with ``--json`` (which then needs ``-o``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mirage_cli import serialize
from mirage_cli.console import info
from mirage_cli.diagnostics import MirageError
from mirage_cli.importers import mirage_dtypes
from mirage_cli.importers.mirage import import_checkpoint
from mirage_cli.ir import Graph
from mirage_cli.loading import read_text
from mirage_cli.util import write_atomic


def _stem(path: str) -> str:
    name = Path(path).name
    return name.removesuffix(".json")


def _summary(g: Graph) -> dict[str, Any]:
    return {"kernels": len(g.ops), "custom_kernels": sum(op.op == "custom" for op in g.ops)}


def _targets(checkpoint: str, graphs: list[Graph], output: str | None,
             index: int | None) -> list[tuple[int, str | None]]:
    """(candidate index, file to write or None for stdout) for each candidate to emit."""
    if index is not None:
        if not 0 <= index < len(graphs):
            raise MirageError(f"--index {index} is out of range: the checkpoint holds "
                              f"{len(graphs)} candidate(s)", file=checkpoint)
        return [(index, output)]
    if output is None:
        return [(i, None) for i in range(len(graphs))]
    if Path(output).exists() and not Path(output).is_dir():
        raise MirageError(f"-o {output} is a file; without --index, -o names a directory "
                          f"for one .ugraph.json per candidate")
    stem = _stem(checkpoint)
    return [(i, str(Path(output) / f"{stem}.{i}.ugraph.json")) for i in range(len(graphs))]


@click.command(name="import-mirage")
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option("-o", "--output", metavar="DIR|FILE",
              help="Directory for <stem>.<i>.ugraph.json files, or the file for --index N.")
@click.option("--index", type=int, default=None, help="Import only candidate N (from 0).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--mirage-dtypes", "numbering", type=click.Choice(list(mirage_dtypes.NUMBERINGS)),
              default=None, help="Mirage's data_type numbering, where the file leaves it open.")
def command(checkpoint: str, output: str | None, index: int | None, as_json: bool,
            numbering: str | None) -> None:
    """Import a Mirage checkpoint (a JSON array of candidate µGraphs)."""
    if as_json and output is None:
        raise MirageError("--json prints the summary on stdout; write the graphs with -o")
    graphs = import_checkpoint(read_text(checkpoint), checkpoint, numbering)
    targets = _targets(checkpoint, graphs, output, index)
    base = Path(checkpoint).name
    if output is None:
        if index is not None:
            click.echo(serialize.dumps(graphs[index]), nl=False)
        else:
            click.echo(serialize.dumps_candidates(
                [(g, {"source": base, "index": i}) for i, g in enumerate(graphs)]), nl=False)
    else:
        for i, path in targets:
            assert path is not None
            write_atomic(path, serialize.dumps(graphs[i]))
    rows = [dict(index=i, path=path, **_summary(graphs[i])) for i, path in targets]
    if as_json:
        click.echo(json.dumps({"checkpoint": checkpoint, "candidates": len(graphs),
                               "imported": rows}, indent=2, sort_keys=True))
        return
    info(f"{base}: {len(graphs)} candidate(s)")
    for row in rows:
        where = f" -> {row['path']}" if row["path"] else ""
        info(f"  candidate {row['index']}: {row['kernels']} kernel(s), "
             f"{row['custom_kernels']} custom{where}")
