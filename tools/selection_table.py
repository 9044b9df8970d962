"""Measured selection on the six examples at batch 1, 8 and 16 (issue 10, Must-show 1).

    PYTHONPATH=$PWD python tools/selection_table.py OUT.json [--gpu 0] [--batches 1,8,16]
        [--budget 120] [--jobs 16] [--top 3] [--examples gqa,lora]

For each example and batch: the search (``mirage opt``'s, through the result cache),
then measured selection (:mod:`mirage_cli.search.measure`: the top designs' tunings x
plan knobs, compiled in parallel, checked against the float64 reference on the GPU and
timed with the bench's method). Every search runs before the GPU is opened (its worker
processes are forked; the bench does the same). The shipped µGraph is then compiled and
timed once more on its own (``shipped_retimed_us``), so "within 3% of the fastest" is
a fresh measurement, not the minimum it was chosen as. Columns: shipped µs (re-timed),
best µs of all timed variants, the model's pick µs (what `opt` ships without --gpu),
search and tuning seconds, variants timed and wrong ones.

Writes OUT.json (every timed variant with its µGraph, measured and predicted µs: the
input of ``tools/model_fit.py`` and ``mirage calibrate --fit``) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mirage_cli import serialize
from mirage_cli.loading import load_graph
from mirage_cli.search.driver import SearchOptions, cached_search

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("rmsnorm_linear", "gated_mlp", "lora", "ntrans", "gqa", "qknorm_gqa")
FORMAT = "mirage-cli/selection-table"


def _search_all(names: list[str], batches: list[int], budget: float, jobs: int
                ) -> list[dict[str, Any]]:
    work = []
    for name in names:
        for batch in batches:
            prog = load_graph(str(ROOT / "examples" / f"{name}.mir"), {"batch": batch})
            t0 = time.monotonic()
            out = cached_search(prog, SearchOptions(), budget, jobs, True)
            work.append({"program": name, "batch": batch, "graph": prog,
                         "cands": [g for g, _ in out.candidates], "cached": out.cached,
                         "search_s": round(time.monotonic() - t0, 2)})
            took = "cached" if out.cached else f"{work[-1]['search_s']} s"
            print(f"{name} batch={batch}: {len(out.candidates)} candidates ({took})",
                  file=sys.stderr)
    return work


def _retime(timer: Any, v: Any, prog: Any) -> float | None:
    """The shipped variant compiled and timed again on its own, as the timer times every
    variant (the bench's check and method, in the timer's GPU process)."""
    from mirage_cli.codegen.cubins import compile_one

    cubin = compile_one((v.graph, timer.arch))
    if isinstance(cubin, str):
        return None
    t = timer.time(v, cubin, prog)
    return t.us if t.ok else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    a = ap.parse_args(argv)
    from mirage_cli.search import measure

    names = a.examples.split(",")
    work = _search_all(names, [int(b) for b in a.batches.split(",")], a.budget, a.jobs)
    timer = measure.GpuTimer(a.gpu)  # after every search: no fork once CUDA is up
    rows = []
    for w in work:
        row: dict[str, Any] = {k: w[k] for k in ("program", "batch", "search_s", "cached")}
        if not w["cands"]:
            rows.append({**row, "error": "the search found no verified µGraph"})
            continue
        res = measure.measure(w["cands"], w["graph"], timer, top=a.top, workers=a.jobs)
        shipped = res.variants[res.best]
        retimed = _retime(timer, shipped, w["graph"])
        fastest = res.fastest_us()
        row.update({
            "device": timer.device, "tuning_s": round(res.seconds, 2),
            "variants_timed": len(res.variants), "wrong": [res.variants[i].label
                                                           for i in res.wrong],
            "shipped": shipped.label, "shipped_us": res.timings[res.best].us,
            "shipped_retimed_us": retimed, "fastest_us": fastest,
            "model_pick": res.variants[0].label, "model_pick_us": res.timings[0].us,
            "within_3pct": retimed is not None and retimed <= 1.03 * fastest,
            "variants": [{"label": v.label, "design": v.design,
                          "graph": serialize.graph_to_json(v.graph),
                          "predicted_us": v.predicted_us, "measured_us": t.us,
                          "ok": t.ok, "reason": t.reason}
                         for v, t in zip(res.variants, res.timings)]})
        rows.append(row)
        _write(a.out, timer.device, rows)  # after every row: a cut-short run keeps its rows
    md = _write(a.out, timer.device, rows)
    print(md)
    return 0 if all(r.get("within_3pct") and not r.get("wrong") for r in rows) else 1


def _write(out: str, device: str, rows: list[dict[str, Any]]) -> str:
    """OUT.json and OUT.md from the rows so far; the table's text."""
    doc = {"format": FORMAT, "version": 1, "device": device, "rows": rows}
    Path(out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    md = markdown(rows)
    Path(out).with_suffix(".md").write_text(md)
    return md


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [("| program | batch | shipped µs (re-timed) | best µs of all variants | "
            "within 3% | model's pick µs | variants (wrong) | search s | tuning s |"),
           "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['program']} | {r['batch']} | {r['error']} | | | | | | |")
            continue
        out.append(f"| {r['program']} | {r['batch']} | {_f(r['shipped_retimed_us'])} | "
                   f"{_f(r['fastest_us'])} | {'yes' if r['within_3pct'] else 'NO'} | "
                   f"{_f(r['model_pick_us'])} | {r['variants_timed']} "
                   f"({len(r['wrong'])}) | {r['search_s']}"
                   f"{' (cached)' if r['cached'] else ''} | {r['tuning_s']} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
