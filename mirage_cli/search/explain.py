"""Why this µGraph: the cost model's terms, the constraints and the tie rule, per kernel.

:func:`explain` turns a ranked list of candidates (and, when known, the unfused program)
into a JSON document (schema below); :func:`render_text` prints it. Times are the
model's predictions (:mod:`.cost`); a measured time appears only where a candidate's
metadata holds ``measured_us``. Design decisions (what each kernel fuses, how each
input is split, which operators accumulate) are reported apart from tuning values
(grid, forloop, the kernel plan's knobs), as DESIGN.md §1 keeps them apart.

Schema (``format: mirage-cli/explain``, ``version: 1``)::

    {"format", "version", "arch", "tie_rule": str,
     "model": {"profile", "calibrated", "dram_bw", "l2_bw", "peak_flops", "launch_us",
               "iter_us", "num_sms", "smem_per_block", "fit": {...}},
     "chosen": ENTRY, "rivals": [ENTRY + {"loses_on": LOSS}],
     "unfused": ENTRY + ({"loses_on": LOSS} or {"wins_by_us": float}) | null}
    ENTRY = {"label", "rank": int | null, "predicted_us", "measured_us": float | null,
             "fits": bool, "kernels": [KERNEL], "design": [DESIGN], "tuning": [TUNING]}
    KERNEL = {"index", "kind", "dram_bytes", "l2_bytes", "flops", "launches",
              "smem_bytes", "smem_source": "plan" | "model", "threads", "warps",
              "blocks", "sms", "waves", "per_sm", "terms_us": {"dram", "l2", "compute",
              "stream", "sync", "launch"}, "time_us", "binds", "tight": [str]}
             ("sync" includes the cluster term of a forloop split over a cluster)
    DESIGN = {"kernel", "kind", "fuses": [str], "splits": [{"tensor", "imap", "fmap"}],
              "accumulators": [str], "stores": [str], "running"?: [str]}
             ("running": the accumulators whose result the loop reads, a running
             maximum: docs/ir.md)
    TUNING = {"kernel", "grid", "forloop", "knobs": {...}, "predefined"?: true}
             (custom kernels, and each pre-defined matmul as the custom kernel it runs
             as, marked "predefined": its tiling is the cost model's pick)
    LOSS = {"term", "delta_us", "detail"}
"""

from __future__ import annotations

from typing import Any

from mirage_cli import ops
from mirage_cli.check import online_reads
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph, KernelOp, TensorType
from mirage_cli.search import cost as model
from mirage_cli.search.cost import Cost, KernelCost, estimate, kernel_costs, tie_breaker

FORMAT = "mirage-cli/explain"
VERSION = 1
# A constraint is reported as tight when its use reaches this fraction of the limit.
TIGHT = 0.75

Json = dict[str, Any]


def _knobs(op: KernelOp, types: dict[str, TensorType], arch: str) -> Json:
    """The knobs of the kernel's plan (the one it carries, else the planner's)."""
    from mirage_cli.codegen.planner import plan_kernel

    assert op.block is not None
    try:
        p = op.plan if op.plan is not None else plan_kernel(op.block, types, arch)
    except MirageError:
        return {}
    return p.knobs.as_json()


def _kernel(i: int, op: KernelOp, k: KernelCost, types: dict[str, TensorType], arch: str
            ) -> tuple[Json, Json | None]:
    """A kernel's cost entry and (custom kernels) its tuning entry."""
    prof = model.profile()
    limit = prof.smem_per_block
    tight: list[str] = []
    smem, source, threads = k.smem_bytes, "model", 0
    knobs: Json = {}
    sms = prof.num_sms
    if k.threads:  # a custom kernel, or the one a pre-defined matmul runs as
        smem, threads, source = k.plan_smem, k.threads, "plan"
    if op.block is not None:
        if k.violation:
            tight.append(k.violation)
        if k.threads:
            knobs = _knobs(op, types, arch)
        if not k.violation and smem >= TIGHT * limit:
            tight.append(f"shared memory {smem} B is {100 * smem // limit}% "
                         f"of the {limit} B per block")
        if k.blocks < sms:
            tight.append(f"grid of {k.blocks} blocks fills {k.blocks} of {sms} SMs")
        elif k.blocks % (sms * k.per_sm):
            tight.append(f"{k.blocks} blocks: a last wave of {k.blocks % (sms * k.per_sm)} "
                         f"on {sms} SMs x {k.per_sm} resident")
    entry = {"index": i, "kind": "custom" if op.block is not None else op.op,
             "dram_bytes": k.dram_bytes, "l2_bytes": k.l2_bytes, "flops": k.flops,
             "launches": int(k.launched), "smem_bytes": smem, "smem_source": source,
             "threads": threads, "warps": threads // 32, "blocks": k.blocks,
             "sms": sms, "waves": k.waves, "per_sm": k.per_sm,
             "terms_us": {"dram": _r(k.dram_us), "l2": _r(k.l2_us),
                          "compute": _r(k.compute_us), "stream": _r(k.stream_us),
                          "sync": _r(k.sync_us + k.cluster_us),
                          "launch": _r(k.launch_us)},
             "time_us": _r(k.time_us), "binds": k.binding, "tight": tight}
    tuning = None
    if op.block is not None:
        tuning = {"kernel": i, "grid": list(op.block.grid), "forloop": op.block.forloop,
                  "knobs": knobs}
    elif (runs := model.lowered(op, types)).block is not None:
        # A pre-defined matmul runs as a custom kernel whose tiling the model picked.
        tuning = {"kernel": i, "grid": list(runs.block.grid), "forloop": runs.block.forloop,
                  "knobs": _knobs(runs, types, arch), "predefined": True}
    return entry, tuning


def _design(i: int, op: KernelOp) -> Json:
    """The design decisions of one kernel (no sizes)."""
    bg = op.block
    if bg is None:
        return {"kernel": i, "kind": op.op, "fuses": [op.op], "splits": [],
                "accumulators": [], "stores": [o.name for o in op.outputs]}
    out: Json = {"kernel": i, "kind": "custom", "fuses": [b.op for b in bg.ops],
                 "splits": [{"tensor": bi.source, "imap": list(bi.imap), "fmap": bi.fmap}
                            for bi in bg.inputs],
                 "accumulators": [b.op for b in bg.ops if ops.get(b.op).is_accumulator],
                 "stores": [bo.value.name for bo in bg.outputs]}
    read = online_reads(bg)
    if read:  # accumulators whose result the loop reads: a running maximum
        out["running"] = [b.op for b in bg.ops if b.outputs[0].name in read]
    return out


def _r(x: float) -> float:
    return round(x, 3)


def entry(g: Graph, label: str, rank: int | None, meta: Json, arch: str) -> tuple[Json, Cost]:
    """One candidate's explanation and its cost."""
    types = g.tensor_types()
    ks = kernel_costs(g)
    c = estimate(g)
    kernels, tunings = [], []
    for i, (op, k) in enumerate(zip(g.ops, ks)):
        ke, te = _kernel(i, op, k, types, arch)
        kernels.append(ke)
        if te is not None:
            tunings.append(te)
    measured = meta.get("measured_us")
    doc = {"label": label, "rank": rank, "predicted_us": _r(c.time_us),
           "measured_us": measured if isinstance(measured, (int, float)) else None,
           "fits": c.fits, "kernels": kernels,
           "design": [_design(i, op) for i, op in enumerate(g.ops)], "tuning": tunings}
    return doc, c


def _totals(g: Graph) -> dict[str, float]:
    ks = kernel_costs(g)
    return {"stream": sum(k.stream_us for k in ks),
            "sync": sum(k.sync_us + k.cluster_us for k in ks),
            "launch": sum(k.launch_us for k in ks)}


def loses_on(rival: Graph, rc: Cost, chosen: Graph, cc: Cost) -> Json:
    """The term that puts ``rival`` after ``chosen``: the tie rule's term when the
    predicted times tie, else the model term (streaming, synchronisation, launches)
    with the largest excess over the chosen candidate's."""
    if not rc.fits and cc.fits:
        return {"term": "feasibility", "delta_us": None,
                "detail": "; ".join(rc.violations) or "does not fit in shared memory"}
    tie = tie_breaker(cc, rc)
    if tie is not None:
        return {"term": f"tie: {tie}", "delta_us": _r(rc.time_us - cc.time_us),
                "detail": f"predicted times tie; ordered by {tie} (the tie rule)"}
    rt, ct = _totals(rival), _totals(chosen)
    term = max(rt, key=lambda t: (rt[t] - ct[t], t))
    delta = rt[term] - ct[term]
    detail = {"stream": "streaming time (bytes and FLOPs over bandwidth and peak, "
                        "divided by SM utilisation, plus element-wise math)",
              "sync": "forloop iterations and waves (synchronisation)",
              "launch": "more kernel launches"}[term]
    if term == "stream":
        binds = sorted({k.binding for k in kernel_costs(rival)})
        detail += f"; its kernels are bound by {', '.join(binds)}"
    return {"term": term, "delta_us": _r(delta), "detail": detail}


def explain(cands: list[tuple[Graph, Json]], program: Graph | None, arch: str) -> Json:
    """The explanation document of a ranked candidate list (first = chosen)."""
    if not cands:
        raise MirageError("explain: the file holds no candidate µGraph")
    prof = model.profile()
    g0, m0 = cands[0]
    chosen, c0 = entry(g0, "#0", _rank(m0, 0), m0, arch)
    rivals = []
    for i, (g, m) in enumerate(cands[1:], 1):
        e, c = entry(g, f"#{i}", _rank(m, i), m, arch)
        e["loses_on"] = loses_on(g, c, g0, c0)
        rivals.append(e)
    unfused = None
    if program is not None:
        unfused, cu = entry(program, "unfused", None, {}, arch)
        if cu.fits and c0.fits and cu.time_us < c0.time_us:
            # Without --gpu, opt ships the unfused lowering then (driver.slower_than_unfused).
            unfused["wins_by_us"] = _r(c0.time_us - cu.time_us)
        else:
            unfused["loses_on"] = loses_on(program, cu, g0, c0)
    return {"format": FORMAT, "version": VERSION, "arch": arch, "tie_rule": model.TIE_RULE,
            "model": {"profile": prof.name, "calibrated": prof.calibrated,
                      "dram_bw": prof.dram_bw, "l2_bw": prof.l2_bw,
                      "peak_flops": prof.peak_flops, "launch_us": prof.launch_us,
                      "iter_us": prof.iter_us, "num_sms": prof.num_sms,
                      "smem_per_block": prof.smem_per_block, "fit": dict(prof.fit)},
            "chosen": chosen, "rivals": rivals, "unfused": unfused}


def _rank(meta: Json, default: int) -> int:
    r = meta.get("rank")
    return r if isinstance(r, int) else default


# -- text ---------------------------------------------------------------------------


def _time(e: Json) -> str:
    m = "" if e["measured_us"] is None else f", measured {e['measured_us']} us"
    return f"predicted {e['predicted_us']} us{m}"


def kernel_rows(e: Json) -> list[list[str]]:
    """One row per kernel: the columns of the cost table."""
    return [[str(k["index"]), k["kind"], str(k["dram_bytes"]), str(k["l2_bytes"]),
             str(k["flops"]), f"{k['smem_bytes']} ({k['smem_source']})",
             f"{k['threads']}/{k['warps']}", f"{k['blocks']}/{k['sms']}",
             str(k["time_us"]), k["binds"]] for k in e["kernels"]]


COLUMNS = ["k", "kind", "DRAM B", "L2 B", "FLOPs", "smem B", "thr/warps", "blocks/SMs",
           "us", "binds"]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [COLUMNS, *rows]]


def entry_lines(e: Json) -> list[str]:
    head = f"{e['label']}: {sum(k['launches'] for k in e['kernels'])} kernel(s), {_time(e)}"
    if not e["fits"]:
        head += " (does not fit)"
    lines = [head]
    if "loses_on" in e:
        lo = e["loses_on"]
        delta = "" if lo["delta_us"] is None else f" (+{lo['delta_us']} us)"
        lines.append(f"  loses on {lo['term']}{delta}: {lo['detail']}")
    if "wins_by_us" in e:
        lines.append(f"  predicted faster than #0 by {e['wins_by_us']} us: without --gpu, "
                     f"opt ships this unfused lowering instead")
    lines += _table(kernel_rows(e))
    for k in e["kernels"]:
        lines += [f"  tight k{k['index']}: {t}" for t in k["tight"]]
    lines.append("  design:")
    for d in e["design"]:
        if d["kind"] != "custom":
            lines.append(f"    k{d['kernel']}: {d['kind']} (pre-defined) -> "
                         f"{', '.join(d['stores'])}")
            continue
        splits = "; ".join(f"{s['tensor']} imap=({_axes(s['imap'])}) "
                           f"fmap={'-' if s['fmap'] is None else s['fmap']}"
                           for s in d["splits"])
        running = d.get("running", [])
        acc = ", ".join(f"{a} (running: the loop reads its result)" if a in running else a
                        for a in d["accumulators"]) or "none"
        lines.append(f"    k{d['kernel']}: fuses {' '.join(d['fuses'])} -> "
                     f"{', '.join(d['stores'])}")
        lines.append(f"      splits: {splits}")
        lines.append(f"      accumulators: {acc}")
    if e["tuning"]:
        lines.append("  tuning:")
        for t in e["tuning"]:
            knobs = ",".join(f"{k}={v}" for k, v in sorted(t["knobs"].items())) or "-"
            how = " (a pre-defined matmul: the model's tiling)" if t.get("predefined") else ""
            lines.append(f"    k{t['kernel']}: grid={t['grid']} forloop={t['forloop']} "
                         f"knobs {knobs}{how}")
    return lines


def _axes(imap: list[int | None]) -> str:
    """An axis map as ``x:1 y:- z:-`` (which tensor dimension each grid axis splits)."""
    return " ".join(f"{a}:{'-' if d is None else d}" for a, d in zip("xyz", imap))


def render_text(doc: Json) -> str:
    """The plain-text explanation (what a pipe or a golden test sees)."""
    lines = [(f"chosen {doc['chosen']['label']} ({doc['arch']}; times are the cost "
              f"model's predictions unless marked measured)")]
    lines += entry_lines(doc["chosen"])
    for r in doc["rivals"]:
        lines += ["", *entry_lines(r)]
    if doc["unfused"] is not None:
        lines += ["", *entry_lines(doc["unfused"])]
    lines += ["", f"tie rule: {doc['tie_rule']}"]
    return "\n".join(lines) + "\n"
