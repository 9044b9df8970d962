"""Time a µGraph's kernels with and without early weight copies, on a GPU.

    python tools/pdl_probe.py OUT.json PROGRAM.mir:BATCH:GRAPH.ugraph.json ...

Each kernel waits for the kernel ahead of it in the stream (``griddepcontrol.wait``)
and then lets the next one launch (``griddepcontrol.launch_dependents``); before the
wait it may copy the first pipeline stages of inputs declared ``weight``. For each
µGraph (its inputs' ``weight`` flags taken from the program), these variants:

- ``plain``: no input declared ``weight``, no release, 4 stages, no bulk tensor copies
  (the code before v19);
- ``weight tma=0``: the program's ``weight`` flags and the release, ``cp.async`` copies;
- ``weight``: as generated from the program, under its default plan;
- ``weight st=4``, ``weight st=8``, ``weight t=256``: one knob pinned.

Each is compiled by NVRTC, checked once against the float64 reference with
NaN-poisoned outputs, and timed the bench's way (CUDA-graph replays of calls rotating
over input copies larger than twice the L2). The floor uses the bench's copy-kernel
bandwidth. Used for docs/perf-log.md (v19).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from mirage_cli.codegen import bench, copybw, planner, smemplan
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.runner import Device
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph

MAX = int(os.environ.get("PROBE_MAX_STAGES", "8"))
smemplan.MAX_STAGES = planner.MAX_STAGES = MAX  # widen the knob's range for the sweep


def _flags(g: Graph, prog: Graph, on: bool) -> Graph:
    w = {i.value.name: i.weight for i in prog.inputs}
    ins = tuple(dataclasses.replace(i, weight=on and w.get(i.value.name, False))
                for i in g.inputs)
    return dataclasses.replace(g, inputs=ins)


def _pinned(g: Graph, **pins: int) -> Graph | None:
    types = g.tensor_types()
    ops = []
    for op in g.ops:
        if op.block is not None and op.plan is not None:
            space = planner.knob_space(op.block, types, "sm_90")
            if any(v not in space[k] for k, v in pins.items()):
                return None
            knobs = dataclasses.replace(op.plan.knobs, **pins)
            try:
                op = dataclasses.replace(op, plan=planner.plan_kernel(op.block, types,
                                                                      "sm_90", knobs))
            except MirageError:
                return None
        ops.append(op)
    return dataclasses.replace(g, ops=tuple(ops))


def variants(g: Graph, prog: Graph) -> list[tuple[str, Graph, bool]]:
    plain = _pinned(_flags(g, prog, False), stages=4, tma=0)
    out = [("plain", plain, False)] if plain is not None else []
    wg = _flags(g, prog, True)
    for label, pins in (("weight tma=0", {"tma": 0}), ("weight", {}),
                        ("weight st=4", {"stages": 4}), ("weight st=8", {"stages": 8}),
                        ("weight t=256", {"threads": 256})):
        pg = _pinned(wg, **pins) if pins else wg
        if pg is not None:
            out.append((label, pg, True))
    return out


def main(argv: list[str]) -> int:
    out_path, specs = argv[0], argv[1:]
    dev = Device(0)
    bw = copybw.measure(dev).copy_kernel
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for spec in specs:
        prog_path, batch, graph_path = spec.split(":")
        prog = load_graph(prog_path, {"batch": int(batch)})
        g = load_graph(graph_path)
        floor = bench.floor_us(prog, bw)
        scale = bench.input_scale(prog)
        base = {name: bench._torch_baseline(dev, prog, c, 20, scale)[0]
                for name, c in (("eager", False), ("compile", True))}
        for label, vg, release in variants(g, prog):
            lowered = lower(vg)
            cu, _ = emit(lowered)
            if not release:
                cu = cu.replace("  mg_grid_release();\n", "")
            res = compile_cuda(cu, f"{lowered.name}.cu", dev.arch)
            loaded = dev.load(lowered, res.cubin)
            chk = bench.compare(loaded.run(bench.scaled_inputs(prog, 0, scale)),
                                bench.reference_outputs(prog, 0, scale), list(prog.outputs))
            us = bench.time_loaded(dev, loaded, prog, 20, scale) if chk.ok else None
            loaded.unload()
            smem = [k.smem_bytes for k in lowered.kernels]
            rows.append({"program": prog.name, "batch": int(batch), "variant": label,
                         "us": us, "ok": chk.ok, "rel_err": chk.rel_err, "floor_us": floor,
                         "bandwidth": bw, "smem": smem, **base,
                         "plans": [k.plan for k in lowered.kernels]})
            print(f"{prog.name:15s} b={batch:>2} {label:13s} "
                  f"{'-' if us is None else f'{us:7.2f}'} us  floor {floor:6.2f}  "
                  f"compile {base['compile'] or 0:6.2f}  smem {smem} "
                  f"{'ok' if chk.ok else 'FAIL ' + chk.reason}", flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
