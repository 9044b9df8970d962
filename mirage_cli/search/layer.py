"""Whole layers: a program too large for one search, cut into parts, searched part by
part, stitched back into one µGraph and verified whole.

Not to be confused with :mod:`.partition`, which cuts a *small* program that found no
fused design into a mixed design. This pass runs first, on programs the search
cannot take whole (:func:`needs_layering`: a decoder layer has some thirty operators
and reshapes between them; the search handles about a dozen).

**The rule** (``plan_parts``), over the operators in program order:

1. *Barriers.* An operator the search cannot fuse through — a kernel-level operator
   without a decomposition into block operators (``reshape``), an
   operator the generator never builds (``concat``, :data:`.enumerate.NEVER_BUILT`),
   or a custom kernel already written — is a part of its own, never searched: it
   ships as its pre-defined (unfused) kernel.
2. *Size.* Each run of operators between barriers is cut into the fewest parts of at
   most ``max_ops`` operators (the search's limit); among the ways to do so, the cuts
   are put where the fewest bytes are live (tensors made before the cut and read
   after it, or program outputs), earliest on ties. Fewest bytes is where a model's
   blocks meet (after a residual add, before a normalisation feeds two projections).
3. *Normalisations start parts.* A cut that would close a part with a composite
   operator that mixes along a row without changing its shape (``rms_norm``,
   ``softmax``: a normalisation) moves before it, so that the normalisation joins the part that reads
   it, which may then hold ``max_ops + 1`` operators (:data:`SLACK`): there the search
   folds it into the loop of the matmuls it feeds (an RMSNorm before gate/up becomes
   the projections' ``acc_rms``) instead of shipping it as a kernel of its own, whose
   result every reader then loads from memory.

The rule depends on the program alone, so the parts are deterministic. Each searched
part is the existing search (:func:`.driver.search`) on a sub-program whose inputs and
outputs are the program's own tensors. A part of several outputs that finds no fused
µGraph worth shipping is searched again one output at a time, the operators they
share recomputed for each (:func:`_per_output`: a normalisation feeding the Q, K and V
projections of three weights); a part that still finds none ships its own operators
(the unfused lowering), never an unverified kernel. The parts' chosen
µGraphs are stitched in part order (names a part invents are prefixed ``p{k}_``) into
one graph with the program's inputs and outputs, one entry point and one workspace;
element-wise kernels that only finish another kernel's output fold into its epilogue
(:mod:`.epilogue`; the parts a fold joins are certified again, together), and the
whole is verified against the program (:func:`.verify.verify_composed`: every part
certified against its sub-program, plus one finite-field trial of the whole).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mirage_cli import ops
from mirage_cli.ir import BlockGraph, Graph, KernelOp, Value
from mirage_cli.search import partition
from mirage_cli.search.enumerate import NEVER_BUILT

DEFAULT_MAX_OPS = 4
# Operators a part may hold beyond ``max_ops`` when a normalisation joins it (rule 3).
SLACK = 1
# The largest program searched whole (examples/qknorm_gqa.mir, 11 operators, is).
WHOLE_MAX_OPS = 12


@dataclass(frozen=True)
class PartPlan:
    """Operators ``start:stop`` of the program, searched or not, and why the part ends
    where it does (``why``, for ``mirage explain``)."""

    index: int
    start: int
    stop: int
    searched: bool
    why: str

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_barrier(op: KernelOp) -> str | None:
    """Why the search cannot fuse through ``op``, or None when it can."""
    if op.block is not None:
        return "a custom kernel written in the program"
    if op.op in NEVER_BUILT:
        return f"{op.op} is an operator the search never builds"
    d = ops.get(op.op)
    if ops.BLOCK not in d.levels and d.decompose is None:
        return f"{op.op} is a kernel-level operator the search does not fuse through"
    return None


def needs_layering(g: Graph) -> bool:
    """Whether ``g`` goes through this pass: more than ``WHOLE_MAX_OPS`` operators, or
    a barrier the program wrote (not a custom kernel: a hand-fused µGraph is searched
    as before) between operators that could fuse. Smaller programs are searched whole,
    as they always were (the parts' size limit, ``max_ops``, is smaller than that)."""
    written = any(is_barrier(o) for o in g.ops if o.block is None)
    return len(g.ops) > WHOLE_MAX_OPS or (len(g.ops) > 1 and written)


def plan_parts(g: Graph, max_ops: int = DEFAULT_MAX_OPS) -> list[PartPlan]:
    """The parts of ``g`` by the rule of the module docstring."""
    bounds: list[tuple[int, int, bool, str]] = []
    run_start = 0
    for i, op in enumerate(g.ops):
        why = is_barrier(op)
        if why is None:
            continue
        bounds += _split_run(g, run_start, i, max_ops,
                             f"the next operator, {op.outputs[0].name} = {op.op}(...), is a "
                             f"barrier: {why}")
        bounds.append((i, i + 1, False, why))
        run_start = i + 1
    bounds += _split_run(g, run_start, len(g.ops), max_ops, "end of the program")
    return [PartPlan(k, a, b, s, w) for k, (a, b, s, w) in enumerate(bounds)]


def _split_run(g: Graph, start: int, stop: int, max_ops: int, end_why: str
               ) -> list[tuple[int, int, bool, str]]:
    """Operators ``start:stop`` (no barrier among them) in the fewest parts of at
    most ``max_ops``, cut where the fewest bytes are live."""
    if start >= stop:
        return []
    n = stop - start
    parts = -(-n // max_ops)
    cuts = _best_cuts(g, start, stop, parts, max_ops)
    edges = _normalisations_forward(g, [start, *cuts, stop], max_ops + SLACK)
    out = []
    for a, b in itertools.pairwise(edges):
        if b == stop:
            why = end_why
        elif b not in cuts:
            why = (f"size: at most {max_ops} operators per part, the cut moved before the "
                   f"normalisation {g.ops[b].outputs[0].name} = {g.ops[b].op}(...) so that "
                   f"it joins the part that reads it (at most {max_ops + SLACK})")
        else:
            why = (f"size: at most {max_ops} operators per part; {_live_bytes(g, b)} bytes "
                   f"live after '{g.ops[b - 1].outputs[0].name}', the fewest of the possible "
                   f"cuts")
        out.append((a, b, True, why))
    return out


def _normalisations_forward(g: Graph, edges: list[int], limit: int) -> list[int]:
    """``edges`` (a run's start, its cuts, its stop) with every cut that follows a
    normalisation moved before it (rule 3), where the part before keeps an operator
    and the part after stays within ``limit``."""
    out = list(edges)
    for k in range(1, len(out) - 1):
        cut = out[k]
        if (_is_normalisation(g, g.ops[cut - 1]) and cut - 1 > out[k - 1]
                and out[k + 1] - (cut - 1) <= limit):
            out[k] = cut - 1
    return out


def _is_normalisation(g: Graph, op: KernelOp) -> bool:
    """A composite row-wise operator of one result shaped as its first operand
    (rms_norm, softmax: a row statistic and a division, by the registry's index kind
    and decomposition; not rotate_half, which only moves data)."""
    if op.block is not None or len(op.outputs) != 1:
        return False
    d = ops.get(op.op)
    first = g.tensor_types()[op.inputs[0]]
    return (d.index in (ops.Index.MIX_LAST, ops.Index.MIX_DIM) and d.decompose is not None
            and op.outputs[0].type.shape == first.shape)


def _best_cuts(g: Graph, start: int, stop: int, parts: int, max_ops: int) -> list[int]:
    """``parts - 1`` cut positions in ``(start, stop)``, every part of 1..max_ops
    operators, minimising the total live bytes (earliest cuts on ties): a small
    dynamic program over (cut position, parts so far)."""
    inf = (float("inf"), ())
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(start, 0): (0.0, ())}
    for k in range(1, parts + 1):
        for end in range(start + 1, stop + 1):
            options = []
            for begin in range(max(start, end - max_ops), end):
                prev = best.get((begin, k - 1), inf)
                if prev[0] == float("inf"):
                    continue
                cost = 0.0 if end == stop else float(_live_bytes(g, end))
                options.append((prev[0] + cost, prev[1] + ((end,) if end != stop else ())))
            if options:
                best[(end, k)] = min(options)
    return list(best[(stop, parts)][1])


def _live_bytes(g: Graph, at: int) -> int:
    """Bytes of the tensors made by operators before ``at`` and read at or after it
    (or returned by the program)."""
    later = {i for op in g.ops[at:] for i in op.inputs} | set(g.outputs)
    return sum(v.type.nbytes for op in g.ops[:at] for v in op.outputs if v.name in later)


def part_program(g: Graph, part: PartPlan) -> Graph:
    """The program of one part: its operators over the program tensors it reads,
    returning the program tensors it makes that later parts or the program use."""
    made = [v.name for op in g.ops[part.start:part.stop] for v in op.outputs]
    later = {i for op in g.ops[part.stop:] for i in op.inputs} | set(g.outputs)
    outs = tuple(n for n in made if n in later)
    return partition.subprogram(g, g.ops[part.start:part.stop], outs,
                                f"{g.name}_part{part.index}")


@dataclass(frozen=True)
class PartResult:
    """What one part ships: a verified µGraph of the sub-program, or (``fused`` False)
    the sub-program itself; ``verdict`` is the certificate (None: the program's own
    operators, nothing to certify)."""

    plan: PartPlan
    graph: Graph
    fused: bool
    verdict: dict[str, Any] | None
    seconds: float
    note: str
    # False when the wall clock (the budget, a safety stop) ended the part's search:
    # what it ships then depends on timing.
    complete: bool = True
    # True when every search the part ran came from the search cache.
    cached: bool = False


def stitch(program: Graph, results: Sequence[PartResult]) -> Graph:
    """One µGraph of ``program`` from the parts' µGraphs, in part order: device
    tensors a part invents (not the program's) are renamed ``p{k}_NAME``."""
    keep = set(program.tensor_types())
    return _joined(program, [(f"p{r.plan.index}_", r.graph) for r in results], keep,
                   set(keep))


def _joined(program: Graph, pieces: Sequence[tuple[str, Graph]], keep: set[str],
            taken: set[str]) -> Graph:
    """``program``'s interface over the pieces' operators in order, each piece's names
    outside ``keep`` prefixed with its prefix (made unique against ``taken``)."""
    out_ops: list[KernelOp] = []
    for prefix, g in pieces:
        rename = _renamer(keep, taken, prefix)
        out_ops.extend(_rename_op(op, rename) for op in g.ops)
    return Graph(program.name, program.params, program.inputs, tuple(out_ops),
                 program.outputs)


def _renamer(keep: set[str], taken: set[str], prefix: str) -> Callable[[str], str]:
    memo: dict[str, str] = {}

    def rename(n: str) -> str:
        if n in keep:
            return n
        if n not in memo:
            new = prefix + n
            while new in taken:
                new += "_"
            taken.add(new)
            memo[n] = new
        return memo[n]
    return rename


def _rename_op(op: KernelOp, r: Callable[[str], str]) -> KernelOp:
    outs = tuple(Value(r(v.name), v.type) for v in op.outputs)
    block = None if op.block is None else _rename_block(op.block, r)
    return dataclasses.replace(op, inputs=tuple(r(i) for i in op.inputs), outputs=outs,
                               block=block)


def _rename_block(bg: BlockGraph, r: Callable[[str], str]) -> BlockGraph:
    ins = tuple(dataclasses.replace(bi, source=r(bi.source)) for bi in bg.inputs)
    outs = tuple(dataclasses.replace(bo, value=Value(r(bo.value.name), bo.value.type))
                 for bo in bg.outputs)
    return dataclasses.replace(bg, inputs=ins, outputs=outs)


# -- searching the parts ----------------------------------------------------------

@dataclass(frozen=True)
class PartTask:
    """Everything a worker needs to search one part (picklable)."""

    plan: PartPlan
    graph: Graph
    options: Any            # driver.SearchOptions
    budget: float | None    # seconds for this part's search (``--budget``)
    use_cache: bool


@dataclass(frozen=True)
class LayerResult:
    """The stitched µGraph (None when it did not verify), its verdict and the parts."""

    graph: Graph | None
    verdict: dict[str, Any]
    parts: tuple[PartResult, ...]
    complete: bool
    seconds: float
    # Epilogues folded across parts (:mod:`.epilogue`): "Q into the kernel of QM".
    folds: tuple[str, ...] = ()

    @property
    def cached(self) -> bool:
        """Every searched part's search came from the cache (the whole is still
        verified, and parts joined by a fold certified, each time)."""
        searched = [r for r in self.parts if r.plan.searched]
        return bool(searched) and all(r.cached for r in searched)

    def as_json(self) -> dict[str, Any]:
        return {"verification": self.verdict, "complete": self.complete,
                "parts": [part_json(r) for r in self.parts], "folds": list(self.folds)}


def part_json(r: PartResult) -> dict[str, Any]:
    """A part as ``mirage explain`` reads it from the candidate's metadata."""
    return {**r.plan.as_json(), "fused": r.fused, "kernels": len(r.graph.ops),
            "operators": [op.outputs[0].name for op in r.graph.ops] if not r.fused else [],
            "certified": r.verdict is not None, "seconds": round(r.seconds, 2),
            "complete": r.complete, "note": r.note}


def search_part(task: PartTask, unit_map: Any = None) -> PartResult:
    """One part: its best verified µGraph, or its own operators (unfused).
    ``unit_map`` runs the search's units elsewhere (:mod:`.executor`)."""
    import time

    from mirage_cli.search.driver import cached_search, slower_than_unfused

    t0 = time.time()
    if not task.plan.searched:
        return PartResult(task.plan, task.graph, False, None, 0.0,
                          "not searched: " + task.plan.why)
    opts = dataclasses.replace(task.options, top=1)
    out = cached_search(task.graph, opts, task.budget, 1, task.use_cache, None, unit_map)
    secs = time.time() - t0
    stopped = "" if out.complete or out.progress is None else \
        f"; stopped by the clock: {out.progress.clock}"
    if not out.candidates:
        from mirage_cli.search.driver import explain_none

        why = explain_none(out.progress) if out.progress else "no candidate"
        return _per_output(task, unit_map, t0, out.complete, out.cached) or PartResult(
            task.plan, task.graph, False, None, secs,
            f"unfused: no verified µGraph ({why}{stopped})", out.complete, out.cached)
    g, meta = out.candidates[0]
    slower = slower_than_unfused(task.graph, g)
    if slower is not None:
        return _per_output(task, unit_map, t0, out.complete, out.cached) or PartResult(
            task.plan, task.graph, False, None, secs, f"unfused: {slower}", out.complete,
            out.cached)
    note = "cached" if out.cached else ("complete" if out.complete else stopped[2:])
    # A best µGraph of pre-defined operators only says so: nothing of it is fused
    # (the rotary parts of the layers: element-wise operators, no design enumerated).
    what = "kernel(s)," if g.is_fused else "pre-defined kernel(s), nothing fused,"
    return PartResult(task.plan, g, True, meta.get("verification"), secs,
                      f"{len(g.ops)} {what} verified ({note})", out.complete, out.cached)


def _per_output(task: PartTask, unit_map: Any, t0: float, complete: bool,
                cached: bool) -> PartResult | None:
    """A part with several outputs that found no fused µGraph worth shipping, searched
    again one output at a time (:func:`.partition.output_cones`: the operators they
    share recomputed for each) and joined, when at least one output fuses and the
    join is predicted faster than the part's own operators; else None.

    Why: a grid axis splits one index, so a normalisation feeding the Q, K and V
    projections of three weights (the Llama layer's first part) had only designs
    that read every weight from every block (2343 µs predicted at batch 8) and
    shipped unfused (35.1 µs); each projection with its own copy of the
    normalisation is the single-weight program that fuses (llama3_rmsnorm_qkv's kind).
    Each output's µGraph is certified against its own sub-program, which computes
    exactly that output of the part, so the join's bound is the sum of theirs.
    """
    import time

    from mirage_cli.search.driver import cached_search, slower_than_unfused

    cones = partition.output_cones(task.graph)
    if cones is None:
        return None
    opts = dataclasses.replace(task.options, top=1)
    graphs: list[Graph] = []
    bounds: list[float | None] = []  # None: the output's own operators, not fused
    for cone in cones:
        out = cached_search(cone, opts, task.budget, 1, task.use_cache, None, unit_map)
        complete = complete and out.complete
        cached = cached and out.cached
        verdict = _certified(out.candidates[0][1].get("verification")) \
            if out.candidates else None
        bound = (verdict or {}).get("certificate", {}).get("bound")
        if (verdict is None or not verdict.get("equivalent") or bound is None
                or slower_than_unfused(cone, out.candidates[0][0]) is not None):
            graphs.append(cone)  # this output's own operators
            bounds.append(None)
            continue
        graphs.append(out.candidates[0][0])
        bounds.append(float(bound))
    fused = [b is not None for b in bounds]
    if not any(fused):
        return None
    together = _tuned_together(task, cones, graphs, bounds)
    if together is not None:
        graphs, bounds, note = together[0], together[1], together[2]
    joined = join_outputs(task.graph, graphs)
    if not _faster_joined(task.graph, joined):
        return None
    verdict = {"equivalent": True, "method": "one µGraph per output, each certified "
               "against its own sub-program (bound: the sum of theirs)",
               "certificate": {"bound": sum(b for b in bounds if b is not None)}}
    return PartResult(task.plan, joined, True, verdict, time.time() - t0,
                      f"{len(joined.ops)} kernel(s), one search per output ({sum(fused)} "
                      f"of {len(graphs)} fused, shared operators recomputed in each"
                      f"{note if together is not None else ''}), verified",
                      complete, cached)


def _faster_joined(part: Graph, joined: Graph) -> bool:
    """Whether the model predicts the join of the outputs' µGraphs faster than the
    part's own operators, each side with the kernels that share a launch priced as
    one (:func:`.grouped.layout_us`): the outputs' kernels are independent, and both
    sides launch them side by side."""
    from mirage_cli.search import grouped

    return grouped.layout_us(joined) <= grouped.layout_us(part)


def _tuned_together(task: PartTask, cones: Sequence[Graph], graphs: Sequence[Graph],
                    old: Sequence[float | None]
                    ) -> tuple[list[Graph], list[float | None], str] | None:
    """The outputs' µGraphs retuned for the launches they share (:mod:`.grouped`), each
    retuned one certified again against its own sub-program, with the new bounds and a
    note; None where that finds nothing better or a retuned one does not verify."""
    from mirage_cli.search import grouped
    from mirage_cli.search.verify import verify

    ms = grouped.members(cones, graphs, [b is not None for b in old])
    found = grouped.tune_together(ms, lambda gs: join_outputs(task.graph, gs))
    if found is None:
        return None
    new, before, after = found
    bounds: list[float | None] = []
    for m, g, b in zip(ms, new, old):
        if m.design is None or g is m.graph:
            bounds.append(b)
            continue
        v = verify(m.cone, g, task.options.seed)
        bound = v.detail.get("certificate", {}).get("bound") if v.ok else None
        if bound is None:
            return None
        bounds.append(float(bound))
    return new, bounds, (f"; tuned together for their shared launch, {before:.1f} -> "
                         f"{after:.1f} us predicted")


def join_outputs(part: Graph, graphs: Sequence[Graph]) -> Graph:
    """One graph of ``part`` from its outputs' graphs, in output order: tensors other
    than the part's inputs and outputs are renamed ``o{j}_NAME`` for output ``j``."""
    keep = {i.value.name for i in part.inputs} | set(part.outputs)
    return _joined(part, [(f"o{j}_", g) for j, g in enumerate(graphs)], keep,
                   set(part.tensor_types()))


PartMapper = Callable[[Sequence[PartTask]], list[PartResult]]


def local_mapper(jobs: int) -> PartMapper:
    """Parts searched in ``jobs`` worker processes (one search each), results in part
    order whatever order they finish in."""
    def run(tasks: Sequence[PartTask]) -> list[PartResult]:
        searched = [t for t in tasks if t.plan.searched]
        if jobs <= 1 or len(searched) <= 1:
            return [search_part(t) for t in tasks]
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() \
            else mp.get_context()
        with ctx.Pool(min(jobs, len(searched)), _init_part_worker) as pool:
            # the longest parts first, so two workers finish close together
            order = sorted(range(len(tasks)), key=lambda i: -_weight(tasks[i]))
            done = dict(zip(order, pool.map(search_part, [tasks[i] for i in order],
                                            chunksize=1)))
        return [done[i] for i in range(len(tasks))]
    return run


def _init_part_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C


def _weight(t: PartTask) -> int:
    return (t.plan.stop - t.plan.start) if t.plan.searched else 0


def optimise_layer(program: Graph, options: Any, part_budget: float | None,
                   mapper: PartMapper, max_ops: int = DEFAULT_MAX_OPS,
                   use_cache: bool = True) -> LayerResult:
    """Plan the parts, search them (through ``mapper``; each part's search gets
    ``part_budget`` seconds), stitch, verify the whole."""
    import time

    from mirage_cli.search.verify import verify_composed

    t0 = time.time()
    plans = plan_parts(program, max_ops)
    tasks = [PartTask(p, part_program(program, p), options, part_budget, use_cache)
             for p in plans]
    results = mapper(tasks)
    whole = stitch(program, results)
    verdicts = [_certified(r.verdict) for r in results if r.fused]
    folded, joined, folds = _folded(program, whole, results, options.seed)
    if folded is not None:
        whole, verdicts = folded, joined
    v = verify_composed(program, whole, verdicts, options.seed)
    complete = all(r.complete for r in results)
    return LayerResult(whole if v.ok else None, v.as_json(), tuple(results), complete,
                       time.time() - t0, folds)


def _folded(program: Graph, whole: Graph, results: Sequence[PartResult], seed: int
            ) -> tuple[Graph | None, list[dict[str, Any] | None], tuple[str, ...]]:
    """The stitched layer with its foldable epilogues folded (:mod:`.epilogue`) and the
    parts' certificates for it: each group of parts that a fold joins is certified
    anew against its joined sub-program (the kernels now span both parts), the others
    keep theirs; and what was folded, in words. (None, [], ()) when nothing folds or a
    joined group does not verify: the layer then ships as stitched."""
    from mirage_cli.search import epilogue
    from mirage_cli.search.verify import verify

    folded, folds = epilogue.fold(whole)
    if not folds:
        return None, [], ()
    # Which part made each tensor of the stitched graph (its kernels are in part order).
    owners = [r.plan.index for r in results for _ in r.graph.ops]
    part_of = {v.name: k for k, op in zip(owners, whole.ops, strict=True)
               for v in op.outputs}
    groups: list[set[int]] = []
    for f in folds:
        pair = {part_of[f.stored], part_of[f.output]}
        joined = [g for g in groups if g & pair]
        groups = [g for g in groups if not g & pair] + [pair.union(*joined)]
    verdicts = [_certified(r.verdict) for r in results
                if r.fused and not any(r.plan.index in g for g in groups)]
    for g in groups:
        sub, cand = _joined_parts(program, folded, results, g, part_of)
        v = verify(sub, cand, seed)
        if not v.ok:
            return None, [], ()
        verdicts.append(v.as_json())
    said = tuple(f"{f.output} (part {part_of[f.output]}) into the kernel of {f.stored} "
                 f"(part {part_of[f.stored]})" for f in folds)
    return folded, verdicts, said


def _joined_parts(program: Graph, folded: Graph, results: Sequence[PartResult],
                  group: set[int], part_of: dict[str, int]) -> tuple[Graph, Graph]:
    """The sub-program of the parts in ``group`` (their operators, in program order)
    and the folded layer's kernels that compute it, as a µGraph of the same interface."""
    plans = [r.plan for r in results if r.plan.index in group]
    ops_ = tuple(op for p in plans for op in program.ops[p.start:p.stop])
    made = [v.name for op in ops_ for v in op.outputs]
    rest = [op for p in results if p.plan.index not in group
            for op in program.ops[p.plan.start:p.plan.stop]]
    later = {i for op in rest for i in op.inputs} | set(program.outputs)
    sub = partition.subprogram(program, ops_, tuple(n for n in made if n in later),
                               f"{program.name}_parts{'_'.join(map(str, sorted(group)))}")
    kernels = tuple(op for op in folded.ops
                    if any(part_of.get(v.name) in group for v in op.outputs))
    return sub, Graph(sub.name, sub.params, sub.inputs, kernels, sub.outputs)


def _certified(verdict: dict[str, Any] | None) -> dict[str, Any] | None:
    """A part's verdict in the form :func:`.verify.verify_composed` reads: a part
    whose own search composed a mixed design carries its bound at the top level."""
    if verdict is None or "certificate" in verdict or "bound" not in verdict:
        return verdict
    return {**verdict, "certificate": {"bound": verdict["bound"]}}


def render_parts(doc: dict[str, Any]) -> list[str]:
    """The parts of a layer (``LayerResult.as_json``, or a plan alone) as text lines."""
    lines = []
    for p in doc["parts"]:
        ops_ = f"ops {p['start']}..{p['stop'] - 1}" if p["stop"] - p["start"] > 1 \
            else f"op {p['start']}"
        what = p.get("note", "searched" if p["searched"] else "not searched: " + p["why"])
        lines.append(f"part {p['index']} ({ops_}): {what}")
        lines.append(f"    ends here because: {p['why']}")
    for f in doc.get("folds", []):
        lines.append(f"epilogue folded: {f}")
    if "verification" in doc:
        v = doc["verification"]
        lines.append(f"whole layer: {'verified' if v.get('equivalent') else 'NOT verified'}"
                     f" ({v.get('method')})")
    return lines
