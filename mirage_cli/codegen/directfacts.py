"""What makes a custom kernel a direct kernel (``codegen/direct.py``): each output element
computed by one thread straight from global memory.

:func:`direct_reason` decides (the planner plans such a kernel with no tile staged, and
``custom.py`` picks its emitter by the same test); :func:`fold` says how many values an
operator reduces per result; :func:`direct_locals` and
:func:`direct_reads` say which per-row values each element computes and how many input
elements it reads. Nothing here depends on the knobs or the target.
"""

from __future__ import annotations

from mirage_cli import ops
from mirage_cli.codegen.blockfacts import Analysis
from mirage_cli.ir import BlockOp
from mirage_cli.semantics.accum import Finish

# Input elements a direct kernel may read per output element, its per-row values
# recomputed by each thread (a split's combine over 64 splits reads about 320), and
# the longest row it reduces: a norm over a long row keeps the staged form, which
# reads each element once.
DIRECT_READS = 512
DIRECT_FOLD = 64


def is_alias(op: BlockOp) -> bool:
    """Whether ``op`` is an accumulator that, over one iteration, returns its input."""
    spec = ops.get(op.op).accum
    return (spec is not None and spec.reduce is ops.Reduce.NONE and spec.pre is ops.Pre.ID
            and spec.finish is Finish.ID)


def fold(op: BlockOp, a: Analysis) -> int | None:
    """How many values ``op`` combines into each result over a forloop of one
    iteration: the last dimension's length for a reduction along it (an operator, or
    an accumulator reducing each tile's last dimension), the number of groups for a
    sum down to a width; None for an element-wise operator or an alias. A reduction
    along another dimension is reported as one over the last (``direct_reason``
    refuses it first)."""
    reg = ops.get(op.op)
    n = a.types[op.inputs[0]].shape[-1]
    if reg.accum is not None:
        match reg.accum.reduce:
            case ops.Reduce.NONE:
                return None
            case ops.Reduce.LAST:
                return n
            case ops.Reduce.TO_WIDTH:
                return n // int(reg.attr_values(op.attrs)["width"])  # type: ignore[call-overload]
    match reg.cuda.kind:
        case "elementwise":
            return None
        case "sum_to":
            return n // int(reg.attr_values(op.attrs)["width"])  # type: ignore[call-overload]
    return n


def direct_reason(a: Analysis) -> str | None:
    """None when the block graph is computed element by element from global memory
    (``codegen/direct.py``), else the first reason it is not. It must have one
    iteration, outputs of one shape, every tensor with the outputs' leading dimensions
    (only the last differs: per-row values, rows of splits), and operators that are
    element-wise or reduce along the last dimension, at least one of them a reduction
    (element-wise kernels keep the staged form's 16-byte accesses); and it must read
    at most ``DIRECT_READS`` input elements per output element."""
    bg = a.bg
    if bg.forloop != 1:
        return "the forloop has more than one iteration"
    shapes = {a.types[bo.source].shape for bo in bg.outputs}
    if len(shapes) != 1:
        return "its outputs are not of one shape"
    lead = next(iter(shapes))[:-1]
    for name, t in a.types.items():
        if t.shape[:-1] != lead:
            return f"{name} does not share the outputs' leading dimensions"
    reduces = False
    for op in bg.ops:
        reg = ops.get(op.op)
        spec, kind = reg.accum, reg.cuda.kind
        if spec is not None and spec.reduce is ops.Reduce.NONE and not is_alias(op):
            return f"accumulator {op.op} over one iteration is not computed here"
        if spec is not None and spec.reduce is ops.Reduce.LAST and spec.pre is ops.Pre.SQUARE \
                and spec.finish is not Finish.RMS:
            return f"accumulator {op.op} over one iteration is not computed here"
        x = a.types[op.inputs[0]].shape
        attrs = reg.attr_values(op.attrs)
        if kind == "reduce" and (int(attrs["dim"]) % len(x) != len(x) - 1  # type: ignore[call-overload]
                                 or not attrs.get("keepdim", False)):
            return f"{op.op} does not reduce along the last dimension"
        if kind not in ("elementwise", "reduce", "rms", "sum_to", "accum"):
            return f"operator {op.op} is not computed element by element"
        n = fold(op, a)
        if n is not None and n > DIRECT_FOLD:
            return f"{op.op} reduces {n} values per result (at most {DIRECT_FOLD})"
        reduces = reduces or n is not None
    if not reduces:
        return "no reduction (the staged form's 16-byte accesses are faster)"
    n = direct_reads(a)
    if n > DIRECT_READS:
        return f"{n} input elements read per output element"
    return None


def direct_locals(a: Analysis) -> list[str]:
    """The tensors of a direct kernel computed once per output element, in block order:
    the per-row ones (last dimension 1) that operators compute."""
    return [op.outputs[0].name for op in a.bg.ops
            if not is_alias(op) and op.outputs[0].type.shape[-1] == 1]


def direct_reads(a: Analysis) -> int:
    """Input elements read to compute one element of a direct kernel's output (the most
    of its outputs): its own expression's and those of the per-row values it needs
    (:func:`direct_locals`), which each element computes again."""
    local = set(direct_locals(a))

    def src(name: str) -> str:  # an alias is its input
        op = a.producer.get(name)
        return src(op.inputs[0]) if op is not None and is_alias(op) else name

    def own(name: str) -> int:  # the expression of ``name``, per-row values as read
        op = a.producer.get(src(name))
        if op is None:
            return 1
        return (fold(op, a) or 1) * sum(cost(i) for i in op.inputs)

    def cost(name: str) -> int:
        return 0 if src(name) in local else own(name)

    def needed(name: str, seen: set[str]) -> set[str]:
        op = a.producer.get(src(name))
        if op is not None:
            name = src(name)
            if name in local:
                seen.add(name)
            for i in op.inputs:
                needed(i, seen)
        return seen
    return max(own(bo.source) + sum(own(n) for n in needed(bo.source, set()) - {src(bo.source)})
               for bo in a.bg.outputs)
