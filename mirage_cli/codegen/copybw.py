"""The DRAM bandwidth that defines the memory floor of `mirage bench` (DESIGN.md §7).

A streaming copy kernel, compiled by NVRTC in the benchmark's own process, copies a
buffer much larger than the L2 cache with 16-byte (``uint4``) loads and stores; the
bandwidth is the bytes read plus written per second of its median CUDA-graph replay.
``cuMemcpyDtoDAsync`` is timed the same way, but only as a second figure: the driver's
copy reaches about two thirds of what a kernel reaches on an H200, so a floor from it
would flatter every kernel measured against it.

The kernel is timed in two launch shapes, and the faster one defines the bandwidth
(a floor is the best the memory system does, not the average of two guesses):

- ``one-per-thread``: one grid-stride iteration per thread, enough blocks to cover
  the buffer (the hardware block scheduler balances the SMs);
- ``persistent``: a few blocks per SM, each thread walking the buffer in a grid-stride
  loop (fewer block launches, the same bytes in flight).

In both, each thread issues ``UNROLL`` independent 16-byte loads before its stores, so
enough bytes are in flight per SM to cover DRAM latency.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from mirage_cli.codegen.nvrtc import compile_cuda

KERNEL = "mirage_copy_v16"
THREADS = 256
UNROLL = 4
# Bytes one thread moves per grid-stride iteration.
CHUNK = 16 * UNROLL

# The loads of one iteration are issued before its stores (no aliasing: __restrict__),
# and adjacent threads touch adjacent 16-byte words, so every warp access is four
# fully used 128-byte lines.
SOURCE = f"""\
// Streaming copy with 16-byte accesses: the bandwidth that defines the memory floor.
extern "C" __global__ void __launch_bounds__({THREADS})
{KERNEL}(const uint4* __restrict__ src, uint4* __restrict__ dst, unsigned long long n)
{{
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + {UNROLL - 1} * stride < n; i += {UNROLL} * stride) {{
    uint4 v[{UNROLL}];
#pragma unroll
    for (int k = 0; k < {UNROLL}; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < {UNROLL}; ++k) dst[i + k * stride] = v[k];
  }}
  for (; i < n; i += stride) dst[i] = src[i];
}}
"""

DEFAULT_BYTES = 1 << 30


@dataclass(frozen=True)
class Bandwidth:
    """The measured bandwidths, bytes per second counting bytes read and written."""

    copy_kernel: float
    launch: str               # the launch shape that gave ``copy_kernel``
    shapes: dict[str, float]  # every launch shape measured, bytes per second
    memcpy: float             # cuMemcpyDtoDAsync, for comparison only
    nbytes: int               # bytes copied per call

    def as_json(self) -> dict[str, Any]:
        return {"copy_kernel_bytes_per_s": self.copy_kernel, "launch": self.launch,
                "shapes_bytes_per_s": dict(sorted(self.shapes.items())),
                "memcpy_bytes_per_s": self.memcpy, "buffer_bytes": self.nbytes,
                "kernel": f"{KERNEL}: {THREADS} threads, {UNROLL} x 16-byte loads then "
                          f"stores per thread and iteration"}


def compile_copy(arch: str) -> bytes:
    """The copy kernel's cubin for ``arch`` (no CUDA header needed: NVRTC knows uint4)."""
    return compile_cuda(SOURCE, "mirage_copy.cu", arch).cubin


def launch_shapes(nbytes: int, sms: int) -> dict[str, int]:
    """Grid sizes of the two launch shapes for a buffer of ``nbytes``."""
    one = -(-nbytes // (CHUNK * THREADS))
    # 2048 threads per SM on sm_80/sm_90: 8 blocks of 256 fill an SM.
    return {"one-per-thread": one, "persistent": min(one, sms * (2048 // THREADS))}


def _attr(dev: Any, name: str) -> int:
    drv = dev.drv
    err, v = drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), dev.dev)
    if int(err) != 0:
        raise RuntimeError(f"cuDeviceGetAttribute({name}) failed")
    return int(v)


def measure(dev: Any, nbytes: int = DEFAULT_BYTES, replays: int = 10, calls: int = 4
            ) -> Bandwidth:
    """Copy and memcpy bandwidth on ``dev`` (a :class:`runner.Device`): median of
    ``replays`` CUDA-graph replays of ``calls`` copies of ``nbytes`` after warm-up.
    The copy is checked first (a kernel that moved nothing would read as infinitely
    fast)."""
    from mirage_cli.codegen.runner import check

    if nbytes % CHUNK:
        raise ValueError(f"copy size {nbytes} is not a multiple of {CHUNK} bytes")
    drv = dev.drv
    module = check(drv.cuModuleLoadData(compile_copy(dev.arch)), "cuModuleLoadData")
    src, dst = dev.alloc(nbytes), dev.alloc(nbytes)
    try:
        fn = check(drv.cuModuleGetFunction(module, KERNEL.encode()), "cuModuleGetFunction")
        sms = _attr(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        shapes = launch_shapes(nbytes, sms)
        for grid in shapes.values():
            _check_copy(dev, fn, src, dst, nbytes, grid)
        rates = {name: 2 * nbytes / (_time(dev, fn, src, dst, nbytes, grid, calls, replays)
                                     * 1e-6) for name, grid in shapes.items()}
        us = dev.time_graph(lambda i: check(drv.cuMemcpyDtoDAsync(dst, src, nbytes, dev.stream),
                                            "cuMemcpyDtoDAsync"), calls, replays)
        best = max(sorted(rates), key=lambda k: rates[k])
        return Bandwidth(rates[best], best, rates, 2 * nbytes / (us * 1e-6), nbytes)
    finally:
        dev.free(src)
        dev.free(dst)
        check(drv.cuModuleUnload(module), "cuModuleUnload")


def _launch(dev: Any, fn: Any, src: int, dst: int, nbytes: int, grid: int) -> None:
    from mirage_cli.codegen.runner import check

    cells = [ctypes.c_void_p(src), ctypes.c_void_p(dst), ctypes.c_ulonglong(nbytes // 16)]
    argv = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
    check(dev.drv.cuLaunchKernel(fn, grid, 1, 1, THREADS, 1, 1, 0, dev.stream,
                                 ctypes.addressof(argv), 0), "cuLaunchKernel")


def _time(dev: Any, fn: Any, src: int, dst: int, nbytes: int, grid: int, calls: int,
          replays: int) -> float:
    """Median µs per copy (Device.time_graph warms up before timing)."""
    return float(dev.time_graph(lambda i: _launch(dev, fn, src, dst, nbytes, grid), calls,
                                replays))


def _check_copy(dev: Any, fn: Any, src: int, dst: int, nbytes: int, grid: int) -> None:
    """One copy of a patterned buffer over a poisoned one; the head and the tail of the
    destination must hold the pattern (the grid-stride loop and its remainder)."""
    import numpy as np

    from mirage_cli.codegen.runner import check

    drv = dev.drv
    check(drv.cuMemsetD32Async(src, 0x3C013C02, nbytes // 4, dev.stream), "cuMemsetD32")
    check(drv.cuMemsetD32Async(dst, 0xFFFFFFFF, nbytes // 4, dev.stream), "cuMemsetD32")
    _launch(dev, fn, src, dst, nbytes, grid)
    dev.sync()
    span = min(nbytes, 1 << 20)
    for at in (0, nbytes - span):
        words = dev.download(dst + at, span).view(np.uint32)
        if not (words == 0x3C013C02).all():
            raise RuntimeError(f"the bandwidth copy kernel did not copy bytes "
                               f"[{at}, {at + span}) (grid {grid})")
