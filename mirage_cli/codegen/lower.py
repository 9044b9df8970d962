"""Lowering of a whole µGraph to a :class:`~mirage_cli.codegen.plan.Program`.

Expects a checked graph. Every kernel operator becomes one kernel: custom operators
through :mod:`fused`, pre-defined ones through :mod:`standalone`, but for reshapes
whose tensors share one buffer (:mod:`aliasing`) and concatenations whose readers read
the parts in place (:mod:`joins`), which launch nothing. Kernels are
launched level by level, and neighbours that run alike share one launch
(:mod:`grouping`). Device tensors that
are neither inputs nor outputs live in the workspace (256-byte aligned), followed by
each fused kernel's per-block scratch area. ``unfused`` is the baseline lowering of a
program without custom kernels (the same thing; named for the benchmark).
"""

from __future__ import annotations

import functools

from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.aliasing import aliasing
from mirage_cli.codegen.custom import lower_custom
from mirage_cli.codegen.grouping import compatible, fit_residency, levels, merge
from mirage_cli.codegen.joins import joined_ops, joins
from mirage_cli.codegen.names import (
    RESERVED,
    check_entry_name,
    default_entry_name,
    is_safe_identifier,  # noqa: F401  (re-exported)
    kernel_name,
)
from mirage_cli.codegen.plan import Buffer, Copy, Kernel, Launch, Program, align
from mirage_cli.codegen.standalone import lower_kernel_op
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph

# Kept for callers of the old names: the rules now live in :mod:`names`.
C_KEYWORDS = RESERVED


def entry_name(g: Graph, name: str | None = None) -> str:
    """The entry point's C name: ``name`` (``--name``) when given and safe, else the
    prefixed program name with its ABI signature (:func:`names.default_entry_name`)."""
    if name is not None:
        return check_entry_name(name)
    types = g.tensor_types()
    return default_entry_name(g.name, [i.value.type for i in g.inputs],
                              [types[n] for n in g.outputs])


def early_inputs(g: Graph, i: int) -> frozenset[str]:
    """The inputs that a kernel of ``g`` in launch ``i`` (0: the first) may read before
    its grid-dependency wait, while the kernel ahead of it in the stream may still run.
    The first launch follows the caller's work, which may write any input but those
    declared ``weight``. Every later launch follows a kernel of this call, which lets
    it launch only after its own wait: by then all of the caller's work is done, and no
    kernel writes an input."""
    if i == 0:
        return frozenset(inp.value.name for inp in g.inputs if inp.weight)
    return frozenset(inp.value.name for inp in g.inputs)


def lower(g: Graph, arch: str = DEFAULT_ARCH, *, name: str | None = None) -> Program:
    """``g`` as kernels and launch steps; ``name`` is the entry point (default:
    :func:`entry_name`), ``arch`` the target GPU (``sm_80`` / ``sm_90``)."""
    name = entry_name(g, name)
    types = g.tensor_types()
    inputs = tuple(Buffer(i.value.name, i.value.type, "input", k, i.weight)
                   for k, i in enumerate(g.inputs))
    outputs = tuple(Buffer(n, types[n], "output", k) for k, n in enumerate(g.outputs))
    external = {b.name for b in inputs + outputs}
    shared = aliasing(g)
    joined = joins(g, arch)
    free = shared.free | joined_ops(g, joined)
    temps: list[Buffer] = []
    ws = 0
    for op in g.ops:
        for v in op.outputs:
            if v.name not in external and v.name not in shared.storage \
                    and v.name not in joined:
                temps.append(Buffer(v.name, v.type, "workspace", ws))
                ws = align(ws + v.type.nbytes)
    # Kernels launch level by level, neighbours of one level that run alike in one
    # launch (grouping.py). The first launch follows the caller's work, so its kernels
    # read no input but weights before their wait; a kernel lowered for it that does
    # not join it is lowered again for a later launch, where it may read any input.
    level = levels(g, free)

    def lowered(i: int, first: bool, stages: int | None = None,
                threads: int | None = None) -> Kernel:
        op, kname = g.ops[i], kernel_name(name, i)
        early = early_inputs(g, 0 if first else 1)
        if op.block is not None:
            return lower_custom(op, kname, types, arch, early, joined, stages, threads)
        return lower_kernel_op(op, kname, types, arch, early)

    def relowered(i: int, stages: int | None, threads: int, first: bool) -> Kernel | None:
        """Custom kernel ``i`` lowered at ``stages`` and ``threads`` (fit_residency);
        None where that is illegal."""
        try:
            return lowered(i, first, stages, threads) if g.ops[i].block is not None else None
        except MirageError:
            return None

    runs: list[list[tuple[int, Kernel]]] = []
    for i in sorted(level, key=lambda i: (level[i], i)):
        first = len(runs) <= 1 and (not runs or level[runs[0][0][0]] == level[i])
        k = lowered(i, first)
        if runs and level[runs[-1][0][0]] == level[i]:
            run = runs[-1] + [(i, k)]
            if compatible([m for _, m in runs[-1]], k, arch):
                runs[-1] = run
                continue
            if (fitted := fit_residency(run, arch, functools.partial(relowered, first=first))):
                runs[-1] = fitted
                continue
        runs.append([(i, k if not runs or not first else lowered(i, False))])
    kernels: list[Kernel] = []
    steps: list[Launch | Copy] = []
    for run in runs:
        k = run[0][1] if len(run) == 1 else merge([m for _, m in run], run[0][1].name)
        kernels.append(k)
        steps.append(Launch(k.name, ws))
        ws = align(ws + k.scratch_bytes * k.grid[0] * k.grid[1] * k.grid[2])
    produced = {v.name for op in g.ops for v in op.outputs}
    for n in g.outputs:
        if n not in produced:  # an output that is an input: copy it
            steps.append(Copy(n, n, types[n].nbytes))
    return Program(name, inputs, outputs, tuple(temps), tuple(kernels), tuple(steps), ws,
                   arch=arch, source_name=g.name, aliases=tuple(sorted(shared.storage.items())),
                   launch_ops=tuple(tuple(i for i, _ in run) for run in runs))
