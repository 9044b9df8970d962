"""Importing Mirage's µGraph checkpoints into our IR.

A checkpoint (``benchmark/saved_mugraphs/*.json`` of mirage-project/mirage) is a JSON
array of candidates; each candidate is a topologically ordered array of kernel operators
whose tensors are identified by ``guid``. Every graph is rebuilt through
:class:`~mirage_cli.builder.GraphBuilder`, so it is type-checked, and every shape the
checkpoint records is compared with the one our semantics infer.

What this module owns: the structural operators (``kn_input_op``, ``kn_output_op``,
``kn_customized_op``, ``tb_input_op``, ``tb_output_op``), strides, grid/imap/fmap/omap,
data types. Which of our operators a Mirage ``op_type`` means is per-operator knowledge,
looked up in the registry (``OpDef.mirage``). docs/mirage-import.md states the mapping
and where each fact of Mirage's semantics was established.

Tensor names are deterministic: kernel inputs ``in0, in1, ...`` (by position, which is how
programs and candidates are compared), program outputs ``out0, ...`` (in the order of the
``kn_output_op``s), other device tensors ``t<n>`` and block tensors ``b<n>``.

Every malformed field or unknown operator is a :class:`MirageError` naming the file and
a path such as ``candidate 3, op 4 (kn_customized_op), block op 2 (tb_foo_op)``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from mirage_cli import ops
from mirage_cli.builder import BlockBuilder, GraphBuilder
from mirage_cli.diagnostics import MirageError, did_you_mean
from mirage_cli.importers import mirage_dtypes
from mirage_cli.ir import GRID_AXES, Attrs, AxisMap, Graph, TensorType

STRUCTURAL = ("kn_input_op", "kn_output_op", "kn_customized_op", "tb_input_op",
              "tb_output_op")

Json = Any


@functools.cache
def mirage_index() -> dict[str, tuple[str, Attrs]]:
    """Mirage op_type -> (our operator, the attributes its name implies), from the
    registry. ``kn_*`` names must be kernel operators, ``tb_*`` names block operators."""
    index: dict[str, tuple[str, Attrs]] = {}
    for name, opdef in ops.REGISTRY.items():
        for mname, attrs in opdef.mirage:
            level = ops.KERNEL if mname.startswith("kn_") else ops.BLOCK
            assert level in opdef.levels, f"{mname} names {name}, not a {level} operator"
            assert mname not in index, f"Mirage name {mname} is registered twice"
            index[mname] = (name, attrs)
    return index


class _Reader:
    """Typed access to the checkpoint, with the file and a path in every error."""

    def __init__(self, file: str, dtypes: dict[int, str]) -> None:
        self.file = file
        self.dtypes = dtypes

    def fail(self, where: str, msg: str) -> NoReturn:
        raise MirageError(f"{where}: {msg}", file=self.file)

    def get(self, d: Json, key: str, kind: type, where: str) -> Any:
        if not isinstance(d, dict):
            self.fail(where, f"expected a JSON object, got {_show(d)}")
        if key not in d:
            self.fail(where, f"missing field '{key}'")
        v = d[key]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            self.fail(where, f"field '{key}' should be {_KIND[kind]}, got {_show(v)}")
        return v

    def ints(self, d: Json, key: str, where: str) -> list[int]:
        v = self.get(d, key, list, where)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            self.fail(where, f"field '{key}' should be a list of integers, got {_show(v)}")
        return v

    def xyz(self, d: Json, key: str, where: str) -> tuple[int, int, int]:
        m = self.get(d, key, dict, where)
        return (self.get(m, "x", int, f"{where}, {key}"),
                self.get(m, "y", int, f"{where}, {key}"),
                self.get(m, "z", int, f"{where}, {key}"))

    @contextmanager
    def at(self, where: str) -> Iterator[None]:
        """Attach ``where`` to the builder's (unlocated) diagnostics."""
        try:
            yield
        except MirageError as e:
            if e.file is not None or e.span is not None:
                raise
            self.fail(where, e.message)


_KIND = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def _show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------


def _tensor(r: _Reader, t: Json, where: str, device: bool) -> tuple[int, TensorType]:
    """(guid, type) of a recorded tensor: ``dim`` zero-padded to 4, ``num_dims`` used."""
    guid = r.get(t, "guid", int, where)
    n = r.get(t, "num_dims", int, where)
    dims = r.ints(t, "dim", where)
    if not 1 <= n <= min(4, len(dims)):
        r.fail(where, f"num_dims {n} is out of range (1 to 4, at most len(dim) = {len(dims)})")
    if any(d < 1 for d in dims[:n]) or any(d != 0 for d in dims[n:]):
        r.fail(where, f"dim {dims} with num_dims {n}: expected {n} positive sizes, then zeros")
    code = r.get(t, "data_type", int, where)
    meaning = r.dtypes.get(code, "unknown")
    dtype = mirage_dtypes.to_dtype(meaning)
    if dtype is None:
        r.fail(where, f"data_type {code} ({meaning}) is not supported; tensors are f16, "
                      f"bf16 or f32")
    layout = t.get("layout", "DmemRowMajor" if device else None)
    if device and layout != "DmemRowMajor":
        r.fail(where, f"device tensor layout {_show(layout)} is not supported "
                      f"(only DmemRowMajor)")
    return guid, TensorType(tuple(dims[:n]), dtype)


def _only_tensor(r: _Reader, op: Json, key: str, where: str, device: bool
                 ) -> tuple[int, TensorType]:
    ts = r.get(op, key, list, where)
    if len(ts) != 1:
        r.fail(where, f"expected exactly one tensor in '{key}', got {len(ts)}")
    return _tensor(r, ts[0], f"{where}, {key}[0]", device)


def _check_type(r: _Reader, where: str, recorded: TensorType, ours: TensorType) -> None:
    if recorded != ours:
        r.fail(where, f"Mirage records {recorded} but our semantics give {ours}")


def _row_major(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def _check_strides(r: _Reader, op: Json, key: str, t: TensorType, where: str) -> None:
    strides = r.ints(op, key, where)
    if strides != _row_major(t.shape):
        r.fail(where, f"{key} {strides} for shape {list(t.shape)} are not row-major "
                      f"contiguous ({_row_major(t.shape)}); only contiguous row-major "
                      f"tensors are supported")


def _no_device_map(r: _Reader, op: Json, key: str, where: str) -> None:
    """Kernel-graph input/output maps partition tensors over GPUs (distributed Mirage)."""
    if key in op and r.xyz(op, key, where) != (-1, -1, -1):
        r.fail(where, f"{key} {_show(op[key])} partitions the tensor over several GPUs; "
                      f"only single-GPU graphs (all -1) are supported")


# ---------------------------------------------------------------------------
# Kernel graph
# ---------------------------------------------------------------------------


class _Candidate:
    """Rebuilds one candidate through the builder; ``names`` maps guids to our names."""

    def __init__(self, r: _Reader, name: str, where: str) -> None:
        self.r = r
        self.where = where
        self.b = GraphBuilder(name)
        self.names: dict[int, str] = {}
        self.out_names: dict[int, str] = {}
        self.n_inputs = 0

    def define(self, guid: int, name: str, where: str) -> None:
        if guid in self.names:
            self.r.fail(where, f"tensor guid {guid} is defined twice")
        self.names[guid] = name

    def use(self, t: Json, where: str) -> str:
        """Our name of a recorded input tensor, checking its recorded type."""
        guid, recorded = _tensor(self.r, t, where, device=True)
        if guid not in self.names:
            self.r.fail(where, f"tensor guid {guid} is not produced by an earlier operator")
        name = self.names[guid]
        _check_type(self.r, where, recorded, self.b.types[name])
        return name

    def build(self, ops_json: Json) -> Graph:
        if not isinstance(ops_json, list):
            self.r.fail(self.where, f"expected a list of operators, got {_show(ops_json)}")
        self.out_names = _output_names(ops_json)
        for j, op in enumerate(ops_json):
            op_type = self.r.get(op, "op_type", str, f"{self.where}, op {j}")
            where = f"{self.where}, op {j} ({op_type})"
            match op_type:
                case "kn_input_op":
                    self.input(op, where)
                case "kn_output_op":
                    self.output(op, where)
                case "kn_customized_op":
                    _Kernel(self, op, where).build()
                case _:
                    self.kernel_op(op, op_type, where)
        with self.r.at(self.where):
            return self.b.build()

    def input(self, op: Json, where: str) -> None:
        if self.r.get(op, "input_tensors", list, where):
            self.r.fail(where, "an input operator takes no input tensors")
        guid, t = _only_tensor(self.r, op, "output_tensors", where, device=True)
        _check_strides(self.r, op, "input_strides", t, where)
        _no_device_map(self.r, op, "input_map", where)
        name = f"in{self.n_inputs}"
        self.n_inputs += 1
        with self.r.at(where):
            self.b.input(name, t.shape, t.dtype)
        self.define(guid, name, where)

    def output(self, op: Json, where: str) -> None:
        ts = self.r.get(op, "input_tensors", list, where)
        if len(ts) != 1:
            self.r.fail(where, f"expected exactly one tensor in 'input_tensors', got {len(ts)}")
        name = self.use(ts[0], f"{where}, input_tensors[0]")
        _check_strides(self.r, op, "output_strides", self.b.types[name], where)
        _no_device_map(self.r, op, "output_map", where)
        with self.r.at(where):
            self.b.output(name)

    def kernel_op(self, op: Json, op_type: str, where: str) -> None:
        ours, attrs = _lookup(self.r, op_type, ops.KERNEL, where)
        ins = [self.use(t, f"{where}, input_tensors[{i}]")
               for i, t in enumerate(self.r.get(op, "input_tensors", list, where))]
        guid, recorded = _only_tensor(self.r, op, "output_tensors", where, device=True)
        values = _attr_values(self.r, ours, attrs, op, None, where)
        with self.r.at(where):
            out = self.b.op(ours, *ins, out=self.out_names.get(guid) or self.b.fresh(),
                            **values)
        _check_type(self.r, f"{where}, output_tensors[0]", recorded, self.b.types[out])
        self.define(guid, out, where)


def _output_names(ops_json: list[Json]) -> dict[int, str]:
    """guid -> ``out<k>`` for the tensors the ``kn_output_op``s mark, in their order.
    Lenient: a malformed operator is reported later, where it is read in full."""
    names: dict[int, str] = {}
    for op in ops_json:
        if isinstance(op, dict) and op.get("op_type") == "kn_output_op":
            ts = op.get("input_tensors")
            if isinstance(ts, list) and ts and isinstance(ts[0], dict):
                guid = ts[0].get("guid")
                if isinstance(guid, int) and guid not in names:
                    names[guid] = f"out{len(names)}"
    return names


def _lookup(r: _Reader, op_type: str, level: str, where: str) -> tuple[str, Attrs]:
    """Our operator for a Mirage op_type at ``level`` (through the registry)."""
    index = mirage_index()
    prefix = "kn_" if level == ops.KERNEL else "tb_"
    if op_type in STRUCTURAL:
        r.fail(where, f"'{op_type}' cannot appear here")
    if op_type not in index or not op_type.startswith(prefix):
        known = [n for n in (*index, *STRUCTURAL) if n.startswith(prefix)]
        r.fail(where, f"unknown Mirage {level} operator '{ascii(op_type)[1:-1][:64]}'"
                      f"{did_you_mean(op_type, known)}")
    return index[op_type]


def _attr_values(r: _Reader, ours: str, fixed: Attrs, op: Json, dimx: int | None,
                 where: str) -> dict[str, Any]:
    """Attributes of our operator: those its Mirage name implies, the width of a
    reduce-to-x accumulator (the block graph's ``reduction_dimx``), and any other the
    checkpoint records under the same name (e.g. ``scalar``)."""
    values: dict[str, Any] = dict(fixed)  # AttrValues (Any: passed on as **kwargs)
    for spec in ops.get(ours).attrs:
        if spec.name in values:
            continue
        if spec.name == "width" and dimx is not None:
            values["width"] = dimx
        elif isinstance(op, dict) and spec.name in op:
            v = op[spec.name]
            if not isinstance(v, (int, float, str)):
                r.fail(where, f"field '{spec.name}' should be a number, got {_show(v)}")
            values[spec.name] = v
        elif spec.required:
            r.fail(where, f"the checkpoint does not record '{spec.name}', which '{ours}' needs")
    return values


# ---------------------------------------------------------------------------
# Custom kernels (block graphs)
# ---------------------------------------------------------------------------


class _Kernel:
    """One ``kn_customized_op``: its block graph, rebuilt through a BlockBuilder."""

    def __init__(self, cand: _Candidate, op: Json, where: str) -> None:
        self.c = cand
        self.r = cand.r
        self.op = op
        self.where = where
        self.names: dict[int, str] = {}  # block tensor guid -> our block tensor name

    def build(self) -> None:
        r, op, where = self.r, self.op, self.where
        ins_json = r.get(op, "input_tensors", list, where)
        ins = [(self._guid(t, f"{where}, input_tensors[{i}]"),
                self.c.use(t, f"{where}, input_tensors[{i}]")) for i, t in enumerate(ins_json)]
        outs_json = r.get(op, "output_tensors", list, where)
        outs = [_tensor(r, t, f"{where}, output_tensors[{i}]", device=True)
                for i, t in enumerate(outs_json)]
        bg = r.get(op, "bgraph", dict, where)
        k = self._block_builder(bg)
        dimx = bg.get("reduction_dimx")
        dimx = dimx if isinstance(dimx, int) and not isinstance(dimx, bool) else None
        stores: list[tuple[str, str | None, AxisMap]] = []
        n_loads = 0
        for j, bop in enumerate(r.get(bg, "operators", list, f"{where}, bgraph")):
            op_type = r.get(bop, "op_type", str, f"{where}, block op {j}")
            w = f"{where}, block op {j} ({op_type})"
            match op_type:
                case "tb_input_op":
                    if n_loads >= len(ins):
                        r.fail(w, f"more tb_input_ops than the kernel's {len(ins)} inputs")
                    self.load(k, bop, ins[n_loads], w)
                    n_loads += 1
                case "tb_output_op":
                    if len(stores) >= len(outs):
                        r.fail(w, f"more tb_output_ops than the kernel's {len(outs)} outputs")
                    stores.append(self.store(k, bop, outs[len(stores)][0], w))
                case _:
                    self.block_op(k, bop, op_type, dimx, w)
        if n_loads != len(ins) or len(stores) != len(outs):
            r.fail(where, f"the block graph loads {n_loads} and stores {len(stores)} tensors, "
                          f"but the kernel has {len(ins)} inputs and {len(outs)} outputs")
        with r.at(where):
            names = k.finish(stores)
        for i, ((guid, recorded), name) in enumerate(zip(outs, names)):
            _check_type(r, f"{where}, output_tensors[{i}]", recorded, self.c.b.types[name])
            self.c.define(guid, name, where)

    def _guid(self, t: Json, where: str) -> int:
        return int(self.r.get(t, "guid", int, where))

    def _block_builder(self, bg: Json) -> BlockBuilder:
        r, where = self.r, f"{self.where}, bgraph"
        grid = r.xyz(bg, "grid_dim", where)
        bx, by, bz = r.xyz(bg, "block_dim", where)
        if (by, bz) != (1, 1):
            r.fail(where, f"block_dim ({bx}, {by}, {bz}): only one-dimensional thread "
                          f"blocks (y = z = 1) are supported")
        forloop = r.get(bg, "forloop_range", int, where)
        # Checked here, before any tile is cut: the builder divides by them on each load.
        for what, n in (("grid_dim", min(grid)), ("block_dim.x", bx), ("forloop_range", forloop)):
            if n < 1:
                r.fail(where, f"{what} must be positive, got {_show(bg[what.split('.')[0]])}")
        with r.at(where):
            return self.c.b.custom(grid, bx, forloop)

    def _axis_map(self, k: BlockBuilder, d: Json, key: str, where: str) -> AxisMap:
        """Mirage's x/y/z -> dim map. Mirage ignores the entry of a grid axis of size 1
        (src/threadblock/input_loader.cc, output.cc), so we drop it too; -1 replicates."""
        m = self.r.xyz(d, key, where)
        dims: list[int | None] = []
        for axis, g, dim in zip(GRID_AXES, k.grid, m):
            if dim < -1:
                self.r.fail(where, f"{key}.{axis} = {dim}: expected a dimension or -1")
            dims.append(dim if dim >= 0 and g > 1 else None)
        return (dims[0], dims[1], dims[2])

    def load(self, k: BlockBuilder, bop: Json, source: tuple[int, str], where: str) -> None:
        """A ``tb_input_op`` reads the kernel's inputs in order (Mirage binds them by
        position, src/kernel/customized.cc); its ``dtensor`` must agree."""
        r = self.r
        guid, name = source
        dguid, _ = _tensor(r, r.get(bop, "dtensor", dict, where), f"{where}, dtensor", True)
        if dguid != guid:
            r.fail(where, f"dtensor guid {dguid} is not the kernel's input {guid} at this "
                          f"position")
        imap = self._axis_map(k, bop, "input_map", where)
        fdim = r.get(bop, "forloop_dim", int, where)
        if fdim < -1:
            r.fail(where, f"forloop_dim = {fdim}: expected a dimension or -1")
        out_guid, recorded = _only_tensor(r, bop, "output_tensors", where, device=False)
        with r.at(where):
            b = k.load(name, imap, fdim if fdim >= 0 else None)
        _check_type(r, f"{where}, output_tensors[0]", recorded, k.types[b])
        self._define(out_guid, b, where)

    def store(self, k: BlockBuilder, bop: Json, out_guid: int, where: str
              ) -> tuple[str, str | None, AxisMap]:
        r = self.r
        ts = r.get(bop, "input_tensors", list, where)
        if len(ts) != 1:
            r.fail(where, f"expected exactly one tensor in 'input_tensors', got {len(ts)}")
        src = self._use(k, ts[0], f"{where}, input_tensors[0]")
        if "dtensor" in bop:
            dguid, _ = _tensor(r, r.get(bop, "dtensor", dict, where), f"{where}, dtensor", True)
            if dguid != out_guid:
                r.fail(where, f"dtensor guid {dguid} is not the kernel's output {out_guid} at "
                              f"this position")
        if bop.get("forloop_dim", -1) != -1:
            r.fail(where, f"forloop_dim {_show(bop['forloop_dim'])} on an output (storing "
                          f"every iteration) is not supported")
        omap = self._axis_map(k, bop, "output_map", where)
        return (src, self.c.out_names.get(out_guid), omap)

    def block_op(self, k: BlockBuilder, bop: Json, op_type: str, dimx: int | None,
                 where: str) -> None:
        r = self.r
        ours, attrs = _lookup(r, op_type, ops.BLOCK, where)
        ins = [self._use(k, t, f"{where}, input_tensors[{i}]")
               for i, t in enumerate(r.get(bop, "input_tensors", list, where))]
        guid, recorded = _only_tensor(r, bop, "output_tensors", where, device=False)
        values = _attr_values(r, ours, attrs, bop, dimx, where)
        with r.at(where):
            out = k.op(ours, *ins, **values)
        _check_type(r, f"{where}, output_tensors[0]", recorded, k.types[out])
        self._define(guid, out, where)

    def _define(self, guid: int, name: str, where: str) -> None:
        if guid in self.names:
            self.r.fail(where, f"block tensor guid {guid} is defined twice")
        self.names[guid] = name

    def _use(self, k: BlockBuilder, t: Json, where: str) -> str:
        guid, recorded = _tensor(self.r, t, where, device=False)
        if guid not in self.names:
            self.r.fail(where, f"block tensor guid {guid} is not produced by an earlier "
                               f"block operator")
        name = self.names[guid]
        _check_type(self.r, where, recorded, k.types[name])
        return name


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _document(text: str, file: str) -> list[Json]:
    from mirage_cli import jsondoc

    doc = jsondoc.load(text, file)  # bounded nesting and numbers, located errors
    if not isinstance(doc, list):
        raise MirageError("not a Mirage checkpoint: expected a JSON array of candidate "
                          "µGraphs", file=file)
    if not doc:
        raise MirageError("the checkpoint holds no candidates", file=file)
    return doc


def _walk(d: Json, key: str) -> Iterator[Any]:
    """Every value stored under ``key`` anywhere in ``d``."""
    stack = [d]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if key in x:
                yield x[key]
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _dtype_table(doc: list[Json], file: str, numbering: str | None) -> dict[int, str]:
    """What each ``data_type`` code of this checkpoint means (see mirage_dtypes)."""
    if numbering is not None:
        if numbering not in mirage_dtypes.NUMBERINGS:
            raise MirageError(f"unknown Mirage data type numbering '{numbering}' (known: "
                              f"{', '.join(mirage_dtypes.NUMBERINGS)})", file=file)
        return mirage_dtypes.NUMBERINGS[numbering]
    codes = {c for c in _walk(doc, "data_type") if isinstance(c, int)}
    op_types = (t for t in _walk(doc, "op_type") if isinstance(t, str))
    meaning = mirage_dtypes.resolve(codes, mirage_dtypes.possible_numberings(op_types))
    if isinstance(meaning, str):
        raise MirageError(meaning, file=file)
    return meaning


def graph_name(file: str, index: int) -> str:
    """``<file stem>_<index>``, made a valid name (ASCII, at most 48 characters of
    the stem: see mirage_cli.syntax.check_name)."""
    stem = re.sub(r"[^A-Za-z0-9_]", "_", Path(file).name.split(".")[0])[:48] or "mirage"
    return f"{'g_' if stem[0].isdigit() else ''}{stem}_{index}"


def import_checkpoint(text: str, file: str, numbering: str | None = None) -> list[Graph]:
    """Every candidate of a Mirage checkpoint, as checked µGraphs (in file order).

    ``numbering`` names Mirage's data type numbering (mirage_dtypes.NUMBERINGS) where
    the checkpoint alone does not decide it."""
    doc = _document(text, file)
    r = _Reader(file, _dtype_table(doc, file, numbering))
    return [_Candidate(r, graph_name(file, i), f"candidate {i}").build(c)
            for i, c in enumerate(doc)]
