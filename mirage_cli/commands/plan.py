"""`mirage plan FILE`: the kernel plan of every custom kernel (DESIGN.md §2).

Prints each custom kernel's plan (the thread level: threads, where every tile lives,
access widths, pipeline depth, mma mapping, reductions) and its tuning space (each
knob's legal values). ``--pin stages=2,kwarps=1`` or ``--plan PINS.json`` fixes knobs
(an illegal value is a diagnostic, exit 2); ``-o best.ugraph.json`` writes the µGraph
with the plans attached, which ``mirage codegen`` then follows.
"""

from __future__ import annotations

import dataclasses
import json

import click

from mirage_cli import serialize
from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.custom import located_plan
from mirage_cli.codegen.joins import joins, shifted_names
from mirage_cli.codegen.planner import knob_space
from mirage_cli.commands.common import defines_option, parse_defines
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs, knobs_from_json
from mirage_cli.loading import load_graph, read_text
from mirage_cli.util import write_atomic


def parse_pins(text: str) -> Knobs:
    """``stages=2,kwarps=1`` → knob pins."""
    d: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise MirageError(f"--pin {item}: expected KNOB=INTEGER")
        d[key.strip()] = int(value)
    try:
        return knobs_from_json(d, "--pin")
    except ValueError as e:
        raise MirageError(str(e)) from None


def pins_file(path: str) -> list[Knobs]:
    """A JSON list with one object of knob pins per custom kernel, in order."""
    try:
        doc = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise MirageError(f"{path}:{e.lineno}:{e.colno}: error: invalid JSON: {e.msg}") from None
    if not isinstance(doc, list):
        raise MirageError(f"{path}: expected a JSON list of knob objects, one per custom kernel")
    try:
        return [knobs_from_json(d, f"{path}[{i}]") for i, d in enumerate(doc)]
    except ValueError as e:
        raise MirageError(str(e)) from None


def recorded_pins(g: Graph) -> list[Knobs]:
    """The knobs of the plans a µGraph carries (defaults where it carries none)."""
    return [op.plan.knobs if op.plan is not None else Knobs()
            for op in g.ops if op.block is not None]


def plan_report(g: Graph, arch: str) -> list[dict]:  # type: ignore[type-arg]
    """Each custom kernel's plan (its recorded knobs pinned) and tuning space."""
    g = planned(g, arch, recorded_pins(g))
    types = g.tensor_types()
    return [{"kernel": i, "plan": op.plan.as_json() if op.plan else None,
             "space": knob_space(op.block, types, arch, op.plan.knobs)
             if op.block is not None and op.plan is not None else None}
            for i, op in enumerate(g.ops) if op.block is not None]


def planned(g: Graph, arch: str, pins: list[Knobs]) -> Graph:
    """``g`` with a plan on every custom kernel (the i-th pins on the i-th kernel), the
    plan its code is generated from: with the concatenations it reads in place staged
    (codegen/joins.py)."""
    types = g.tensor_types()
    joined = joins(g, arch)
    found = frozenset(joined)
    ops, k = [], 0
    for op in g.ops:
        if op.block is not None:
            p = pins[k] if k < len(pins) else Knobs()
            mine = found & set(op.inputs)
            plan = located_plan(op, types, arch, p, mine, shifted_names(joined, mine))
            ops.append(dataclasses.replace(op, plan=plan))
            k += 1
        else:
            ops.append(op)
    if k < len(pins):
        raise MirageError(f"{len(pins)} sets of knob pins given, but the µGraph has {k} "
                          f"custom kernel(s)")
    return dataclasses.replace(g, ops=tuple(ops))


@click.command()
@click.argument("file", metavar="FILE")
@click.option("-o", "--output", metavar="best.ugraph.json",
              help="Write the µGraph with its plans attached.")
@click.option("--arch", default=DEFAULT_ARCH, show_default=True, help="Target architecture.")
@click.option("--pin", "pin", default="", metavar="KNOB=V,...",
              help="Pin knobs of every custom kernel.")
@click.option("--plan", "plan_path", metavar="PINS.json",
              help="A JSON list of knob objects, one per custom kernel.")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
@defines_option
def command(file: str, output: str | None, arch: str, pin: str, plan_path: str | None,
            as_json: bool, defines: tuple[str, ...]) -> None:
    """Plan the custom kernels of FILE and print the plans and their tuning space."""
    g = load_graph(file, parse_defines(defines))
    n = sum(1 for op in g.ops if op.block is not None)
    # Without pins, the plans FILE records are kept (re-planning from defaults would
    # print and write plans that are not the ones codegen follows).
    if plan_path:
        pins = pins_file(plan_path)
    elif pin:
        pins = [parse_pins(pin)] * n
    else:
        pins = recorded_pins(g)
    g = planned(g, arch, pins)
    doc = plan_report(g, arch)
    click.echo(json.dumps(doc, indent=2, sort_keys=True) if as_json else plan_text(doc))
    if output:
        write_atomic(output, serialize.dumps(g))


def plan_text(doc: list[dict]) -> str:  # type: ignore[type-arg]
    out = []
    for d in doc:
        p = d["plan"]
        out.append(f"kernel {d['kernel']}: {p['threads']} threads ({p['warps']} warps), "
                   f"{p['smem_bytes']} B shared memory, scratch {p['scratch_floats']} floats, "
                   f"{p['arch']}")
        out.append("  knobs: " + ", ".join(f"{k}={v}" for k, v in sorted(p["knobs"].items())))
        out.append("  space: " + "; ".join(f"{k} in {v}" for k, v in sorted(d["space"].items())))
        for t in p["tiles"]:
            where = f" @{t['smem_offset']} pitch {t['pitch']}" if t["smem_offset"] >= 0 else ""
            out.append(f"  tile {t['name']}: {t['home']}{where}, vec {t['vec']}, "
                       f"stages {t['stages']}: {t['owner']}")
        for m in p["mmas"]:
            out.append(f"  mma {m['output']}: A {m['a_path']}, B {m['b_path']}, kwarps "
                       f"{m['kwarps']}, {m['tiles_per_warp']} tile(s)/warp"
                       + (f", accumulates into {m['accumulator']}" if m["accumulator"] else ""))
        for r in p["reductions"]:
            out.append(f"  reduce {r['output']}: {r['strategy']}, {r['threads_per_row']} "
                       f"threads per row")
    return "\n".join(out)
