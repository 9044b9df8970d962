"""A max-subtracted softmax in one loop over its keys: the running maximum.

The generator (:mod:`.enumerate`) adds a kernel's operators phase by phase: loop
body, accumulators, epilogue. A softmax's maximum over the keys is an accumulator of
a loop over the keys, and ``exp(x - max)`` reads it inside that loop again, so the
generator never builds such a kernel; and at decode sizes a whole row of keys does
not fit one block. This move finds those kernels anyway:

1. :func:`strip` writes the program without its maxima: every ``softmax(x, dim)`` as
   ``exp(x) / sum(exp(x), dim)``, every ``exp(x - max(x, dim))`` as ``exp(x)``. In
   exact arithmetic that is the same function (shift invariance); the generator
   searches it as it searches gqa, whose loops walk the keys.
2. :func:`with_running_max` puts the maximum back into a one-kernel design of the
   stripped program whose loop computes ``exp(x)`` in every iteration:
   ``m = acc_max_ld(x)`` and ``exp(x - m)``, a loop operator reading an
   accumulator's result, i.e. the maximum over *all* iterations
   (:func:`mirage_cli.check.block_phases`). The code generator runs it with a
   running maximum and rescales the sums when it grows (``codegen/chain.py``).

The result evaluates the program's own expression, every exponent ``x - max x <= 0``,
so it is verified against the program itself (the finite-field maximum is a random
function of the multiset of elements reduced, the same whether the row is reduced in
one piece or over iterations) and passes the numerics check where the program does.
Its split over blocks (each block a chunk of the keys with its own running maximum,
the chunks rescaled when they are added) is :mod:`.online`'s move.
"""

from __future__ import annotations

from dataclasses import replace

from mirage_cli import ops
from mirage_cli.builder import GraphBuilder
from mirage_cli.check import block_phases
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import AttrValue, Graph, KernelOp
from mirage_cli.search.design import CustomD, Design, OpD, Tuning, looped_kernel


def strip(program: Graph) -> Graph | None:
    """``program`` with its maxima taken out of its exponentials (see the module
    docstring), or None when it subtracts none. Composite operators whose registry
    decomposition takes a maximum (``softmax``) are written as their parts first."""
    program = _expanded(program)
    users: dict[str, list[KernelOp | None]] = {}
    for op in program.ops:
        for i in op.inputs:
            users.setdefault(i, []).append(op)
    for name in program.outputs:
        users.setdefault(name, []).append(None)
    made = {op.outputs[0].name: op for op in program.ops}
    shifted = {op.outputs[0].name: op.inputs[0] for op in program.ops
               if _subtracts_its_max(op, made, users)}
    if not shifted:
        return None
    dropped = {made[s].inputs[1] for s in shifted}
    dropped = {m for m in dropped
               if all(u is not None and u.outputs[0].name in shifted for u in users[m])}
    b = _builder(program)
    names: dict[str, str] = {inp.value.name: inp.value.name for inp in program.inputs}
    try:
        for op in program.ops:
            out = op.outputs[0].name
            if out in dropped:
                continue
            if out in shifted:
                names[out] = names[shifted[out]]
                continue
            names[out] = b.op_with(op.op, [names[i] for i in op.inputs], dict(op.attrs),
                                   out=out)
        for name in program.outputs:
            b.output(names[name])
        return b.build()
    except MirageError:
        return None


def _builder(program: Graph) -> GraphBuilder:
    """A builder holding ``program``'s inputs."""
    b = GraphBuilder(program.name, program.params)
    for inp in program.inputs:
        b.input(inp.value.name, inp.value.type.shape, inp.value.type.dtype, inp.dims_src,
                weight=inp.weight)
    return b


def _expanded(program: Graph) -> Graph:
    """``program`` with every operator whose registry decomposition takes a maximum
    written as that decomposition (its last part keeps the operator's name)."""
    parts = {op.outputs[0].name: _parts(op) for op in program.ops}
    if not any(p is not None and any(ops.is_maximum(n) for n, _, _ in p[0])
               for p in parts.values()):
        return program
    b = _builder(program)
    for op in program.ops:
        out = op.outputs[0].name
        p = parts[out]
        if p is None or not any(ops.is_maximum(n) for n, _, _ in p[0]):
            b.op_with(op.op, op.inputs, dict(op.attrs), out=out)
            continue
        steps, result = p
        made: list[str] = []
        for k, (name, args, attrs) in enumerate(steps):
            ins = [made[a] if isinstance(a, int) else a for a in args]
            made.append(b.op_with(name, ins, attrs,
                                  out=out if k == result else b.fresh(f"{out}_{name}")))
    for name in program.outputs:
        b.output(name)
    return b.build()


Parts = tuple[list[tuple[str, tuple[int | str, ...], dict[str, AttrValue]]], int]


def _parts(op: KernelOp) -> Parts | None:
    """The operators ``op``'s registry decomposition emits (an ``int`` argument is an
    earlier part's index, a ``str`` one of ``op``'s inputs), and which part is its
    result; None for an operator that has none."""
    opdef = ops.get(op.op)
    if opdef.decompose is None:
        return None
    steps: list[tuple[str, tuple[int | str, ...], dict[str, AttrValue]]] = []

    def emit(name: str, *args: int | str, **attrs: AttrValue) -> int:
        steps.append((name, args, attrs))
        return len(steps) - 1

    result = opdef.decompose(emit, list(op.inputs), opdef.attr_values(op.attrs))
    return steps, result


def _subtracts_its_max(op: KernelOp, made: dict[str, KernelOp],
                       users: dict[str, list[KernelOp | None]]) -> bool:
    """``op`` is ``x - max(x, dim, keepdim)`` and only exponentials read it."""
    producer = made.get(op.inputs[1]) if op.op == "sub" else None
    if producer is None or not ops.is_maximum(producer.op) \
            or producer.inputs[0] != op.inputs[0]:
        return False
    if not ops.get(producer.op).attr_values(producer.attrs).get("keepdim", False):
        return False
    return all(u is not None and u.op == "exp" for u in users[op.outputs[0].name])


def with_running_max(program: Graph, design: Design, tuning: Tuning) -> Design | None:
    """The one-kernel ``design`` (of :func:`strip`'s program) with a running maximum
    subtracted before every exponential its loop computes, as a design of
    ``program``; None where it has no such exponential. ``tuning`` is any valid
    tuning of the design (it gives the phases)."""
    found = looped_kernel(program, design, tuning)
    if found is None:
        return None
    c, bg = found
    phases = block_phases(bg)
    nl = len(c.loads)
    new: list[OpD] = []
    remap = {i: i for i in range(nl)}

    def add(o: OpD) -> int:
        new.append(o)
        return nl + len(new) - 1

    shifted = False
    for k, (o, bop) in enumerate(zip(c.ops, bg.ops)):
        args = tuple(remap[a] for a in o.args)
        if o.op == "exp" and phases[bop.outputs[0].name] == "loop":
            top = add(OpD(ops.accumulator_of(ops.ROW_MAX), args, ()))
            args = (add(OpD("sub", (args[0], top), ())),)
            shifted = True
        remap[nl + k] = add(OpD(o.op, args, o.attrs))
    if not shifted:
        return None
    stores = tuple(replace(s, tile=remap[s.tile]) for s in c.stores)
    return Design((CustomD(c.loads, tuple(new), stores, c.axes, c.looped),), design.outputs)
