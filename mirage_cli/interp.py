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
from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.diagnostics import MirageError
from mirage_cli.dtypes import round_to
from mirage_cli.ir import AttrValue, AxisMap, BlockGraph, Graph, KernelOp, TensorType

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
        # asarray: no copy when the caller already passes the compute type (the store
        # below copies anyway); large weights would otherwise be copied twice.
        env[name] = _store(np.asarray(x, dtype=dt), t, precision)
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


@dataclass(frozen=True)
class _Step:
    """One block operator, resolved once per kernel (not once per block and iteration)."""

    fn: ops.NumpyFn
    inputs: tuple[str, ...]
    output: str
    attrs: dict[str, AttrValue]


@dataclass(frozen=True)
class _Plan:
    """A block graph's operators by phase; accumulators apart (they close the loop)."""

    invariant: tuple[_Step, ...]
    loop: tuple[_Step, ...]
    accumulators: tuple[_Step, ...]
    epilogue: tuple[_Step, ...]


def _plan(bg: BlockGraph) -> _Plan:
    phases = block_phases(bg)
    by_phase: dict[str, list[_Step]] = {"invariant": [], "loop": [], "epilogue": [],
                                        "accumulators": []}
    for op in bg.ops:
        opdef = ops.get(op.op)
        assert opdef.numpy is not None
        step = _Step(opdef.numpy, op.inputs, op.outputs[0].name, opdef.attr_values(op.attrs))
        by_phase["accumulators" if opdef.is_accumulator else phases[step.output]].append(step)
    return _Plan(*(tuple(by_phase[k]) for k in ("invariant", "loop", "accumulators",
                                                 "epilogue")))


def run_block_graph(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type
                    ) -> list[np.ndarray]:
    """Run a custom kernel: every block, every forloop iteration."""
    outs: list[np.ndarray] = [np.full(bo.value.type.shape, np.nan, dtype=dt)
                              for bo in bg.outputs]
    plan = _plan(bg)
    with np.errstate(all="ignore"):
        for block in itertools.product(*(range(n) for n in bg.grid)):
            tiles = _run_one_block(bg, env, dt, block, plan)  # type: ignore[arg-type]
            for out, bo in zip(outs, bg.outputs):
                sl = _block_slices(bo.omap, bg.grid, block, out.shape)  # type: ignore[arg-type]
                out[tuple(sl)] = tiles[bo.source]
    return outs


def _run_one_block(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type,
                   block: tuple[int, int, int], plan: _Plan) -> dict[str, np.ndarray]:
    parts = {bi.value.name: env[bi.source][tuple(_block_slices(
        bi.imap, bg.grid, block, env[bi.source].shape))] for bi in bg.inputs}
    fmaps = {bi.value.name: bi.fmap for bi in bg.inputs}
    values: dict[str, np.ndarray] = {n: p for n, p in parts.items() if fmaps[n] is None}
    _eval(plan.invariant, values, dt)
    collected: dict[str, list[np.ndarray]] = {s.output: [] for s in plan.accumulators}
    for i in range(bg.forloop):
        it = dict(values)
        for name, part in parts.items():
            dim = fmaps[name]
            if dim is not None:
                step = part.shape[dim] // bg.forloop
                sl = [slice(None)] * part.ndim
                sl[dim] = slice(i * step, (i + 1) * step)
                it[name] = part[tuple(sl)]
        _eval(plan.loop, it, dt)
        for acc in plan.accumulators:
            collected[acc.output].append(it[acc.inputs[0]])
    for acc in plan.accumulators:
        values[acc.output] = np.asarray(acc.fn([np.stack(collected[acc.output])], acc.attrs),
                                        dtype=dt)
    _eval(plan.epilogue, values, dt)
    return values


def _eval(steps: tuple[_Step, ...], values: dict[str, np.ndarray], dt: type) -> None:
    """Evaluate the (non-accumulator) block operators of one phase, in order."""
    for s in steps:
        values[s.output] = np.asarray(s.fn([values[i] for i in s.inputs], s.attrs), dtype=dt)
