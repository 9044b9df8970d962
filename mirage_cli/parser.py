"""The `.mir` frontend: program text -> checked µGraph.

:func:`parse_text` reads the syntax tree (:mod:`mirage_cli.syntax`), evaluates the
parameters (with ``-D`` overrides) and the integer expressions of shapes and
attributes, and builds the graph statement by statement through
:class:`~mirage_cli.builder.GraphBuilder`, passing the span of each statement, so
that every error of inference and tiling (:mod:`mirage_cli.check`) points into the
source. What only the language knows (scopes, reserved places of statements, the
custom header, stores matching the left-hand side) is checked here.

Guarantees: the result passed :func:`mirage_cli.check.check_graph`; every node
carries a span; an input's ``dims_src`` holds its dimensions as written, in the
canonical spelling of :func:`mirage_cli.syntax.expr_text`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

from mirage_cli import ops
from mirage_cli.builder import BlockBuilder, GraphBuilder
from mirage_cli.diagnostics import MirageError, Span, did_you_mean
from mirage_cli.ir import GRID_AXES, AttrValue, AxisMap, DType, Graph
from mirage_cli.sourcefile import read_text
from mirage_cli.syntax import (
    MAX_INT,
    AttrArg,
    BinOp,
    CustomStmt,
    Expr,
    InputStmt,
    Lit,
    LoadStmt,
    MapClause,
    Name,
    Neg,
    NestedCall,
    Num,
    Operand,
    OpStmt,
    OutputStmt,
    Program,
    Stmt,
    StoreStmt,
    TupleExpr,
    Var,
    expr_text,
    parse_program,
)

DTYPES = tuple(d.value for d in DType)
CUSTOM_HEADER = ("forloop", "grid", "threads")
DEFAULT_THREADS = 128
DEFAULT_FORLOOP = 1


def parse_text(text: str, file: str = "<input>", defines: dict[str, int] | None = None,
               strict_defines: bool = True) -> Graph:
    """Parse and check one program; ``defines`` override parameter defaults (with
    ``strict_defines`` False, a define the program does not declare is skipped)."""
    try:
        prog = parse_program(text, file)
        return _Lowering(file, defines or {}, strict_defines).program(prog)
    except MirageError as e:
        raise e.with_source(text) from None


def parse_syntax(text: str, file: str = "<input>") -> tuple[Program, Graph]:
    """The syntax tree and the checked graph of one program (parsed once)."""
    try:
        prog = parse_program(text, file)
        return prog, _Lowering(file, {}).program(prog)
    except MirageError as e:
        raise e.with_source(text) from None


def parse_file(path: str | Path, defines: dict[str, int] | None = None) -> Graph:
    return parse_text(read_text(str(path)), str(path), defines)


# ---------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------


def _span_of(e: Expr) -> Span:
    return e.span


def eval_int(e: Expr, env: dict[str, int], what: str) -> int:
    """An integer expression over parameters; ``/`` must divide exactly, and every
    intermediate value must fit in an int64 (a located error otherwise: sizes are
    int64 everywhere downstream)."""
    v = _eval_int(e, env, what)
    if not -MAX_INT - 1 <= v <= MAX_INT:
        raise MirageError(f"{what}: {_short(expr_text(e))} does not fit in 64 bits", e.span)
    return v


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _eval_int(e: Expr, env: dict[str, int], what: str) -> int:
    match e:
        case Num(value=v):
            if isinstance(v, float):
                raise MirageError(f"{what} must be an integer, got {v!r}", e.span)
            return v
        case Var(name=n):
            if n not in env:
                raise MirageError(f"unknown parameter '{n}'{did_you_mean(n, list(env))}"
                                  f"{_known(env)}", e.span)
            return env[n]
        case Neg(operand=x):
            return -eval_int(x, env, what)
        case BinOp(op=op, left=a, right=b):
            lv, rv = eval_int(a, env, what), eval_int(b, env, what)  # each checked
            if op == "+":
                return lv + rv
            if op == "-":
                return lv - rv
            if op == "*":
                return lv * rv
            if rv == 0 or lv % rv:
                raise MirageError(f"{_short(expr_text(e))} = {lv} / {rv} is not an exact "
                                  f"integer division", e.span)
            return lv // rv
        case Lit() | TupleExpr():
            raise MirageError(f"{what} must be an integer, got {expr_text(e)}", e.span)
    assert_never(e)


def _known(env: dict[str, int]) -> str:
    if not env:
        return " (the program has no parameters)"
    return f" (parameters: {', '.join(env)})"


def eval_attr(e: Expr, env: dict[str, int]) -> AttrValue:
    """An attribute value: a number, ``true``/``false``, a string, or an integer
    expression over parameters."""
    match e:
        case Num(value=v):
            return v
        case Lit(value=v):
            return v
        case Neg(operand=Num(value=float() as v)):
            return -v
        case TupleExpr():
            raise MirageError("a tuple is only allowed as the grid of a custom kernel", e.span)
        case Var() | Neg() | BinOp():
            return eval_int(e, env, "an attribute value")
    assert_never(e)


# ---------------------------------------------------------------------------
# Statements
# ---------------------------------------------------------------------------


@dataclass
class _Store:
    source: str
    target: Name
    omap: AxisMap
    span: Span
    dtype: str | None


def _dtype(name: Name) -> str:
    """A dtype as written (f16, bf16, f32), or a located error."""
    if name.text not in DTYPES:
        raise MirageError(f"unknown dtype '{name.text}'{did_you_mean(name.text, DTYPES)}; "
                          f"expected f16, bf16 or f32", name.span)
    return name.text


class _Lowering:
    """Builds the graph of one program through :class:`GraphBuilder`."""

    def __init__(self, file: str, defines: dict[str, int], strict_defines: bool = True
                 ) -> None:
        self.file = file
        self.defines = defines
        self.strict_defines = strict_defines
        self.env: dict[str, int] = {}

    def program(self, prog: Program) -> Graph:
        self._params(prog)
        b = GraphBuilder(prog.name.text, tuple(self.env.items()))
        for stmt in prog.stmts:
            self._kernel_stmt(b, stmt)
        if not b.outputs:
            raise MirageError(f"program '{prog.name.text}' declares no output "
                              f"(add 'output NAME;')", prog.close)
        return b.build()

    def _params(self, prog: Program) -> None:
        names = [p.name.text for p in prog.params]
        for key in self.defines:
            if key not in names and self.strict_defines:
                listed = ", ".join(names) if names else "none"
                raise MirageError(f"-D {key}: program '{prog.name.text}' has no parameter "
                                  f"'{key}'{did_you_mean(key, names)}; its parameters: "
                                  f"{listed}", prog.name.span)
        for p in prog.params:
            if p.name.text in self.env:
                raise MirageError(f"parameter '{p.name.text}' is defined twice", p.name.span)
            value = eval_int(p.default, self.env, f"the default of '{p.name.text}'")
            self.env[p.name.text] = self.defines.get(p.name.text, value)

    # --- kernel level -------------------------------------------------------
    def _kernel_stmt(self, b: GraphBuilder, stmt: Stmt) -> None:
        match stmt:
            case InputStmt():
                self._input(b, stmt)
            case OpStmt():
                self._op(b, stmt, b.types, ops.KERNEL)
            case CustomStmt():
                self._custom(b, stmt)
            case OutputStmt(names=names):
                for n in names:
                    self._defined(n, b.types, "tensor")
                    b.output(n.text, n.span)
            case LoadStmt(keyword=kw) | StoreStmt(keyword=kw):
                word = "load" if isinstance(stmt, LoadStmt) else "store"
                raise MirageError(f"'{word}' is only allowed inside a custom kernel", kw)
            case _:
                assert_never(stmt)

    def _input(self, b: GraphBuilder, stmt: InputStmt) -> None:
        dtype = _dtype(stmt.dtype)
        shape = []
        for i, d in enumerate(stmt.dims):
            n = eval_int(d, self.env, f"dimension {i} of '{stmt.name.text}'")
            if n < 1:
                raise MirageError(f"dimension {i} of '{stmt.name.text}' is {expr_text(d)} = "
                                  f"{n}; dimensions must be positive", d.span)
            shape.append(n)
        q = stmt.qualifier
        if q is not None and q.text != "weight":
            raise MirageError(f"unknown input qualifier '{q.text}'"
                              f"{did_you_mean(q.text, ('weight',))}; the only one is 'weight'",
                              q.span)
        self._fresh(stmt.name, b.types, "tensor")
        b.input(stmt.name.text, shape, dtype, tuple(expr_text(d) for d in stmt.dims),
                span=stmt.name.span, weight=q is not None)

    def _custom(self, b: GraphBuilder, stmt: CustomStmt) -> None:
        seen: set[str] = set()
        for o in stmt.outs:
            self._fresh(o, b.types, "tensor")
            if o.text in seen:
                raise MirageError(f"'{o.text}' appears twice on the left-hand side", o.span)
            seen.add(o.text)
        grid, threads, forloop = self._header(stmt)
        k = b.custom(grid, threads, forloop, span=stmt.span)
        stores: dict[str, _Store] = {}
        for s in stmt.body:
            self._block_stmt(k, s, stmt, stores)
        for o in stmt.outs:
            if o.text not in stores:
                raise MirageError(f"'{o.text}' is never stored by this custom kernel "
                                  f"(add 'store TILE -> {o.text};')", o.span)
        k.finish([(stores[o.text].source, o.text, stores[o.text].omap, stores[o.text].span,
                   stores[o.text].dtype) for o in stmt.outs])

    def _header(self, stmt: CustomStmt) -> tuple[tuple[int, ...], int, int]:
        values: dict[str, Expr] = {}
        for a in stmt.args:
            match a:
                case AttrArg(key=key, value=v):
                    if key.text not in CUSTOM_HEADER:
                        raise MirageError(f"custom has no attribute '{key.text}'"
                                          f"{did_you_mean(key.text, CUSTOM_HEADER)}; it takes "
                                          f"grid=, threads= and forloop=", key.span)
                    if key.text in values:
                        raise MirageError(f"attribute '{key.text}' is given twice", key.span)
                    values[key.text] = v
                case Operand(name=n):
                    raise MirageError("custom takes no operands (load device tensors inside "
                                      "the kernel); it takes grid=, threads= and forloop=",
                                      n.span)
                case NestedCall(span=span):
                    raise MirageError("custom takes no operands", span)
                case _:
                    assert_never(a)
        if "grid" not in values:
            raise MirageError("custom needs a grid, e.g. grid=(8, 1, 1)", stmt.span)
        g = values["grid"]
        items = g.items if isinstance(g, TupleExpr) else (g,)
        if len(items) > 3:
            raise MirageError(f"grid has {len(items)} entries; a grid has 1 to 3 (x, y, z)",
                              g.span)
        grid = tuple(eval_int(x, self.env, "a grid size") for x in items)
        threads = eval_int(values["threads"], self.env, "threads") if "threads" in values \
            else DEFAULT_THREADS
        forloop = eval_int(values["forloop"], self.env, "forloop") if "forloop" in values \
            else DEFAULT_FORLOOP
        return grid, threads, forloop

    # --- block level --------------------------------------------------------
    def _block_stmt(self, k: BlockBuilder, stmt: Stmt, custom: CustomStmt,
                    stores: dict[str, _Store]) -> None:
        match stmt:
            case LoadStmt():
                self._load(k, stmt)
            case OpStmt():
                self._op(k, stmt, k.types, ops.BLOCK)
            case StoreStmt():
                self._store(k, stmt, custom, stores)
            case InputStmt(span=span):
                raise MirageError("'input' is not allowed inside a custom kernel", span)
            case OutputStmt(keyword=span):
                raise MirageError("'output' is not allowed inside a custom kernel "
                                  "(use 'store TILE -> TENSOR;')", span)
            case CustomStmt(span=span):
                raise MirageError("custom kernels cannot be nested", span)
            case _:
                assert_never(stmt)

    def _load(self, k: BlockBuilder, stmt: LoadStmt) -> None:
        src = stmt.source
        if src.text not in k.parent.types:
            hint = (f"; '{src.text}' is a block tensor, load reads device tensors"
                    if src.text in k.types else did_you_mean(src.text, list(k.parent.types)))
            raise MirageError(f"undefined device tensor '{src.text}'{hint}", src.span)
        imap: AxisMap = (None, None, None)
        fmap: int | None = None
        seen: set[str] = set()
        for c in stmt.clauses:
            if c.kind in seen:
                raise MirageError(f"'{c.kind}' is given twice", c.span)
            seen.add(c.kind)
            if c.kind == "omap":
                raise MirageError("'omap' belongs to store; a load takes imap and fmap",
                                  c.span)
            if c.kind == "imap":
                imap = self._axis_map(c)
            else:
                fmap = eval_int(c.items[0][1], self.env, "an fmap dimension")
        self._fresh(stmt.out, k.types, "block tensor")
        k.load(src.text, imap, fmap, out=stmt.out.text, span=stmt.span)

    def _axis_map(self, c: MapClause) -> AxisMap:
        dims: dict[str, int] = {}
        for axis, value in c.items:
            if axis.text not in GRID_AXES:
                raise MirageError(f"unknown grid axis '{axis.text}' in {c.kind}; the axes are "
                                  f"x, y and z", axis.span)
            if axis.text in dims:
                raise MirageError(f"grid axis '{axis.text}' is mapped twice", axis.span)
            dims[axis.text] = eval_int(value, self.env, f"the {c.kind} dimension")
        return (dims.get("x"), dims.get("y"), dims.get("z"))

    def _store(self, k: BlockBuilder, stmt: StoreStmt, custom: CustomStmt,
               stores: dict[str, _Store]) -> None:
        outs = [o.text for o in custom.outs]
        tgt = stmt.target
        if tgt.text not in outs:
            raise MirageError(f"'{tgt.text}' is not an output of this custom kernel (its "
                              f"left-hand side: {', '.join(outs)})", tgt.span)
        if tgt.text in stores:
            raise MirageError(f"'{tgt.text}' is stored twice", tgt.span)
        self._defined(stmt.source, k.types, "block tensor")
        omap: AxisMap = (None, None, None)
        for c in stmt.clauses:
            if c.kind != "omap":
                raise MirageError(f"'{c.kind}' belongs to load; a store takes omap", c.span)
            omap = self._axis_map(c)
        dtype = _dtype(stmt.dtype) if stmt.dtype is not None else None
        stores[tgt.text] = _Store(stmt.source.text, tgt, omap, stmt.span, dtype)

    # --- operators (both levels) ----------------------------------------------
    def _op(self, b: GraphBuilder | BlockBuilder, stmt: OpStmt, types: Mapping[str, object],
            level: str) -> None:
        name = stmt.op.text
        self._check_level(name, level, stmt.op.span)
        operands: list[str] = []
        attrs: dict[str, AttrValue] = {}
        for a in stmt.args:
            match a:
                case Operand(name=n):
                    self._operand(n, b, level)
                    operands.append(n.text)
                case NestedCall(op=inner, span=span):
                    raise MirageError(f"nested call of '{inner.text}': one operator per "
                                      f"statement; give it its own statement, "
                                      f"e.g. 't = {inner.text}(...);'", span)
                case AttrArg(key=key, value=v):
                    if key.text in attrs:
                        raise MirageError(f"attribute '{key.text}' is given twice", key.span)
                    attrs[key.text] = eval_attr(v, self.env)
                case _:
                    assert_never(a)
        self._normalize_dim(attrs, operands, b)
        what = "tensor" if level == ops.KERNEL else "block tensor"
        self._fresh(stmt.out, types, what)
        b.op_with(name, operands, attrs, out=stmt.out.text, span=stmt.span)

    def _check_level(self, name: str, level: str, span: Span) -> None:
        opdef = ops.REGISTRY.get(name)
        if opdef is None or level in opdef.levels or name == "custom":
            return  # unknown operators are reported by inference, with a suggestion
        if level == ops.KERNEL:
            raise MirageError(f"'{name}' is a block operator; it is only allowed inside a "
                              f"custom kernel", span)
        raise MirageError(f"'{name}' is a kernel operator; it is not allowed inside a "
                          f"custom kernel", span)

    def _operand(self, n: Name, b: GraphBuilder | BlockBuilder, level: str) -> None:
        if n.text in b.types:
            return
        if isinstance(b, BlockBuilder) and n.text in b.parent.types:
            raise MirageError(f"'{n.text}' is a device tensor; inside a custom kernel, load "
                              f"it first ('t = load {n.text} ...;')", n.span)
        what = "tensor" if level == ops.KERNEL else "block tensor"
        raise MirageError(f"undefined {what} '{n.text}'{did_you_mean(n.text, list(b.types))}",
                          n.span)

    @staticmethod
    def _normalize_dim(attrs: dict[str, AttrValue], operands: Sequence[str],
                       b: GraphBuilder | BlockBuilder) -> None:
        """A negative ``dim`` counts from the end (numpy style)."""
        dim = attrs.get("dim")
        if isinstance(dim, int) and not isinstance(dim, bool) and dim < 0 and operands:
            rank = b.types[operands[0]].rank
            if dim + rank >= 0:
                attrs["dim"] = dim + rank

    # --- names -------------------------------------------------------------
    @staticmethod
    def _fresh(n: Name, types: Mapping[str, object], what: str) -> None:
        if n.text in types:
            raise MirageError(f"{what} '{n.text}' is defined twice", n.span)

    @staticmethod
    def _defined(n: Name, types: Mapping[str, object], what: str) -> None:
        if n.text not in types:
            raise MirageError(f"undefined {what} '{n.text}'{did_you_mean(n.text, list(types))}",
                              n.span)
