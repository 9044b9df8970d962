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
- ``ld``: 16-byte loads straight into registers, 8 in flight per thread.

Configurations sweep the piece width (96 B to whole 12 KB rows), the number of blocks
(128 or 256) and the pipeline depth. W is 4096 x 6144 f16 (rmsnorm_linear's), four
copies rotated between calls so that no call finds W in the L2. The copy kernel's
bandwidth is measured in the same process for reference. Used for docs/perf-log.md.
"""

from __future__ import annotations

import ctypes
import json
import sys

from mirage_cli.codegen import copybw
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.runner import Device, check

K, ROW = 4096, 12288  # rows of W, bytes per row (6144 f16)
THREADS = 256
COPIES = 4

SOURCE = r"""
#define THREADS 256
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(g) : "memory");
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


def configs() -> list[dict[str, int | str]]:
    out: list[dict[str, int | str]] = []
    for piece in (96, 192, 384, 768, 1536, 3072, 12288):
        ntiles = ROW // piece
        for blocks in (128, 256, 512):
            if blocks % ntiles:
                continue
            rows_k = K // (blocks // ntiles)
            rows_stage = max(1, min(rows_k, 24576 // piece))
            while rows_k % rows_stage:
                rows_stage -= 1
            for kind, stages in (("cp", 2), ("cp", 4), ("ld", 0)):
                out.append({"kind": kind, "piece": piece, "blocks": blocks, "stages": stages,
                            "rows_k": rows_k, "rows_stage": rows_stage})
    return out


def main(argv: list[str]) -> int:
    dev = Device(0)
    drv = dev.drv
    bw = copybw.measure(dev)
    print(f"copy kernel {bw.copy_kernel / 1e12:.3f} TB/s", flush=True)
    nbytes = K * ROW
    ws = [dev.alloc(nbytes) for _ in range(COPIES)]
    for w in ws:
        check(drv.cuMemsetD32Async(w, 0x3C003C00, nbytes // 4, dev.stream), "memset")
    out = dev.alloc(512 * THREADS * 4)
    modules = {}
    rows = []
    for cfg in configs():
        stages = int(cfg["stages"]) or 2
        if stages not in modules:
            src = f"#define STAGES {stages}\n#define ROW {ROW}\n" + SOURCE
            modules[stages] = check(drv.cuModuleLoadData(
                compile_cuda(src, "probe.cu", dev.arch).cubin), "load")
        name = b"probe_cp" if cfg["kind"] == "cp" else b"probe_ld"
        fn = check(drv.cuModuleGetFunction(modules[stages], name), "fn")
        smem = stages * int(cfg["rows_stage"]) * int(cfg["piece"]) if cfg["kind"] == "cp" else 0
        check(drv.cuFuncSetAttribute(
            fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            max(smem, 1)), "attr")
        cells = {}

        def launch(i: int, cfg: dict[str, int | str] = cfg, fn=fn, smem=smem,
                   cells: dict = cells) -> None:
            vals = [ctypes.c_void_p(ws[i % COPIES]), ctypes.c_void_p(out),
                    ctypes.c_int(int(cfg["piece"])), ctypes.c_int(int(cfg["rows_k"])),
                    ctypes.c_int(int(cfg["rows_stage"]))]
            cells[i] = vals
            argv_ = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(c) for c in vals])
            cells[(i, "a")] = argv_
            check(drv.cuLaunchKernel(fn, int(cfg["blocks"]), 1, 1, THREADS, 1, 1, smem,
                                     dev.stream, ctypes.addressof(argv_), 0), "launch")

        us = dev.time_graph(launch, COPIES * 2, 10)
        row = {**cfg, "us": us, "tbps": nbytes / (us * 1e-6) / 1e12,
               "copy_tbps": bw.copy_kernel / 1e12}
        rows.append(row)
        print(f"{cfg['kind']} piece {cfg['piece']:>5} B  blocks {cfg['blocks']:>3}  "
              f"stages {cfg['stages']}  {us:6.2f} us  {row['tbps']:.2f} TB/s", flush=True)
    with open(argv[0], "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
