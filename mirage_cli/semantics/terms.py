"""Abstract expressions: what a tensor computes, with its indices abstracted away.

After the Mirage paper (§4.3), every tensor of a µGraph gets a term over its program's
inputs in which element indices are dropped: ``matmul(a, b)`` becomes
``sum(k, mul(a, b))`` (``k`` the size of the contracted dimension), a forloop
accumulator over ``F`` iterations of a tile whose last dimension has ``m`` elements
becomes ``sum(F*m, ...)``, ``rms(x)`` over ``n`` elements is
``sqrt(div(sum(n, mul(x, x)), size(n)))``, and composite operators (``rms_norm``,
``softmax``) are expanded through their registered decompositions.

This module owns the term language and the *rule library* that the operator registry
references: each :class:`~mirage_cli.ops.OpDef` holds an :class:`AbstractRule` in its
``abstract`` slot (expression + index-label rule + the function symbols it introduces)
and, for composite operators, a decomposition in its ``decompose`` slot. It must not
import :mod:`mirage_cli.ops` (ops imports it): lookups of other operators go through a
``lookup`` function the registry passes in.

Terms are plain nested tuples, so they hash and compare structurally:
``("in", name) | ("size", n) | ("const", text) | ("add", (t, ...)) | ("mul", (t, ...))
| ("sum", n, t) | ("max", n, t) | (fn, t, ...)``. Construction normalises what is cheap
and true under the abstraction: ``add``/``mul`` are flattened and their operands sorted
(AC), ``sum(1, x) = x``, ``sum(m, sum(n, x)) = sum(m*n, x)``, and fractions are kept in
one normal form (divisions move out of products and sums and nested quotients merge),
so that the many orders of dividing by the same norms give one term: the search then
builds each distinct tile once. The Z3 axioms of :mod:`.prune` state the same
identities, and more, as equations.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, assert_never

from mirage_cli.ir import AttrValue, TensorType
from mirage_cli.semantics.accum import AccumSpec, Finish, Pre, Reduce, is_extreme

# Finds an operator's registry entry by name (an ``ops.OpDef``, read by attribute).
Lookup = Callable[[str], Any]

Term = tuple[Any, ...]
Labels = tuple[int, ...]
Unions = list[tuple[int, int]]

# Index label of a dimension of size 1 produced by a reduction (never split).
UNIT = -1
# Attribute key through which block-level evaluation passes the forloop range to
# accumulator rules (accumulators have no such attribute of their own).
FORLOOP_KEY = "__forloop__"
# Labels minted by ``index_fresh`` start here (an analysis counts input dims from 0).
FRESH_LABELS = 1 << 30
# Heads of the terms that reduce a counted number of elements: (head, n, term).
REDUCTIONS = frozenset({"sum", "max", "min"})

# ---------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 12)
def term_key(t: Term) -> str:
    """A total order on terms (used to sort operands of AC operators). Memoised: the
    search sorts the same few operands again for every product and sum it builds (a
    few hundred distinct ones over qknorm_gqa's 300 000 sorts). Equal terms have one
    repr: their numbers are ints (sizes and counts), their constants strings."""
    return repr(t)


def inp(name: str) -> Term:
    return ("in", name)


def size(n: int) -> Term:
    return ("size", int(n))


def const(value: AttrValue) -> Term:
    return ("const", repr(value))


def _ac(op: str, xs: Sequence[Term]) -> Term:
    flat: list[Term] = []
    for x in xs:
        flat.extend(x[1] if x[0] == op else (x,))
    return (op, tuple(sorted(flat, key=term_key)))


def add(*xs: Term) -> Term:
    return _ac("add", xs)


def mul(*xs: Term) -> Term:
    """Product; divisions among the factors move out (a/b * c = (a*c)/b) so that
    equal fractions get equal terms."""
    nums: list[Term] = []
    dens: list[Term] = []
    for x in xs:
        if x[0] == "div":
            nums.append(x[1])
            dens.append(x[2])
        else:
            nums.append(x)
    if dens:
        return div(mul(*nums), mul(*dens))
    return _ac("mul", nums) if len(nums) > 1 else nums[0]


def div(a: Term, b: Term) -> Term:
    """Quotient in normal form: one fraction (a/b)/c = a/(b*c), a/(b/c) = (a*c)/b."""
    if a[0] == "div":
        return div(a[1], mul(a[2], b))
    if b[0] == "div":
        return div(mul(a, b[2]), b[1])
    return ("div", a, b)


def sum_(n: int, x: Term) -> Term:
    """Sum over ``n`` elements: nested sums merge; a divisor leaves the sum (the
    index abstraction cannot tell whether it depends on the summed index, as in
    Mirage's axioms)."""
    if n == 1:
        return x
    if x[0] == "sum":
        return ("sum", n * x[1], x[2])
    if x[0] == "div":
        return div(sum_(n, x[1]), x[2])
    return ("sum", int(n), x)


def max_(n: int, x: Term) -> Term:
    return x if n == 1 else ("max", int(n), x)


def extreme(combine: str, n: int, x: Term) -> Term:
    """max or min over ``n`` elements (``combine`` one of :data:`REDUCTIONS` but sum)."""
    return x if n == 1 else (combine, int(n), x)


def fn(name: str, *xs: Term) -> Term:
    return (name, *xs)


def subterms(t: Term) -> list[Term]:
    """Every subterm of ``t`` (including ``t``), children first, each once."""
    out: dict[Term, None] = {}

    def walk(x: Term) -> None:
        for c in children(x):
            walk(c)
        out[x] = None

    walk(t)
    return list(out)


def children(t: Term) -> tuple[Term, ...]:
    head = t[0]
    if head in ("in", "size", "const"):
        return ()
    if head in ("add", "mul"):
        return t[1]
    if head in REDUCTIONS:
        return (t[2],)
    return t[1:]


def symbols(t: Term) -> frozenset[str]:
    """The function symbols a term uses (its vocabulary)."""
    return frozenset(x[0] for x in subterms(t) if x[0] not in ("in", "size", "const"))


def show(t: Term) -> str:
    """Human-readable form, e.g. ``div(sum(4096, mul(W, X)), sqrt(...))``."""
    head = t[0]
    if head == "in":
        return str(t[1])
    if head == "size":
        return str(t[1])
    if head == "const":
        return str(t[1])
    if head in ("add", "mul"):
        return f"{head}({', '.join(show(c) for c in t[1])})"
    if head in REDUCTIONS:
        return f"{head}({t[1]}, {show(t[2])})"
    return f"{head}({', '.join(show(c) for c in t[1:])})"

# ---------------------------------------------------------------------------
# Abstract values and rules
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AVal:
    """A tensor as the search sees it: abstract expression, type and index labels."""

    term: Term
    type: TensorType
    labels: Labels


ExprFn = Callable[[Sequence[AVal], Mapping[str, AttrValue], TensorType], Term]
IndexFn = Callable[[Sequence[AVal], Mapping[str, AttrValue], TensorType],
                   tuple[Labels, Unions]]


@dataclass(frozen=True)
class AbstractRule:
    """The ``abstract`` slot of an operator: its expression, how it maps index labels
    (and which labels it identifies), and the function symbols it introduces (an
    operator is only tried by the search when the target uses all of them)."""

    expr: ExprFn
    index: IndexFn
    symbols: frozenset[str]


# A decomposition writes a composite operator in simpler registered operators:
# decompose(emit, args, attrs) -> result, where emit(op, *args, **attrs) -> result.
Emit = Callable[..., Any]
Decomposition = Callable[[Emit, Sequence[Any], Mapping[str, AttrValue]], Any]

# -- index rules --------------------------------------------------------------


def _broadcast_labels(xs: Sequence[AVal], out: TensorType) -> tuple[Labels, Unions]:
    """Right-aligned broadcasting: equal-size dims are the same index. A dim of size 1
    in every operand keeps the index its operands agree on: in a block graph it is an
    index split down to one element per block (gqa's 2 heads over a grid of 2), which
    a store must still map to its grid axis; as UNIT it was lost, and no design that
    split the heads over 2 blocks could store its output."""
    unions: Unions = []
    labels: list[int] = []
    for i in range(1, out.rank + 1):
        present = [x for x in xs if i <= x.type.rank and x.type.shape[-i] != 1]
        if present:
            first = present[0].labels[-i]
            unions.extend((first, x.labels[-i]) for x in present[1:])
            labels.append(first)
        else:
            agreed = {x.labels[-i] for x in xs if i <= x.type.rank} - {UNIT}
            labels.append(agreed.pop() if len(agreed) == 1 else UNIT)
    return tuple(reversed(labels)), unions


def index_same(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
               ) -> tuple[Labels, Unions]:
    return _broadcast_labels(xs, out)


def index_matmul(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                 ) -> tuple[Labels, Unions]:
    x, y = xs
    bx = AVal(x.term, TensorType(x.type.shape[:-2], x.type.dtype), x.labels[:-2])
    by = AVal(y.term, TensorType(y.type.shape[:-2], y.type.dtype), y.labels[:-2])
    batch, unions = _broadcast_labels([bx, by], TensorType(out.shape[:-2], out.dtype))
    unions.append((x.labels[-1], y.labels[-2]))
    return batch + (x.labels[-2], y.labels[-1]), unions


def index_reduce(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                 ) -> tuple[Labels, Unions]:
    dim = int(a["dim"])
    labels = xs[0].labels
    if a.get("keepdim", False):
        return labels[:dim] + (UNIT,) + labels[dim + 1:], []
    return labels[:dim] + labels[dim + 1:], []


def index_last_to_unit(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                       ) -> tuple[Labels, Unions]:
    return xs[0].labels[:-1] + (UNIT,), []


def index_first(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                ) -> tuple[Labels, Unions]:
    return xs[0].labels, []


def index_concat(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                 ) -> tuple[Labels, Unions]:
    dim = int(a["dim"])
    unions = [(p, q) for i, (p, q) in enumerate(zip(xs[0].labels, xs[1].labels)) if i != dim]
    return xs[0].labels, unions

# -- rule factories ------------------------------------------------------------


def elementwise(build: Callable[..., Term], *syms: str) -> AbstractRule:
    """An element-wise operator whose expression is ``build(*operand terms)``."""
    return AbstractRule(lambda xs, a, out: build(*(x.term for x in xs)), index_same,
                        frozenset(syms))


def unary(name: str) -> AbstractRule:
    return elementwise(lambda x: fn(name, x), name)


def _sub(x: Term, y: Term) -> Term:
    return add(x, fn("neg", y))


SUB = elementwise(_sub, "add", "neg")
SQUARE = elementwise(lambda x: mul(x, x), "mul")
RSQRT = elementwise(lambda x: div(const(1.0), fn("sqrt", x)), "div", "sqrt")
MUL_SCALAR = AbstractRule(lambda xs, a, out: mul(xs[0].term, const(a["scalar"])),
                          index_same, frozenset({"mul"}))
MATMUL = AbstractRule(lambda xs, a, out: sum_(xs[0].type.shape[-1],
                                              mul(xs[0].term, xs[1].term)),
                      index_matmul, frozenset({"sum", "mul"}))


def _reduced(xs: Sequence[AVal], a: Mapping[str, AttrValue]) -> int:
    return xs[0].type.shape[int(a["dim"])]


REDUCE_SUM = AbstractRule(lambda xs, a, out: sum_(_reduced(xs, a), xs[0].term),
                          index_reduce, frozenset({"sum"}))
REDUCE_MEAN = AbstractRule(lambda xs, a, out: div(sum_(_reduced(xs, a), xs[0].term),
                                                  size(_reduced(xs, a))),
                           index_reduce, frozenset({"sum", "div"}))
REDUCE_MAX = AbstractRule(lambda xs, a, out: max_(_reduced(xs, a), xs[0].term),
                          index_reduce, frozenset({"max"}))


def rms_term(n: int, x: Term, eps: float = 0.0) -> Term:
    """rms over ``n`` elements, by its definition."""
    mean_sq = div(sum_(n, mul(x, x)), size(n))
    return fn("sqrt", add(mean_sq, const(eps)) if eps else mean_sq)


RMS = AbstractRule(lambda xs, a, out: rms_term(xs[0].type.shape[-1], xs[0].term,
                                               float(a.get("eps", 0.0))),
                   index_last_to_unit, frozenset({"sqrt", "div", "sum", "mul"}))
SUM_TO = AbstractRule(lambda xs, a, out: sum_(xs[0].type.shape[-1] // int(a["width"]),
                                              xs[0].term),
                      index_first, frozenset({"sum"}))
CONCAT = AbstractRule(lambda xs, a, out: fn("concat", xs[0].term, xs[1].term),
                      index_concat, frozenset({"concat"}))


def index_fresh(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
                ) -> tuple[Labels, Unions]:
    """Labels for a result whose dimensions are none of its operand's (a reshape):
    fresh ones, derived deterministically from the operand's term and labels and the
    result's shape, far above the labels an analysis counts from 0."""
    seed = zlib.crc32(repr((xs[0].term, xs[0].labels, out.shape)).encode())
    base = FRESH_LABELS + (seed & 0xFFFFFF) * 8
    return tuple(UNIT if n == 1 else base + i for i, n in enumerate(out.shape)), []


RESHAPE = AbstractRule(lambda xs, a, out: fn("reshape", xs[0].term), index_fresh,
                       frozenset({"reshape"}))
# rotate_half keeps its operand's indices (it permutes within the last one).
ROTATE_HALF = AbstractRule(lambda xs, a, out: fn("rotate_half", xs[0].term), index_first,
                           frozenset({"rotate_half"}))


def accumulator(spec: AccumSpec) -> AbstractRule:
    """The rule of a forloop accumulator, read off its ``AccumSpec``: the number of
    elements it reduces is the forloop range times what it reduces of each tile."""

    def expr(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType) -> Term:
        x = xs[0]
        count = int(a.get(FORLOOP_KEY, 1)) * _per_tile(spec.reduce, x.type, a)
        match spec.pre:
            case Pre.ID:
                v = x.term
            case Pre.SQUARE:
                v = mul(x.term, x.term)
            case other:
                assert_never(other)
        r = sum_(count, v) if not is_extreme(spec.combine) else \
            extreme(spec.combine.value, count, v)
        match spec.finish:
            case Finish.ID:
                return r
            case Finish.MEAN:
                return div(r, size(count))
            case Finish.RMS:
                # The same term as ``rms_term`` (rms / rms_norm with the same eps), so a
                # normalisation accumulated over the forloop matches the program's.
                mean_sq = div(r, size(count))
                eps = float(a.get("eps", 0.0))
                return fn("sqrt", add(mean_sq, const(eps)) if eps else mean_sq)
            case finish:
                assert_never(finish)

    syms = {spec.combine.value}
    syms |= {"mul"} if spec.pre is Pre.SQUARE else set()
    syms |= {"div"} if spec.finish in (Finish.MEAN, Finish.RMS) else set()
    syms |= {"sqrt"} if spec.finish is Finish.RMS else set()
    index = index_last_to_unit if spec.reduce is Reduce.LAST else index_first
    return AbstractRule(expr, index, frozenset(syms))


def _per_tile(reduce: Reduce, t: TensorType, a: Mapping[str, AttrValue]) -> int:
    """How many elements of each tile one output element reduces."""
    match reduce:
        case Reduce.NONE:
            return 1
        case Reduce.LAST:
            return t.shape[-1]
        case Reduce.TO_WIDTH:
            return t.shape[-1] // int(a["width"])  # type: ignore[call-overload]
        case other:
            assert_never(other)


def composite(decomposition: Decomposition, lookup: Lookup) -> AbstractRule:
    """The rule of a composite operator: evaluate its decomposition abstractly, its
    parts looked up through ``lookup`` (the registry that holds them)."""

    def run(xs: Sequence[AVal], a: Mapping[str, AttrValue]) -> tuple[AVal, Unions]:
        unions: Unions = []

        def emit(op: str, *args: AVal, **attrs: AttrValue) -> AVal:
            r, u = apply(lookup, op, args, attrs)
            unions.extend(u)
            return r

        return decomposition(emit, xs, a), unions

    def expr(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType) -> Term:
        return run(xs, a)[0].term

    def index(xs: Sequence[AVal], a: Mapping[str, AttrValue], out: TensorType
              ) -> tuple[Labels, Unions]:
        r, unions = run(xs, a)
        return r.labels, unions

    return AbstractRule(expr, index, frozenset())  # symbols: from the parts, see below


def decompose_rms_norm(emit: Emit, xs: Sequence[Any], a: Mapping[str, AttrValue]) -> Any:
    """rms_norm(x[, g]) = div(x, rms(x)) [* g]."""
    eps = a.get("eps", 0.0)
    y = emit("div", xs[0], emit("rms", xs[0], **({"eps": eps} if eps else {})))
    return emit("mul", y, xs[1]) if len(xs) == 2 else y


def decompose_softmax(emit: Emit, xs: Sequence[Any], a: Mapping[str, AttrValue]) -> Any:
    """softmax(x, dim) = e / sum(e, dim) with e = exp(x - max(x, dim)): the max shift
    cancels over the reals, but without it exp overflows for logits near 100, so the
    search only ever builds the numerically safe form (the verifier's numerical check,
    ``verifier.numerics``, rejects a candidate that drops it)."""
    m = emit("max", xs[0], dim=a["dim"], keepdim=True)
    e = emit("exp", emit("sub", xs[0], m))
    return emit("div", e, emit("sum", e, dim=a["dim"], keepdim=True))

# ---------------------------------------------------------------------------
# Evaluation through the registry
# ---------------------------------------------------------------------------


def apply(lookup: Lookup, op: str, xs: Sequence[AVal], attrs: Mapping[str, AttrValue]
          ) -> tuple[AVal, Unions]:
    """The abstract value of operator ``op`` (found by ``lookup``) applied to ``xs``
    (attrs with defaults filled in, plus ``FORLOOP_KEY`` for accumulators), and the
    index labels it identifies. Raises ``ops.ShapeError`` when the operands do not fit."""
    opdef = lookup(op)
    rule: AbstractRule = opdef.abstract
    values = {k: v for k, v in attrs.items() if k != FORLOOP_KEY}
    out = opdef.infer([x.type for x in xs], opdef.attr_values(_attrs_tuple(values)))
    full = dict(opdef.attr_values(_attrs_tuple(values)))
    if FORLOOP_KEY in attrs:
        full[FORLOOP_KEY] = attrs[FORLOOP_KEY]
    term = rule.expr(xs, full, out)
    labels, unions = rule.index(xs, full, out)
    return AVal(term, out, labels), unions


def _attrs_tuple(values: Mapping[str, AttrValue]) -> tuple[tuple[str, AttrValue], ...]:
    return tuple(sorted(values.items()))


def op_symbols(lookup: Lookup, op: str) -> frozenset[str]:
    """Function symbols an operator introduces; a composite's are its parts'."""
    opdef = lookup(op)
    if opdef.decompose is None:
        return opdef.abstract.symbols  # type: ignore[no-any-return]
    used: set[str] = set()

    def emit(name: str, *args: Any, **attrs: Any) -> None:
        used.update(op_symbols(lookup, name))

    opdef.decompose(emit, [None, None], {"dim": 0, "eps": 0.0})
    return frozenset(used)
