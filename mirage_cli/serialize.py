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
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mirage_cli.builder import GraphBuilder
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import AxisMap, BlockGraph, DType, Graph, KernelOp, TensorType, Value
from mirage_cli.kplan import plan_from_json

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


def graph_to_json(g: Graph) -> Json:
    return {
        "name": g.name,
        "params": [{"name": n, "value": v} for n, v in g.params],
        "inputs": [dict(_value(i.value), dims=list(i.dims_src)) for i in g.inputs],
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


class _Reader:
    """Typed access to a JSON document with paths in its error messages."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, path: str, msg: str) -> MirageError:
        return MirageError(f"{path}: {msg}", file=self.file)

    def get(self, d: Any, key: str, kind: type | tuple[type, ...], path: str) -> Any:
        if not isinstance(d, dict):
            raise self.fail(path, "expected an object")
        if key not in d:
            raise self.fail(path, f"missing key '{key}'")
        v = d[key]
        if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, (int, float))):
            name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(f"{path}.{key}", f"expected {name}, got {json.dumps(v)}")
        return v

    def type_of(self, d: Any, path: str) -> TensorType:
        dtype = self.get(d, "dtype", str, path)
        if dtype not in {x.value for x in DType}:
            raise self.fail(f"{path}.dtype", f"unknown dtype '{dtype}'")
        shape = self.get(d, "shape", list, path)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
            raise self.fail(f"{path}.shape", "expected a list of integers")
        return TensorType(tuple(shape), DType(dtype))

    def axis_map(self, d: Any, key: str, path: str) -> AxisMap:
        m = self.get(d, key, list, path)
        if len(m) != 3 or not all(x is None or (isinstance(x, int) and not isinstance(x, bool))
                                  for x in m):
            raise self.fail(f"{path}.{key}", "expected [x, y, z] of integers or null")
        return (m[0], m[1], m[2])

    def attrs(self, d: Any, path: str) -> dict[str, Any]:
        a = d.get("attrs", {}) if isinstance(d, dict) else {}
        if not isinstance(a, dict):
            raise self.fail(f"{path}.attrs", "expected an object")
        return a


def _check_type(r: _Reader, path: str, recorded: TensorType, inferred: TensorType) -> None:
    if recorded != inferred:
        raise r.fail(path, f"recorded type {recorded} disagrees with the inferred {inferred}")


def graph_from_json(d: Any, file: str = "<json>", path: str = "graph") -> Graph:
    """Rebuild (and check) a µGraph from its JSON form."""
    r = _Reader(file)
    try:
        return _build(r, d, path)
    except MirageError as e:
        if e.span is None and e.file is None:
            raise MirageError(f"{path}: {e.message}", file=file) from None
        raise


def _build(r: _Reader, d: Any, path: str) -> Graph:
    params = [(r.get(p, "name", str, f"{path}.params[{i}]"),
               r.get(p, "value", int, f"{path}.params[{i}]"))
              for i, p in enumerate(r.get(d, "params", list, path))]
    b = GraphBuilder(r.get(d, "name", str, path), params)
    for i, inp in enumerate(r.get(d, "inputs", list, path)):
        p = f"{path}.inputs[{i}]"
        t = r.type_of(inp, p)
        dims = r.get(inp, "dims", list, p)
        b.input(r.get(inp, "name", str, p), t.shape, t.dtype, tuple(str(x) for x in dims))
    for i, op in enumerate(r.get(d, "ops", list, path)):
        _build_op(r, b, op, f"{path}.ops[{i}]")
    for i, name in enumerate(r.get(d, "outputs", list, path)):
        if not isinstance(name, str):
            raise r.fail(f"{path}.outputs[{i}]", "expected a tensor name")
        b.output(name)
    return b.build()


def _outputs(r: _Reader, op: Any, path: str) -> list[Value]:
    outs = r.get(op, "outputs", list, path)
    return [Value(r.get(o, "name", str, f"{path}.outputs[{j}]"),
                  r.type_of(o, f"{path}.outputs[{j}]")) for j, o in enumerate(outs)]


def _build_op(r: _Reader, b: GraphBuilder, op: Any, path: str) -> None:
    name = r.get(op, "op", str, path)
    inputs = r.get(op, "inputs", list, path)
    outs = _outputs(r, op, path)
    if name != "custom":
        if len(outs) != 1:
            raise r.fail(f"{path}.outputs", "expected exactly one output")
        try:
            out = b.op(name, *inputs, out=outs[0].name, **r.attrs(op, path))
        except MirageError as e:
            raise r.fail(path, e.message) from None
        _check_type(r, f"{path}.outputs[0]", outs[0].type, b.types[out])
        return
    bd = r.get(op, "block", dict, path)
    grid = r.get(bd, "grid", list, f"{path}.block")
    try:
        k = b.custom(grid, r.get(bd, "threads", int, f"{path}.block"),
                     r.get(bd, "forloop", int, f"{path}.block"))
        for j, bi in enumerate(r.get(bd, "inputs", list, f"{path}.block")):
            p = f"{path}.block.inputs[{j}]"
            fmap = bi.get("fmap") if isinstance(bi, dict) else None
            n = k.load(r.get(bi, "source", str, p), r.axis_map(bi, "imap", p), fmap,
                       out=r.get(bi, "name", str, p))
            _check_type(r, p, r.type_of(bi, p), k.types[n])
        for j, bop in enumerate(r.get(bd, "ops", list, f"{path}.block")):
            p = f"{path}.block.ops[{j}]"
            (v,) = _outputs(r, bop, p)
            n = k.op(r.get(bop, "op", str, p), *r.get(bop, "inputs", list, p), out=v.name,
                     **r.attrs(bop, p))
            _check_type(r, f"{p}.outputs[0]", v.type, k.types[n])
        stores = []
        for j, bo in enumerate(r.get(bd, "outputs", list, f"{path}.block")):
            p = f"{path}.block.outputs[{j}]"
            stores.append((r.get(bo, "source", str, p), r.get(bo, "name", str, p),
                           r.axis_map(bo, "omap", p)))
        k.finish(stores)
    except MirageError as e:
        if e.file is not None:
            raise
        raise r.fail(path, e.message) from None
    if [v.name for v in outs] != [bo[1] for bo in stores]:
        raise r.fail(f"{path}.outputs", "custom kernel outputs disagree with its stores")
    if "plan" in op:
        try:
            plan = plan_from_json(op["plan"], f"{path}.plan")
        except ValueError as e:
            raise r.fail(f"{path}.plan", str(e)) from None
        b.ops[-1] = dataclasses.replace(b.ops[-1], plan=plan)
    for j, v in enumerate(outs):
        _check_type(r, f"{path}.outputs[{j}]", v.type, b.types[v.name])


def _document(text: str, file: str) -> Json:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        from mirage_cli.diagnostics import Span

        raise MirageError(f"malformed JSON: {e.msg}", Span(file, e.lineno, e.colno),
                          source=text) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MirageError(f"not a µGraph file (expected \"format\": \"{FORMAT}\"); "
                          f"Mirage checkpoints are read with 'mirage import-mirage'", file=file)
    version = doc.get("version")
    if version != VERSION:
        raise MirageError(f"unsupported .ugraph.json version {json.dumps(version)} "
                          f"(this mirage reads version {VERSION})", file=file)
    return doc


def loads(text: str, file: str = "<json>") -> Graph:
    """One µGraph; a candidate list yields its first candidate."""
    doc = _document(text, file)
    if "graph" in doc:
        return graph_from_json(doc["graph"], file)
    cands = loads_candidates(text, file)
    if not cands:
        raise MirageError("the candidate list is empty", file=file)
    return cands[0][0]


def loads_candidates(text: str, file: str = "<json>") -> list[tuple[Graph, Json]]:
    """Every candidate of a file, with its metadata (a single graph is one candidate)."""
    doc = _document(text, file)
    if "graph" in doc:
        return [(graph_from_json(doc["graph"], file), {})]
    r = _Reader(file)
    out = []
    for i, c in enumerate(r.get(doc, "candidates", list, "file")):
        g = graph_from_json(r.get(c, "graph", dict, f"candidates[{i}]"), file,
                            f"candidates[{i}].graph")
        meta = c.get("meta", {}) if isinstance(c, dict) else {}
        out.append((g, meta if isinstance(meta, dict) else {}))
    return out


def load(path: str) -> Graph:
    with open(path, encoding="utf-8") as f:
        return loads(f.read(), path)
