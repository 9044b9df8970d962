"""µGraph -> canonical `.mir` text (what `mirage fmt` prints).

The canonical form: one statement per line, two-space indentation; inputs, then
operators in graph order, then one ``output`` statement; attributes sorted by name
with defaults omitted (the builder already drops them); the custom header always
``grid=(x, y, z), threads=T, forloop=F``; in a kernel, loads, then block operators,
then stores; imap/omap axes in x, y, z order with replicated axes omitted; floats as
Python ``repr``. Input dimensions print as written (``dims_src``) when they evaluate
to the shape under the graph's parameters, else as integers.

Guarantee: ``parse_text(print_graph(g)) == g`` for every checked graph whose names
are identifiers (not reserved words), whose attribute floats are finite and whose
``dims_src`` are in canonical spelling (as the parser and the builder make them; a
hand-written ``"2*n"`` in a `.ugraph.json` prints, and reads back, as ``2 * n``).
Printing is deterministic.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from mirage_cli.diagnostics import MirageError, Span
from mirage_cli.ir import GRID_AXES, Attrs, AttrValue, AxisMap, BlockGraph, Graph, Input, KernelOp
from mirage_cli.parser import eval_int
from mirage_cli.syntax import KEYWORDS, expr_text, parse_dim_expr

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# Where a printed line came from, for re-attaching comments (mirage_cli.comments):
# a source line number, "program", "output" (the first output statement), "end",
# ("close", n) (the closing brace of the custom kernel whose header is on line n),
# or None.
Anchor = int | str | tuple[str, int] | None


def print_graph(g: Graph) -> str:
    """The canonical `.mir` text of ``g`` (ends with a newline)."""
    return "".join(text + "\n" for text, _ in print_lines(g))


def print_lines(g: Graph, headers: Mapping[int, str] | None = None
                ) -> list[tuple[str, Anchor]]:
    """The canonical lines of ``g``, each with the source position it came from.

    ``headers`` replaces the custom header of the kernel written on a given source
    line (used by `fmt` to keep a header's parameter expressions, which the graph holds
    only as numbers)."""
    params = ", ".join(f"{_name(n)} = {v}" for n, v in g.params)
    lines: list[tuple[str, Anchor]] = [(f"program {_program_name(g.name)}({params}) {{",
                                      "program")]
    env = dict(g.params)
    lines += [((f"  input {_name(i.value.name)}: {i.value.type.dtype.value}"
               f"[{', '.join(_dims(i, env))}]{' weight' if i.weight else ''};"),
               _line(i.value.span)) for i in g.inputs]
    for op in g.ops:
        lines += _kernel_op(op, headers or {})
    lines.append((f"  output {', '.join(_name(n) for n in g.outputs)};", "output"))
    lines.append(("}", "end"))
    return lines


def _line(span: Span | None) -> int | None:
    return span.line if span is not None else None


def _name(n: str) -> str:
    if not _IDENT.match(n) or n in KEYWORDS:
        raise MirageError(f"the name '{n}' cannot be written in .mir (names are identifiers "
                          f"and not reserved words)")
    return n


def _program_name(n: str) -> str:
    """Program names are labels only: make any name printable."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", n) or "program"
    if clean[0].isdigit():
        clean = "_" + clean
    return clean + "_" if clean in KEYWORDS else clean


def _dims(inp: Input, env: dict[str, int]) -> list[str]:
    shape = inp.value.type.shape
    if len(inp.dims_src) == len(shape):
        try:
            exprs = [parse_dim_expr(s) for s in inp.dims_src]
            if all(eval_int(e, env, "a dimension") == d for e, d in zip(exprs, shape)):
                return [expr_text(e) for e in exprs]
        except MirageError:
            pass  # not an expression over the parameters: fall back to the numbers
    return [str(d) for d in shape]


def _value(v: AttrValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise MirageError(f"the attribute value {v!r} cannot be written in .mir")
        return repr(v)
    return json.dumps(v)


def _attrs(attrs: Attrs) -> list[str]:
    return [f"{_name(k)}={_value(v)}" for k, v in attrs]


def _call(op: str, inputs: tuple[str, ...], attrs: Attrs) -> str:
    return f"{op}({', '.join([_name(i) for i in inputs] + _attrs(attrs))})"


def _axis_map(kw: str, amap: AxisMap) -> str:
    items = [f"{axis}={dim}" for axis, dim in zip(GRID_AXES, amap) if dim is not None]
    return f" {kw}({', '.join(items)})" if items else ""


def _kernel_op(op: KernelOp, headers: Mapping[int, str]) -> list[tuple[str, Anchor]]:
    outs = [_name(v.name) for v in op.outputs]
    line = _line(op.span)
    if op.block is None:
        return [(f"  {outs[0]} = {_call(op.op, op.inputs, op.attrs)};", line)]
    lhs = outs[0] if len(outs) == 1 else f"({', '.join(outs)})"
    close: Anchor = ("close", line) if line is not None else None
    header = headers.get(line, _custom_header(op.block)) if line is not None \
        else _custom_header(op.block)
    return [(f"  {lhs} = {header} {{", line), *_block(op.block), ("  }", close)]


def _custom_header(bg: BlockGraph) -> str:
    gx, gy, gz = bg.grid
    return f"custom(grid=({gx}, {gy}, {gz}), threads={bg.threads}, forloop={bg.forloop})"


def _block(bg: BlockGraph) -> list[tuple[str, Anchor]]:
    lines: list[tuple[str, Anchor]] = []
    for bi in bg.inputs:
        fmap = f" fmap({bi.fmap})" if bi.fmap is not None else ""
        lines.append(((f"    {_name(bi.value.name)} = load {_name(bi.source)}"
                      f"{_axis_map('imap', bi.imap)}{fmap};"), _line(bi.span)))
    for op in bg.ops:
        lines.append((f"    {_name(op.outputs[0].name)} = {_call(op.op, op.inputs, op.attrs)};",
                      _line(op.span)))
    tiles = bg.tile_types()
    for bo in bg.outputs:
        dtype = bo.value.type.dtype
        conv = f": {dtype.value}" if dtype != tiles[bo.source].dtype else ""
        lines.append(((f"    store {_name(bo.source)} -> {_name(bo.value.name)}{conv}"
                      f"{_axis_map('omap', bo.omap)};"), _line(bo.span)))
    return lines
