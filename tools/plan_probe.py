"""Check and time a µGraph under every legal value of every plan knob, on a GPU.

    python tools/plan_probe.py OUT.json PROGRAM.mir:BATCH[,NAME=N...]:GRAPH.ugraph.json ...

For each triple: the program (at ``-D batch=BATCH`` and the other ``NAME=N`` given, for
shapes the program's defaults do not have; a µGraph file as the program, such as a
layer's ``PART.ugraph.json`` from ``--save-temps``, keeps its own sizes and BATCH only
labels the rows) is the float64 reference and the
baseline (PyTorch eager and torch.compile, timed the same way); the µGraph is lowered
with its default plan and with each knob set to each of its legal values (the others
left to the planner), checked against the reference with NaN-poisoned outputs and
timed as CUDA-graph replays over input copies larger than twice the L2 (the bench's
method). The floor uses the bandwidth of a large device-to-device copy through
PyTorch's copy kernel measured in the same process. Prints a table; writes every row
to OUT.json (``PROBE_NO_TORCH=1``: no PyTorch baselines; ``PROBE_KNOBS=a,b``: only
these knobs; ``PROBE_PINS="kwarps=1;kwarps=1,tma=1"``: these sets of pins instead, each
one variant; ``PROBE_KERNEL=i``: pins on the i-th custom kernel only, the others keep
their recorded plans; ``PROBE_PER_KERNEL=1``: also each kernel of the default plan timed alone,
its intermediates uninitialised; ``PROBE_REPLAN=1``: the plans a µGraph file records
are dropped, so that the current planner plans it, as ``mirage opt`` would now). Used
for docs/perf-log.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from mirage_cli.codegen import bench
from mirage_cli.codegen.planner import knob_space
from mirage_cli.codegen.runner import Device
from mirage_cli.commands.plan import planned
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def probed(i: int) -> bool:
    """Whether custom kernel ``i`` (in program order) is one the pins apply to:
    ``PROBE_KERNEL=i`` names one, by default every kernel."""
    only = os.environ.get("PROBE_KERNEL")
    return only is None or int(only) == i


def pinned(g: Graph, pins: Knobs) -> Graph | None:
    """``g`` with ``pins`` on every probed custom kernel where they are legal (the
    planner chooses the rest); the other kernels keep the knobs of the plans ``g``
    records. Planned as codegen plans a µGraph (``commands.plan.planned``: the
    concatenations read in place, shifted ones included). None where no pin is legal
    or the planner refuses them."""
    types = g.tensor_types()
    customs = [op for op in g.ops if op.block is not None]
    per, any_ok = [], False
    for i, op in enumerate(customs):
        assert op.block is not None
        legal = {}
        if probed(i):
            space = knob_space(op.block, types, "sm_90")
            legal = {k: v for k, v in dataclasses.asdict(pins).items()
                     if v is not None and v in space[k]}
        any_ok = any_ok or bool(legal)
        per.append(Knobs(**legal) if legal else
                   op.plan.knobs if op.plan is not None else Knobs())
    if not any_ok:
        return None
    try:
        return planned(g, "sm_90", per)
    except MirageError:  # legal alone, not with the planner's other choices
        return None


def per_kernel_us(dev: Device, g: Graph, scale: float) -> list[dict[str, object]]:
    """Each launch of ``g`` timed alone, as `mirage bench --per-kernel` times it
    (:func:`mirage_cli.codegen.bench.kernel_times`)."""
    from mirage_cli.codegen.plan import Launch

    loaded = bench.build(dev, g)
    try:
        times = bench.kernel_times(dev, loaded, g, 20, scale)
        full = loaded.prog
        return [{"step": i, "kernel": k.name, "grid": list(k.grid), "threads": k.threads,
                 "smem": k.smem_bytes, "us": times[k.name]}
                for i, step in enumerate(full.steps) if isinstance(step, Launch)
                for k in (full.kernel(step.kernel),)]
    finally:
        loaded.unload()


def variants(g: Graph) -> list[tuple[str, Graph]]:
    out = [("default", g)]
    types = g.tensor_types()
    blocks = [op.block for op in g.ops if op.block is not None]
    spaces = [knob_space(bg, types, "sm_90") for i, bg in enumerate(blocks) if probed(i)]
    # PROBE_PINS="kwarps=1;kwarps=1,tma=1": these pin sets only, each as one variant.
    if sets := os.environ.get("PROBE_PINS"):
        for text in sets.split(";"):
            pins = dict(item.split("=") for item in text.split(","))
            pg = pinned(g, Knobs(**{k: int(v) for k, v in pins.items()}))
            if pg is not None:
                out.append((text, pg))
        return out
    only = os.environ.get("PROBE_KNOBS")
    for knob in (only.split(",") if only else Knobs.names()):
        values = sorted({v for s in spaces for v in s[knob]})
        if len(values) < 2:
            continue
        for v in values:
            pg = pinned(g, Knobs(**{knob: v}))
            if pg is not None:
                out.append((f"{knob}={v}", pg))
    return out


def defines_of(sizes: str) -> dict[str, int]:
    """``"8"`` or ``"8,heads=16,seq=8192"``: the batch, then other ``-D`` values."""
    batch, *rest = sizes.split(",")
    out = {"batch": int(batch)}
    for item in rest:
        name, value = item.split("=")
        out[name] = int(value)
    return out


def main(argv: list[str]) -> int:
    default_only = argv[0] == "--default-only"
    argv = argv[1:] if default_only else argv
    out_path, specs = argv[0], argv[1:]
    dev = Device(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for spec in specs:
        prog_path, sizes, graph_path = spec.split(":")
        defines = defines_of(sizes)
        batch = defines["batch"]
        # A µGraph file as the program (a layer's part): its own sizes.
        prog = load_graph(prog_path, defines if prog_path.endswith(".mir") else None)
        # A .mir as the graph: its unfused lowering, at the same sizes.
        g = load_graph(graph_path, defines if graph_path.endswith(".mir") else None)
        if os.environ.get("PROBE_REPLAN"):
            g = dataclasses.replace(g, ops=tuple(dataclasses.replace(op, plan=None)
                                                 for op in g.ops))
        floor = (bench.input_bytes(prog) + sum(prog.tensor_types()[n].nbytes
                                               for n in prog.outputs)) / bw * 1e6
        scale = bench.input_scale(prog)
        base: dict[str, float | None] = {"eager": None, "compile": None}
        for name, compiled in (() if os.environ.get("PROBE_NO_TORCH") else
                               (("eager", False), ("compile", True))):
            us, chk = bench._torch_baseline(dev, prog, compiled, 20, scale)
            base[name] = us
        for label, vg in ([("default", g)] if default_only else variants(g)):
            m = bench._measure(dev, label, vg, prog, 20, scale)
            us, chk = m.us, m.check
            row = {"program": prog.name, "batch": batch, "defines": defines, "graph": graph_path,
                   "variant": label, "us": us,
                   "ok": chk.ok, "rel_err": chk.rel_err, "reason": chk.reason,
                   "floor_us": floor, "bandwidth": bw, **base,
                   "plans": [op.plan.as_json() if op.plan else None for op in vg.ops]}
            if label == "default" and os.environ.get("PROBE_PER_KERNEL") and chk.ok:
                row["kernels"] = per_kernel_us(dev, vg, scale)
                for k in row["kernels"]:
                    print(f"    step {k['step']}: {k['us']:7.2f} us  grid {k['grid']} "
                          f"threads {k['threads']} smem {k['smem']}", flush=True)
            rows.append(row)
            print(f"{prog.name:16s} b={batch:>2} {label:14s} "
                  f"{'-' if us is None else f'{us:7.2f}'} us  floor {floor:6.2f}  "
                  f"eager {base['eager'] or 0:7.2f}  compile {base['compile'] or 0:7.2f}  "
                  f"{'ok' if chk.ok else 'FAIL ' + chk.reason} err={chk.rel_err:.1e}  "
                  f"{os.path.basename(graph_path)}",
                  flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
