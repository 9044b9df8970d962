"""Calibration: measure a device's figures and fit the cost model to measured kernels.

:func:`measure_device` (``mirage calibrate --gpu N``) times small NVRTC-compiled
kernels as CUDA-graph replays (the bench's timing, :meth:`runner.Device.time_graph`):

- streaming bandwidth: the bench's copy kernel over 1 GiB (:mod:`codegen.copybw`);
- L2 bandwidth: the same copy over a buffer of a quarter of the L2, so it stays there;
- launch latency: an empty kernel, per graph node;
- tensor-core throughput: ``mma.sync m16n8k16`` (f16 in, f32 accumulate) from registers,
  four independent accumulators per warp, 4 blocks of 256 threads per SM;
- FMA throughput: eight independent ``fmaf`` chains per thread;
- barrier cost: ``__syncthreads()`` in a loop, 256 threads, one block per SM;
- limits: the device attributes (SMs, shared memory per block and per SM, registers,
  threads per SM, L2 size).

:func:`fit` fits the model's coefficients (``fit`` of a profile: ``stream``, ``sync``,
``launch``, ``const_us``, ``cluster_us``) to measured kernel times: first by least
squares on relative error (each row divided by its measured time, so 5 µs and 1 ms
kernels weigh alike) with non-negative coefficients (every subset of terms is tried;
the best non-negative solution wins), then by how they rank (:func:`fit`). Its input
is the JSON of ``tools/selection_table.py`` (every timed variant with its µGraph and
measured time). :func:`spearman` and :func:`pick_ratio` (of :func:`model_pick`, the
variant the model's ranking puts first) are the figures ``tools/model_fit.py``
reports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mirage_cli import serialize
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.profiles import FIT_TERMS, Profile

THREADS = 256
FMA_ITERS = 4096
MMA_ITERS = 2048
SYNC_ITERS = 4096

SOURCE = f"""\
// Calibration kernels of mirage calibrate: launch latency, FMA and tensor-core
// throughput, barrier cost. Results are stored so nothing is optimised away.
extern "C" __global__ void mirage_cal_empty() {{}}

extern "C" __global__ void __launch_bounds__({THREADS})
mirage_cal_fma(float* out, int iters)
{{
  float x[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = threadIdx.x * 0.001f + k;
  for (int i = 0; i < iters; ++i) {{
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = fmaf(x[k], 0.999f, 0.001f);
  }}
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += x[k];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}

extern "C" __global__ void __launch_bounds__({THREADS})
mirage_cal_mma(float* out, int iters)
{{
  unsigned a0 = 0x3c003c00u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3;
  unsigned b0 = 0x3c003c00u ^ blockIdx.x, b1 = b0 + 1;
  float c[4][4] = {{}};
  for (int i = 0; i < iters; ++i) {{
#pragma unroll
    for (int k = 0; k < 4; ++k) {{
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                   "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
                   : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }}
  }}
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}

extern "C" __global__ void __launch_bounds__({THREADS})
mirage_cal_sync(float* out, int iters)
{{
  __shared__ float s[{THREADS}];
  s[threadIdx.x] = threadIdx.x;
  for (int i = 0; i < iters; ++i) {{
    __syncthreads();
    s[(threadIdx.x + 1) % {THREADS}] += 1.f;
  }}
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}}
"""
FLOPS_PER_MMA = 2 * 16 * 8 * 16   # one m16n8k16 per warp


def compile_kernels(arch: str) -> bytes:
    """The calibration kernels' cubin (NVRTC; no GPU needed)."""
    from mirage_cli.codegen.nvrtc import compile_cuda

    return compile_cuda(SOURCE, "mirage_calibrate.cu", arch).cubin


def _attr(dev: Any, name: str) -> int:
    from mirage_cli.codegen.runner import check

    drv = dev.drv
    return int(check(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), dev.dev),
                     name))


def _launch(dev: Any, fn: Any, grid: int, args: Sequence[Any]) -> None:
    from mirage_cli.codegen.runner import check

    cells = list(args)
    argv = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
    check(dev.drv.cuLaunchKernel(fn, grid, 1, 1, THREADS if cells else 1, 1, 1, 0,
                                 dev.stream, ctypes.addressof(argv) if cells else 0, 0),
          "cuLaunchKernel")


def measure_device(dev: Any, replays: int = 20) -> dict[str, Any]:
    """Every figure the model needs, measured on ``dev`` (a :class:`runner.Device`)."""
    from mirage_cli.codegen import copybw
    from mirage_cli.codegen.runner import check

    sms = _attr(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
    bw = copybw.measure(dev)
    l2_bytes = int(dev.l2_bytes)
    l2_copy = max(copybw.CHUNK, (l2_bytes // 4) // copybw.CHUNK * copybw.CHUNK)
    l2 = copybw.measure(dev, nbytes=l2_copy, replays=replays, calls=16)
    drv = dev.drv
    module = check(drv.cuModuleLoadData(compile_kernels(dev.arch)), "cuModuleLoadData")
    out = dev.alloc(sms * 8 * THREADS * 4)
    try:
        def fn(name: str) -> Any:
            return check(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")

        def timed(name: str, grid: int, iters: int, calls: int = 4) -> float:
            f = fn(name)
            args = [] if iters == 0 else [ctypes.c_void_p(out), ctypes.c_int(iters)]
            return float(dev.time_graph(lambda i: _launch(dev, f, grid, args), calls,
                                        replays))

        launch_us = timed("mirage_cal_empty", 1, 0, calls=64)
        fma_grid = sms * 8
        fma_us = timed("mirage_cal_fma", fma_grid, FMA_ITERS)
        mma_grid = sms * 4
        mma_us = timed("mirage_cal_mma", mma_grid, MMA_ITERS)
        sync_us = timed("mirage_cal_sync", sms, SYNC_ITERS)
        sync_base = timed("mirage_cal_sync", sms, 1)
    finally:
        dev.free(out)
        check(drv.cuModuleUnload(module), "cuModuleUnload")
    warps = mma_grid * THREADS // 32
    return {
        "device": dev.name, "arch": dev.arch, "num_sms": sms,
        "dram_bw": bw.copy_kernel, "l2_bw": l2.copy_kernel, "l2_bytes": l2_bytes,
        "launch_us": launch_us,
        "fma_flops": 2 * 8 * FMA_ITERS * fma_grid * THREADS / (fma_us * 1e-6),
        "peak_flops": FLOPS_PER_MMA * 4 * MMA_ITERS * warps / (mma_us * 1e-6),
        "barrier_us": max(0.0, sync_us - sync_base) / (SYNC_ITERS - 1),
        "smem_per_block": _attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        "smem_per_sm": _attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        "regs_per_sm": _attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR"),
        "max_threads_per_sm": _attr(dev,
                                    "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR"),
        "copy": bw.as_json(),
    }


def profile_from_measurements(base: Profile, m: dict[str, Any]) -> Profile:
    """``base`` with the measured figures; ``iter_us`` (per forloop iteration and wave)
    becomes the measured barrier cost; the fit is reset to 1/1/1/0/0."""
    return dataclasses.replace(
        base, name=f"{base.name}-calibrated", device=m["device"], arch=m["arch"],
        calibrated=True, source=f"mirage calibrate on {m['device']}",
        num_sms=m["num_sms"], dram_bw=m["dram_bw"], l2_bw=m["l2_bw"], l2_bytes=m["l2_bytes"],
        peak_flops=m["peak_flops"], fma_flops=m["fma_flops"], launch_us=m["launch_us"],
        iter_us=m["barrier_us"], barrier_us=m["barrier_us"],
        smem_per_block=m["smem_per_block"], smem_per_sm=m["smem_per_sm"],
        regs_per_sm=m["regs_per_sm"], max_threads_per_sm=m["max_threads_per_sm"],
        fit={"stream": 1.0, "sync": 1.0, "launch": 1.0, "const_us": 0.0, "cluster_us": 0.0},
        extra={**base.extra, "measured": {"copy": m["copy"]}})


# -- fitting ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed variant: its µGraph, measured µs and the example it belongs to."""

    group: str
    graph: Graph
    measured_us: float


def load_samples(doc: Any, where: str) -> list[Sample]:
    """The correct timed variants of a ``tools/selection_table.py`` JSON document."""
    from mirage_cli import serialize

    if not isinstance(doc, dict) or doc.get("format") != "mirage-cli/selection-table":
        raise MirageError(f"{where}: not a measured selection table "
                          f"(format 'mirage-cli/selection-table' expected)")
    out = []
    for i, row in enumerate(doc.get("rows", [])):
        for j, v in enumerate(row.get("variants", [])):
            if not v.get("ok") or not isinstance(v.get("measured_us"), (int, float)):
                continue
            g = serialize.graph_from_json(v["graph"], where,
                                          ("rows", i, "variants", j, "graph"))
            out.append(Sample(f"{row['program']}@{row['batch']}", g, float(v["measured_us"])))
    if not out:
        raise MirageError(f"{where}: no correct timed variant to fit")
    return out


def terms(samples: Sequence[Sample], base: Profile) -> np.ndarray:
    """Each sample's unscaled model terms, in :data:`FIT_TERMS`' order (stream, sync,
    launch µs, 1 for the per-µGraph constant, and the kernels whose forloop is split
    over a cluster) under ``base`` with a unit fit."""
    from mirage_cli.search import cost

    unit = dataclasses.replace(base, fit={"stream": 1.0, "sync": 1.0, "launch": 1.0,
                                          "const_us": 0.0, "cluster_us": 1.0})
    before = cost.profile()
    cost.use_profile(unit)
    try:
        rows = []
        for s in samples:
            ks = cost.kernel_costs(s.graph)
            rows.append([sum(k.stream_us for k in ks), sum(k.sync_us for k in ks),
                         sum(k.launch_us for k in ks), 1.0, sum(k.cluster_us for k in ks)])
    finally:
        cost.use_profile(before)
    return np.array(rows, dtype=np.float64)


# The second stage of :func:`fit`: the ratios of the sync, launch and cluster terms to
# the streaming term it tries (an overall scale and the constant change no ranking).
RATIOS = {"sync": (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
          "launch": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0),
          "cluster_us": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)}
# A pick counts as good when it measures within this factor of its group's best.
PICK_WITHIN = 1.15


def fit(samples: Sequence[Sample], base: Profile) -> Profile:
    """``base`` with coefficients fitted to the samples, in two stages. First least
    squares on relative error (see the module docstring). Then, since what the model
    is for is choosing, the coefficients are judged by how they rank: in each group
    (a program at a batch) the variant the model's ranking puts first should measure
    within :data:`PICK_WITHIN` of the group's best, and over all samples predicted and
    measured times should correlate in rank. Each ratio of :data:`RATIOS` (sync,
    launch and cluster terms against the streaming term), with its scale and constant
    fitted by least squares, replaces the first stage's coefficients when it ranks
    strictly better: more good picks, or as many and a higher Spearman. Least squares
    alone fitted the sync term at 15 times the streaming one on the six examples'
    758 variants measured on an H200 and ranked lora's single-iteration tilings,
    1.28-1.36 times slower, first (docs/perf-log.md v48)."""
    x = terms(samples, base)
    y = np.array([s.measured_us for s in samples])
    best = _least_squares(x, y)
    costs = estimates(samples, base)  # the tie rule's terms: only time_us depends on the fit
    canonical = [serialize.dumps(s.graph) for s in samples]
    score = ranking_score(samples, costs, canonical, list(x @ best))
    index = {k: FIT_TERMS.index(k) for k in ("stream", *RATIOS)}
    for ratios in itertools.product(*RATIOS.values()):
        direction = np.zeros(len(FIT_TERMS))
        direction[index["stream"]] = 1.0
        for name, r in zip(RATIOS, ratios):
            direction[index[name]] = r
        coef = _scaled(x, y, direction)
        s = ranking_score(samples, costs, canonical, list(x @ coef))
        if s > score:
            best, score = coef, s
    return dataclasses.replace(base, calibrated=True,
                               fit={k: float(v) for k, v in zip(FIT_TERMS, best)})


def _least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients of the terms ``x`` minimising the squared relative
    error against ``y`` (every subset of terms is tried; the best solution wins)."""
    a, b = x / y[:, None], np.ones(len(y))
    best: tuple[float, np.ndarray] | None = None
    n_terms = x.shape[1]
    for n in range(1, n_terms + 1):
        for cols in itertools.combinations(range(n_terms), n):
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n_terms)
            full[list(cols)] = coef
            err = float(np.sum((a @ full - b) ** 2))
            if best is None or err < best[0] - 1e-12:
                best = (err, full)
    assert best is not None  # one term alone always gives a coefficient >= 0
    return best[1]


def _scaled(x: np.ndarray, y: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """``s * direction`` plus the constant term ``c`` (``s``, ``c`` >= 0) minimising the
    squared relative error of ``x @ (s * direction) + c`` against ``y``."""
    const = FIT_TERMS.index("const_us")
    d = direction.copy()
    d[const] = 0.0
    a = (x @ d) / y
    coef, *_ = np.linalg.lstsq(np.stack([a, x[:, const] / y], axis=1), np.ones(len(y)),
                               rcond=None)
    scale, c = float(coef[0]), float(coef[1])
    if c < 0 or scale <= 0:
        scale, c = float(a.sum() / max((a * a).sum(), 1e-30)), 0.0
    out = d * scale
    out[const] = c
    return out


def ranking_score(samples: Sequence[Sample], costs: Sequence[Any], canonical: Sequence[str],
                  predicted: Sequence[float]) -> tuple[int, float]:
    """How well ``predicted`` ranks the samples: the groups whose pick (the first of
    the model's ranking, :func:`model_pick`, with ``predicted`` as its times) measures
    within :data:`PICK_WITHIN` of the group's best, and the Spearman rank correlation
    over all samples (-1 where undefined)."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    good = 0
    for idx in groups.values():
        timed = [dataclasses.replace(costs[i], time_us=predicted[i]) for i in idx]
        measured = [samples[i].measured_us for i in idx]
        pick = model_pick(timed, [canonical[i] for i in idx])
        good += pick_ratio([t.time_us for t in timed], measured, pick) <= PICK_WITHIN
    rho = spearman(predicted, [s.measured_us for s in samples])
    return good, -1.0 if math.isnan(rho) else rho


def estimates(samples: Sequence[Sample], p: Profile) -> list[Any]:
    """The model's :class:`~mirage_cli.search.cost.Cost` of each sample under ``p``."""
    from mirage_cli.search import cost

    before = cost.profile()
    cost.use_profile(p)
    try:
        return [cost.estimate(s.graph) for s in samples]
    finally:
        cost.use_profile(before)


def predict(samples: Sequence[Sample], p: Profile) -> list[float]:
    """The model's predicted µs of each sample under ``p``."""
    return [c.time_us for c in estimates(samples, p)]


def model_pick(costs: Sequence[Any], canonical: Sequence[str]) -> int:
    """The index of the variant the model chooses among ``costs``: the first of
    :func:`~mirage_cli.search.cost.rank`'s order (predicted time; predictions within 1%
    of each other ordered by the stated tie rule, ``canonical`` the µGraphs' JSON text
    last), which is how the search and ``mirage tune`` choose."""
    from mirage_cli.search.cost import rank

    return rank(list(range(len(costs))), lambda i: costs[i], lambda i: canonical[i])[0]


def _ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = np.zeros(len(x))
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks; NaN if one is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def pick_ratio(predicted: Sequence[float], measured: Sequence[float],
               pick: int | None = None) -> float:
    """Measured time of the model's pick over the best measured time. The pick is
    ``pick`` (:func:`model_pick`) when given, else the lowest prediction (ties: the
    first)."""
    if pick is None:
        pick = min(range(len(predicted)), key=lambda i: (predicted[i], i))
    return measured[pick] / min(measured)
