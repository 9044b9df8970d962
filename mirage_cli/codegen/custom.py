"""Lowering of one custom kernel: plan it, then emit it with the emitter its plan calls
for (:mod:`rowregs` when the plan keeps every tile in registers, :mod:`direct` when it
computes each output element from global memory, :mod:`kernel` otherwise)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.blockfacts import analyse, decompose
from mirage_cli.codegen.direct import DirectKernel
from mirage_cli.codegen.directfacts import direct_reason
from mirage_cli.codegen.indexing import check_index_range
from mirage_cli.codegen.joins import Join, shifted_names
from mirage_cli.codegen.kernel import FusedKernel
from mirage_cli.codegen.plan import Kernel
from mirage_cli.codegen.planner import plan_kernel
from mirage_cli.codegen.rowregs import RowKernel
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import KernelOp, TensorType
from mirage_cli.kplan import KernelPlan, Knobs


def lower_custom(kop: KernelOp, name: str, dev_types: dict[str, TensorType],
                 target: str = DEFAULT_ARCH, early: frozenset[str] = frozenset(),
                 joins: Mapping[str, Join] | None = None, stages: int | None = None,
                 threads: int | None = None) -> Kernel:
    """The CUDA kernel of one custom kernel for ``target``, planned with the knobs of
    its recorded plan (if any) pinned; ``early``: inputs it may start copying before
    its grid-dependency wait (:func:`lower.early_inputs`); ``joins``: concatenations it
    reads in place (:mod:`joins`); ``stages`` and ``threads``: a pipeline depth and a
    block size pinned over the recorded ones (a member of a grouped launch,
    :func:`grouping.fit_residency`); a new block size leaves the K split over warps to
    the planner, as the recorded one was chosen for the recorded warps."""
    assert kop.block is not None
    check_index_range(kop, dev_types)
    pins = kop.plan.knobs if kop.plan is not None else Knobs()
    if stages is not None:
        pins = dataclasses.replace(pins, stages=stages)
    if threads is not None and threads != pins.threads:
        pins = dataclasses.replace(pins, threads=threads, kwarps=None)
    mine = {n: j for n, j in (joins or {}).items() if n in kop.inputs}
    plan = located_plan(kop, dev_types, target, pins, frozenset(mine),
                        shifted_names(mine))
    if mine:  # only the loop kernel's staging reads a joined concatenation's parts
        return FusedKernel(kop.block, plan, name, dev_types, early, mine).lower()
    if plan.tiles and all(t.home == "regs" for t in plan.tiles):
        return RowKernel(kop.block, plan, name, dev_types).lower()
    if not plan.smem_bytes and direct_reason(analyse(decompose(kop.block))) is None:
        return DirectKernel(kop.block, plan, name, dev_types).lower()
    return FusedKernel(kop.block, plan, name, dev_types, early).lower()


def located_plan(kop: KernelOp, dev_types: Mapping[str, TensorType], target: str,
                 pins: Knobs, joined: frozenset[str] = frozenset(),
                 shifted: frozenset[str] = frozenset()) -> KernelPlan:
    """:func:`plan_kernel` for a kernel operator: a refusal is located at the kernel in
    its source (file, line, the line and a caret) where it says nowhere else."""
    assert kop.block is not None
    try:
        return plan_kernel(kop.block, dev_types, target, pins, joined, shifted)
    except MirageError as e:
        if e.span is not None or kop.span is None:
            raise
        raise MirageError(f"custom kernel: {e.message}", kop.span) from None
