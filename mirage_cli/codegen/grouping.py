"""Launch order and grouped launches: independent kernels that share one launch.

A kernel's *level* is one more than the highest level of the kernels whose results it
reads (0: it reads only the program's inputs); reshapes and concatenations that launch
nothing (:mod:`.aliasing`, :mod:`.joins`) pass their inputs' producers on. Kernels are
launched level by level, in program order within a level, so kernels that do not
depend on each other become neighbours: the three projections of a decoder layer's
queries, keys and values; the two rotations; the key cache copy.

Neighbours of one level that run alike (equal threads per block, cluster size and grid
depth, no scratch area, as many blocks resident per SM as alone or a launch that fits
the SMs at once) share a launch: one grid whose blocks, by ``blockIdx.x``, run one
member's body or the next's (:func:`merge`); a member kept out only by its block size
or its deep pipeline ring is lowered again at the largest member's size or with fewer
stages to join (:func:`fit_residency`). What that
saves is the fixed cost of a kernel: its launch, the pipeline fill before its first
bytes arrive, and its tail, in which the SMs empty one by one; a small kernel (a key
projection of 8 MB, a rotation) is mostly that. Members keep their own code: each
block runs exactly what it ran alone, with its own block index, grid size and
parameters, and waits for the kernel ahead of it in the stream after its own early
copies of weights, as it did alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from mirage_cli import arch as archs
from mirage_cli.codegen.plan import Kernel, Param
from mirage_cli.ir import Graph

# Tokens of a member's body that become its own values in a grouped launch.
_BLOCK_VARS = re.compile(r"\b(blockIdx|gridDim)\.([xyz])\b")


def levels(g: Graph, free: frozenset[int]) -> dict[int, int]:
    """The level of each launched kernel operator of ``g`` (by op index)."""
    # A tensor -> the launched ops that write what it is read from: its producer, or
    # for an operator that launches nothing (a reshape sharing its input's buffer, a
    # concatenation read in its parts) the writers of its inputs.
    writers: dict[str, frozenset[int]] = {}
    level: dict[int, int] = {}
    for i, op in enumerate(g.ops):
        if i in free:
            writers[op.outputs[0].name] = frozenset().union(
                *(writers.get(t, frozenset()) for t in op.inputs))
            continue
        level[i] = 1 + max((level[w] for t in op.inputs for w in writers.get(t, ())),
                           default=-1)
        for v in op.outputs:
            writers[v.name] = frozenset((i,))
    return level


def compatible(members: Sequence[Kernel], k: Kernel, arch: str) -> bool:
    """Whether ``k`` can join a launch of ``members``: every block of one grid runs the
    same number of threads in clusters of one size, along one grid depth; and the
    launch's shared memory (the largest member's, reserved by every block) either
    keeps as many blocks of each member resident on an SM as it had alone, or leaves
    room for all of the launch's blocks at once. A streaming kernel of thousands of
    small blocks must not run one block per SM beside a kernel whose blocks hold
    200 KB."""
    run = [*members, k]
    if not all(m.threads == k.threads and m.cluster == k.cluster and m.grid[2] == k.grid[2]
               and not m.scratch_bytes for m in run):
        return False
    smem = max(m.smem_bytes for m in run)
    if all(_resident(smem, m.threads, arch) == _resident(m.smem_bytes, m.threads, arch)
           for m in run):
        return True
    blocks = sum(_blocks(m) for m in run)
    return blocks <= archs.get(arch).num_sms * _resident(smem, k.threads, arch)


# The shallowest ring a member of a grouped launch is given (fit_residency).
MIN_GROUPED_STAGES = 4


def fit_residency(run: Sequence[tuple[int, Kernel]], arch: str,
                  relower: Callable[[int, int | None, int], Kernel | None]
                  ) -> list[tuple[int, Kernel]] | None:
    """``run`` (op index, kernel) made one launch by lowering members again
    (``relower(i, stages, threads)``: op ``i`` lowered at that pipeline depth, None for
    its recorded one, and block size; None where illegal): those of another block size
    than the member of the most blocks at its size, and those that hold too few blocks
    per SM with shallower rings, down to MIN_GROUPED_STAGES. None where that does not
    make them :func:`compatible`, or where a resized member's launch would not hold
    all its blocks at once.

    A grouped launch runs one block size, so the Llama layer's key and value
    projections (256 threads) launched apart from its query projection (128). The
    largest member keeps its size since its streaming is most of the launch's time; a
    small member is mostly fixed cost. At batch 1 the three then ran 16.2 us in one
    launch of 256 blocks, two per SM, against 13.6 + 7.2 apart, and the layer 141.3
    against 147.1. At batches 8 and 16 their blocks hold one per SM: one launch of
    two rounds ran 20.7 and 21.2 us against 12.3 + 8.6 and 13.4 + 9.0 apart, but the
    layer 189.1 and 217.7 against 185.6 and 214.2 (docs/perf-log.md v43), so a member
    is resized only into a launch that the SMs hold at once.
    A grouped launch also reserves its largest member's shared memory in every block,
    so one member of many stages would halve the others' blocks per SM. The Qwen
    layer's query projection at 64 columns a block (116 KB, six stages: one block per
    SM) ran 10.7 us beside its key and value projections' own launch of 8.7 (90 KB,
    two per SM), where the three in one launch had run 16.4 (docs/perf-log.md v42
    item 6); the price, a shallower ring for one member, is bounded by
    MIN_GROUPED_STAGES."""
    threads = max((k for _, k in run), key=_blocks).threads
    sized: list[tuple[int, Kernel]] = []
    for i, k in run:
        resized = k if k.threads == threads else relower(i, None, threads)
        if resized is None:
            return None
        sized.append((i, resized))
    blocks = sum(_blocks(k) for _, k in sized)
    at_once = -(-blocks // archs.get(arch).num_sms)
    if any(k.threads != threads for _, k in run) and \
            _resident(max(k.smem_bytes for _, k in sized), threads, arch) < at_once:
        return None
    # Enough blocks per SM to hold the whole launch at once, or as many as the most
    # resident member holds alone, whichever is fewer (either makes it compatible).
    target = min(max(_resident(k.smem_bytes, k.threads, arch) for _, k in sized), at_once)
    out: list[tuple[int, Kernel]] = []
    for i, k in sized:
        stages = _stages_of(k)
        while _resident(k.smem_bytes, k.threads, arch) < target:
            stages -= 1
            shallow = relower(i, stages, threads) if stages >= MIN_GROUPED_STAGES else None
            if shallow is None:
                return None
            k = shallow
        out.append((i, k))
    members = [k for _, k in out]
    if not all(compatible(members[:j], members[j], arch) for j in range(1, len(members))):
        return None
    return out


def _blocks(k: Kernel) -> int:
    """Blocks of a kernel's grid."""
    return k.grid[0] * k.grid[1] * k.grid[2]


def _stages_of(k: Kernel) -> int:
    """The pipeline depth of a custom kernel's plan (0 for any other kernel)."""
    return int(((k.plan or {}).get("knobs") or {}).get("stages") or 0)


# Shared memory the runtime reserves per block on sm_80 and later.
_RESERVED = 1024


def _resident(smem: int, threads: int, arch: str) -> int:
    """Blocks of ``threads`` threads and ``smem`` bytes of shared memory that one SM
    holds at once (registers aside)."""
    a = archs.get(arch)
    return min(a.max_threads_per_sm // threads, a.smem_per_sm // (smem + _RESERVED))


def merge(members: Sequence[Kernel], name: str) -> Kernel:
    """One kernel that runs ``members`` side by side: member ``m`` owns the next
    ``grid.x * grid.y`` values of ``blockIdx.x`` (all of ``blockIdx.z``)."""
    params: list[Param] = []
    body: list[str] = []
    first = 0
    for m, k in enumerate(members):
        rename = {p.name: f"g{m}_{p.name}" for p in k.params}
        params += [Param(p.ctype, rename[p.name], p.arg, p.tmap) for p in k.params]
        gx, gy, _ = k.grid
        cond = "if" if m == 0 else "} else if"
        body += [f"{cond} (blockIdx.x < {first + gx * gy}u) {{",
                 f"  const unsigned mg_bx = (blockIdx.x - {first}u) % {gx}u;",
                 f"  const unsigned mg_by = (blockIdx.x - {first}u) / {gx}u;",
                 "  (void)mg_bx; (void)mg_by;"]
        local = _localizer(rename, k.grid)
        lines = [local(line) for line in k.body]
        body += ["  " + line if line else "" for line in lines[:k.wait_at]]
        body += ["  mg_grid_wait();", "  mg_grid_release();"]
        body += ["  " + line if line else "" for line in lines[k.wait_at:]]
        first += gx * gy
    body.append("}")
    head = members[0]
    return Kernel(name, tuple(params), tuple(body), head.threads,
                  (first, 1, head.grid[2]), max(k.smem_bytes for k in members), 0,
                  "one launch of " + str(len(members)) + " kernels: "
                  + "; ".join(k.comment for k in members),
                  {"grouped": [k.plan for k in members]},
                  max(k.min_blocks for k in members), head.cluster, 0, waits_inside=True)


def _localizer(rename: dict[str, str], grid: tuple[int, int, int]) -> Callable[[str], str]:
    """A line of a member's body with its block index, grid size and parameter names
    made its own (the grid depth and ``blockIdx.z`` are every member's)."""
    names = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b") if rename else None

    def block_var(m: re.Match[str]) -> str:
        axis = "xyz".index(m.group(2))
        if m.group(1) == "gridDim":
            return f"{grid[axis]}u"
        return ("mg_bx", "mg_by", "blockIdx.z")[axis]

    def local(line: str) -> str:
        line = _BLOCK_VARS.sub(block_var, line)
        return line if names is None else names.sub(lambda m: rename[m.group(1)], line)

    return local
