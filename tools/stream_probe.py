"""How fast can a block stream its tile of a weight matrix? A GPU microbenchmark.

    python tools/stream_probe.py OUT.json

A decode matmul ``X[M, K] @ W[K, N]`` (f16, small M) is bound by reading W once. A
custom kernel whose grid splits N into G tiles (and, with a K split over blocks, K into
S parts) has each block read pieces of ``2N/G`` bytes from each of its rows of W, rows
``2N`` bytes apart. This probe reads W in exactly that pattern with nothing else in the
kernel (no mma, no reduction beyond a running sum that keeps the loads alive), so the
rate it reaches is what the access pattern allows:

- ``cp``: the generated kernels' path: 16-byte ``cp.async`` into a ring of shared-memory
  stages (``STAGES`` deep, about 24 KB each), one barrier per stage;
- ``ld``: 16-byte loads straight into registers, 8 in flight per thread;
- ``bulk``: Hopper bulk copies (``cp.async.bulk``, one per row piece, issued by one warp)
  into the same ring, completion counted by an mbarrier per stage, one barrier per stage;
- ``tma``: bulk tensor copies (``cp.async.bulk.tensor.2d``) through a tensor map, one
  box of up to 256 elements by the stage's rows per instruction, issued by one thread;
- ``ws``: the bulk copies issued by a producer warp that waits on an "empty" mbarrier
  per stage instead of a block barrier (warp specialisation), so copies for later stages
  never wait for the slowest consumer warp;
- ``tmad``: ``tma`` with the work claimed at run time (a persistent grid of any size,
  one stage's rows of one tile per claim from a global counter), so that blocks which
  stream faster read more of W and all of them finish together.

``--stages S1,S2,...`` sets the pipeline depths swept (every kind but ``ld``).
``--rows R1,R2,...`` repeats the sweep for W of R rows (default 4096): the time against
the bytes read separates a fixed cost per call from the streaming rate.

Configurations sweep the piece width (96 B to whole 12 KB rows), the number of blocks
(128 or 256) and the pipeline depth. W is 4096 x 6144 f16 (rmsnorm_linear's), four
copies rotated between calls so that no call finds W in the L2. The copy kernel's
bandwidth is measured in the same process for reference. Used for docs/perf-log.md.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from mirage_cli.codegen import copybw
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.runner import Device, check

K, ROW = 4096, 12288  # rows of W, bytes per row (6144 f16)
THREADS = 256
COPIES = 4
ARENA = 192 << 20  # bytes of W copies at least: over three times the H200's 60 MiB L2

SOURCE = r"""
#define THREADS 256
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(g) : "memory");
}
__device__ __forceinline__ unsigned smaddr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(unsigned long long* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smaddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned long long* b, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(smaddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smaddr(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* b, int parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra W;\n}" :: "r"(smaddr(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk(void* s, const void* g, int bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smaddr(s)), "l"(g), "r"(bytes), "r"(smaddr(b)) : "memory");
}
__device__ __forceinline__ float fold(uint4 v) {
  return __int_as_float(v.x & 0x3fffffff) + __int_as_float(v.y & 0x3fffffff)
       + __int_as_float(v.z & 0x3fffffff) + __int_as_float(v.w & 0x3fffffff);
}
extern "C" __global__ void __launch_bounds__(THREADS) probe_cp(
    const char* __restrict__ W, float* out, int piece, int rows_k, int rows_stage) {
  extern __shared__ __align__(16) char sm[];
  const int ntiles = ROW / piece, nt = blockIdx.x % ntiles, kp = blockIdx.x / ntiles;
  const char* base = W + (size_t)kp * rows_k * ROW + (size_t)nt * piece;
  const int cpr = piece / 16, chunks = rows_stage * cpr, sbytes = chunks * 16;
  const int iters = rows_k / rows_stage;
  float acc = 0.f;
  auto issue = [&](int s) {
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      int r = c / cpr, q = c - r * cpr;
      cp16(sm + (s % STAGES) * sbytes + c * 16,
           base + (size_t)(s * rows_stage + r) * ROW + q * 16);
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < iters) issue(s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int it = 0; it < iters; ++it) {
    if (it + STAGES - 1 < iters) issue(it + STAGES - 1);
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += THREADS)
      acc += fold(*(const uint4*)(sm + (it % STAGES) * sbytes + c * 16));
    __syncthreads();
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(THREADS) probe_bulk(
    const char* __restrict__ W, float* out, int piece, int rows_k, int rows_stage) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) unsigned long long full[STAGES];
  const int ntiles = ROW / piece, nt = blockIdx.x % ntiles, kp = blockIdx.x / ntiles;
  const char* base = W + (size_t)kp * rows_k * ROW + (size_t)nt * piece;
  const int sbytes = rows_stage * piece, chunks = sbytes / 16, iters = rows_k / rows_stage;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s) {
    char* dst = sm + (s % STAGES) * sbytes;
    if (lane == 0) bar_expect(&full[s % STAGES], sbytes);
    __syncwarp();
    for (int r = lane; r < rows_stage; r += 32)
      bulk(dst + r * piece, base + (size_t)(s * rows_stage + r) * ROW, piece, &full[s % STAGES]);
  };
  if (warp == 0)
    for (int s = 0; s < STAGES && s < iters; ++s) issue(s);
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    bar_wait(&full[it % STAGES], (it / STAGES) & 1);
    for (int c = threadIdx.x; c < chunks; c += THREADS)
      acc += fold(*(const uint4*)(sm + (it % STAGES) * sbytes + c * 16));
    __syncthreads();
    if (warp == 0 && it + STAGES < iters) issue(it + STAGES);
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(THREADS) probe_ws(
    const char* __restrict__ W, float* out, int piece, int rows_k, int rows_stage) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  const int ntiles = ROW / piece, nt = blockIdx.x % ntiles, kp = blockIdx.x / ntiles;
  const char* base = W + (size_t)kp * rows_k * ROW + (size_t)nt * piece;
  const int sbytes = rows_stage * piece, chunks = sbytes / 16, iters = rows_k / rows_stage;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, consumers = THREADS / 32 - 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) { bar_init(&full[s], 1); bar_init(&empty[s], consumers); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  float acc = 0.f;
  if (warp == 0) {
    for (int s = 0; s < iters; ++s) {
      if (s >= STAGES) bar_wait(&empty[s % STAGES], ((s / STAGES) - 1) & 1);
      char* dst = sm + (s % STAGES) * sbytes;
      if (lane == 0) bar_expect(&full[s % STAGES], sbytes);
      __syncwarp();
      for (int r = lane; r < rows_stage; r += 32)
        bulk(dst + r * piece, base + (size_t)(s * rows_stage + r) * ROW, piece, &full[s % STAGES]);
    }
  } else {
    for (int it = 0; it < iters; ++it) {
      bar_wait(&full[it % STAGES], (it / STAGES) & 1);
      for (int c = threadIdx.x - 32; c < chunks; c += THREADS - 32)
        acc += fold(*(const uint4*)(sm + (it % STAGES) * sbytes + c * 16));
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[it % STAGES]);
    }
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
struct __align__(64) TMap { unsigned long long q[16]; };
// One bulk tensor copy per stage: box [rows_stage, BOX] f16 elements of the arena seen
// as a 2-D tensor of rows of ROW bytes; piece / 2 / BOX boxes side by side per stage.
extern "C" __global__ void __launch_bounds__(THREADS) probe_tma(
    const __grid_constant__ TMap tm, float* out, int piece, int rows_k, int rows_stage,
    int row0) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) unsigned long long full[STAGES];
  const int ntiles = ROW / piece, nt = blockIdx.x % ntiles, kp = blockIdx.x / ntiles;
  const int col0 = nt * (piece / 2), r0 = row0 + kp * rows_k;
  const int box = piece / 2 < 256 ? piece / 2 : 256, nbox = piece / 2 / box;
  const int sbytes = rows_stage * piece, chunks = sbytes / 16, iters = rows_k / rows_stage;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s) {
    char* dst = sm + (s % STAGES) * sbytes;
    bar_expect(&full[s % STAGES], sbytes);
    for (int b = 0; b < nbox; ++b)
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                   " [%0], [%1, {%2, %3}], [%4];"
                   :: "r"(smaddr(dst + b * rows_stage * box * 2)), "l"(&tm),
                      "r"(col0 + b * box), "r"(r0 + s * rows_stage),
                      "r"(smaddr(&full[s % STAGES])) : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES && s < iters; ++s) issue(s);
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    bar_wait(&full[it % STAGES], (it / STAGES) & 1);
    for (int c = threadIdx.x; c < chunks; c += THREADS)
      acc += fold(*(const uint4*)(sm + (it % STAGES) * sbytes + c * 16));
    __syncthreads();
    if (threadIdx.x == 0 && it + STAGES < iters) issue(it + STAGES);
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
// tma with the work claimed at run time: a persistent grid, the stream cut into units
// of one stage (a tile's rows_stage rows), claimed one at a time from a global counter
// by the thread that issues the copies; blocks that stream faster take more units. A
// stage whose claim is past the end is completed by a plain arrive, and the consumers
// stop there. The last block to finish zeroes the counters for the next call.
extern "C" __global__ void __launch_bounds__(THREADS) probe_tmad(
    const __grid_constant__ TMap tm, float* out, int piece, int rows_k, int rows_stage,
    int row0, unsigned* ctr, int rows) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) unsigned long long full[STAGES];
  __shared__ int unit[STAGES];
  const int ntiles = ROW / piece, units = ntiles * (rows / rows_stage);
  const int box = piece / 2 < 256 ? piece / 2 : 256, nbox = piece / 2 / box;
  const int sbytes = rows_stage * piece, chunks = sbytes / 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s) {
    const int u = (int)atomicAdd(&ctr[0], 1u);
    unit[s % STAGES] = u;
    if (u >= units) {
      bar_arrive(&full[s % STAGES]);
      return;
    }
    const int col0 = (u % ntiles) * (piece / 2), r0 = row0 + (u / ntiles) * rows_stage;
    char* dst = sm + (s % STAGES) * sbytes;
    bar_expect(&full[s % STAGES], sbytes);
    for (int b = 0; b < nbox; ++b)
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                   " [%0], [%1, {%2, %3}], [%4];"
                   :: "r"(smaddr(dst + b * rows_stage * box * 2)), "l"(&tm),
                      "r"(col0 + b * box), "r"(r0), "r"(smaddr(&full[s % STAGES])) : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) issue(s);
  float acc = 0.f;
  for (int it = 0;; ++it) {
    bar_wait(&full[it % STAGES], (it / STAGES) & 1);
    if (unit[it % STAGES] >= units) break;  // every later claim is past the end too
    for (int c = threadIdx.x; c < chunks; c += THREADS)
      acc += fold(*(const uint4*)(sm + (it % STAGES) * sbytes + c * 16));
    __syncthreads();
    if (threadIdx.x == 0) issue(it + STAGES);
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&ctr[1], 1u) == gridDim.x - 1) {
      ctr[0] = 0u;
      ctr[1] = 0u;
    }
  }
}
extern "C" __global__ void __launch_bounds__(THREADS) probe_ld(
    const char* __restrict__ W, float* out, int piece, int rows_k, int rows_stage) {
  const int ntiles = ROW / piece, nt = blockIdx.x % ntiles, kp = blockIdx.x / ntiles;
  const char* base = W + (size_t)kp * rows_k * ROW + (size_t)nt * piece;
  const int cpr = piece / 16, total = rows_k * cpr;
  float acc = 0.f;
  int c = threadIdx.x;
  for (; c + 7 * THREADS < total; c += 8 * THREADS) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      int e = c + u * THREADS, r = e / cpr, q = e - r * cpr;
      v[u] = __ldg((const uint4*)(base + (size_t)r * ROW + q * 16));
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += fold(v[u]);
  }
  for (; c < total; c += THREADS) {
    int r = c / cpr, q = c - r * cpr;
    acc += fold(__ldg((const uint4*)(base + (size_t)r * ROW + q * 16)));
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
"""


KINDS = {"cp": (2, 4), "ld": (0,), "bulk": (4, 6, 8), "ws": (4, 6, 8), "tma": (4, 6, 8),
         "tmad": (4, 6, 8)}


def configs(rows: int, kinds: list[str], pieces: tuple[int, ...],
            blocks_list: tuple[int, ...],
            depths: dict[str, tuple[int, ...]] = KINDS) -> list[dict[str, int | str]]:
    out: list[dict[str, int | str]] = []
    for piece in pieces:
        ntiles = ROW // piece
        for blocks in blocks_list:
            if "tmad" in kinds and blocks >= ntiles:  # any grid: the units are claimed
                rows_stage = max(1, min(rows, 24576 // piece, 256))
                while rows % rows_stage:
                    rows_stage -= 1
                out += [{"kind": "tmad", "piece": piece, "blocks": blocks, "stages": st,
                         "rows": rows, "rows_k": rows, "rows_stage": rows_stage}
                        for st in depths["tmad"]]
            if blocks % ntiles or rows % (blocks // ntiles):
                continue
            rows_k = rows // (blocks // ntiles)
            rows_stage = max(1, min(rows_k, 24576 // piece, 256))
            while rows_k % rows_stage:
                rows_stage -= 1
            for kind in (k for k in kinds if k != "tmad"):
                for stages in depths[kind]:
                    out.append({"kind": kind, "piece": piece, "blocks": blocks,
                                "stages": stages, "rows": rows, "rows_k": rows_k,
                                "rows_stage": rows_stage})
    return out


def _tensor_map(drv: Any, base: int, rows: int, rows_stage: int, piece: int) -> Any:
    """A 2-D f16 tensor map over ``rows`` rows of ROW bytes at ``base``; boxes of
    ``rows_stage`` rows and min(piece / 2, 256) elements, no swizzle."""
    box = min(piece // 2, 256)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    return check(drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, base,
        [u64(ROW // 2), u64(rows)], [u64(ROW)], [u32(box), u32(rows_stage)], [u32(1), u32(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


def option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> int:
    dev = Device(0)
    drv = dev.drv
    bw = copybw.measure(dev)
    print(f"copy kernel {bw.copy_kernel / 1e12:.3f} TB/s", flush=True)
    kinds = option(argv, "--kinds", "cp,ld,bulk,ws").split(",")
    row_counts = [int(r) for r in option(argv, "--rows", str(K)).split(",")]
    pieces = tuple(int(p) for p in option(argv, "--pieces", "96,192,384,768,1536,3072,12288").split(","))
    blocks_list = tuple(int(b) for b in option(argv, "--blocks", "128,256,512").split(","))
    # --stages 2,4,6,8: the pipeline depths of every kind but ld (default: KINDS)
    depths = dict(KINDS)
    if "--stages" in argv:
        sweep = tuple(int(x) for x in option(argv, "--stages", "").split(","))
        depths.update({k: sweep for k in depths if k != "ld"})
    # Enough copies of W, rotated between calls, that no call finds its W in the L2.
    arena_bytes = max(COPIES * max(row_counts) * ROW, ARENA)
    arena = dev.alloc(arena_bytes)
    check(drv.cuMemsetD32Async(arena, 0x3C003C00, arena_bytes // 4, dev.stream), "memset")
    out = dev.alloc(1024 * THREADS * 4)
    ctr = dev.alloc(16)  # tmad's claim and finish counters (each call leaves them zero)
    check(drv.cuMemsetD32Async(ctr, 0, 4, dev.stream), "memset")
    modules = {}
    rows = []
    for cfg in [c for r in row_counts for c in configs(r, kinds, pieces, blocks_list, depths)]:
        stages = int(cfg["stages"]) or 2
        if stages not in modules:
            src = f"#define STAGES {stages}\n#define ROW {ROW}\n" + SOURCE
            modules[stages] = check(drv.cuModuleLoadData(
                compile_cuda(src, "probe.cu", dev.arch).cubin), "load")
        name = f"probe_{cfg['kind']}".encode()
        fn = check(drv.cuModuleGetFunction(modules[stages], name), "fn")
        smem = stages * int(cfg["rows_stage"]) * int(cfg["piece"]) if cfg["kind"] != "ld" else 0
        check(drv.cuFuncSetAttribute(
            fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            max(smem, 1)), "attr")
        cells = {}

        nbytes = int(cfg["rows"]) * ROW
        copies = arena_bytes // nbytes

        tmap = _tensor_map(drv, arena, arena_bytes // ROW, int(cfg["rows_stage"]),
                           int(cfg["piece"])) if cfg["kind"] in ("tma", "tmad") else None

        def launch(i: int, cfg: dict[str, int | str] = cfg, fn=fn, smem=smem,
                   cells: dict = cells, nbytes: int = nbytes, copies: int = copies,
                   tmap: Any = tmap) -> None:
            tail = [ctypes.c_void_p(out), ctypes.c_int(int(cfg["piece"])),
                    ctypes.c_int(int(cfg["rows_k"])), ctypes.c_int(int(cfg["rows_stage"]))]
            if tmap is not None:  # by value: the parameter's cell is the map itself
                vals = [ctypes.c_char.from_address(tmap.getPtr()), *tail,
                        ctypes.c_int((i % copies) * nbytes // ROW)]
                if cfg["kind"] == "tmad":
                    vals += [ctypes.c_void_p(ctr), ctypes.c_int(int(cfg["rows"]))]
            else:
                vals = [ctypes.c_void_p(arena + (i % copies) * nbytes), *tail]
            cells[i] = vals
            argv_ = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(c) for c in vals])
            cells[(i, "a")] = argv_
            check(drv.cuLaunchKernel(fn, int(cfg["blocks"]), 1, 1, THREADS, 1, 1, smem,
                                     dev.stream, ctypes.addressof(argv_), 0), "launch")

        us = dev.time_graph(launch, min(copies, 16), 10)
        row = {**cfg, "us": us, "tbps": nbytes / (us * 1e-6) / 1e12,
               "copy_tbps": bw.copy_kernel / 1e12}
        rows.append(row)
        print(f"{cfg['kind']:>4} rows {cfg['rows']:>5} piece {cfg['piece']:>5} B  "
              f"blocks {cfg['blocks']:>3}  stages {cfg['stages']}  {us:6.2f} us  "
              f"{row['tbps']:.2f} TB/s", flush=True)
    with open(argv[0], "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
