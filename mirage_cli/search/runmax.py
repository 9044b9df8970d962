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

from mirage_cli import ops
from mirage_cli.builder import GraphBuilder
from mirage_cli.check import block_phases
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph, KernelOp
from mirage_cli.search.design import CustomD, Design, OpD, StoreD, Tuning, looped_kernel


def strip(program: Graph) -> Graph | None:
    """``program`` with its maxima taken out of its exponentials (see the module
    docstring), or None when it subtracts none."""
    users: dict[str, list[KernelOp | None]] = {}
    for op in program.ops:
        for i in op.inputs:
            users.setdefault(i, []).append(op)
    for name in program.outputs:
        users.setdefault(name, []).append(None)
    shifted = {op.outputs[0].name: op.inputs[0] for op in program.ops
               if _subtracts_its_max(op, program, users)}
    if not shifted and not any(op.op == "softmax" for op in program.ops):
        return None
    dropped = {op.inputs[1] for op in program.ops if op.outputs[0].name in shifted}
    dropped = {m for m in dropped
               if all(u is not None and u.outputs[0].name in shifted for u in users[m])}
    b = GraphBuilder(program.name, program.params)
    for inp in program.inputs:
        b.input(inp.value.name, inp.value.type.shape, inp.value.type.dtype, inp.dims_src,
                weight=inp.weight)
    names: dict[str, str] = {inp.value.name: inp.value.name for inp in program.inputs}
    try:
        for op in program.ops:
            out = op.outputs[0].name
            if out in dropped:
                continue
            if out in shifted:
                names[out] = names[shifted[out]]
                continue
            args = [names[i] for i in op.inputs]
            if op.op == "softmax":
                dim = ops.get("softmax").attr_values(op.attrs)["dim"]
                e = b.op("exp", args[0], out=b.fresh(f"{out}_exp"))
                z = b.op("sum", e, out=b.fresh(f"{out}_sum"), dim=dim, keepdim=True)
                names[out] = b.op("div", e, z, out=out)
            else:
                names[out] = b.op_with(op.op, args, dict(op.attrs), out=out)
        for name in program.outputs:
            b.output(names[name])
        return b.build()
    except MirageError:
        return None


def _subtracts_its_max(op: KernelOp, program: Graph,
                       users: dict[str, list[KernelOp | None]]) -> bool:
    """``op`` is ``x - max(x, dim, keepdim)`` and only exponentials read it."""
    if op.op != "sub":
        return False
    producer = next((p for p in program.ops if p.outputs[0].name == op.inputs[1]), None)
    if producer is None or producer.op != "max" or producer.inputs[0] != op.inputs[0]:
        return False
    if not ops.get("max").attr_values(producer.attrs).get("keepdim", False):
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
            top = add(OpD("acc_max_ld", args, ()))
            args = (add(OpD("sub", (args[0], top), ())),)
            shifted = True
        remap[nl + k] = add(OpD(o.op, args, o.attrs))
    if not shifted:
        return None
    stores = tuple(StoreD(remap[s.tile], s.name, s.omap) for s in c.stores)
    return Design((CustomD(c.loads, tuple(new), stores, c.axes, c.looped),), design.outputs)
