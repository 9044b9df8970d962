"""`mirage run FILE`: run a µGraph on the CPU with the reference interpreter.

Inputs come from ``--inputs in.npz`` (one array per program input, by name) or are
drawn at random (``--seed``). Outputs go to ``-o out.npz`` (written atomically), and a
one-line summary of each output goes to stderr. ``--precision float64`` (default)
computes everything in float64 and saves float64 arrays; ``native`` rounds device
tensors to their dtype (f32 accumulation) and saves them in their storage dtype.
``--json`` also prints the summary as JSON on stdout. ``-o -`` writes the .npz to
standard output (then the summary stays on stderr only).

Before anything is allocated, the memory the run needs is estimated from the shapes
(:func:`mirage_cli.interp.memory_estimate`); over ``--max-memory`` the program is
refused with exit 2, naming its largest tensor.

The executor is chosen in :func:`_executor`, the one place a later ``--gpu N``
option plugs in.
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import click
import numpy as np

from mirage_cli import interp
from mirage_cli.commands.common import (
    check_graph_memory,
    defines_option,
    max_memory_option,
    parse_defines,
    parse_size,
    write_output,
)
from mirage_cli.console import console
from mirage_cli.diagnostics import MirageError
from mirage_cli.dtypes import round_to, storage_dtype
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph

Executor = Callable[[Graph, Mapping[str, np.ndarray]], dict[str, np.ndarray]]


@click.command(short_help="Run a µGraph with the CPU reference interpreter.")
@click.argument("file", metavar="FILE")
@click.option("--inputs", "inputs_path", metavar="in.npz",
              help="Input arrays by name (default: random, see --seed).")
@click.option("-o", "--output", metavar="out.npz", help="Write the outputs here.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random inputs.")
@click.option("--precision", type=click.Choice(["float64", "native"]), default="float64",
              show_default=True, help="float64 everywhere, or the tensors' own dtypes.")
@defines_option
@click.option("--index", type=int, default=None, metavar="N",
              help="Which candidate of a candidate list (default: the first).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary of the outputs as JSON on stdout.")
@click.option("--gpu", type=int, default=None, metavar="N",
              help="Run the generated CUDA on GPU N and check it against the CPU reference "
                   "(exit 1 if the relative L2 error exceeds 1e-2 or an output is NaN).")
@max_memory_option
def command(file: str, inputs_path: str | None, output: str | None, seed: int,
            precision: str, defines: tuple[str, ...], index: int | None,
            as_json: bool, gpu: int | None, max_memory: str | None) -> None:
    """Run FILE (.mir, .ugraph.json or Mirage checkpoint) with the CPU reference."""
    limit = parse_size(max_memory)
    if output == "-" and as_json:
        raise MirageError("-o - writes the .npz to standard output; --json would mix "
                          "text into it")
    g = load_graph(file, parse_defines(defines), index)
    check_graph_memory([(g, file)], limit, "run")
    inputs = read_inputs(g, inputs_path) if inputs_path else interp.random_inputs(g, seed)
    failed = False
    if gpu is not None:
        from mirage_cli.codegen.bench import compare, run_on_gpu

        outputs = run_on_gpu(g, inputs, gpu)
        chk = compare(outputs, interp.run(g, inputs, "float64"), list(g.outputs))
        console.print(f"GPU {gpu} vs float64 reference: relative L2 error {chk.rel_err:.2e}"
                      + ("" if chk.ok else f": FAIL ({chk.reason})"), markup=False,
                      highlight=False, soft_wrap=True)
        failed, precision = not chk.ok, "native"
    else:
        outputs = _executor(precision)(g, inputs)
    for name, arr in outputs.items():
        console.print(_summary(name, arr), markup=False, highlight=False, soft_wrap=True)
    if as_json:
        stats = {"program": g.name, "precision": precision,
                 "inputs": "file" if inputs_path else f"random(seed={seed})",
                 "outputs": [dict(name=n, **_stats(a)) for n, a in outputs.items()]}
        click.echo(json.dumps(stats, indent=2, sort_keys=True))
    if output is not None:
        write_output(output, _npz_bytes(g, outputs, precision))
        if output != "-":
            console.print(f"wrote {output}", markup=False, highlight=False, soft_wrap=True)
    if failed:
        sys.exit(1)


def _executor(precision: str) -> Executor:
    """The CPU reference interpreter at ``precision`` (a GPU runner goes here later)."""
    match precision:
        case "float64":
            return lambda g, x: interp.run(g, x, "float64")
        case "native":
            return lambda g, x: interp.run(g, x, "native")
    raise MirageError(f"unknown precision '{precision}'")


def read_inputs(g: Graph, path: str) -> dict[str, np.ndarray]:
    """Every input of ``g`` from an .npz file, checked by name, shape and kind."""
    if not Path(path).is_file():
        raise MirageError("no such file", file=path)
    if not zipfile.is_zipfile(path):
        raise MirageError("not an .npz file (expected the zip archive that numpy.savez "
                          "writes)", file=path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except FileNotFoundError:
        raise MirageError("no such file", file=path) from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise MirageError(f"not a readable .npz file ({e})", file=path) from None
    names = list(g.input_names)
    for k in arrays:
        if k not in names:
            raise MirageError(f"array '{k}' is not an input of '{g.name}' (its inputs: "
                              f"{', '.join(names)})", file=path)
    out: dict[str, np.ndarray] = {}
    for inp in g.inputs:
        name, t = inp.value.name, inp.value.type
        if name not in arrays:
            raise MirageError(f"missing input '{name}' ({t})", file=path)
        x = arrays[name]
        if x.shape != t.shape:
            raise MirageError(f"input '{name}' has shape {list(x.shape)}, expected "
                              f"{list(t.shape)} ({t})", file=path)
        if x.dtype.kind not in "fiub":
            raise MirageError(f"input '{name}' has dtype {x.dtype}; expected numbers",
                              file=path)
        out[name] = round_to(t.dtype, x.astype(np.float32))
    return out


def _stats(x: np.ndarray) -> dict[str, object]:
    """Shape, mean, min and max of the finite values, and the count of the others."""
    finite = x[np.isfinite(x)]
    out: dict[str, object] = {"shape": list(x.shape), "nonfinite": int(x.size - finite.size)}
    if finite.size:
        out.update(mean=float(finite.mean()), min=float(finite.min()),
                   max=float(finite.max()))
    return out


def _summary(name: str, x: np.ndarray) -> str:
    s = _stats(x)
    text = (f"mean {s['mean']:.6g}  min {s['min']:.6g}  max {s['max']:.6g}" if "mean" in s
            else "no finite values")
    bad = s["nonfinite"]
    return f"{name}: {s['shape']}  {text}" + (f"  non-finite {bad}" if bad else "")


def _npz_bytes(g: Graph, outputs: dict[str, np.ndarray], precision: str) -> bytes:
    types = g.tensor_types()
    buf = io.BytesIO()
    arrays = {n: (a if precision == "float64" else a.astype(storage_dtype(types[n].dtype)))
              for n, a in outputs.items()}
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()
