"""The combine of a forloop split over a thread-block cluster (sm_90, the ``ksplit`` knob).

The KS blocks of a cluster each run 1/KS of the forloop and end it with partial
accumulator states in their own shared memory. Two forms combine them:

* **Shared epilogue** (used whenever the dead staging ring can hold the combined
  tiles). One cluster barrier makes every block's partials visible; then every block
  combines every accumulator in full over the cluster (distributed shared memory,
  16-byte loads of all ranks issued before any is used, ranks in a fixed order so that
  each block's sums are the same and deterministic), finishes it into its own copy in
  the loop's staging ring (no longer read once the loop has ended), arrives on the
  cluster barrier (it reads no peer memory any more), and runs the epilogue and the
  stores of its 1/KS share of each output tile. It waits on the barrier only before it
  exits, so that no block's shared memory goes away while a peer still reads it.
* **Combine into block 0** (the fallback). Every block combines a 1/KS share of each
  accumulator into block 0's tile; after a second cluster barrier block 0 alone runs
  the epilogue and the stores.
* **Push to block 0** (the ``push`` knob, not the default until measured). No cluster
  barrier at the end: every other block stores its partials into its own slot of block
  0's receive area (``st.async``, which completes bytes of block 0's mbarrier) and
  exits; block 0 waits on that mbarrier alone, adds the partials in the same order as
  the shared epilogue (so the same sums, bit for bit), and runs the epilogue and all
  the stores. The other blocks' SMs are free as soon as they have pushed, and block 0
  waits for its peers' data, not for a barrier round trip. Every block arrives on the
  cluster barrier once at its start (block 0 after initialising the mbarrier) and
  waits on it once later: the others before their first push.

Measured on an H200 (docs/perf-log.md v12): the combine into block 0 and its serial
epilogue cost 1.5-3.8 µs of a 17-23 µs streaming matmul, all of it tail (every block
reaches the end of its loads at the same moment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli import ops
from mirage_cli.codegen import reduce
from mirage_cli.codegen.expr import Lines, indent
from mirage_cli.codegen.smemplan import RECV, pushed
from mirage_cli.ir import BlockOp
from mirage_cli.semantics.cuda import c_update

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel

# float4 loads per rank a thread holds at once: enough in flight to cover the
# distributed-shared-memory latency, few enough registers.
BATCH = 4


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def ring_copies(k: FusedKernel, accs: list[BlockOp]) -> dict[str, int] | None:
    """Byte offsets, inside the loop's staging ring, of a copy of each accumulator tile
    (first fit, 16-byte aligned); None when they do not all fit."""
    ranges = []
    for bi in k.staged("loop"):
        t = k.tile(bi.value.name)
        vt = bi.value.type
        elems = (vt.numel // vt.shape[-1]) * t.pitch
        slot = _pad16(elems * vt.dtype.nbytes)
        ranges.append([t.smem_offset, t.smem_offset + slot * t.stages])
    ranges.sort()
    free: list[list[int]] = []
    for lo, hi in ranges:  # the planner lays staged tiles end to end: merge neighbours
        if free and free[-1][1] == lo:
            free[-1][1] = hi
        else:
            free.append([lo, hi])
    out: dict[str, int] = {}
    for op in accs:
        need = _pad16(op.outputs[0].type.numel * 4)
        for r in free:
            if r[1] - r[0] >= need:
                out[op.outputs[0].name] = r[0]
                r[0] += need
                break
        else:
            return None
    return out


def combine(k: FusedKernel, accs: list[BlockOp]) -> tuple[Lines, bool]:
    """The lines after the loop's accumulator finish; True when the stores are to be
    shared over the cluster (the shared epilogue), False when block 0 stores alone."""
    if RECV in k.tiles:
        return _pushed(k, accs), False
    copies = ring_copies(k, accs)
    if copies is None:
        return _into_block0(k, accs), False
    lines = ["mg_cluster_sync();"]
    for op in accs:
        lines += _full_combine(k, op, copies[op.outputs[0].name])
    lines += ["mg_cluster_arrive();", "__syncthreads();"]
    for op in accs:
        name = op.outputs[0].name
        lines.append(f"buf_{name} = reinterpret_cast<float*>(mg_smem + {copies[name]});")
    return lines, True


def _full_combine(k: FusedKernel, op: BlockOp, copy: int) -> Lines:
    """Every element of ``op``'s tile combined over the cluster into this block's copy."""
    name, n = op.outputs[0].name, op.outputs[0].type.numel
    spec = ops.get(op.op).accum
    assert spec is not None
    fin = reduce.finish_format(k, op)
    dst = f"reinterpret_cast<float*>(mg_smem + {copy})"
    src_aligned = k.tile(name).smem_offset % 16 == 0
    if n % 4 or not src_aligned:
        upd = c_update("v", f"mg_dsmem_ld(buf_{name} + e, r)", spec.combine)
        return [f"for (int e = threadIdx.x; e < {n}; e += {k.T}) {{",
                f"  float v = mg_dsmem_ld(buf_{name} + e, 0);",
                f"  for (unsigned r = 1; r < {k.KS}; ++r) {upd}",
                f"  {dst}[e] = {fin.format('v')};", "}"]
    n4, step = n // 4, BATCH * k.T
    body = [f"float4 mg_p[{BATCH}][{k.KS}];", "#pragma unroll",
            f"for (int j = 0; j < {BATCH}; ++j) {{",
            f"  const int e = e0 + j * {k.T};",
            f"  if (e < {n4}) {{",
            "    #pragma unroll",
            (f"    for (unsigned r = 0; r < {k.KS}; ++r) "
             f"mg_p[j][r] = mg_dsmem_ld4(buf_{name} + 4 * e, r);"),
            "  }", "}", "#pragma unroll",
            f"for (int j = 0; j < {BATCH}; ++j) {{",
            f"  const int e = e0 + j * {k.T};",
            f"  if (e < {n4}) {{",
            "    float4 v = mg_p[j][0];",
            "    #pragma unroll",
            f"    for (unsigned r = 1; r < {k.KS}; ++r) {{"]
    body += ["      " + c_update(f"v.{c}", f"mg_p[j][r].{c}", spec.combine) for c in "xyzw"]
    body += ["    }"]
    if fin != "{0}":
        body += [f"    v.{c} = {fin.format(f'v.{c}')};" for c in "xyzw"]
    body += [f"    reinterpret_cast<float4*>({dst})[e] = v;", "  }", "}"]
    return [f"for (int e0 = threadIdx.x; e0 < {n4}; e0 += {step}) {{"] + indent(body) + ["}"]


def _into_block0(k: FusedKernel, accs: list[BlockOp]) -> Lines:
    """Every block combines a 1/KS share of each accumulator tile over the cluster's
    blocks (ranks in a fixed order), finishes it and writes it into block 0's tile;
    block 0 then runs the epilogue and the stores once per cluster."""
    lines = ["mg_cluster_sync();"]
    step = k.KS * k.T
    for op in accs:
        name, n = op.outputs[0].name, op.outputs[0].type.numel
        spec = ops.get(op.op).accum
        assert spec is not None
        fin = reduce.finish_format(k, op)
        upd = c_update("v", f"mg_dsmem_ld(buf_{name} + e, r)", spec.combine)
        first = f"(int)mg_rank * {k.T} + (int)threadIdx.x"
        lines += [f"for (int e = {first}; e < {n}; e += {step}) {{",
                  f"  float v = mg_dsmem_ld(buf_{name} + e, 0);",
                  f"  for (unsigned r = 1; r < {k.KS}; ++r) {upd}",
                  f"  mg_dsmem_st(buf_{name} + e, 0, {fin.format('v')});", "}"]
    return lines + ["mg_cluster_sync();", "if (mg_rank != 0) return;"]


def _pushed(k: FusedKernel, accs: list[BlockOp]) -> Lines:
    """The push form: every block but 0 stores its partial tiles into its slot of block
    0's receive area and returns; block 0 waits for all of them and combines them into
    its own tiles, finished in place."""
    slots = dict(pushed(k.a))
    slot = sum(slots.values())
    recv = k.tile(RECV).smem_offset + 16  # the slots, after block 0's mbarrier
    push: Lines = ["mg_cluster_wait();  // block 0's mbarrier is initialised"]
    add: Lines = []
    total = 0
    off = 0
    for op in accs:
        name, n = op.outputs[0].name, op.outputs[0].type.numel
        spec = ops.get(op.op).accum
        assert spec is not None
        dst = f"reinterpret_cast<float*>(mg_smem + {recv + off} + (mg_rank - 1) * {slot})"
        if n % 4 == 0 and k.tile(name).smem_offset % 16 == 0:
            push.append(f"for (int e = threadIdx.x; e < {n // 4}; e += {k.T}) "
                        f"mg_push4({dst} + 4 * e, reinterpret_cast<const float4*>("
                        f"buf_{name})[e], mg_recv_bar, 0);")
        else:
            push.append(f"for (int e = threadIdx.x; e < {n}; e += {k.T}) "
                        f"mg_push({dst} + e, buf_{name}[e], mg_recv_bar, 0);")
        got = f"reinterpret_cast<const float*>(mg_smem + {recv + off} + (r - 1) * {slot})[e]"
        add += [f"for (int e = threadIdx.x; e < {n}; e += {k.T}) {{",
                f"  float v = buf_{name}[e];",
                f"  for (unsigned r = 1; r < {k.KS}; ++r) {c_update('v', got, spec.combine)}",
                f"  buf_{name}[e] = {reduce.finish_format(k, op).format('v')};", "}"]
        total += 4 * n
        off += slots[name]
    expect = (f"if (threadIdx.x == 0) mg_mbar_arrive_expect_cluster(mg_recv_bar, "
              f"{total * (k.KS - 1)}u);")
    # Block 0 waits on the cluster barrier too (long complete by now): every arrive of
    # the start is matched by a wait before the thread exits.
    return (["__syncthreads();", "if (mg_rank != 0) {"] + indent(push + ["return;"]) + ["}"]
            + ["mg_cluster_wait();", expect, "mg_mbar_wait_cluster(mg_recv_bar, 0);"] + add
            + ["__syncthreads();"])
