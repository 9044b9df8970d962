"""`.ugraph.json`: the canonical, versioned file format of µGraphs.

One file holds either one µGraph::

    {"format": "mirage-cli/ugraph", "version": 1, "graph": {...}}

or a list of candidates, each a µGraph with free-form metadata (cost, verification
certificate, ...)::

    {"format": "mirage-cli/ugraph", "version": 1, "candidates": [{"graph": {...}, "meta": {...}}]}

The text is canonical: sorted keys, two-space indentation, a trailing newline, and the
graph's own order of inputs, operators and outputs, so equal graphs give identical
bytes and ``load(dump(g)) == g``. Loading rebuilds the graph through
:class:`~mirage_cli.builder.GraphBuilder`, so a loaded graph is always checked, and a
file whose recorded types disagree with inference is rejected.

Loading trusts nothing in the file: the text is read through
:func:`mirage_cli.jsondoc.load` (bounded nesting and numbers), every field is checked
for its JSON type and range before it reaches the builder, and every name (program,
parameter, input, output, device and block tensor, attribute key) must pass
:func:`mirage_cli.syntax.check_name`. Each error names the JSON path of the offending
value and, where the text is at hand, its ``file:line:col``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from mirage_cli import jsondoc
from mirage_cli.builder import BlockBuilder, GraphBuilder
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import (
    AttrValue,
    AxisMap,
    BlockGraph,
    DType,
    Graph,
    Input,
    KernelOp,
    TensorType,
    Value,
)
from mirage_cli.kplan import plan_from_json
from mirage_cli.syntax import MAX_INT, check_name

FORMAT = "mirage-cli/ugraph"
VERSION = 1

Json = dict[str, Any]


def _value(v: Value) -> Json:
    return {"name": v.name, "dtype": v.type.dtype.value, "shape": list(v.type.shape)}


def _axis_map(m: AxisMap) -> list[int | None]:
    return list(m)


def _block(bg: BlockGraph) -> Json:
    return {
        "grid": list(bg.grid), "threads": bg.threads, "forloop": bg.forloop,
        "inputs": [dict(_value(bi.value), source=bi.source, imap=_axis_map(bi.imap),
                        fmap=bi.fmap) for bi in bg.inputs],
        "ops": [{"op": op.op, "inputs": list(op.inputs),
                 "outputs": [_value(v) for v in op.outputs], "attrs": dict(op.attrs)}
                for op in bg.ops],
        "outputs": [dict(_value(bo.value), source=bo.source, omap=_axis_map(bo.omap))
                    for bo in bg.outputs],
    }


def _kernel_op(op: KernelOp) -> Json:
    d: Json = {"op": op.op, "inputs": list(op.inputs),
               "outputs": [_value(v) for v in op.outputs], "attrs": dict(op.attrs)}
    if op.block is not None:
        d["block"] = _block(op.block)
    if op.plan is not None:
        d["plan"] = op.plan.as_json()
    return d


def _input(i: Input) -> Json:
    d: Json = dict(_value(i.value), dims=list(i.dims_src))
    if i.weight:  # written only when set: files without weights read as before
        d["weight"] = True
    return d


def graph_to_json(g: Graph) -> Json:
    return {
        "name": g.name,
        "params": [{"name": n, "value": v} for n, v in g.params],
        "inputs": [_input(i) for i in g.inputs],
        "ops": [_kernel_op(op) for op in g.ops],
        "outputs": list(g.outputs),
    }


def _text(doc: Json) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def dumps(g: Graph) -> str:
    """Canonical text of one µGraph."""
    return _text({"format": FORMAT, "version": VERSION, "graph": graph_to_json(g)})


def dumps_candidates(cands: list[tuple[Graph, Json]]) -> str:
    """Canonical text of a list of candidates with their metadata."""
    return _text({"format": FORMAT, "version": VERSION,
                  "candidates": [{"graph": graph_to_json(g), "meta": meta}
                                 for g, meta in cands]})


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

Path = jsondoc.Path
MAX_DIM_TEXT = 16384  # characters of one dimension expression: more than any the parser
# accepts can print to (200 levels of 64-character names and operators)
_KINDS = {int: "an integer", str: "a string", list: "a list", dict: "an object",
          bool: "true or false"}


class _Reader:
    """Checked access to a parsed JSON document; errors name the JSON path of the
    value and, given the text, its line and column."""

    def __init__(self, file: str, text: str | None = None) -> None:
        self.file = file
        self.text = text

    def fail(self, path: Path, msg: str) -> MirageError:
        if self.text is not None:
            return jsondoc.error_at(self.text, self.file, path, msg)
        return MirageError(f"{jsondoc.path_text(path)}: {msg}", file=self.file)

    def get(self, d: Any, key: str, kind: type, path: Path) -> Any:
        if not isinstance(d, dict):
            raise self.fail(path, f"expected an object, got {_show(d)}")
        if key not in d:
            raise self.fail(path, f"missing key '{key}'")
        return self.expect(d[key], kind, path + (key,))

    def expect(self, v: Any, kind: type, path: Path) -> Any:
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise self.fail(path, f"expected {_KINDS[kind]}, got {_show(v)}")
        return v

    def int_in(self, v: Any, path: Path, lo: int, hi: int = MAX_INT) -> int:
        n: int = self.expect(v, int, path)
        if not lo <= n <= hi:
            raise self.fail(path, f"expected an integer from {lo} to {hi}, got {n}")
        return n

    def name(self, d: Any, key: str, path: Path) -> str:
        n: str = self.get(d, key, str, path)
        self.check_name(n, path + (key,))
        return n

    def op_name(self, d: Any, path: Path) -> str:
        """An operator name: the grammar of names (it is quoted in messages)."""
        n: str = self.get(d, "op", str, path)
        problem = check_name(n, reserved_ok=True)
        if problem is not None:
            raise self.fail(path + ("op",), problem)
        return n

    def check_name(self, n: Any, path: Path) -> None:
        problem = check_name(n)
        if problem is not None:
            raise self.fail(path, problem)

    def names(self, d: Any, key: str, path: Path) -> list[str]:
        items = self.get(d, key, list, path)
        for j, n in enumerate(items):
            self.check_name(n, path + (key, j))
        return list(items)

    def type_of(self, d: Any, path: Path) -> TensorType:
        dtype = self.get(d, "dtype", str, path)
        if dtype not in {x.value for x in DType}:
            raise self.fail(path + ("dtype",), f"unknown dtype {_show(dtype)}; expected "
                            f"f16, bf16 or f32")
        shape = self.get(d, "shape", list, path)
        if not 1 <= len(shape) <= 4:
            raise self.fail(path + ("shape",), f"expected 1 to 4 dimensions, got "
                            f"{len(shape)}")
        return TensorType(tuple(self.int_in(x, path + ("shape", j), 1)
                                for j, x in enumerate(shape)), DType(dtype))

    def axis_map(self, d: Any, key: str, path: Path) -> AxisMap:
        m = self.get(d, key, list, path)
        if len(m) != 3:
            raise self.fail(path + (key,), f"expected [x, y, z] (3 entries), got "
                            f"{len(m)} entries")
        dims = tuple(None if x is None else self.int_in(x, path + (key, j), 0, 3)
                     for j, x in enumerate(m))
        return (dims[0], dims[1], dims[2])

    def fmap(self, d: Any, path: Path) -> int | None:
        v = d.get("fmap")
        return None if v is None else self.int_in(v, path + ("fmap",), 0, 3)

    def grid(self, d: Any, path: Path) -> tuple[int, ...]:
        g = self.get(d, "grid", list, path)
        if not 1 <= len(g) <= 3:
            raise self.fail(path + ("grid",), f"a grid has 1 to 3 entries (x, y, z), got "
                            f"{len(g)}")
        return tuple(self.int_in(x, path + ("grid", j), 1) for j, x in enumerate(g))

    def attrs(self, d: Any, path: Path) -> dict[str, AttrValue]:
        a = d.get("attrs", {})
        if not isinstance(a, dict):
            raise self.fail(path + ("attrs",), f"expected an object, got {_show(a)}")
        for k, v in a.items():
            self.check_name(k, path + ("attrs", k))
            if isinstance(v, (bool, str)):
                continue
            if isinstance(v, int):
                self.int_in(v, path + ("attrs", k), -MAX_INT - 1)
            elif not isinstance(v, float) or not math.isfinite(v):
                raise self.fail(path + ("attrs", k), f"an attribute value is a number, "
                                f"true/false or a string, got {_show(v)}")
        return dict(a)

    def dims(self, d: Any, shape: tuple[int, ...], path: Path) -> tuple[str, ...]:
        """The dimensions as written; each must be an expression of the language."""
        from mirage_cli.syntax import parse_dim_expr

        dims = self.get(d, "dims", list, path)
        out = []
        for j, x in enumerate(dims):
            p = path + ("dims", j)
            if isinstance(x, int) and not isinstance(x, bool):
                x = str(self.int_in(x, p, 1))
            text = self.expect(x, str, p)
            if len(text) > MAX_DIM_TEXT:
                raise self.fail(p, f"a dimension expression has at most {MAX_DIM_TEXT} "
                                f"characters")
            try:
                parse_dim_expr(text, jsondoc.path_text(p))
            except MirageError as e:
                raise self.fail(p, f"not a dimension expression ({e.message})") from None
            out.append(text)
        return tuple(out)


def _show(v: Any) -> str:
    """A JSON value for a message: short, and inert on a terminal."""
    text = json.dumps(v, ensure_ascii=True) if not isinstance(v, (dict, list)) else \
        ("an object" if isinstance(v, dict) else "a list")
    return text if len(text) <= 40 else text[:37] + "..."


def _check_type(r: _Reader, path: Path, recorded: TensorType, inferred: TensorType) -> None:
    if recorded != inferred:
        raise r.fail(path, f"recorded type {recorded} disagrees with the inferred {inferred}")


def graph_from_json(d: Any, file: str = "<json>", path: Path = ("graph",),
                    text: str | None = None) -> Graph:
    """Rebuild (and check) a µGraph from its JSON form (``text``: the file's text, to
    give errors a line and column)."""
    r = _Reader(file, text)
    try:
        return _build(r, d, path)
    except MirageError as e:
        if e.span is None and e.file is None:
            raise r.fail(path, e.message) from None
        raise


def _build(r: _Reader, d: Any, path: Path) -> Graph:
    params = []
    for i, p in enumerate(r.get(d, "params", list, path)):
        pp = path + ("params", i)
        params.append((r.name(p, "name", pp), r.int_in(r.get(p, "value", int, pp),
                                                        pp + ("value",), -MAX_INT - 1)))
        if params[-1][0] in (n for n, _ in params[:-1]):
            raise r.fail(pp + ("name",), f"parameter '{params[-1][0]}' is defined twice")
    b = GraphBuilder(r.name(d, "name", path), params)
    for i, inp in enumerate(r.get(d, "inputs", list, path)):
        p = path + ("inputs", i)
        name = r.name(inp, "name", p)
        t = r.type_of(inp, p)
        weight = r.expect(inp["weight"], bool, p + ("weight",)) if "weight" in inp else False
        _guard(r, p, b.input, name, t.shape, t.dtype, r.dims(inp, t.shape, p), weight=weight)
    for i, op in enumerate(r.get(d, "ops", list, path)):
        _build_op(r, b, op, path + ("ops", i))
    for i, name in enumerate(r.names(d, "outputs", path)):
        _guard(r, path + ("outputs", i), b.output, name)
    return _guard(r, path, b.build)


def _guard(r: _Reader, path: Path, f: Any, *args: Any, **kwargs: Any) -> Any:
    """``f(*args, **kwargs)``, with an unlocated builder error put at ``path``."""
    try:
        return f(*args, **kwargs)
    except MirageError as e:
        if e.span is not None or e.file is not None:
            raise
        raise r.fail(path, e.message) from None


def _outputs(r: _Reader, op: Any, path: Path) -> list[Value]:
    outs = r.get(op, "outputs", list, path)
    return [Value(r.name(o, "name", path + ("outputs", j)),
                  r.type_of(o, path + ("outputs", j))) for j, o in enumerate(outs)]


def _build_op(r: _Reader, b: GraphBuilder, op: Any, path: Path) -> None:
    name = r.op_name(op, path)
    inputs = r.names(op, "inputs", path)
    outs = _outputs(r, op, path)
    if name != "custom":
        if len(outs) != 1:
            raise r.fail(path + ("outputs",), f"'{name}' has exactly one output, "
                         f"got {len(outs)}")
        if "block" in op:
            raise r.fail(path + ("block",), "only a custom operator has a block graph")
        attrs = r.attrs(op, path)
        out = _guard(r, path, b.op_with, name, inputs, attrs, out=outs[0].name)
        _check_type(r, path + ("outputs", 0), outs[0].type, b.types[out])
        return
    if r.attrs(op, path):
        raise r.fail(path + ("attrs",), "a custom operator has no attributes")
    bd = r.get(op, "block", dict, path)
    bp = path + ("block",)
    k = b.custom(r.grid(bd, bp), r.int_in(r.get(bd, "threads", int, bp), bp + ("threads",), 1),
                 r.int_in(r.get(bd, "forloop", int, bp), bp + ("forloop",), 1))
    _block_inputs(r, k, bd, bp)
    _block_ops(r, k, bd, bp)
    stores = []
    dtype_of = {v.name: v.type.dtype for v in outs}  # a store converts to its tensor's
    for j, bo in enumerate(r.get(bd, "outputs", list, bp)):
        p = bp + ("outputs", j)
        name = r.name(bo, "name", p)
        stores.append((r.name(bo, "source", p), name, r.axis_map(bo, "omap", p), None,
                       dtype_of.get(name)))
    _guard(r, path, k.finish, stores)
    if [v.name for v in outs] != [bo[1] for bo in stores]:
        raise r.fail(path + ("outputs",), "custom kernel outputs disagree with its stores")
    if sorted(inputs) != sorted({bi.source for bi in k.inputs}):
        raise r.fail(path + ("inputs",), "a custom kernel's inputs are the device tensors "
                     "its block graph loads")
    if "plan" in op:
        where = jsondoc.path_text(path + ("plan",))
        try:
            plan = plan_from_json(op["plan"], where)
        except ValueError as e:
            raise r.fail(path + ("plan",), str(e).removeprefix(where + ": ")) from None
        b.ops[-1] = dataclasses.replace(b.ops[-1], plan=plan)
    for j, v in enumerate(outs):
        _check_type(r, path + ("outputs", j), v.type, b.types[v.name])


def _block_inputs(r: _Reader, k: BlockBuilder, bd: Any, bp: Path) -> None:
    for j, bi in enumerate(r.get(bd, "inputs", list, bp)):
        p = bp + ("inputs", j)
        src, imap, fmap, out = (r.name(bi, "source", p), r.axis_map(bi, "imap", p),
                                r.fmap(bi, p), r.name(bi, "name", p))
        n = _guard(r, p, k.load, src, imap, fmap, out=out)
        _check_type(r, p, r.type_of(bi, p), k.types[n])


def _block_ops(r: _Reader, k: BlockBuilder, bd: Any, bp: Path) -> None:
    for j, bop in enumerate(r.get(bd, "ops", list, bp)):
        p = bp + ("ops", j)
        name = r.op_name(bop, p)
        outs = _outputs(r, bop, p)
        if len(outs) != 1:
            raise r.fail(p + ("outputs",), f"a block operator has exactly one output, got "
                         f"{len(outs)}")
        ins, attrs = r.names(bop, "inputs", p), r.attrs(bop, p)
        n = _guard(r, p, k.op_with, name, ins, attrs, out=outs[0].name)
        _check_type(r, p + ("outputs", 0), outs[0].type, k.types[n])


def _document(text: str, file: str) -> Json:
    doc = jsondoc.load(text, file)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MirageError(f"not a µGraph file (expected \"format\": \"{FORMAT}\"); "
                          f"Mirage checkpoints are read with 'mirage import-mirage'", file=file)
    version = doc.get("version")
    if version != VERSION or isinstance(version, bool):
        raise jsondoc.error_at(text, file, ("version",), f"unsupported .ugraph.json version "
                               f"{_show(version)} (this mirage reads version {VERSION})")
    return doc


def loads(text: str, file: str = "<json>") -> Graph:
    """One µGraph; a candidate list yields its first candidate."""
    cands = loads_candidates(text, file)
    if not cands:
        raise MirageError("the candidate list is empty", file=file)
    return cands[0][0]


def loads_candidates(text: str, file: str = "<json>") -> list[tuple[Graph, Json]]:
    """Every candidate of a file, with its metadata (a single graph is one candidate)."""
    doc = _document(text, file)
    if "graph" in doc:
        return [(graph_from_json(doc["graph"], file, ("graph",), text), {})]
    r = _Reader(file, text)
    out = []
    for i, c in enumerate(r.get(doc, "candidates", list, ())):
        p: Path = ("candidates", i)
        g = graph_from_json(r.get(c, "graph", dict, p), file, p + ("graph",), text)
        meta = c.get("meta", {})
        out.append((g, meta if isinstance(meta, dict) else {}))
    return out


def load(path: str) -> Graph:
    with open(path, encoding="utf-8") as f:
        return loads(f.read(), path)

