"""Write the fitting tunings of a µGraph's design, to time them on a GPU. No GPU needed.

    PYTHONPATH=$PWD python tools/tuning_sweep.py OUT_DIR PROGRAM.mir BATCH GRAPH.ugraph.json
        [--tag NAME] [--top N] [--blocks MIN,MAX] [--forloops 2,4,8,16]

GRAPH's design (:func:`mirage_cli.search.design.design_of`) is instantiated on PROGRAM
at ``-D batch=BATCH`` with every power-of-two grid of its first custom kernel (each
split axis at least 2 blocks, between MIN and MAX blocks in all) and every forloop
given, its other kernels at the tuning the tuner gives them; the ones the builder
accepts and whose plans fit are ranked by the cost model, and the first N are written
to OUT_DIR/TAG_gx_gy_gz_F.json, their predictions printed. Time them with
``PROBE_PER_KERNEL=1 tools/plan_probe.py --default-only``, then see how the model
ranks them against the measurements. docs/perf-log.md v23 swept gqa's and qknorm_gqa's
chain kernels so (``docs/perf/chain-sweep-h100-v23.json``).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.search.cost import estimate
from mirage_cli.search.design import Design, Tuning, custom_steps, design_of, instantiate
from mirage_cli.search.tune import tune
from mirage_cli.serialize import dumps

POWERS = [1, 2, 4, 8, 16, 32, 64, 128]


def grids(axes: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Power-of-two grids over ``axes`` split axes (each at least 2) of ``lo`` to ``hi``
    blocks."""
    out = []
    for g in itertools.product(POWERS, repeat=3):
        split, rest = g[:axes], g[axes:]
        if min(split, default=2) >= 2 and all(n == 1 for n in rest) and \
                lo <= g[0] * g[1] * g[2] <= hi:
            out.append((g[0], g[1], g[2]))
    return out


def sweep(program: Graph, design: Design, blocks: tuple[int, int], forloops: list[int]
          ) -> list[tuple[float, Tuning, Graph]]:
    """The fitting tunings of ``design`` on ``program`` (first kernel swept, the rest as
    tuned), best predicted first."""
    tuned = tune(program, design)
    if not tuned:
        return []
    rest = tuned[0][1][1:]
    first = custom_steps(design)[0]
    out = []
    for grid in grids(first.axes, *blocks):
        for f in forloops if first.looped else [1]:
            t: Tuning = ((grid, f),) + tuple(rest)
            g = instantiate(program, design, t)
            if g is None:
                continue
            c = estimate(g)
            if c.fits:
                out.append((c.time_us, t, g))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("program")
    ap.add_argument("batch", type=int)
    ap.add_argument("graph")
    ap.add_argument("--tag", default=None, help="file name prefix (default: program and batch)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--blocks", default="96,528", help="MIN,MAX blocks of the first kernel")
    ap.add_argument("--forloops", default="2,4,8,16")
    a = ap.parse_args()
    program = load_graph(a.program, {"batch": a.batch})
    design, _ = design_of(load_graph(a.graph))
    lo, hi = (int(x) for x in a.blocks.split(","))
    found = sweep(program, design, (lo, hi), [int(x) for x in a.forloops.split(",")])
    tag = a.tag or f"{Path(a.program).stem}{a.batch}"
    a.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{tag}: {len(found)} fitting tunings, writing {min(len(found), a.top)}")
    for us, t, g in found[:a.top]:
        (gx, gy, gz), f = t[0]
        name = f"{tag}_{gx}_{gy}_{gz}_{f}.json"
        (a.out_dir / name).write_text(dumps(g))
        print(f"{name} {us:.2f}")


if __name__ == "__main__":
    main()
