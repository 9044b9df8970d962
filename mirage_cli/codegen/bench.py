"""`mirage bench --gpu N`: correctness and speed of the µGraphs `mirage opt` ships and of
the hand-written fused µGraphs, against the unfused lowering and PyTorch, measured the
same way in one process (DESIGN.md §7).

For each example program (``examples/*.mir``) and each batch size, the variants are the
hand-written fused µGraphs (``examples/mugraphs/<program>*.mir``) and the candidates a
caller supplies (``mirage bench`` passes the first ``--top`` of `mirage opt`'s ranked,
verified candidates: :func:`opt_variants`; with ``--mirage-ckpt DIR``, every candidate
of Mirage's own checkpoints for the program: :func:`mirage_variants`). Each is lowered,
compiled with NVRTC for the device, run on random inputs with NaN-poisoned outputs and
checked against the float64 reference interpreter (relative L2 error ≤ 1e-2, no NaN);
then timed as CUDA-graph replays of calls rotating over input copies that total more
than twice the L2 cache (median of the replays). PyTorch eager and ``torch.compile`` of the program are timed
the same way when torch is importable, and so is PyTorch's fused attention
(``scaled_dot_product_attention``) where the program is plain softmax attention
(:func:`attention_pattern`). With ``per_kernel``, each kernel of a variant is also timed
alone (:func:`kernel_times`) and its achieved TFLOP/s and GB/s derived from the cost
model's FLOP and DRAM byte counts (:func:`with_rates`). The memory floor divides the
bytes of inputs and outputs by the bandwidth of a streaming copy kernel (:mod:`.copybw`);
the results are rendered by :mod:`.benchreport`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mirage_cli import interp, ops
from mirage_cli.codegen import copybw
from mirage_cli.codegen.copybw import Bandwidth
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.plan import Launch
from mirage_cli.codegen.runner import Buffers, Device, Loaded
from mirage_cli.console import info, warn
from mirage_cli.diagnostics import MirageError
from mirage_cli.importers.mirage import import_checkpoint
from mirage_cli.ir import Graph

TOLERANCE = 1e-2


@dataclass
class Check:
    ok: bool
    rel_err: float
    reason: str = ""


def compare(outs: dict[str, np.ndarray], ref: dict[str, np.ndarray], names: list[str]
            ) -> Check:
    """Outputs by position against the reference: rel L2 error ≤ 1e-2, no NaN."""
    worst = 0.0
    for name, rname in zip(names, ref):
        o, r = outs[name].astype(np.float64), ref[rname]
        if np.isnan(o).any():
            bad = int(np.isnan(o).sum())
            return Check(False, math.nan, f"{name}: {bad} of {o.size} elements NaN "
                                          f"(unwritten or invalid)")
        denom = float(np.linalg.norm(r))
        err = float(np.linalg.norm(o - r)) / (denom if denom > 0 else 1.0)
        worst = max(worst, err)
    ok = worst <= TOLERANCE
    return Check(ok, worst, "" if ok else f"relative L2 error {worst:.3g} > {TOLERANCE}")


def build(dev: Device, g: Graph) -> Loaded:
    prog = lower(g, dev.arch)
    cubin = _CUBINS.get((g, dev.arch))
    if cubin is None:
        cu, _ = emit(prog)
        cubin = compile_cuda(cu, f"{prog.name}.cu", dev.arch).cubin
    return dev.load(prog, cubin)


# Cubins compiled ahead by :func:`precompile`, by (µGraph, arch).
_CUBINS: dict[tuple[Graph, str], bytes] = {}


def precompile(graphs: list[Graph], arch: str, workers: int) -> None:
    """NVRTC-compile every graph for ``arch`` on ``workers`` processes ahead of the
    measurements (measured selection's compiler), which then only load. What does not
    compile is left for :func:`build` to report where the bench measures it."""
    from mirage_cli.codegen.cubins import compile_all

    todo = list(dict.fromkeys(g for g in graphs if (g, arch) not in _CUBINS))
    try:
        cubins = compile_all([(g, arch) for g in todo], workers)
    except Exception as e:  # noqa: BLE001 - only time is lost: build() compiles the rest
        warn(f"compiling ahead failed ({type(e).__name__}: {e}); compiling one at a time")
        return
    for g, cubin in zip(todo, cubins):
        if isinstance(cubin, bytes):
            _CUBINS[(g, arch)] = cubin


def scaled_inputs(g: Graph, seed: int, scale: float) -> dict[str, np.ndarray]:
    """Random normal inputs times ``scale`` (a power of two), rounded to each dtype.

    Read-only arrays, kept for the inputs of one program at a time: every variant of a
    program (the bench's rows, measured selection's dozens of tunings) draws the same
    ones, so drawing them once per program saves seconds per variant; holding only one
    program's keeps the memory bounded."""
    sig = tuple((i.value.name, i.value.type) for i in g.inputs)
    key = (sig, seed, scale)
    hit = _INPUTS.get(key)
    if hit is None:
        from mirage_cli.dtypes import round_to

        if any(k[0] != sig for k in _INPUTS):
            _INPUTS.clear()
        ins = interp.random_inputs(g, seed)
        hit = {i.value.name: round_to(i.value.type.dtype, ins[i.value.name] * scale)
               for i in g.inputs}
        for a in hit.values():
            a.flags.writeable = False  # shared between callers: nobody may write
        _INPUTS[key] = hit
    return hit


_INPUTS: dict[tuple[Any, int, float], dict[str, np.ndarray]] = {}


def reference_outputs(g: Graph, seed: int, scale: float) -> dict[str, np.ndarray]:
    """The float64 reference outputs of ``g`` on ``scaled_inputs(g, seed, scale)``
    (cached: the program's reference serves every variant checked against it)."""
    key = (g, seed, scale)
    hit = _REFERENCES.get(key)
    if hit is None:
        hit = interp.run(g, scaled_inputs(g, seed, scale), "float64")
        _remember(key, hit)
    return hit


def _remember(key: tuple[Graph, int, float], outs: dict[str, np.ndarray]) -> None:
    """Keep ``outs`` as the reference under ``key``; the oldest of more than eight goes
    (a layer's outputs are small, but its programs' references need not all stay)."""
    _REFERENCES[key] = outs
    while len(_REFERENCES) > 8:
        del _REFERENCES[next(iter(_REFERENCES))]


_REFERENCES: dict[tuple[Graph, int, float], dict[str, np.ndarray]] = {}


def input_scale(g: Graph, seed: int = 0) -> float:
    """The largest power-of-two scale (≤ 1) of standard normal inputs on which ``g``,
    evaluated in its own dtypes (f32 accumulation), agrees with its float64 value to
    within a tenth of the check's tolerance. Example: exp(Q @ K) without a max
    subtraction overflows f16 on unit-variance inputs; such inputs would test the
    program's precision, not the generated code."""
    scale = 1.0
    for _ in range(8):
        native = interp.run(g, scaled_inputs(g, seed, scale), "native")
        exact = reference_outputs(g, seed, scale)
        if compare(native, exact, list(g.outputs)).rel_err <= TOLERANCE / 10:
            return scale
        scale /= 2
    return scale


def scale_and_reference(g: Graph, seed: int = 0) -> tuple[float, dict[str, np.ndarray]]:
    """:func:`input_scale` of ``g`` and its float64 reference outputs at that scale: one
    program's share of the work :class:`References` does ahead."""
    scale = input_scale(g, seed)
    return scale, reference_outputs(g, seed, scale)


# Programs whose references are worth a worker process (a decoder layer's weights).
AHEAD_BYTES = 64 << 20


class References:
    """The input scale and float64 reference of each program a bench measures, computed
    ahead on ``workers`` spawned processes while the device measures the programs
    before it (a decoder layer's take tens of seconds on one core: the native and
    float64 interpreter runs of :func:`input_scale`). Programs with fewer input bytes
    than :data:`AHEAD_BYTES` (milliseconds each, against a second to spawn a worker),
    and all of them with one worker or one such program, are computed in this process
    when first asked for. Either way the values are :func:`input_scale`'s and
    :func:`reference_outputs`': only where they are computed changes."""

    def __init__(self, programs: Sequence[Graph], workers: int) -> None:
        self._futures: dict[Graph, Any] = {}
        self._pool = None
        todo = [g for g in dict.fromkeys(programs) if input_bytes(g) >= AHEAD_BYTES]
        if workers > 1 and len(todo) > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # Spawned, not forked: the caller may already hold a CUDA context.
            self._pool = ProcessPoolExecutor(max_workers=min(workers, len(todo)),
                                             mp_context=multiprocessing.get_context("spawn"))
            self._futures = {g: self._pool.submit(scale_and_reference, g) for g in todo}

    def scale(self, g: Graph) -> float:
        """The input scale of ``g``; its reference is then cached for
        :func:`reference_outputs`."""
        fut = self._futures.pop(g, None)
        if fut is None:
            return input_scale(g)
        try:
            scale, outs = fut.result()
        except Exception as e:  # noqa: BLE001 - a lost worker costs time, not the row
            info(f"  computing the reference ahead failed ({type(e).__name__}: {e}); "
                 f"computing it here")
            return input_scale(g)
        _remember((g, 0, scale), outs)
        return scale

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._futures.values():
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


def check_graph(dev: Device, g: Graph, seed: int = 0, reference: Graph | None = None,
                scale: float | None = None) -> tuple[Loaded, Check]:
    """Compile and run ``g`` once on random inputs; compare with the float64
    reference of ``reference`` (default ``g`` itself), inputs matched by position."""
    ref_g = reference or g
    if scale is None:
        scale = input_scale(ref_g, seed)
    loaded = build(dev, g)
    ins = scaled_inputs(g, seed, scale)
    # Inputs match by position: same shapes in the same order draw the same values.
    assert [i.value.type for i in g.inputs] == [i.value.type for i in ref_g.inputs]
    ref = reference_outputs(ref_g, seed, scale)
    outs = loaded.run(ins)
    return loaded, compare(outs, ref, list(g.outputs))


def input_bytes(g: Graph) -> int:
    return sum(i.value.type.nbytes for i in g.inputs)


def copies_needed(dev: Device, g: Graph) -> int:
    """Input copies whose total exceeds twice the L2 cache."""
    return max(2, 2 * dev.l2_bytes // max(1, input_bytes(g)) + 1)


@contextlib.contextmanager
def rotating_buffers(dev: Device, loaded: Loaded, g: Graph, scale: float
                     ) -> Iterator[list[Buffers]]:
    """Buffer sets whose inputs are copies at distinct addresses totalling more than
    twice the L2 (outputs and workspace are shared, as in a real model), inputs
    uploaded; freed on exit. Allocated once for every timing of one loaded program. Every copy holds the
    checked inputs (seed 0): what defeats the L2 is the copies' addresses, and no
    kernel's time depends on the values, while drawing another set of a decoder
    layer's inputs takes seconds (300 million normals at batch 16)."""
    n = copies_needed(dev, g)
    base = loaded.alloc()
    extra = [{b.name: dev.alloc(b.type.nbytes) for b in loaded.prog.inputs}
             for _ in range(n - 1)]
    sets = [base] + [Buffers({**base.ptrs, **ptrs}, base.workspace) for ptrs in extra]
    ins = scaled_inputs(g, 0, scale)
    try:
        for bufs in sets:
            loaded.upload_inputs(bufs, ins)
        dev.sync()
        yield sets
    finally:
        for ptrs in extra:
            for p in ptrs.values():
                dev.free(p)
        loaded.free(base)


def time_loaded(dev: Device, loaded: Loaded, g: Graph, replays: int, scale: float = 1.0
                ) -> float:
    """Median µs per call; calls rotate over input copies (:func:`rotating_buffers`)."""
    with rotating_buffers(dev, loaded, g, scale) as sets:
        n = len(sets)
        return dev.time_graph(lambda i: loaded.enqueue(sets[i % n]), max(n, 8), replays)


def kernel_times(dev: Device, loaded: Loaded, g: Graph, replays: int, scale: float = 1.0
                 ) -> dict[str, float]:
    """Median µs of each kernel of ``loaded`` launched alone, by kernel name, timed as
    :func:`time_loaded` times the whole call (CUDA-graph replays over the same rotating
    input copies). A later kernel reads intermediates no kernel wrote: the generated
    kernels' times do not depend on the values they read. Alone, a kernel neither
    overlaps its neighbours (grid-dependency waits) nor finds their outputs in L2, so
    the times need not sum to the call's."""
    launches = [s for s in loaded.prog.steps if isinstance(s, Launch)]
    out: dict[str, float] = {}
    with rotating_buffers(dev, loaded, g, scale) as sets:
        n = len(sets)
        for step in launches:
            out[step.kernel] = dev.time_graph(
                lambda i, s=step: loaded.enqueue(sets[i % n], (s,)), max(n, 8), replays)
    return out



# -- achieved rates per kernel ------------------------------------------------------------


def model_counts(g: Graph, launch_ops: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(FLOPs, DRAM bytes) of each launch of ``g`` (the kernel operators each runs, in
    launch order: ``Program.launch_ops``), as the search's cost model counts them
    (:func:`~mirage_cli.search.cost.kernel_costs`): the rates are then the model's own
    terms over measured time, which is what shows where the model and the device
    disagree."""
    from mirage_cli.search.cost import kernel_costs

    ks = kernel_costs(g)
    return [(sum(ks[i].flops for i in run), sum(ks[i].dram_bytes for i in run))
            for run in launch_ops]


def launch_kinds(g: Graph, launch_ops: Sequence[Sequence[int]]) -> list[str]:
    """The operator kind of each launch: its kernels' kinds, joined by '+'."""
    return ["+".join(g.ops[i].op for i in run) for run in launch_ops]


def achieved(flops: int, dram_bytes: int, us: float | None
             ) -> tuple[float | None, float | None]:
    """TFLOP/s and GB/s of ``flops`` and ``dram_bytes`` done in ``us`` µs (``None``:
    no time to divide by)."""
    if us is None or not us > 0:
        return None, None
    return flops / us / 1e6, dram_bytes / us / 1e3


def with_rates(kernels: list[dict[str, Any]], op_kinds: list[str],
               counts: list[tuple[int, int]] | None, times: dict[str, float]
               ) -> list[dict[str, Any]]:
    """Kernel records (:func:`kernel_records`, in launch order) with each kernel's
    operator kind, its own time (``us``, from :func:`kernel_times`), the model's
    ``flops`` and ``dram_bytes`` and the rates they give (``tflop_s``, ``gb_s``);
    ``None`` for what is unknown (``counts`` is ``None`` when the model could not
    price the µGraph). Kinds and counts are by position, one per kernel: lists of
    another length are not matched up at all."""
    if counts is not None and len(counts) != len(kernels):
        counts = None
    out = []
    for i, k in enumerate(kernels):
        us = times.get(k["name"])
        flops, dram = counts[i] if counts is not None else (None, None)
        tflop_s, gb_s = (None, None) if flops is None or dram is None else \
            achieved(flops, dram, us)
        out.append({**k, "op": op_kinds[i] if len(op_kinds) == len(kernels) else None,
                    "us": us, "flops": flops, "dram_bytes": dram, "tflop_s": tflop_s,
                    "gb_s": gb_s})
    return out


# -- PyTorch baselines ---------------------------------------------------------------


def torch_fn(g: Graph) -> Callable[..., Any]:
    """The program as a PyTorch function of its inputs (pre-defined operators only)."""
    import torch

    def fn(*xs: Any) -> Any:
        env = {i.value.name: x for i, x in zip(g.inputs, xs)}
        for op in g.ops:
            spec = ops.get(op.op).cuda
            if spec.torch is None:
                raise ValueError(f"no PyTorch form for '{op.op}'")
            env[op.outputs[0].name] = spec.torch(torch, [env[i] for i in op.inputs],
                                                 ops.get(op.op).attr_values(op.attrs))
        return tuple(env[n] for n in g.outputs)
    return fn


@dataclass(frozen=True)
class Attention:
    """A program that is plain softmax attention, ``O = softmax(scale * (Q @ K), dim=-1)
    @ V``, by the names of its inputs: ``q`` [..., L, E], ``k`` stored transposed
    [..., E, S] (as the examples store it), ``v`` [..., S, Ev], leading dims equal."""

    q: str
    k: str
    v: str
    scale: float


# The operators of plain softmax attention, in program order, with and without the scale.
_ATTENTION_KINDS = (("matmul", "mul_scalar", "softmax", "matmul"),
                    ("matmul", "softmax", "matmul"))


def attention_pattern(g: Graph) -> Attention | None:
    """``g`` as :class:`Attention` if it is exactly ``A = matmul(Q, K)``, optionally
    ``S = mul_scalar(A)``, ``P = softmax(S, dim=<last>)``, ``O = matmul(P, V)`` with Q,
    K, V program inputs of one dtype and O the only output; else ``None``. Exactly:
    SDPA computes that program, the softmax with its max subtracted, so one that only
    resembles it must not get the baseline (gqa's exp / sum / div has no max
    subtraction, and overflows f16 where softmax does not). There is no transpose
    operator, so K is always the transposed [..., E, S] form."""
    if tuple(op.op for op in g.ops) not in _ATTENTION_KINDS or len(g.outputs) != 1:
        return None
    first, *scaled, soft, last = g.ops
    chain, scale = first.outputs[0].name, 1.0
    for op in scaled:
        if op.inputs != (chain,):
            return None
        scale, chain = float(ops.get(op.op).attr_values(op.attrs)["scalar"]), op.outputs[0].name
    probs = soft.outputs[0]
    if (soft.inputs != (chain,) or ops.get("softmax").attr_values(soft.attrs)["dim"]
            != probs.type.rank - 1 or last.inputs[0] != probs.name
            or g.outputs != (last.outputs[0].name,)):
        return None
    (q, k), v = first.inputs, last.inputs[1]
    inputs = {i.value.name: i.value.type for i in g.inputs}
    if not {q, k, v} <= inputs.keys():
        return None
    tq, tk, tv = inputs[q], inputs[k], inputs[v]
    if (not tq.rank == tk.rank == tv.rank >= 2 or len({tq.dtype, tk.dtype, tv.dtype}) != 1
            or not tq.shape[:-2] == tk.shape[:-2] == tv.shape[:-2]):
        return None
    return Attention(q, k, v, scale)


def sdpa_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A rank-2 to rank-4 attention operand's shape as SDPA takes it, (N, H, L, E): the
    leading dims are batch dims, a head dim of 1 is added where there are fewer than
    two."""
    lead = shape[:-2]
    return lead + (1,) * (2 - len(lead)) + shape[-2:] if len(lead) < 2 else shape


def sdpa_fn(g: Graph, att: Attention) -> Callable[..., Any]:
    """PyTorch's fused attention on ``g``'s inputs as :func:`sdpa_inputs` lays them out
    (K as [.., seq, d]): ``scaled_dot_product_attention(q, k, v, scale=att.scale)`` on
    views of them, its output in the program's output shape."""
    import torch

    names = g.input_names
    iq, ik, iv = (names.index(n) for n in (att.q, att.k, att.v))
    out_shape = g.tensor_types()[g.outputs[0]].shape

    def fn(*xs: Any) -> Any:
        q, k, v = (x.view(sdpa_shape(tuple(x.shape))) for x in (xs[iq], xs[ik], xs[iv]))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=att.scale)
        return (o.reshape(out_shape),)
    return fn


def sdpa_inputs(g: Graph, att: Attention) -> Callable[[list[Any]], list[Any]]:
    """The inputs as SDPA takes them, made once outside the timed region: K, which the
    program stores transposed ([.., d, seq]), copied to [.., seq, d], the layout of a
    model's KV cache. As a transposed view (last dimension not contiguous) PyTorch's
    fused attention kernels refuse it and SDPA falls back to its unfused path, which
    would time a layout, not the attention."""
    ik = g.input_names.index(att.k)

    def prepare(xs: list[Any]) -> list[Any]:
        out = list(xs)
        out[ik] = xs[ik].transpose(-1, -2).contiguous()
        return out
    return prepare


def time_torch(dev: Device, g: Graph, fn: Callable[..., Any], replays: int, scale: float,
               prepare: Callable[[list[Any]], list[Any]] | None = None
               ) -> tuple[float, Check]:
    """``fn``'s median µs per call (CUDA-graph replays over input copies) and its check
    against the float64 reference; ``prepare`` lays each input set out for ``fn``
    before anything is timed."""
    import torch

    lay = prepare or (lambda xs: xs)

    dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    n = copies_needed(dev, g)
    calls = max(n, 8)
    # The copies hold the checked inputs, as the generated code's (rotating_buffers).
    ins0 = scaled_inputs(g, 0, scale)
    sets = [lay([torch.from_numpy(ins0[i.value.name].copy()).to("cuda", dt[i.value.type.dtype.value])
                 for i in g.inputs]) for _ in range(n)]
    ref = reference_outputs(g, 0, scale)
    with torch.no_grad():
        outs = fn(*lay([torch.from_numpy(ins0[i.value.name].copy()).to("cuda", dt[i.value.type.dtype.value])
                        for i in g.inputs]))
        torch.cuda.synchronize()
        got = {name: o.float().cpu().numpy() for name, o in zip(g.outputs, outs)}
        chk = compare(got, ref, list(g.outputs))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(*sets[0])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*sets[i % n])
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph, sets
    return statistics.median(times), chk


# -- the benchmark ---------------------------------------------------------------------


@dataclass
class Row:
    """One (benchmark, batch, variant) of the results; baselines are columns.

    ``kernels`` holds each kernel of the variant as timed: launch configuration and its
    plan (``None`` where the code generator records none), and when measured per kernel
    its own µs and achieved rates (:func:`with_rates`); ``bandwidth`` is the copy
    kernel's bytes per second that ``floor_us`` divides by; ``predicted_us`` is the
    search's cost-model time of an ``opt`` candidate; ``search`` says how it was found."""

    benchmark: str
    batch: int
    variant: str
    us: float | None
    ok: bool
    rel_err: float | None
    reason: str = ""
    floor_us: float = 0.0
    baselines: dict[str, float | None] = field(default_factory=dict)
    bandwidth: float = 0.0
    kernels: list[dict[str, Any]] = field(default_factory=list)
    shipped: bool = False
    predicted_us: float | None = None
    search: dict[str, Any] | None = None


@dataclass(frozen=True)
class Variant:
    """A µGraph to time for one program and batch: hand-written or found by the search.

    ``graph`` is ``None`` when there is nothing to time; ``reason`` then says why, and
    ``ok`` whether that is a failure (the search found nothing) or not (a fixed grid that
    does not tile this batch)."""

    label: str
    graph: Graph | None
    reason: str = ""
    ok: bool = True
    shipped: bool = False
    predicted_us: float | None = None
    search: dict[str, Any] | None = None


Candidates = Callable[[Graph], list[Variant]]
# (program, candidate) -> (certified equivalent?, what the verifier did, as JSON data)
Verify = Callable[[Graph, Graph], tuple[bool, dict[str, Any]]]
# (example program file, batch, program at that batch) -> the variants to time
Checkpoints = Callable[[Path, int, Graph], list[Variant]]


def discover(root: Path) -> list[tuple[Path, list[Path]]]:
    """Example programs and their fused µGraphs, by file name: those of
    ``root/examples``, or where ``root`` has no ``examples/``, ``root``'s own programs
    (``--root examples/models``)."""
    out = []
    where = root / "examples" if (root / "examples").is_dir() else root
    for prog in sorted(where.glob("*.mir")):
        fused = sorted(p for p in (where / "mugraphs").glob(f"{prog.stem}*.mir")
                       if p.stem == f"{prog.stem}_fused" or p.stem.startswith(f"{prog.stem}_fused"))
        out.append((prog, fused))
    return out


def hand_written(paths: list[Path], defines: dict[str, int],
                 load: Callable[[Path, dict[str, int]], Graph]) -> list[Variant]:
    """The hand-written fused µGraphs at these sizes; one whose fixed grid does not tile
    them is rejected with a diagnostic and reported as not applicable (not as a wrong
    result)."""
    out = []
    for fp in paths:
        try:
            out.append(Variant(fp.stem, load(fp, defines)))
        except MirageError as e:
            out.append(Variant(fp.stem, None, "n/a: " + e.message))
    return out


def kernel_records(loaded: Loaded) -> list[dict[str, Any]]:
    """Each kernel of a loaded program: launch configuration and plan, as JSON data."""
    return [{"name": k.name, "grid": list(k.grid), "threads": k.threads,
             "dynamic_smem_bytes": k.smem_bytes, "scratch_bytes": k.scratch_bytes,
             "plan": plan_json(getattr(k, "plan", None))}
            for k in loaded.prog.kernels]


def plan_json(plan: Any) -> Any:
    """A kernel's plan as JSON data: a dict as is, an object by its ``as_json``, a
    dataclass by its fields; ``None`` where the kernel carries no plan."""

    if plan is None or isinstance(plan, dict):
        return plan
    if callable(getattr(plan, "as_json", None)):
        return plan.as_json()
    if dataclasses.is_dataclass(plan) and not isinstance(plan, type):
        return dataclasses.asdict(plan)
    return str(plan)


@dataclass
class Measured:
    us: float | None
    check: Check
    kernels: list[dict[str, Any]] = field(default_factory=list)


def _measure(dev: Device, label: str, g: Graph, ref: Graph, replays: int, scale: float,
             per_kernel: bool = False) -> Measured:
    """Check ``g`` against ``ref`` and, if correct, time it; with ``per_kernel``, also
    each of its kernels alone (:func:`kernel_times`, :func:`with_rates`)."""
    try:
        loaded, chk = check_graph(dev, g, seed=0, reference=ref, scale=scale)
    except Exception as e:  # noqa: BLE001 - reported in the table, never hidden
        info(f"  {label}: FAIL {type(e).__name__}: {e}")
        return Measured(None, Check(False, math.nan, f"{type(e).__name__}: {e}"))
    try:
        kernels = kernel_records(loaded)
        us = time_loaded(dev, loaded, g, replays, scale) if chk.ok else None
        if per_kernel and chk.ok:
            times = kernel_times(dev, loaded, g, replays, scale)
            runs = loaded.prog.launch_ops
            kernels = with_rates(kernels, launch_kinds(g, runs), _counts(g, runs), times)
    finally:
        loaded.unload()
    info(f"  {label}: {'ok' if chk.ok else 'FAIL ' + chk.reason} rel_err={chk.rel_err:.2e}"
         + (f" {us:.1f} us" if us is not None else ""))
    for k in kernels if per_kernel and chk.ok else ():
        info(f"    {k['name']}: {_rates_text(k)}")
    return Measured(us, chk, kernels)


def _counts(g: Graph, launch_ops: Sequence[Sequence[int]]) -> list[tuple[int, int]] | None:
    """:func:`model_counts`, or ``None`` (rates unknown) where the model fails: the
    rates are information, never a reason to lose a measurement."""
    try:
        return model_counts(g, launch_ops)
    except Exception as e:  # noqa: BLE001
        info(f"    cost model: {type(e).__name__}: {e} (no rates)")
        return None


def _rates_text(k: dict[str, Any]) -> str:
    """A timed kernel's µs and rates, for the progress log."""
    us, tf, gb = k.get("us"), k.get("tflop_s"), k.get("gb_s")
    return ("-" if us is None else f"{us:.2f} us") + (
        "" if tf is None or gb is None else f" {tf:.2f} TFLOP/s {gb:.0f} GB/s")


def floor_us(prog: Graph, bandwidth: float) -> float:
    """Minimum bytes (every input read once, every output written once) / bandwidth."""
    nbytes = input_bytes(prog) + sum(prog.tensor_types()[n].nbytes for n in prog.outputs)
    return nbytes / bandwidth * 1e6


def run_bench(dev: Device | Callable[[], Device], pairs: list[tuple[Path, list[Path]]],
              batches: tuple[int, ...] | None,
              replays: int = 30, use_torch: bool = True, use_compile: bool = True,
              load: Callable[[Path, dict[str, int]], Graph] | None = None,
              candidates: Candidates | None = None, bandwidth: Bandwidth | None = None,
              checkpoints: Checkpoints | None = None, per_kernel: bool = False,
              workers: int = 1,
              progress: Callable[[Bandwidth, list[Row], int, int], None] | None = None,
              ) -> tuple[Bandwidth, list[Row]]:
    """Measure every program at every batch (``batches`` None: each at its own sizes,
    the batch its ``batch`` parameter's value): baselines, hand-written fused µGraphs, the
    variants ``candidates`` gives for the program (the search's, see
    :func:`opt_variants`) and those ``checkpoints`` gives for the example and batch
    (Mirage's, see :func:`mirage_variants`). ``dev`` may be a function that opens the
    device: it is then called after the searches and verifications. With
    ``per_kernel``, every correct variant's kernels are also timed one by one (a
    timing per kernel: off by default). With ``workers`` > 1 every program and variant
    is compiled ahead on that many processes (:func:`precompile`). ``progress`` is
    called after each program and batch with the rows so far, the pairs done and their
    number (the command rewrites its reports, so a run stopped early keeps what it
    measured). Returns the bandwidth that defines the floor and the rows."""
    from mirage_cli.loading import load_graph

    load = load or (lambda p, d: load_graph(str(p), d))
    # Every search runs before the first measurement: its worker processes are forked,
    # which is safe before the CUDA context and PyTorch (their threads) start, not after:
    # a search forked from a multi-threaded process found nothing on an H200 machine.
    work: list[tuple[Graph, int, list[Variant]]] = []
    for prog_path, fused_paths in pairs:
        for size in batches or (None,):
            defines = {} if size is None else {"batch": size}
            prog = _sized(prog_path, defines, load)
            if prog is None:
                break
            batch = size if size is not None else int(dict(prog.params).get("batch", 0))
            variants = hand_written(fused_paths, defines, load)
            if candidates is not None:
                info(f"{prog.name} batch={batch}: the candidates of mirage opt")
                variants += candidates(prog)
            if checkpoints is not None:
                variants += checkpoints(prog_path, batch, prog)
            work.append((prog, batch, variants))
    refs = References([prog for prog, _, _ in work], workers)
    try:
        return _measure_all(dev, work, refs, replays, use_torch, use_compile, bandwidth,
                            per_kernel, workers, progress)
    finally:
        refs.close()


def _measure_all(dev: Device | Callable[[], Device], work: list[tuple[Graph, int, list[Variant]]],
                 refs: References, replays: int, use_torch: bool, use_compile: bool,
                 bandwidth: Bandwidth | None, per_kernel: bool, workers: int,
                 progress: Callable[[Bandwidth, list[Row], int, int], None] | None,
                 ) -> tuple[Bandwidth, list[Row]]:
    """:func:`run_bench` once every search is done: compile, open the device, measure
    each program and batch in turn."""
    # A CUDA context starts driver threads: open it only once no more workers fork.
    dev = dev() if callable(dev) else dev
    if workers > 1:
        graphs = [g for prog, _, variants in work
                  for g in [prog] + [v.graph for v in variants if v.graph is not None]]
        info(f"compiling {len(graphs)} programs and variants with {workers} workers")
        precompile(graphs, dev.arch, workers)
    bw = bandwidth or copybw.measure(dev)
    info(f"device {dev.name} ({dev.arch}), L2 {dev.l2_bytes >> 20} MiB, copy kernel "
         f"{bw.copy_kernel / 1e9:.0f} GB/s ({bw.launch}), cuMemcpyDtoDAsync "
         f"{bw.memcpy / 1e9:.0f} GB/s (bytes read + written)")
    rows: list[Row] = []
    why_not = torch_unavailable() if use_torch else None
    torch_ok = use_torch and why_not is None
    if why_not:
        # Numbers without the baselines read as absolute: say so, loudly.
        warn(f"PyTorch baselines skipped: {why_not}")
    for done, (prog, batch, variants) in enumerate(work, 1):
        rows += _bench_one(dev, prog, batch, variants, bw.copy_kernel, replays, torch_ok,
                           use_compile, per_kernel, refs.scale(prog))
        if progress is not None and done < len(work):
            progress(bw, rows, done, len(work))
    return bw, rows


def _sized(prog_path: Path, defines: dict[str, int],
           load: Callable[[Path, dict[str, int]], Graph]) -> Graph | None:
    """The program at ``defines``' batch, or None (with a warning) where it has no
    ``batch`` parameter for ``--batch`` to set: one such program is left out, not the
    end of a bench over many (the searches of the others may already have run); any
    other error in the program is reported."""
    try:
        return load(prog_path, defines)
    except MirageError:
        if "batch" in dict(load(prog_path, {}).params):
            raise
    warn(f"{prog_path}: left out: the program has no 'batch' parameter for --batch to set "
         f"(declare one, e.g. 'batch = 1', and use it in the input shapes)")
    return None


def _bench_one(dev: Device, prog: Graph, batch: int, variants: list[Variant], bw: float,
               replays: int, torch_ok: bool, use_compile: bool, per_kernel: bool,
               scale: float) -> list[Row]:
    """The rows of one program at one batch, its inputs scaled by ``scale``
    (:func:`input_scale`)."""
    floor = floor_us(prog, bw)
    info(f"{prog.name} batch={batch} (memory floor {floor:.1f} us, input scale {scale})")
    base: dict[str, float | None] = {}
    base_chk: dict[str, Check] = {}
    m = _measure(dev, "unfused", prog, prog, replays, scale)
    base["unfused"], base_chk["unfused"] = m.us, m.check
    if torch_ok:
        base["eager"], base_chk["eager"] = _torch_baseline(dev, prog, False, replays, scale)
        if use_compile:
            base["compile"], base_chk["compile"] = _torch_baseline(dev, prog, True, replays,
                                                                   scale)
        att = attention_pattern(prog)
        if att is not None:
            base["sdpa"], base_chk["sdpa"] = _sdpa_baseline(dev, prog, att, replays, scale)
    rows = [Row(prog.name, batch, f"baseline {name}", base[name], False, chk.rel_err,
                chk.reason, floor, bandwidth=bw)
            for name, chk in base_chk.items() if not chk.ok]
    for v in variants:
        row = Row(prog.name, batch, v.label, None, v.ok, None, v.reason, floor, dict(base),
                  bw, shipped=v.shipped, predicted_us=v.predicted_us, search=v.search)
        if v.graph is not None:
            m = _measure(dev, v.label, v.graph, prog, replays, scale, per_kernel)
            row.us, row.ok, row.rel_err = m.us, m.check.ok, m.check.rel_err
            row.reason, row.kernels = m.check.reason, m.kernels
        else:
            info(f"  {v.label}: {v.reason}")
        rows.append(row)
    if not variants:
        rows.append(Row(prog.name, batch, "(no fused µGraph)", None, True, None, "", floor,
                        dict(base), bw))
    return rows


# -- the candidates `mirage opt` keeps ---------------------------------------------------


def opt_variants(program: Graph, top: int, search: Callable[[Graph], Any],
                 select: Callable[[Any], Graph | None],
                 plan: Callable[[Graph], Graph] = lambda g: g) -> list[Variant]:
    """The first ``top`` ranked, verified candidates of ``search(program)`` (an
    :class:`~mirage_cli.search.driver.Outcome`), labelled ``opt#1``, ``opt#2``, ...,
    each with its kernel plans as ``plan`` (opt's planning step) gives them; the one
    ``select`` picks (what ``mirage opt`` ships) is marked ``(shipped)``; where that is
    the program itself (opt ships the unfused lowering when the model predicts every
    candidate slower), it is a variant of its own, ``opt: unfused (shipped)``. No
    candidate at all is a failure row, not an empty list."""
    out = search(program)
    info_search = {"cached": out.cached, "complete": out.complete}
    if not out.candidates:
        return [Variant("opt", None, "the search found no verified µGraph", ok=False,
                        search=info_search)]
    chosen = select(out)
    shipped = plan(chosen) if chosen is not None else None
    variants = []
    if chosen is program:
        from mirage_cli.search.cost import estimate

        variants.append(Variant("opt: unfused (shipped)", shipped, shipped=True,
                                predicted_us=estimate(program).time_us,
                                search={**info_search, "unfused": True}))
    for i, (g, meta) in enumerate(out.candidates[:top]):
        g = plan(g)
        mark = g == shipped
        cost = meta.get("cost", {})
        variants.append(Variant(f"opt#{i + 1}" + (" (shipped)" if mark else ""), g,
                                shipped=mark, predicted_us=cost.get("time_us"),
                                search={**info_search, "rank": meta.get("rank", i),
                                        "design": meta.get("design"),
                                        "tuning": meta.get("tuning")}))
    if not any(v.shipped for v in variants):
        # The shipped µGraph is always one of the candidates; if it is not among the
        # first ``top``, that is a bug to see, not to hide.
        variants.append(Variant("opt (shipped)", None, "the shipped µGraph is not among "
                                "the ranked candidates", ok=False, search=info_search))
    return variants


# -- Mirage's own candidates (its published checkpoints) -----------------------------------

def checkpoint_files(ckpt_dir: Path, example: str, batch: int) -> list[Path]:
    """The Mirage checkpoints of ``example`` at ``batch`` found in ``ckpt_dir``, in the
    order their candidates are numbered: ``<example>_bs<batch>.json``, then
    ``<example>.json`` (a checkpoint for no batch in particular: its shapes decide)."""
    names = (f"{example}_bs{batch}.json", f"{example}.json")
    return [ckpt_dir / n for n in names if (ckpt_dir / n).is_file()]


def mirage_variants(program: Graph, files: list[Path], verify: Verify,
                    plan: Callable[[Graph], Graph] = lambda g: g,
                    price: Callable[[Graph], float | None] = lambda g: None
                    ) -> list[Variant]:
    """Every candidate of the checkpoints ``files`` (in file, then candidate order),
    labelled ``mirage#1``, ``mirage#2``, ...: imported, bound to ``program``'s inputs
    and outputs by position (:func:`~mirage_cli.importers.bind.bind`), certified
    against it by ``verify``, then given its kernel plans by ``plan`` (opt's planning
    step, as opt's candidates) and a predicted time by ``price`` (the search's cost
    model, as opt's candidates). Nothing is dropped: a file that cannot be imported is
    a FAIL row; a file none of whose candidates has the program's signature at this
    batch is one n/a row saying why; a candidate that does not bind is an n/a row, one
    that is not certified or cannot be planned a FAIL row."""
    out: list[Variant] = []
    numbered = 0  # candidates are numbered across the files, in order
    for path in files:
        try:
            graphs = import_checkpoint(path.read_text(encoding="utf-8"), str(path))
        except (MirageError, OSError, UnicodeDecodeError) as e:
            out.append(Variant("mirage", None, f"{path.name}: cannot import: {_message(e)}",
                               ok=False, search={"checkpoint": path.name}))
            continue
        bound = [_bound(g, program) for g in graphs]
        if graphs and all(isinstance(b, str) for b in bound):
            info(f"  {path.name}: not for this batch: {bound[0]}")
            out.append(Variant("mirage", None, f"n/a: {path.name}: {bound[0]}",
                               search={"checkpoint": path.name, "candidates": len(graphs)}))
            continue
        for i, b in enumerate(bound):
            numbered += 1
            out.append(_checkpoint_variant(f"mirage#{numbered}", path.name, i, b, program,
                                           verify, plan, price))
    return out


def _bound(candidate: Graph, program: Graph) -> Graph | str:
    """The candidate bound to the program, or why it cannot be."""
    from mirage_cli.importers.bind import bind

    try:
        return bind(candidate, program)
    except MirageError as e:
        return e.message


def _checkpoint_variant(label: str, file: str, index: int, g: Graph | str, program: Graph,
                        verify: Verify, plan: Callable[[Graph], Graph],
                        price: Callable[[Graph], float | None]) -> Variant:
    """One checkpoint candidate as a variant (see :func:`mirage_variants`)."""
    where: dict[str, Any] = {"checkpoint": file, "index": index}
    if isinstance(g, str):
        return Variant(label, None, f"n/a: {file} candidate {index}: {g}", search=where)
    try:
        ok, how = verify(program, g)
    except Exception as e:  # noqa: BLE001 - reported in the table, never hidden
        return Variant(label, None, f"verification failed: {type(e).__name__}: {e}",
                       ok=False, search=where)
    where["verify"] = how
    bound = how.get("bound")
    info(f"  {label} ({file} candidate {index}): " + (
        f"certified (bound {bound:.2g})" if ok and isinstance(bound, float)
        else f"{'certified' if ok else 'NOT certified'} ({how.get('method')})"))
    if not ok:
        return Variant(label, None, f"{file} candidate {index} is not certified equivalent "
                       f"to the program ({how.get('method')})", ok=False, search=where)
    try:
        # Priced as the search prices its candidates: before opt's planning step.
        predicted = price(g)
    except Exception:  # noqa: BLE001 - a prediction is information, not a condition
        predicted = None
    try:
        g = plan(g)
    except Exception as e:  # noqa: BLE001
        return Variant(label, None, f"planning failed: {type(e).__name__}: {e}", ok=False,
                       predicted_us=predicted, search=where)
    return Variant(label, g, predicted_us=predicted, search=where)


def _message(e: Exception) -> str:
    return e.message if isinstance(e, MirageError) else f"{type(e).__name__}: {e}"


def torch_unavailable() -> str | None:
    """Why PyTorch cannot give the baselines here (None: it can)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        return f"import torch failed: {type(e).__name__}: {e}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"torch.cuda failed: {type(e).__name__}: {e}"
    return None


def _torch_baseline(dev: Device, g: Graph, compiled: bool, replays: int, scale: float
                    ) -> tuple[float | None, Check]:
    import torch

    def make() -> Callable[..., Any]:
        fn = torch_fn(g)
        if not compiled:
            return fn
        # Each program is its own compilation: without a reset, dynamo's per-function
        # recompile limit is reached after a few programs and it silently runs eager.
        torch._dynamo.reset()
        info("  torch.compile ... ")
        return torch.compile(fn, dynamic=False)
    return _baseline(dev, g, "torch.compile" if compiled else "eager", make, replays, scale,
                     report_elapsed=compiled)


def _sdpa_baseline(dev: Device, g: Graph, att: Attention, replays: int, scale: float
                   ) -> tuple[float | None, Check]:
    """PyTorch's ``scaled_dot_product_attention`` (:func:`sdpa_fn`), timed and checked
    as the other PyTorch baselines."""
    return _baseline(dev, g, "sdpa", lambda: sdpa_fn(g, att), replays, scale,
                     prepare=sdpa_inputs(g, att))


def _baseline(dev: Device, g: Graph, label: str, make: Callable[[], Callable[..., Any]],
              replays: int, scale: float, report_elapsed: bool = False,
              prepare: Callable[[list[Any]], list[Any]] | None = None
              ) -> tuple[float | None, Check]:
    """Time and check the PyTorch function ``make()`` gives (:func:`time_torch`): its µs
    (``None`` unless correct) and the check. Any exception makes the baseline
    unavailable, with the reason, rather than ending the bench."""
    t0 = time.perf_counter()
    try:
        us, chk = time_torch(dev, g, make(), replays, scale, prepare)
    except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
        info(f"  {label}: unavailable ({type(e).__name__}: {str(e)[:200]})")
        return None, Check(True, math.nan, f"unavailable: {type(e).__name__}")
    if report_elapsed:
        info(f"  ({time.perf_counter() - t0:.0f} s with compilation)")
    info(f"  {label}: {us:.1f} us rel_err={chk.rel_err:.2e}")
    return (us if chk.ok else None), chk


def run_on_gpu(g: Graph, inputs: dict[str, np.ndarray], ordinal: int = 0
               ) -> dict[str, np.ndarray]:
    """``mirage run --gpu N``: lower, compile for the device, run once (outputs
    poisoned first); the outputs as float32 arrays by name."""
    dev = Device(ordinal)
    loaded = build(dev, g)
    try:
        return loaded.run(inputs)
    finally:
        loaded.unload()
