"""The expression engine: C code that computes one element of a tensor.

Both kernel lowerings (fused block graphs and standalone kernel operators) describe
their tensors as :class:`Node` s. A node is either *stored* (an element is a load from
a pointer at an offset computed from strides) or *inline* (an operator applied to
other nodes, recomputed wherever it is read: the thread level, registers only).
:meth:`Emitter.value` returns the statements and the f32 C expression of the element
at a given index; what each operator computes comes from its registry ``cuda`` slot.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import assert_never

from mirage_cli import ops
from mirage_cli.codegen.plan import swizzled
from mirage_cli.ir import AttrValue, BlockOp, DType, TensorType
from mirage_cli.semantics.accum import AccumSpec, Combine, Finish, Pre, Reduce
from mirage_cli.semantics.cuda import c_float, c_init, c_update

Lines = list[str]

CTYPE = {DType.F16: "mg_f16", DType.BF16: "mg_bf16", DType.F32: "float"}


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def offset_expr(base: str, idx: Sequence[str], strides: Sequence[int]) -> str:
    """``base + sum(idx[d] * strides[d])`` with trivial terms dropped."""
    terms = [] if base == "0" else [base]
    for i, s in zip(idx, strides):
        if i == "0" or s == 0:
            continue
        terms.append(i if s == 1 else f"{i} * {s}")
    return " + ".join(terms) if terms else "0"


def broadcast_index(idx: Sequence[str], shape: Sequence[int]) -> list[str]:
    """The index into an operand of ``shape`` that numpy broadcasting reads for output
    index ``idx`` (ranks aligned on the right; size-1 dimensions read index 0)."""
    lead = len(idx) - len(shape)
    return ["0" if d == 1 else idx[lead + k] for k, d in enumerate(shape)]


def indent(lines: Lines, n: int = 1) -> Lines:
    return ["  " * n + ln for ln in lines]


def unrolled(var: str, n: int, body: Lines) -> Lines:
    """``body`` in an unrolled loop of ``var`` over ``n``."""
    return ["#pragma unroll", f"for (int {var} = 0; {var} < {n}; ++{var}) {{"] + indent(body) + ["}"]


@dataclass(frozen=True)
class Stored:
    """Elements live in memory: ``ptr[base + sum(i*stride)]`` of C type ``ctype``; or,
    for a tile that bulk tensor copies bring in swizzled boxes (``swizzled``: its type
    and swizzle span), at the address :func:`swizzled_address` gives."""

    ptr: str
    base: str
    strides: tuple[int, ...]
    ctype: str
    swizzled: tuple[TensorType, int] | None = None


@dataclass(frozen=True)
class Inline:
    """Elements are computed by operator ``op`` from other nodes when read."""

    op: str
    inputs: tuple[str, ...]
    attrs: dict[str, AttrValue]


@dataclass(frozen=True)
class Regs:
    """Elements live in this thread's registers: ``array[slot]``, where ``slot`` is the
    register element the enclosing loop is at (:attr:`Emitter.reg_slot`): a thread only
    ever reads its own elements of such a tile (``codegen/rowregs.py``)."""

    array: str


@dataclass(frozen=True)
class Local:
    """The element being computed is already in the C expression ``var`` (a local
    variable or register of this thread): an enclosing loop visits one element at a
    time and computes each tensor of it once (``codegen/chain.py``)."""

    var: str


@dataclass(frozen=True)
class Node:
    shape: tuple[int, ...]
    how: Stored | Inline | Regs | Local


def attr_c(v: AttrValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return c_float(v)
    raise ValueError(f"attribute {v!r} has no C form")


class Emitter:
    """Holds the nodes of one kernel and hands out fresh local names."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._n = 0
        self.reg_slot: str | None = None  # the register element being computed (Regs)
        # Tiles stored as their reciprocal (blockfacts.stored_inverse): a division by
        # one of them is spelled as its registry ``by_inverse`` form.
        self.inverted: frozenset[str] = frozenset()

    def fresh(self, prefix: str = "v") -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def load(self, name: str, idx: Sequence[str]) -> str:
        how = self.nodes[name].how
        assert isinstance(how, Stored)
        if how.swizzled is not None:
            addr = swizzled_address(how.ptr, list(idx), *how.swizzled)
            ref = f"*reinterpret_cast<const {how.ctype}*>({addr})"
        else:
            ref = f"{how.ptr}[{offset_expr(how.base, idx, how.strides)}]"
        return ref if how.ctype == "float" else f"mg_ld({ref})"

    def value(self, name: str, idx: Sequence[str]) -> tuple[Lines, str]:
        """Statements and an f32 expression for element ``idx`` of tensor ``name``."""
        node = self.nodes[name]
        match node.how:
            case Stored():
                return [], self.load(name, idx)
            case Inline(op=op, inputs=inputs, attrs=attrs):
                lines, e = self._inline(op, inputs, attrs, node.shape, list(idx))
                v = self.fresh()
                return lines + [f"const float {v} = {e};"], v
            case Regs(array=array):
                assert self.reg_slot is not None, f"{name} is read outside its owner's loop"
                return [], f"{array}[{self.reg_slot}]"
            case Local(var=var):
                return [], var
            case _:
                assert_never(node.how)

    def apply(self, op: BlockOp, idx: Sequence[str]) -> tuple[Lines, str]:
        """Statements and the f32 expression of operator ``op`` at element ``idx``, its
        inputs read as their nodes say."""
        return self._inline(op.op, op.inputs, ops.get(op.op).attr_values(op.attrs),
                            op.outputs[0].type.shape, list(idx))

    def as_stored(self, name: str, e: str) -> str:
        """The value tensor ``name`` is stored as: its reciprocal if it is inverted."""
        return reciprocal(e) if name in self.inverted else e

    def _indexable(self, name: str) -> bool:
        """Whether element ``idx`` of ``name`` can be read at any ``idx``."""
        match self.nodes[name].how:
            case Stored():
                return True
            case Inline(inputs=inputs):
                return all(self._indexable(i) for i in inputs)
            case _:
                return False

    def _operand(self, name: str, idx: Sequence[str], lines: Lines) -> str:
        st, e = self.value(name, idx)
        lines.extend(st)
        return e

    def _inline(self, op: str, inputs: tuple[str, ...], attrs: dict[str, AttrValue],
                shape: tuple[int, ...], idx: list[str]) -> tuple[Lines, str]:
        spec = ops.get(op).cuda
        lines: Lines = []
        shapes = [self.nodes[i].shape for i in inputs]
        match spec.kind:
            case "gather":
                # Data movement (reshape, rotate_half): one operand, read elsewhere. Only
                # a node that can be read at any index can be: one in memory, or
                # computed from such. A register or local holds this thread's own
                # element alone, and reading it "elsewhere" would read the wrong one.
                assert spec.gather is not None
                if not self._indexable(inputs[0]):
                    raise AssertionError(f"{op} reads {inputs[0]} at another element, but "
                                         f"it is held in registers")
                at, wrap = spec.gather(idx, shapes[0], shape, attrs)
                e = self._operand(inputs[0], at, lines)
                return lines, wrap.format(e)
            case "elementwise":
                args = []
                for i, s in zip(inputs, shapes):
                    e = self._operand(i, broadcast_index(idx, s), lines)
                    if not e.isidentifier():
                        v = self.fresh()
                        lines.append(f"const float {v} = {e};")
                        e = v
                    args.append(e)
                form = spec.by_inverse if len(inputs) == 2 and inputs[1] in self.inverted \
                    else spec.expr
                assert form is not None
                return lines, form.format(*args, **{k: attr_c(v) for k, v in attrs.items()})
            case "matmul":
                return self._matmul(inputs, shapes, idx)
            case "reduce":
                return self._reduce(inputs[0], shapes[0], idx, int(attrs["dim"]),
                                    bool(attrs.get("keepdim", False)), spec.combine or Combine.SUM,
                                    spec.finish)
            case "rms":
                return self._rms(inputs[0], shapes[0], idx, float(attrs.get("eps", 0.0)))
            case "rms_norm":
                ln, r = self._rms(inputs[0], shapes[0], idx[:-1] + ["0"],
                                  float(attrs.get("eps", 0.0)))
                x = self._operand(inputs[0], idx, ln)
                e = _div(x, r)
                if len(inputs) == 2:
                    e = f"({e} * {self._operand(inputs[1], broadcast_index(idx, shapes[1]), ln)})"
                return ln, e
            case "softmax":
                return self._softmax(inputs[0], shapes[0], idx, int(attrs["dim"]))
            case "concat":
                return self._concat(inputs, shapes, idx, int(attrs["dim"]))
            case "sum_to":
                return self._sum_to(inputs[0], shapes[0], idx, int(attrs["width"]))
            case "accum":
                acc = ops.get(op).accum
                assert acc is not None
                return self._accum(acc, inputs[0], shapes[0], idx, attrs)
            case "custom":
                raise AssertionError(f"{op} cannot be computed inline")
            case _:
                assert_never(spec.kind)

    def _accum(self, spec: AccumSpec, x: str, sx: tuple[int, ...], idx: list[str],
               attrs: dict[str, AttrValue]) -> tuple[Lines, str]:
        """An accumulator's value over a forloop of one iteration (a direct kernel's,
        ``codegen/direct.py``): its reduction of the one tile, as the operator with that
        reduction computes it. Over the iterations of a longer loop an accumulator is
        carried by the kernel, never computed where read."""
        last = len(sx) - 1
        match spec.reduce, spec.pre, spec.finish:
            case Reduce.LAST, Pre.SQUARE, Finish.RMS:
                return self._rms(x, sx, idx, float(attrs.get("eps", 0.0)))  # type: ignore[arg-type]
            case Reduce.LAST, Pre.ID, (Finish.ID | Finish.MEAN) as finish:
                return self._reduce(x, sx, idx, last, True, spec.combine, finish)
            case Reduce.TO_WIDTH, Pre.ID, Finish.ID:
                return self._sum_to(x, sx, idx, int(attrs["width"]))  # type: ignore[arg-type]
            case Reduce.NONE, Pre.ID, Finish.ID:
                lines: Lines = []
                e = self._operand(x, idx, lines)
                return lines, e
        raise AssertionError(f"accumulator {spec} has no one-iteration form here")

    def _matmul(self, inputs: tuple[str, ...], shapes: list[tuple[int, ...]],
                idx: list[str]) -> tuple[Lines, str]:
        (a, b), (sa, sb) = inputs, shapes
        k, acc = self.fresh("k"), self.fresh("acc")
        body: Lines = []
        ia = broadcast_index(idx[:-2], sa[:-2]) + [idx[-2], k]
        ib = broadcast_index(idx[:-2], sb[:-2]) + [k, idx[-1]]
        x = self._operand(a, ia, body)
        y = self._operand(b, ib, body)
        body.append(f"{acc} = fmaf({x}, {y}, {acc});")
        lines = [f"float {acc} = 0.0f;", "#pragma unroll 4",
                 f"for (int {k} = 0; {k} < {sa[-1]}; ++{k}) {{"] + indent(body) + ["}"]
        return lines, acc

    def _reduce(self, x: str, sx: tuple[int, ...], idx: list[str], dim: int, keepdim: bool,
                combine: Combine, finish: Finish) -> tuple[Lines, str]:
        def term(k: str, body: Lines) -> str:
            return self._operand(x, idx[:dim] + [k] + (idx[dim + 1:] if keepdim else idx[dim:]),
                                 body)
        lines, acc = self._fold(sx[dim], combine, term)
        match finish:
            case Finish.ID:
                return lines, acc
            case Finish.MEAN:
                return lines, f"({acc} / {c_float(float(sx[dim]))})"
            case Finish.RMS:
                raise AssertionError("rms is its own CUDA kind, not a reduce finish")
            case other:
                assert_never(other)

    def _rms(self, x: str, sx: tuple[int, ...], idx: list[str], eps: float
             ) -> tuple[Lines, str]:
        def term(k: str, body: Lines) -> str:
            t = self.fresh()
            body.append(f"const float {t} = {self._operand(x, idx[:-1] + [k], body)};")
            return f"{t} * {t}"
        lines, acc = self._fold(sx[-1], Combine.SUM, term)
        return lines, f"sqrtf({acc} / {c_float(float(sx[-1]))} + {c_float(eps)})"

    def _fold(self, length: int, combine: Combine, term: Callable[[str, Lines], str]
              ) -> tuple[Lines, str]:
        """``combine`` of ``term(k)`` over ``k < length``, as statements and the name of
        the result. A thread computes such a reduction alone (a tile element computed
        where it is read), so the fold keeps ``_FOLD_WAYS`` independent partials: the
        loads of one pass issue together instead of each waiting on the previous add
        (a 64-long serial fold cost about 2000 cycles per element)."""
        acc, k = self.fresh("acc"), self.fresh("k")
        ways = _FOLD_WAYS if length % _FOLD_WAYS == 0 and length >= 2 * _FOLD_WAYS else 1
        body: Lines = []
        if ways == 1:
            body.append(c_update(acc, term(k, body), combine))
            return ([f"float {acc} = {c_init(combine)};",
                     f"for (int {k} = 0; {k} < {length}; ++{k}) {{"] + indent(body) + ["}"],
                    acc)
        q = self.fresh("q")
        kq = f"({k} + {q})"
        body.append(c_update(f"{acc}_p[{q}]", term(kq, body), combine))
        unroll = "#pragma unroll" if length <= _FOLD_UNROLL else "#pragma unroll 2"
        lines = [f"float {acc}_p[{ways}];", "#pragma unroll",
                 f"for (int {q} = 0; {q} < {ways}; ++{q}) {acc}_p[{q}] = {c_init(combine)};",
                 unroll, f"for (int {k} = 0; {k} < {length}; {k} += {ways}) {{",
                 "  #pragma unroll", f"  for (int {q} = 0; {q} < {ways}; ++{q}) {{"]
        lines += indent(indent(body)) + ["  }", "}", f"float {acc} = {acc}_p[0];"]
        lines += [c_update(acc, f"{acc}_p[{i}]", combine) for i in range(1, ways)]
        return lines, acc

    def _softmax(self, x: str, sx: tuple[int, ...], idx: list[str], dim: int
                 ) -> tuple[Lines, str]:
        m, s = self.fresh("mx"), self.fresh("se")
        k1, k2 = self.fresh("k"), self.fresh("k")
        b1: Lines = []
        e1 = self._operand(x, idx[:dim] + [k1] + idx[dim + 1:], b1)
        b2: Lines = []
        e2 = self._operand(x, idx[:dim] + [k2] + idx[dim + 1:], b2)
        lines = [f"float {m} = __int_as_float(0xff800000);",
                 f"for (int {k1} = 0; {k1} < {sx[dim]}; ++{k1}) {{"]
        lines += indent(b1 + [f"{m} = fmaxf({m}, {e1});"]) + ["}", f"float {s} = 0.0f;",
                                                               f"for (int {k2} = 0; {k2} < {sx[dim]}; ++{k2}) {{"]
        lines += indent(b2 + [f"{s} += mg_exp({e2} - {m});"]) + ["}"]
        e = self._operand(x, idx, lines)
        return lines, _div(f"mg_exp({e} - {m})", s)

    def _concat(self, inputs: tuple[str, ...], shapes: list[tuple[int, ...]], idx: list[str],
                dim: int) -> tuple[Lines, str]:
        (a, b), (sa, _) = inputs, shapes
        v = self.fresh()
        la: Lines = []
        ea = self._operand(a, idx, la)
        ib = list(idx)
        ib[dim] = f"({idx[dim]} - {sa[dim]})"
        lb: Lines = []
        eb = self._operand(b, ib, lb)
        lines = [f"float {v};", f"if ({idx[dim]} < {sa[dim]}) {{"] + indent(la + [f"{v} = {ea};"])
        lines += ["} else {"] + indent(lb + [f"{v} = {eb};"]) + ["}"]
        return lines, v

    def _sum_to(self, x: str, sx: tuple[int, ...], idx: list[str], width: int
                ) -> tuple[Lines, str]:
        g, acc = self.fresh("g"), self.fresh("acc")
        body: Lines = []
        e = self._operand(x, idx[:-1] + [f"({g} * {width} + {idx[-1]})"], body)
        body.append(f"{acc} += {e};")
        lines = [f"float {acc} = 0.0f;", f"for (int {g} = 0; {g} < {sx[-1] // width}; ++{g}) {{"]
        return lines + indent(body) + ["}"], acc


# A thread's own fold keeps this many partials; folds up to _FOLD_UNROLL long unroll fully.
_FOLD_WAYS = 4
_FOLD_UNROLL = 256


def index_vars(shape: Sequence[int], flat: str, prefix: str) -> tuple[Lines, list[str]]:
    """Declarations that split the flat row-major index ``flat`` into one variable per
    dimension (size-1 dimensions become the constant 0)."""
    strides = row_major(shape)
    lines: Lines = []
    names: list[str] = []
    for d, (n, s) in enumerate(zip(shape, strides)):
        if n == 1:
            names.append("0")
            continue
        v = f"{prefix}{d}"
        e = flat if s == 1 else f"{flat} / {s}"
        if d > 0 and numel(shape[:d]) > 1:
            e = f"({e}) % {n}"
        lines.append(f"const int {v} = {e};")
        names.append(v)
    return lines, names


def keep_used(decl: Lines, body: Lines) -> Lines:
    """The index declarations that ``body`` refers to (the others would be unused
    variables, which nvcc warns about)."""
    text = "\n".join(body)
    return [d for d in decl if re.search(r"\b" + d.split()[2] + r"\b", text)]


def swizzled_address(ptr: str, idx: list[str], t: TensorType, swizzle: int) -> str:
    """The shared-memory address of element ``idx`` of a tile that bulk tensor copies
    bring in (``tmaplan``: boxes of ``swizzle`` bytes per row, side by side, with the
    hardware's XOR swizzle of 16-byte chunks where ``swizzle`` is a span, else one
    plain box per row) whose current slot is ``ptr``: an
    ldmatrix row where the last index is a multiple of 16 bytes; the swizzle moves
    whole chunks, so any element's address is its chunk's plus its offset in it."""
    es = t.dtype.nbytes
    strides = row_major(t.shape[:-1]) if t.rank > 1 else ()
    row = " + ".join(f"({i}) * {s}" if s != 1 else f"({i})"
                     for i, s in zip(idx[:-1], strides)) or "0"
    col = f"(({idx[-1]}) * {es})"
    o = f"(({row}) * {swizzle} + {col} % {swizzle})"
    if not swizzled(swizzle):  # one plain box per row (tmaplan)
        return f"(reinterpret_cast<const unsigned char*>({ptr}) + {o})"
    phys = f"({o} ^ ((({o} >> 7) & {swizzle // 16 - 1}) << 4))"
    rows = t.numel // t.shape[-1]  # every dimension but the last (tmaplan.rows)
    box = f"({col} / {swizzle}) * {rows * swizzle}"
    return f"(reinterpret_cast<const unsigned char*>({ptr}) + {box} + {phys})"


def _div(a: str, b: str) -> str:
    """``a / b`` as the registry's ``div`` spells it (the one place that says how a
    generated kernel divides: docs/codegen.md)."""
    spelled = ops.get("div").cuda.expr
    assert spelled is not None
    return spelled.format(a, b)


def reciprocal(e: str) -> str:
    """``1 / e`` in f32: ``rsqrtf(x)`` where ``e`` is ``sqrtf(x)``, else ``mg_rcp(e)``
    (one ``rcp.approx``, within 1 ulp). An IEEE square root and an IEEE division are
    each a sequence with a slow path; the reciprocal square root is one instruction,
    within 2 ulp. As a norm's reciprocal it took qknorm_gqa's chain kernel
    on an H100 from 28.4 to 24.7 µs at batch 8 and from 10.4 to 9.4 at batch 1, relative
    errors unchanged (docs/perf-log.md v29)."""
    if e.startswith("sqrtf(") and _closing(e, 5) == len(e) - 1:
        return f"rsqrtf({e[6:-1]})"
    return f"mg_rcp({e})"


def _closing(e: str, start: int) -> int:
    """The index of the bracket that closes the one at ``start`` (-1 if none)."""
    depth = 0
    for i in range(start, len(e)):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(e[i], 0)
        if depth == 0:
            return i
    return -1
