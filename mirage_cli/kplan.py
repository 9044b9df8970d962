"""The kernel plan: the thread level of one custom kernel, as plain data.

A block graph says *what* each thread block computes; its plan says *how* the threads
of a block do it (DESIGN.md §2): threads and warps, where every tile lives (registers,
shared memory with its row pitch, global memory, the workspace), the width of its
global accesses, the pipeline depth of loop inputs, how reductions are spread over
threads, and how tensor-core matmuls are mapped onto warps. The plan is produced by
:mod:`mirage_cli.codegen.planner`, checked there, priced by the cost model and printed
by the emitter; ``best.ugraph.json`` carries it, and ``mirage fmt --plan`` shows it.

The :class:`Knobs` are the tuning space of a design: every other field of the plan is
derived from the block graph, the target and the knobs, so a user pins knobs (``--plan
FILE``), never the derived fields. This module sits beside the IR and imports nothing
from the passes.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Literal

PLAN_VERSION = 1

Home = Literal["global", "smem", "inline", "acc_regs", "acc_mma", "acc_smem", "scratch",
               "regs", "frag"]
Reduction = Literal["thread", "rows", "block", "quad"]


@dataclass(frozen=True)
class Knobs:
    """Tuning parameters of one kernel's plan. ``None`` means "the planner's choice"."""

    stages: int | None = None     # cp.async pipeline depth of loop inputs (1 = no overlap)
    kwarps: int | None = None     # warps that split the K dimension of accumulated mmas
    pad: int | None = None        # 1: pad shared-memory rows to an odd number of 16 B chunks
    ldmatrix: int | None = None   # 1: mma operands through ldmatrix(.trans)
    stage_once: int | None = None  # 1: stage inputs read once through 16 B cp.async too
    vec: int | None = None        # elements per global store (1 or a 16-byte vector)
    threads: int | None = None    # threads per block (the block graph's value by default)
    ksplit: int | None = None     # blocks of a cluster (sm_90) splitting the forloop
    stagger: int | None = None    # 1: each block starts its forloop at its own iteration
    chain: int | None = None      # 1: a matmul chain keeps its score tile in mma fragments
    tma: int | None = None        # 1: loop inputs read only by mma copied by bulk tensor copies
    wgmma: int | None = None      # 1: a chain's mmas as warpgroup wgmma (sm_90a), B by descriptor
    push: int | None = None       # 1: a cluster's other blocks push their partials to block 0

    def as_json(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Knobs))


@dataclass(frozen=True)
class TilePlan:
    """Where one block tensor lives and how it is accessed."""

    name: str
    home: Home
    owner: str                 # which threads own which elements, in words
    vec: int = 1               # elements per global access
    stages: int = 1            # copies in flight (staged loop inputs)
    smem_offset: int = -1      # bytes into dynamic shared memory (-1: none)
    pitch: int = 0             # elements per shared-memory row (0: not in shared memory)
    scratch_offset: int = -1   # f32 elements into the block's workspace scratch (-1: none)
    # Bytes per box row of a tile that bulk tensor copies (TMA, sm_90) bring into shared
    # memory: a swizzle span (32, 64 or 128), or an unswizzled row of an odd number of
    # 16-byte chunks (48, 80, 112, ...: codegen/tmaplan.py); 0: not by TMA.
    swizzle: int = 0


@dataclass(frozen=True)
class MmaPlan:
    """One block matmul on tensor cores (mma.sync m16n8k16, f32 accumulation)."""

    output: str
    accumulator: str           # the acc_sum it feeds in registers ("" if materialised)
    a_path: str                # "ldmatrix" | "direct" | "frag" (the first mma's fragments)
    #                            | "scaled" (a tile's ldmatrix fragments times a vector)
    #                            | "held" (ldmatrix once before the loop, kept in registers)
    b_path: str                # "ldmatrix.trans" | "direct" | "wgmma" (a shared-memory descriptor)
    #                            | "gather" (element by element from a shifted join's tile)
    kwarps: int                # warps splitting K (their fragments are summed after the loop)
    tiles_per_warp: int        # m16n8 output tiles per warp


@dataclass(frozen=True)
class ReducePlan:
    """How a reduction over a row (an operator or an accumulator) is spread over threads."""

    output: str
    strategy: Reduction        # thread: one thread per result; rows: threads_per_row per row;
    #                            quad: the 4 lanes holding a row of mma fragments (or a
    #                            column of B fragments)
    threads_per_row: int


@dataclass(frozen=True)
class KernelPlan:
    arch: str
    threads: int
    knobs: Knobs
    smem_bytes: int
    scratch_floats: int
    tiles: tuple[TilePlan, ...]
    mmas: tuple[MmaPlan, ...]
    reductions: tuple[ReducePlan, ...]
    version: int = PLAN_VERSION

    @property
    def warps(self) -> int:
        return self.threads // 32

    def tile(self, name: str) -> TilePlan:
        for t in self.tiles:
            if t.name == name:
                return t
        raise KeyError(name)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["knobs"] = self.knobs.as_json()
        d["warps"] = self.warps
        return d


def knobs_from_json(d: Any, where: str) -> Knobs:
    """Knob pins from JSON (``{"stages": 3, ...}``); raises ValueError naming the bad key."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object of knob values")  # noqa: TRY004
    names = Knobs.names()
    for k, v in d.items():
        if k not in names:
            raise ValueError(f"{where}: unknown knob '{k}' (knobs: {', '.join(names)})")
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{where}.{k}: expected an integer, got {v!r}")  # noqa: TRY004
    return Knobs(**d)


def _record(cls: type, d: Any, where: str) -> Any:
    """A plan record from its JSON object, every field present and of the right kind."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object")  # noqa: TRY004
    args = {}
    for f in fields(cls):
        if f.name not in d:
            if f.default is not MISSING:  # a field added later: older plans lack it
                continue
            raise ValueError(f"{where}: missing '{f.name}'")
        v = d[f.name]
        want = int if f.type in ("int",) else str
        if not isinstance(v, want) or isinstance(v, bool):
            raise ValueError(f"{where}.{f.name}: expected {want.__name__}, got {v!r}")  # noqa: TRY004
        args[f.name] = v
    return cls(**args)


def plan_from_json(d: Any, where: str) -> KernelPlan:
    """A serialised plan (format errors are ValueErrors, reported by the loader as
    diagnostics). Only its knobs are authoritative: the code generator
    re-derives the rest and reports a plan whose details disagree with its knobs."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a plan object")  # noqa: TRY004
    version = d.get("version")
    if version != PLAN_VERSION:
        raise ValueError(f"{where}.version: plan format {version!r} is not supported "
                         f"(this version reads {PLAN_VERSION})")
    for key, kind in (("arch", str), ("threads", int), ("smem_bytes", int),
                      ("scratch_floats", int), ("tiles", list), ("mmas", list),
                      ("reductions", list)):
        if not isinstance(d.get(key), kind) or isinstance(d.get(key), bool):
            raise ValueError(f"{where}.{key}: expected {kind.__name__}")  # noqa: TRY004
    return KernelPlan(
        d["arch"], d["threads"], knobs_from_json(d.get("knobs", {}), f"{where}.knobs"),
        d["smem_bytes"], d["scratch_floats"],
        tuple(_record(TilePlan, t, f"{where}.tiles[{i}]") for i, t in enumerate(d["tiles"])),
        tuple(_record(MmaPlan, t, f"{where}.mmas[{i}]") for i, t in enumerate(d["mmas"])),
        tuple(_record(ReducePlan, t, f"{where}.reductions[{i}]")
              for i, t in enumerate(d["reductions"])))
