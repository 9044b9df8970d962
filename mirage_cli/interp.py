"""The reference interpreter: the executable definition of what a µGraph computes.

Runs any µGraph on the CPU with numpy, exactly as DESIGN.md §3 states: pre-defined
kernel operators directly through their registry semantics, custom kernels block by
block and forloop iteration by iteration. Written for obviousness, not speed.

Two precisions:
- ``float64``: every value in float64 (the numerical ground truth);
- ``native``: device tensors rounded to their dtype (f16/bf16/f32) after every kernel
  operator, arithmetic and block tiles in float32, i.e. f32 accumulation.
"""

from __future__ import annotations

import itertools
from typing import Literal, Mapping

import numpy as np

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.diagnostics import MirageError
from mirage_cli.dtypes import round_to
from mirage_cli.ir import AxisMap, BlockGraph, Graph, KernelOp, TensorType

Precision = Literal["float64", "native"]


def random_inputs(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Reproducible random inputs (standard normal, never zeros), float32 values
    already representable in each input's dtype."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for inp in g.inputs:
        t = inp.value.type
        x = rng.standard_normal(t.shape).astype(np.float32)
        out[inp.value.name] = round_to(t.dtype, x)
    return out


def run(g: Graph, inputs: Mapping[str, np.ndarray], precision: Precision = "float64"
        ) -> dict[str, np.ndarray]:
    """Evaluate ``g`` on ``inputs``; returns its outputs by name."""
    dt = np.float64 if precision == "float64" else np.float32
    env: dict[str, np.ndarray] = {}
    for inp in g.inputs:
        name, t = inp.value.name, inp.value.type
        if name not in inputs:
            raise MirageError(f"missing input '{name}' ({t})")
        x = np.asarray(inputs[name])
        if x.shape != t.shape:
            raise MirageError(f"input '{name}' has shape {list(x.shape)}, expected "
                              f"{list(t.shape)}")
        env[name] = _store(x.astype(dt), t, precision)
    for op in g.ops:
        results = _run_kernel_op(op, env, dt)
        for v, r in zip(op.outputs, results):
            env[v.name] = _store(r, v.type, precision)
    return {name: env[name] for name in g.outputs}


def _store(x: np.ndarray, t: TensorType, precision: Precision) -> np.ndarray:
    """What a device tensor holds after it is written."""
    if precision == "float64":
        return x.astype(np.float64)
    return round_to(t.dtype, x)


def _run_kernel_op(op: KernelOp, env: dict[str, np.ndarray], dt: type) -> list[np.ndarray]:
    if op.block is not None:
        return run_block_graph(op.block, env, dt)
    opdef = ops.get(op.op)
    assert opdef.numpy is not None
    with np.errstate(all="ignore"):
        y = opdef.numpy([env[i] for i in op.inputs], opdef.attr_values(op.attrs))
    return [np.asarray(y, dtype=dt)]


def _block_slices(amap: AxisMap, grid: tuple[int, int, int], block: tuple[int, int, int],
                  shape: tuple[int, ...]) -> list[slice]:
    """The region of a device tensor that block ``block`` reads or writes."""
    sl = [slice(None)] * len(shape)
    for g, b, dim in zip(grid, block, amap):
        if dim is not None:
            part = shape[dim] // g
            sl[dim] = slice(b * part, (b + 1) * part)
    return sl


def run_block_graph(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type
                    ) -> list[np.ndarray]:
    """Run a custom kernel: every block, every forloop iteration."""
    outs = [np.full(bo.value.type.shape, np.nan, dtype=dt) for bo in bg.outputs]
    phases = block_phases(bg)
    for block in itertools.product(*(range(n) for n in bg.grid)):
        tiles = _run_one_block(bg, env, dt, block, phases)  # type: ignore[arg-type]
        for out, bo in zip(outs, bg.outputs):
            sl = _block_slices(bo.omap, bg.grid, block, out.shape)  # type: ignore[arg-type]
            out[tuple(sl)] = tiles[bo.source]
    return outs


def _run_one_block(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type,
                   block: tuple[int, int, int], phases: dict[str, str]
                   ) -> dict[str, np.ndarray]:
    parts = {bi.value.name: env[bi.source][tuple(_block_slices(
        bi.imap, bg.grid, block, env[bi.source].shape))] for bi in bg.inputs}
    fmaps = {bi.value.name: bi.fmap for bi in bg.inputs}
    values: dict[str, np.ndarray] = {n: p for n, p in parts.items() if fmaps[n] is None}
    _eval(bg, values, dt, phases, "invariant")
    collected: dict[str, list[np.ndarray]] = {}
    for i in range(bg.forloop):
        it = dict(values)
        for name, part in parts.items():
            dim = fmaps[name]
            if dim is not None:
                step = part.shape[dim] // bg.forloop
                sl = [slice(None)] * part.ndim
                sl[dim] = slice(i * step, (i + 1) * step)
                it[name] = part[tuple(sl)]
        _eval(bg, it, dt, phases, "loop")
        for op in bg.ops:
            if ops.get(op.op).is_accumulator:
                collected.setdefault(op.outputs[0].name, []).append(it[op.inputs[0]])
    for op in bg.ops:
        if ops.get(op.op).is_accumulator:
            opdef = ops.get(op.op)
            assert opdef.numpy is not None
            stacked = np.stack(collected[op.outputs[0].name])
            values[op.outputs[0].name] = np.asarray(
                opdef.numpy([stacked], opdef.attr_values(op.attrs)), dtype=dt)
    _eval(bg, values, dt, phases, "epilogue")
    return values


def _eval(bg: BlockGraph, values: dict[str, np.ndarray], dt: type, phases: dict[str, str],
          phase: str) -> None:
    """Evaluate the non-accumulator block operators of one phase, in order."""
    for op in bg.ops:
        opdef = ops.get(op.op)
        if opdef.is_accumulator or phases[op.outputs[0].name] != phase:
            continue
        assert opdef.numpy is not None
        with np.errstate(all="ignore"):
            y = opdef.numpy([values[i] for i in op.inputs], opdef.attr_values(op.attrs))
        values[op.outputs[0].name] = np.asarray(y, dtype=dt)
