"""Binding an imported µGraph to the program it claims to implement.

An imported candidate names its device tensors ``in<k>``, ``out<k>``, ``t<n>``
(:mod:`.mirage`); it relates to a program the way `mirage verify` relates any two
graphs: inputs and outputs by position, each of the same shape and dtype
(:func:`mirage_cli.verifier.api.check_signatures`). :func:`bind` checks that and
returns the candidate with the program's input and output names, so that everything
keyed by name afterwards (random inputs drawn per program, the runner's buffers, the
generated code's parameters) treats it exactly as the program's own variants.
Block-level tensor names are a scope of their own and are left as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mirage_cli.check import check_graph
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import BlockGraph, Graph, KernelOp, Value
from mirage_cli.verifier.api import check_signatures


def bind(candidate: Graph, program: Graph) -> Graph:
    """``candidate`` with ``program``'s input and output names, matched by position, and
    its inputs' ``weight`` declarations (the program's promise about its inputs).

    A :class:`MirageError` says which position differs when the signatures do not
    match (different counts, shapes or dtypes), or why the names cannot be carried
    over (a candidate that returns one tensor twice, or an input as an output)."""
    check_signatures(program, candidate)
    names = _device_names(candidate, program)

    def r(n: str) -> str:
        return names.get(n, n)

    inputs = tuple(dataclasses.replace(i, value=_renamed(i.value, r), weight=p.weight)
                   for i, p in zip(candidate.inputs, program.inputs))
    ops = tuple(_rename_op(op, r) for op in candidate.ops)
    bound = Graph(candidate.name, candidate.params, inputs, ops,
                  tuple(r(o) for o in candidate.outputs))
    check_graph(bound)  # a renaming that broke the graph is a bug to see here
    return bound


def _device_names(candidate: Graph, program: Graph) -> dict[str, str]:
    """Old name -> new name for every device tensor of ``candidate`` that changes:
    inputs and outputs take the program's names; any other tensor whose name one of
    them takes is renamed with trailing underscores to a name nobody uses."""
    wanted = dict(zip(candidate.input_names, program.input_names))
    for k, (old, new) in enumerate(zip(candidate.outputs, program.outputs)):
        if wanted.setdefault(old, new) != new:
            raise MirageError(f"output #{k} of '{candidate.name}' is '{old}', which is "
                              f"also its {'input' if old in candidate.input_names else 'output'}"
                              f" bound to '{wanted[old]}': the program's names cannot be "
                              f"carried over")
    others = [v.name for op in candidate.ops for v in op.outputs if v.name not in wanted]
    taken = set(wanted.values()) | set(others)
    names = dict(wanted)
    for old in others:
        if old in wanted.values():
            new = old + "_"
            while new in taken:
                new += "_"
            taken.add(new)
            names[old] = new
    return names


def _renamed(v: Value, r: Callable[[str], str]) -> Value:
    return dataclasses.replace(v, name=r(v.name))


def _rename_op(op: KernelOp, r: Callable[[str], str]) -> KernelOp:
    block = None if op.block is None else _rename_block(op.block, r)
    return dataclasses.replace(op, inputs=tuple(r(i) for i in op.inputs),
                               outputs=tuple(_renamed(v, r) for v in op.outputs), block=block)


def _rename_block(bg: BlockGraph, r: Callable[[str], str]) -> BlockGraph:
    """Only the device tensors a block graph loads from and stores into."""
    ins = tuple(dataclasses.replace(bi, source=r(bi.source)) for bi in bg.inputs)
    outs = tuple(dataclasses.replace(bo, value=_renamed(bo.value, r)) for bo in bg.outputs)
    return dataclasses.replace(bg, inputs=ins, outputs=outs)
