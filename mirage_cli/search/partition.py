"""Mixed designs: a program cut at its own intermediate tensors.

The generator builds designs kernel by kernel from the program's inputs, and a custom
kernel stores only program outputs (or partial sums for the split-reduction move). A
whole MLP (gate and up projections, then the down projection) or LayerNorm + linear
then has no design whose kernels fit: one kernel cannot hold the whole intermediate.
Here the program's operator list is *cut* after operator ``i``: the first part is a
program whose outputs are the tensors live across the cut, the second part a program
that takes them as inputs. Each part is searched on its own (recursively: a part may
be cut again, to ``MAX_DEPTH``); a part of one operator that nothing fused beats is
that pre-defined operator itself. The parts' designs are joined (internal tensor names
renamed apart) into one design of the whole program, tuned by concatenating the parts'
tunings, and then verified against the whole program like every other candidate.

So "custom kernel, then a pre-defined operator" (or the other way round, or two custom
kernels meeting at a program tensor) comes out of the same search, with every kernel
boundary at a tensor the program itself names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from mirage_cli.builder import GraphBuilder
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.search.design import CustomD, Design, LoadD, PredefD, Step, Tuning

MAX_DEPTH = 2


@dataclass(frozen=True)
class Part:
    """One side of a cut: a program and the program tensors it produces."""

    graph: Graph
    outputs: tuple[str, ...]


def cut_points(program: Graph) -> list[int]:
    """Positions to cut at (after operator ``i - 1``), the latest first: the second
    part is then as small as possible (often one pre-defined operator)."""
    return list(range(len(program.ops) - 1, 0, -1))


def split(program: Graph, at: int) -> tuple[Part, Part] | None:
    """The two programs of the cut before operator ``at`` (None if a part would have
    no output)."""
    first, second = program.ops[:at], program.ops[at:]
    made = {v.name for op in first for v in op.outputs}
    used_later = {i for op in second for i in op.inputs} | set(program.outputs)
    live = tuple(v.name for op in first for v in op.outputs if v.name in used_later)
    outs2 = tuple(o for o in program.outputs if o not in made)
    if not live or not outs2:
        return None
    try:
        g1 = subprogram(program, first, live, f"{program.name}_part1")
        g2 = subprogram(program, second, outs2, f"{program.name}_part2")
    except MirageError:
        return None
    return Part(g1, live), Part(g2, outs2)


def subprogram(program: Graph, ops: tuple, outputs: tuple[str, ...], name: str) -> Graph:
    types = program.tensor_types()
    made = {v.name for op in ops for v in op.outputs}
    needed = [i for op in ops for i in op.inputs if i not in made]
    b = GraphBuilder(name, program.params)
    src = {i.value.name: i for i in program.inputs}
    for n in dict.fromkeys(needed):
        t = types[n]
        b.input(n, t.shape, t.dtype, src[n].dims_src if n in src else (),
                weight=n in src and src[n].weight)
    for op in ops:
        b.op(op.op, *op.inputs, out=op.outputs[0].name, **dict(op.attrs))  # type: ignore[arg-type]
    for o in outputs:
        b.output(o)
    return b.build()


def output_cones(program: Graph) -> list[Graph] | None:
    """One sub-program per output of ``program``: the operators that output needs, in
    program order, those shared with other outputs repeated in each (a normalisation
    feeding three projections). None unless there are two or more outputs and none is
    read on the way to another (then its cone would repeat the other's whole work)."""
    if len(program.outputs) < 2:
        return None
    producer = {v.name: i for i, op in enumerate(program.ops) for v in op.outputs}
    cones = []
    for j, out in enumerate(program.outputs):
        need: set[int] = set()
        todo = [out]
        while todo:
            i = producer.get(todo.pop())
            if i is not None and i not in need:
                need.add(i)
                todo.extend(program.ops[i].inputs)
        if any(producer.get(o) in need for o in program.outputs if o != out):
            return None
        ops = tuple(program.ops[i] for i in sorted(need))
        cones.append(subprogram(program, ops, (out,), f"{program.name}_out{j}"))
    return cones


def predefined(part: Graph) -> tuple[Design, Tuning] | None:
    """A one-operator part as that pre-defined operator."""
    if len(part.ops) != 1 or part.ops[0].block is not None:
        return None
    op = part.ops[0]
    return Design((PredefD(op.op, op.inputs, op.attrs, op.outputs[0].name),),
                  tuple(part.outputs)), ()


def join(program: Graph, parts: list[tuple[Design, Tuning]]) -> tuple[Design, Tuning]:
    """One design of ``program`` from the parts' designs, in order: names a part
    invents (not the program's) are prefixed with the part's number."""
    keep = set(program.tensor_types())
    steps: list[Step] = []
    tuning: Tuning = ()
    for k, (d, t) in enumerate(parts):
        rename = _renamer(keep, f"p{k}_")
        steps.extend(_rename_step(s, rename) for s in d.steps)
        tuning += t
    return Design(tuple(steps), tuple(program.outputs)), tuning


def _renamer(keep: set[str], prefix: str) -> Callable[[str], str]:
    return lambda n: n if n in keep else prefix + n


def _rename_step(s: Step, r: Callable[[str], str]) -> Step:
    if isinstance(s, PredefD):
        return PredefD(s.op, tuple(r(a) for a in s.args), s.attrs, r(s.name))
    return CustomD(tuple(LoadD(r(ld.source), ld.imap, ld.fmap) for ld in s.loads), s.ops,
                   tuple(replace(st, name=r(st.name)) for st in s.stores),
                   s.axes, s.looped)
