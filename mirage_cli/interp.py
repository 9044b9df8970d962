"""The reference interpreter: the executable definition of what a µGraph computes.

Runs any µGraph on the CPU with numpy, exactly as DESIGN.md §3 states: pre-defined
kernel operators directly through their registry semantics, custom kernels block by
block and forloop iteration by iteration. Written for obviousness, not speed; the one
concession is that a block's iterations go through each operator together, stacked on
a leading axis (``stack_iterations=False`` evaluates them one at a time).

Two precisions:
- ``float64``: every value in float64 (the numerical ground truth);
- ``native``: device tensors rounded to their dtype (f16/bf16/f32) after every kernel
  operator, arithmetic and block tiles in float32, i.e. f32 accumulation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mirage_cli import ops
from mirage_cli.check import block_phases, loop_passes
from mirage_cli.diagnostics import MirageError
from mirage_cli.dtypes import round_to
from mirage_cli.ir import AttrValue, AxisMap, BlockGraph, Graph, KernelOp, TensorType, Value

Precision = Literal["float64", "native"]


# Normals drawn per call of the generator by random_inputs: a draw in pieces is the same
# sequence as one draw, and a whole input's float64 draw (twice its float32 result) is
# never held: 2.1 GB for a 268 M-element input.
DRAW_CHUNK = 1 << 22


def random_inputs(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Reproducible random inputs (standard normal, never zeros), float32 values
    already representable in each input's dtype. (The values of
    ``round_to(dtype, rng.standard_normal(shape).astype(np.float32))`` per input in
    order, drawn ``DRAW_CHUNK`` at a time.)"""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for inp in g.inputs:
        t = inp.value.type
        x = np.empty(t.shape, dtype=np.float32)
        flat = x.reshape(-1)
        for a in range(0, flat.size, DRAW_CHUNK):
            part = rng.standard_normal(min(DRAW_CHUNK, flat.size - a)).astype(np.float32)
            flat[a:a + part.size] = round_to(t.dtype, part)
        out[inp.value.name] = x
    return out


# Called with each kernel operator's result as it is stored (see ``run``).
Observer = Callable[[Value, np.ndarray], None]


def run(g: Graph, inputs: Mapping[str, np.ndarray], precision: Precision = "float64",
        stack_iterations: bool = True, observe: Observer | None = None
        ) -> dict[str, np.ndarray]:
    """Evaluate ``g`` on ``inputs``; returns its outputs by name.

    ``stack_iterations`` (see ``run_block_graph``) only changes the speed; with False,
    every forloop iteration is evaluated on its own, the literal reading. ``observe``,
    if given, sees every kernel operator's result as stored (a device tensor, in the
    run's precision), so a caller can check intermediates without keeping them."""
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
        env[name] = _store(np.asarray(x, dtype=dt), t, precision)
    for op in g.ops:
        results = _run_kernel_op(op, env, dt, stack_iterations)
        for v, r in zip(op.outputs, results):
            env[v.name] = _store(r, v.type, precision)
            if observe is not None:
                observe(v, env[v.name])
    return {name: env[name] for name in g.outputs}


def _store(x: np.ndarray, t: TensorType, precision: Precision) -> np.ndarray:
    """What a device tensor holds after it is written."""
    if precision == "float64":
        # No copy: the interpreter never writes into a value it has stored, and copying
        # large float64 weights dominated the run time of small kernels.
        return np.asarray(x, dtype=np.float64)
    return round_to(t.dtype, x)


def _run_kernel_op(op: KernelOp, env: dict[str, np.ndarray], dt: type,
                   stack_iterations: bool = True) -> list[np.ndarray]:
    if op.block is not None:
        return run_block_graph(op.block, env, dt, stack_iterations)
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
    ranks: tuple[int, ...]  # of the input tiles


@dataclass(frozen=True)
class _Plan:
    """A block graph's operators by phase; accumulators apart (they close the loop)."""

    invariant: tuple[_Step, ...]
    loop: tuple[_Step, ...]
    accumulators: tuple[_Step, ...]
    epilogue: tuple[_Step, ...]
    per_iteration: frozenset[str]  # the values that differ between iterations
    passes: tuple[_Plan, ...] = ()  # the loop's passes (check.loop_passes), in order


def _plan(bg: BlockGraph) -> _Plan:
    full = _phase_plan(bg)
    level = loop_passes(bg)
    n = max(level.values(), default=0) + 1

    def upto(p: int) -> tuple[_Step, ...]:  # a pass computes the earlier passes' values again
        return tuple(s for s in full.loop if level.get(s.output, 0) <= p)

    def accs(p: int) -> tuple[_Step, ...]:
        return tuple(s for s in full.accumulators if level.get(s.output, 0) == p)

    passes = tuple(_Plan(full.invariant, upto(p), accs(p), (), full.per_iteration)
                   for p in range(n))
    return _Plan(full.invariant, full.loop, full.accumulators, full.epilogue,
                 full.per_iteration, passes)


def _phase_plan(bg: BlockGraph) -> _Plan:
    phases = block_phases(bg)
    ranks = {bi.value.name: bi.value.type.rank for bi in bg.inputs}
    ranks.update((op.outputs[0].name, op.outputs[0].type.rank) for op in bg.ops)
    by_phase: dict[str, list[_Step]] = {"invariant": [], "loop": [], "epilogue": [],
                                        "accumulators": []}
    for op in bg.ops:
        opdef = ops.get(op.op)
        assert opdef.numpy is not None
        step = _Step(opdef.numpy, op.inputs, op.outputs[0].name, opdef.attr_values(op.attrs),
                     tuple(ranks[i] for i in op.inputs))
        by_phase["accumulators" if opdef.is_accumulator else phases[step.output]].append(step)
    return _Plan(tuple(by_phase["invariant"]), tuple(by_phase["loop"]),
                 tuple(by_phase["accumulators"]), tuple(by_phase["epilogue"]),
                 frozenset(n for n, ph in phases.items() if ph == "loop"))


def run_block_graph(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type,
                    stack_iterations: bool = True) -> list[np.ndarray]:
    """Run a custom kernel: every block, every forloop iteration.

    With ``stack_iterations``, each per-iteration operator runs once on all iterations'
    tiles stacked on a new leading axis (what the accumulators consume anyway) instead
    of once per iteration: same values, far fewer numpy calls."""
    outs: list[np.ndarray] = [np.full(bo.value.type.shape, np.nan, dtype=dt)
                              for bo in bg.outputs]
    plan = _plan(bg)
    with np.errstate(all="ignore"):
        for block in itertools.product(*(range(n) for n in bg.grid)):
            tiles = _run_one_block(bg, env, dt, block, plan,  # type: ignore[arg-type]
                                   stack_iterations)
            for out, bo in zip(outs, bg.outputs):
                sl = _block_slices(bo.omap, bg.grid, block, out.shape)  # type: ignore[arg-type]
                out[tuple(sl)] = tiles[bo.source]
    return outs


def _run_one_block(bg: BlockGraph, env: Mapping[str, np.ndarray], dt: type,
                   block: tuple[int, int, int], plan: _Plan, stack_iterations: bool
                   ) -> dict[str, np.ndarray]:
    parts = {bi.value.name: env[bi.source][tuple(_block_slices(
        bi.imap, bg.grid, block, env[bi.source].shape))] for bi in bg.inputs}
    fmaps = {bi.value.name: bi.fmap for bi in bg.inputs}
    values: dict[str, np.ndarray] = {n: p for n, p in parts.items() if fmaps[n] is None}
    _eval(plan.invariant, values, dt)
    loop = {n: (p, dim) for n, p in parts.items() if (dim := fmaps[n]) is not None}
    run_loop = _loop_stacked if stack_iterations else _loop_literal
    # One run of the loop per pass (check.loop_passes): a pass reads the results of
    # the accumulators of earlier passes as loop-invariant values.
    for ps in plan.passes:
        tiles = run_loop(ps, values, loop, bg.forloop, dt)
        for acc in ps.accumulators:
            values[acc.output] = np.asarray(acc.fn([tiles[acc.output]], acc.attrs), dtype=dt)
    _eval(plan.epilogue, values, dt)
    return values


LoopInputs = dict[str, tuple[np.ndarray, int]]  # block input -> (its part, fmap dim)


def _loop_literal(plan: _Plan, values: dict[str, np.ndarray], loop: LoopInputs, F: int,
                  dt: type) -> dict[str, np.ndarray]:
    """Each iteration on its own; returns each accumulator's input tiles, stacked."""
    collected: dict[str, list[np.ndarray]] = {s.output: [] for s in plan.accumulators}
    for i in range(F):
        it = dict(values)
        for name, (part, dim) in loop.items():
            step = part.shape[dim] // F
            sl = [slice(None)] * part.ndim
            sl[dim] = slice(i * step, (i + 1) * step)
            it[name] = part[tuple(sl)]
        _eval(plan.loop, it, dt)
        for acc in plan.accumulators:
            collected[acc.output].append(it[acc.inputs[0]])
    return {n: np.stack(ts) for n, ts in collected.items()}


def _loop_stacked(plan: _Plan, values: dict[str, np.ndarray], loop: LoopInputs, F: int,
                  dt: type) -> dict[str, np.ndarray]:
    """All iterations at once: a per-iteration value is held with the iterations on a
    leading axis; a loop-invariant operand is broadcast along it. Operands are padded to
    the operator's largest tile rank right after that axis (where numpy's broadcasting
    would pad them) and a ``dim`` attribute is counted from the end, so the registry's
    numpy functions see, after the leading axis, exactly the tiles they would see in
    one iteration."""
    it = dict(values)
    for name, (part, dim) in loop.items():
        split = part.shape[:dim] + (F, part.shape[dim] // F) + part.shape[dim + 1:]
        it[name] = np.moveaxis(part.reshape(split), dim, 0)

    def stacked(name: str, rank: int) -> np.ndarray:
        x = it[name]
        if name not in plan.per_iteration:
            x = np.broadcast_to(x, (F,) + x.shape)
        return x.reshape((F,) + (1,) * (rank - x.ndim + 1) + x.shape[1:])

    for s in plan.loop:
        rank = max(s.ranks)
        attrs = dict(s.attrs)
        if "dim" in attrs:
            attrs["dim"] = int(attrs["dim"]) - s.ranks[0]
        it[s.output] = np.asarray(s.fn([stacked(n, rank) for n in s.inputs], attrs), dtype=dt)
    return {a.output: stacked(a.inputs[0], a.ranks[0]) for a in plan.accumulators}


def _eval(steps: tuple[_Step, ...], values: dict[str, np.ndarray], dt: type) -> None:
    """Evaluate the (non-accumulator) block operators of one phase, in order."""
    for s in steps:
        values[s.output] = np.asarray(s.fn([values[i] for i in s.inputs], s.attrs), dtype=dt)


# ---------------------------------------------------------------------------
# Memory, before anything is allocated
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """What evaluating a graph holds at its peak, and its largest tensor."""

    bytes: int
    largest: Value | None
    largest_bytes: int


def memory_estimate(g: Graph, itemsize: int = 8) -> MemoryEstimate:
    """An upper estimate of the bytes :func:`run` holds at its peak, from shapes alone:
    every device tensor stays alive to the end (``itemsize`` bytes per element, plus a
    float32 copy of each input as drawn or read), and one custom kernel at a time holds
    its forloop's iterations stacked (``forloop`` times every tile of its block graph)."""
    values = [i.value for i in g.inputs] + [v for op in g.ops for v in op.outputs]
    total = sum(_elements(v.type) for v in values) * itemsize
    total += sum(_elements(i.value.type) for i in g.inputs) * 4
    stacked = max((_kernel_tiles(op.block) * itemsize for op in g.ops
                   if op.block is not None), default=0)
    largest = max(values, key=lambda v: _elements(v.type), default=None)
    return MemoryEstimate(total + stacked, largest,
                          0 if largest is None else _elements(largest.type) * itemsize)


def _elements(t: TensorType) -> int:
    return math.prod(t.shape)


def _kernel_tiles(bg: BlockGraph) -> int:
    tiles = [bi.value for bi in bg.inputs] + [v for op in bg.ops for v in op.outputs]
    return bg.forloop * sum(_elements(v.type) for v in tiles)


def check_memory(graphs: Sequence[tuple[Graph, str | None]], limit: int, what: str,
                 itemsize: int = 8) -> None:
    """Refuse (exit 2) to ``what`` (e.g. "run") the (graph, file) pairs together when
    their estimates add up to more than ``limit`` bytes; the error names the largest
    tensor and points at it where it has a place in the source."""
    ests = [(memory_estimate(g, itemsize), g, file) for g, file in graphs]
    need = sum(e.bytes for e, _, _ in ests)
    if need <= limit:
        return
    est, g, file = max(ests, key=lambda x: x[0].largest_bytes)
    big = est.largest
    detail = "" if big is None else (f"; its largest tensor '{big.name}' is {big.type}, "
                                     f"{format_bytes(est.largest_bytes)} at {itemsize} bytes "
                                     f"per element")
    names = " and ".join(f"'{x.name}'" for _, x, _ in ests)
    raise MirageError(f"{names} would need about {format_bytes(need)} of memory to {what}, "
                      f"over the limit of {format_bytes(limit)} (--max-memory); '{g.name}' is "
                      f"the largest{detail}" if len(ests) > 1 else
                      f"{names} would need about {format_bytes(need)} of memory to {what}, "
                      f"over the limit of {format_bytes(limit)} (--max-memory){detail}",
                      big.span if big is not None else None, file=file)


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
