"""Where a weight-streaming kernel's time goes: per-block timestamps, on a GPU.

    python tools/timeline_probe.py OUT.json PROGRAM.mir:BATCH:GRAPH.ugraph.json[:BEFORE.cu] ...

The generated source of each µGraph's first custom kernel is rewritten so that thread 0
of every block writes ``%globaltimer`` (ns) at its start, after the grid-dependency
wait, when each forloop iteration's inputs have landed (the wait on the stage's
mbarrier or cp.async group), after the loop, and at its end, with its SM. The kernel
is checked against the float64 reference on NaN-poisoned outputs and timed as the
bench times it (CUDA-graph replays over input copies larger than twice the L2), with
and without the timestamps, then one replay's timestamps of every call are read back.

Printed per variant: the phases of :func:`summary` (medians, µs), then the median time
each top-level statement after the loop takes, and when iteration 0's inputs landed.
Variants (``TIMELINE_VARIANTS="a;b"`` picks some): the shipped source; BEFORE.cu where given
(the same µGraph from another code generator, for an A/B in one process); the ring's
weight stages moved after the other inputs' copies (:func:`inputs_first`); the epilogue's
divisions approximate (:func:`fast_epilogue`); no block barrier before the cluster
barrier (:func:`one_barrier`); the cluster arrive after the combine relaxed
(:func:`relaxed_arrive`); the combine's loads of every accumulator issued at once
(:func:`one_pass_combine`, an experimental emitter patched in for that variant). Writes the phases to OUT.json and every block's record to OUT-blocks.json. Used for
docs/perf-log.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mirage_cli.codegen import bench, cluster
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.runner import Device, check
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from plan_probe import defines_of

SLOT = 64  # u64 per block record: 0 start, 1 after wait, 2.. iterations, 36 loop end,
# 37 end, 38 id, 40.. the tail's top-level statements, 58/59 iteration 0's two waits
MAX_IT = 32
MAX_MARKS = 16
MAX_SLOTS = 8192
HELPERS = f"""
__device__ unsigned long long mg_tl[{MAX_SLOTS * SLOT}];
__device__ unsigned mg_tl_n;
__device__ __forceinline__ unsigned long long mg_gt() {{
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); return t;
}}
__device__ __forceinline__ unsigned mg_smid() {{
  unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s;
}}
"""
MARKS: list[str] = []  # the tail statements of the last instrumented source
REC = "if (threadIdx.x == 0 && mg_tl_s < {max}) mg_tl[mg_tl_s * {slot} + ({i})] = mg_gt();"


def _matching_brace(lines: list[str], start: int) -> int:
    """The line holding the brace that closes the first ``{`` at or after ``start``."""
    depth, opened = 0, False
    for i in range(start, len(lines)):
        for ch in lines[i]:
            if ch == "{":
                depth, opened = depth + 1, True
            elif ch == "}":
                depth -= 1
                if opened and depth == 0:
                    return i
    raise ValueError("unbalanced braces")


def instrumented(src: str) -> str:
    """``src`` with the first kernel's timestamps (see the module docstring)."""
    lines = src.split("\n")
    k = next(i for i, s in enumerate(lines) if "__global__" in s)
    body = next(i for i in range(k, len(lines)) if lines[i].rstrip().endswith("{"))
    end = _matching_brace(lines, body)
    rec = lambda i: "  " + REC.format(max=MAX_SLOTS, slot=SLOT, i=i)
    out = lines[:body + 1]
    out.append("  unsigned mg_tl_s = 0; if (threadIdx.x == 0) mg_tl_s = atomicAdd(&mg_tl_n, 1u);")
    out.append(rec(0))
    loop_end = None
    marks: list[str] = []
    i = body + 1
    while i < end:
        line = lines[i]
        out.append(line)
        top = line.startswith("  ") and not line.startswith("   ")
        if (loop_end is not None and i > loop_end and top and len(marks) < MAX_MARKS
                and (line.rstrip().endswith(";") or line.strip() == "}")):
            out.append(rec(40 + len(marks)))
            marks.append(line.strip()[:60] if line.strip() != "}" else f"}} (line {i})")
        if line.strip() == "mg_grid_wait();":
            out.append(rec(1))
        if re.match(r"\s*for \(int it = 0; it < \d+; \+\+it\) \{", line) and loop_end is None:
            loop_end = _matching_brace(lines, i)
        if loop_end is not None and i < loop_end and (
                line.strip().startswith("mg_mbar_wait(mg_mbar + (it") or
                line.strip().startswith("mg_cp_async_wait<")):
            # The last of the iteration's waits wins (the later store overwrites).
            out.append(f"    if (it < {MAX_IT}) " + REC.format(max=MAX_SLOTS, slot=SLOT,
                                                             i="2 + it").lstrip())
            slot0 = 58 if line.strip().startswith("mg_cp_async_wait<") else 59
            out.append("    if (it == 0) " + REC.format(max=MAX_SLOTS, slot=SLOT,
                                                        i=slot0).lstrip())
        if loop_end is not None and i == loop_end:
            out.append(rec(36))
        i += 1
    out.append(rec(37))
    out.append(f"  if (threadIdx.x == 0 && mg_tl_s < {MAX_SLOTS}) mg_tl[mg_tl_s * {SLOT} + 38] = "
               "(unsigned long long)mg_smid() | ((unsigned long long)(blockIdx.x + gridDim.x * "
               "(blockIdx.y + gridDim.y * blockIdx.z)) << 16);")
    out += lines[end:]
    text = "\n".join(out)
    MARKS[:] = marks
    marker = "struct __align__(64) mg_tmap { unsigned long long q[16]; };"
    if marker in text:
        return text.replace(marker, marker + HELPERS, 1)
    head, sep, tail = text.partition("extern \"C\" __global__")
    return head + HELPERS + sep + tail


def inputs_first(src: str, keep: int) -> str:
    """``src`` with all but the first ``keep`` of the bulk-copy stages issued before the
    grid-dependency wait moved after the cp.async copies of the loop's other inputs
    (which the wait must precede): iteration 0's activations then no longer queue
    behind the whole ring of weights at the SM."""
    lines = src.split("\n")
    wait = lines.index("  mg_grid_wait();")
    blocks: list[tuple[int, int]] = []
    i = 0
    while i < wait:
        if lines[i] == "  if (threadIdx.x == 0) {" and "mg_tma" in lines[i + 2]:
            j = _matching_brace(lines, i)
            blocks.append((i, j))
            i = j + 1
            continue
        i += 1
    if len(blocks) <= keep:
        raise ValueError("no bulk-copy stages to move")
    moved = [ln for a, b in blocks[keep:] for ln in lines[a:b + 1]]
    drop = {k for a, b in blocks[keep:] for k in range(a, b + 1)}
    acc = next(k for k in range(wait, len(lines)) if lines[k].startswith("  float acc_"))
    out = [ln for k, ln in enumerate(lines[:acc]) if k not in drop] + moved + lines[acc:]
    return "\n".join(out)


def fast_epilogue(src: str) -> str:
    """``src`` with the epilogue's IEEE divisions (and SiLU's) as ``__fdividef``."""
    out = re.sub(r"\((v\d+) / (v\d+)\)", r"__fdividef(\1, \2)", src)
    out = out.replace("return x / (1.0f + mg_exp(-x));", "return __fdividef(x, 1.0f + mg_exp(-x));")
    if out == src:
        raise ValueError("no division to replace")
    return out


def relaxed_arrive(src: str) -> str:
    """``src`` with the cluster arrive after the combine relaxed: it only says that the
    block reads no peer's shared memory any more (it publishes no writes)."""
    helper = 'asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");\n}\n'
    i = src.index("void mg_cluster_arrive()")
    j = src.index(helper, i)
    out = src[:j] + helper.replace(".release", ".relaxed") + src[j + len(helper):]
    if out == src:
        raise ValueError("no cluster arrive")
    return out


ORIGINAL_COMBINE = cluster.combine
MAX_PULLS = 8  # float4 loads per rank a thread may hold in the one-pass combine


def one_pass_combine(k: Any, accs: list) -> tuple[list[str], bool]:
    """The shared-epilogue combine of ``cluster.combine`` with every accumulator's
    16-byte loads of every rank issued before any is used (one distributed-shared-memory
    latency instead of one per accumulator and per batch of 4), where they fit in
    ``MAX_PULLS`` registers' worth; otherwise the code generator's own combine."""
    from mirage_cli import ops
    from mirage_cli.codegen import cluster, reduce
    from mirage_cli.semantics.cuda import c_update

    copies = cluster.ring_copies(k, accs)
    vec = [op for op in accs if op.outputs[0].type.numel % 4 == 0
           and k.tile(op.outputs[0].name).smem_offset % 16 == 0]
    per = {op.outputs[0].name: -(-op.outputs[0].type.numel // 4 // k.T) for op in vec}
    if copies is None or not vec or sum(per.values()) > MAX_PULLS:
        return ORIGINAL_COMBINE(k, accs)
    lines = ["mg_cluster_sync();"]
    for op in accs:
        if op not in vec:
            lines += cluster._full_combine(k, op, copies[op.outputs[0].name])
    loads, sums = [], []
    for a, op in enumerate(vec):
        name, n4 = op.outputs[0].name, op.outputs[0].type.numel // 4
        spec = ops.get(op.op).accum
        fin = reduce.finish_format(k, op)
        dst = f"reinterpret_cast<float4*>(reinterpret_cast<float*>(mg_smem + {copies[name]}))"
        loads.append(f"float4 mg_q{a}[{per[name]}][{k.KS}];")
        for j in range(per[name]):
            e = f"(threadIdx.x + {j * k.T})"
            loads.append(f"if ({e} < {n4}) for (unsigned r = 0; r < {k.KS}; ++r) "
                         f"mg_q{a}[{j}][r] = mg_dsmem_ld4(buf_{name} + 4 * {e}, r);")
            body = [f"if ({e} < {n4}) {{", f"  float4 v = mg_q{a}[{j}][0];",
                    f"  for (unsigned r = 1; r < {k.KS}; ++r) {{"]
            body += ["    " + c_update(f"v.{c}", f"mg_q{a}[{j}][r].{c}", spec.combine)
                     for c in "xyzw"]
            body += ["  }"]
            if fin != "{0}":
                body += [f"  v.{c} = {fin.format(f'v.{c}')};" for c in "xyzw"]
            body += [f"  {dst}[{e}] = v;", "}"]
            sums += body
    lines += ["{"] + ["  " + ln for ln in loads + sums] + ["}"]
    lines += ["mg_cluster_arrive();", "__syncthreads();"]
    for op in accs:
        name = op.outputs[0].name
        lines.append(f"buf_{name} = reinterpret_cast<float*>(mg_smem + {copies[name]});")
    return lines, True


def _emit_with_one_pass(plan_graph: Any) -> str:
    from mirage_cli.codegen import cluster

    cluster.combine = one_pass_combine
    try:
        return emit(lower(plan_graph, "sm_90"))[0]
    finally:
        cluster.combine = ORIGINAL_COMBINE


def one_barrier(src: str) -> str:
    """``src`` without the block barrier just before the cluster barrier (which every
    thread of the block also arrives on, with release and acquire semantics)."""
    out = src.replace("  __syncthreads();\n  mg_cluster_sync();\n", "  mg_cluster_sync();\n")
    if out == src:
        raise ValueError("no block barrier before a cluster barrier")
    return out


GRAPH: list[Graph] = []  # the µGraph being probed (for variants that emit it again)
VARIANTS = {"shipped": lambda s: s, "fast epilogue": fast_epilogue,
            "one barrier": one_barrier,
            "relaxed arrive": relaxed_arrive,
            "one-pass combine": lambda s: _emit_with_one_pass(GRAPH[0]),
            "one-pass combine, relaxed arrive": lambda s: relaxed_arrive(
                _emit_with_one_pass(GRAPH[0])),
            "fast epilogue, one barrier": lambda s: one_barrier(fast_epilogue(s)), "inputs first, 1 stage early": lambda s: inputs_first(s, 1),
            "inputs first": lambda s: inputs_first(s, 0)}
if os.environ.get("TIMELINE_VARIANTS"):  # a semicolon-separated subset, by label
    VARIANTS = {k: VARIANTS[k] for k in os.environ["TIMELINE_VARIANTS"].split(";")}


def _global(drv: Any, module: Any, name: str) -> tuple[int, int]:
    ptr, size = check(drv.cuModuleGetGlobal(module, name.encode()), "cuModuleGetGlobal")
    return int(ptr), int(size)


def timeline(dev: Device, loaded: Any, g: Graph, scale: float, iters: int) -> list[dict]:
    """Every block's record of one replay of the timing graph."""
    drv = dev.drv
    ptr, size = _global(drv, loaded.module, "mg_tl")
    nptr, _ = _global(drv, loaded.module, "mg_tl_n")
    with bench.rotating_buffers(dev, loaded, g, scale) as sets:
        n = len(sets)
        calls = max(n, 8)
        # The calls captured in one CUDA graph, as the timing replays them (the gaps
        # between calls are then the device's, not Python's launch rate).
        check(drv.cuStreamBeginCapture(
            dev.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture")
        for c in range(calls):
            loaded.enqueue(sets[c % n])
        graph = check(drv.cuStreamEndCapture(dev.stream), "cuStreamEndCapture")
        exe = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        try:
            for _ in range(3):
                check(drv.cuGraphLaunch(exe, dev.stream), "cuGraphLaunch")
            check(drv.cuMemsetD32Async(nptr, 0, 1, dev.stream), "cuMemsetD32Async")
            check(drv.cuMemsetD32Async(ptr, 0, size // 4, dev.stream), "cuMemsetD32Async")
            check(drv.cuGraphLaunch(exe, dev.stream), "cuGraphLaunch")
            dev.sync()
        finally:
            drv.cuGraphExecDestroy(exe)
            drv.cuGraphDestroy(graph)
    raw = dev.download(ptr, size).view(np.uint64).reshape(-1, SLOT)
    count = int(dev.download(nptr, 4).view(np.uint32)[0])
    rows = []
    for r in raw[:min(count, MAX_SLOTS)]:
        rows.append({"start": int(r[0]), "waited": int(r[1]),
                     "iters": [int(x) for x in r[2:2 + min(iters, MAX_IT)]], "loop_end": int(r[36]),
                     "end": int(r[37]), "sm": int(r[38]) & 0xFFFF, "block": int(r[38]) >> 16,
                     "marks": [int(x) for x in r[40:40 + len(MARKS)]],
                     "x0": int(r[58]), "w0": int(r[59])})
    return rows


def summary(rows: list[dict], nblocks: int, loop_bytes: int) -> dict[str, float]:
    """Medians over calls of each phase, µs, and the streaming rates.

    Per block: ``wait`` from its start to the end of its grid-dependency wait (blocks
    that start early on SMs the previous call leaves free wait longest), ``first_data``
    from that wait to its first iteration, ``stream`` from its first to its last
    iteration, ``tail`` from the loop's end to the block's end. Per call: ``release``
    from the previous call's last block end to this call's first wait's end (what the
    dependency costs), ``span`` from that to the call's last block end, ``grid_rate``
    the bytes of the loops over the time from the first to the last iteration."""
    # Blocks take their slots in the order they start, and every block of a call starts
    # before any of the next call's (which waits, with the grid-dependency launch, on
    # the SMs the call leaves free): consecutive slots are one call's blocks.
    calls = [rows[i:i + nblocks] for i in range(0, len(rows) - nblocks + 1, nblocks)]
    med = statistics.median
    us = lambda ns: ns / 1000.0
    per: dict[str, list[float]] = {k: [] for k in (
        "wait", "first_data", "stream", "tail", "release", "span", "last_data_spread",
        "grid_rate", "block_rate")}
    prev_end = None
    for blocks in calls:
        first = [b["iters"][0] for b in blocks]
        last = [b["iters"][-1] for b in blocks]
        go = min(b["waited"] for b in blocks)
        n_it = len(blocks[0]["iters"])
        per["wait"].append(us(med([b["waited"] - b["start"] for b in blocks])))
        per["first_data"].append(us(med([f - b["waited"] for f, b in zip(first, blocks)])))
        per["stream"].append(us(med([la - f for la, f in zip(last, first)])))
        per["tail"].append(us(med([b["end"] - b["loop_end"] for b in blocks])))
        per["span"].append(us(max(b["end"] for b in blocks) - go))
        per["last_data_spread"].append(us(max(last) - min(last)))
        per["grid_rate"].append(loop_bytes * len(blocks) * (n_it - 1) /
                                max(1, max(last) - min(first)))
        per["block_rate"].append(med([loop_bytes * (n_it - 1) / max(1, la - f)
                                      for la, f in zip(last, first)]))
        if prev_end is not None:
            per["release"].append(us(go - prev_end))
        prev_end = max(b["end"] for b in blocks)
    return {k: (med(v) if v else float("nan")) for k, v in per.items()}


def tail_steps(rows: list[dict], marks: list[str]) -> list[tuple[str, float]]:
    """Median µs each top-level statement after the loop takes (from the statement
    before it; the first from the loop's end)."""
    med = statistics.median
    prev = [r["loop_end"] for r in rows]
    out = []
    for k, text in enumerate(marks):
        cur = [r["marks"][k] for r in rows]
        out.append((text, med([c - p for c, p in zip(cur, prev)]) / 1000))
        prev = cur
    return out


def _print_tail(rows: list[dict], marks: list[str]) -> None:
    """:func:`tail_steps`, and when iteration 0's two waits (inputs by cp.async, by
    bulk copy) ended after the block's start."""
    for text, us in tail_steps(rows, marks):
        print(f"    +{us:5.2f} us  {text}")
    for key, what in (("x0", "cp.async wait"), ("w0", "mbarrier wait")):
        got = [r[key] - r["start"] for r in rows if r[key]]
        if got:
            print(f"    iteration 0 {what}: {statistics.median(got) / 1000:.2f} us "
                  "after the block's start")


def _probe(dev: Device, plan: Any, prog: Graph, g: Graph, scale: float, src: str,
           nblocks: int, iters: int, label: str, shipped_us: float | None) -> dict:
    """Check, time (with the timestamps) and read back one variant's timeline."""
    tl_src = instrumented(src)
    marks = list(MARKS)
    plain = dev.load(plan, compile_cuda(src, "variant.cu", dev.arch).cubin)
    try:
        plain_us = bench.time_loaded(dev, plain, g, 30, scale)
    finally:
        plain.unload()
    loaded = dev.load(plan, compile_cuda(tl_src, "timeline.cu", dev.arch).cubin)
    try:
        ins = bench.scaled_inputs(g, 0, scale)
        chk = bench.compare(loaded.run(ins), bench.reference_outputs(prog, 0, scale),
                            list(g.outputs))
        us = bench.time_loaded(dev, loaded, g, 30, scale)
        rows = timeline(dev, loaded, g, scale, iters)
    finally:
        loaded.unload()
    # Bytes each block's loop streams per iteration: the inputs' bytes over blocks
    # and iterations (the weights dominate).
    loop_bytes = bench.input_bytes(prog) // nblocks // iters
    s = summary(rows, nblocks, loop_bytes)
    print(f"{label}: {plain_us:.2f} us (shipped, bench timing: {shipped_us or float('nan'):.2f}); "
          f"with timestamps {us:.2f} us ({'ok' if chk.ok else 'FAIL'}, err {chk.rel_err:.1e}), "
          f"{nblocks} blocks x {iters} it", flush=True)
    print("  " + "  ".join(f"{k} {v:.2f}" if "rate" not in k else f"{k} {v:.0f} GB/s"
                           for k, v in s.items()), flush=True)
    _print_tail(rows, marks)
    return {"label": label, "us": plain_us, "us_timed": us, "ok": chk.ok,
            "rel_err": chk.rel_err, "blocks": nblocks, "iters": iters, "summary": s,
            "tail_steps_us": tail_steps(rows, marks), "rows": rows}


def main(argv: list[str]) -> int:
    out_path, specs = argv[0], argv[1:]
    dev = Device(0)
    results = []
    for spec in specs:
        prog_path, sizes, graph_path = spec.split(":")[:3]
        defines = defines_of(sizes)
        prog = load_graph(prog_path, defines)
        g = load_graph(graph_path, None)
        plan = lower(g, dev.arch)
        cu, _ = emit(plan)
        k0 = plan.kernels[0]
        nblocks = k0.grid[0] * k0.grid[1] * k0.grid[2]
        GRAPH[:] = [g]
        before = spec.split(":")[3] if spec.count(":") >= 3 else None
        scale = bench.input_scale(prog)
        base = bench._measure(dev, "shipped", g, prog, 30, scale)
        iters = int(re.search(r"for \(int it = 0; it < (\d+);", cu).group(1))
        variants = dict(VARIANTS)
        if before:  # another code generator's source of the same µGraph, for an A/B
            variants = {"before": lambda s, p=before: Path(p).read_text(), **variants}
        for label, rewrite in variants.items():
            try:
                src = rewrite(cu)
            except ValueError as e:
                print(f"{prog.name} b={defines['batch']} {label}: {e}")
                continue
            results.append(_probe(dev, plan, prog, g, scale, src, nblocks, iters,
                                  f"{spec} {label}", base.us if label == "shipped" else None))
    with open(out_path, "w") as f:  # the phases; every block's record beside them
        json.dump([{k: v for k, v in r.items() if k != "rows"} for r in results], f, indent=1)
    with open(out_path.removesuffix(".json") + "-blocks.json", "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
