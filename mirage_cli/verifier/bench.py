"""Benchmark of the verifier (not a test): time to verify each example program
against its fused µGraph, at the examples' full sizes.

    python -m mirage_cli.verifier.bench [--dir examples] [--no-float64] [--json]
    python -m mirage_cli.verifier.bench --dir golden --ext .ugraph.json

For each ``examples/<name>.mir`` with a ``examples/mugraphs/<name>_fused.mir`` (or the
same pairs as ``.ugraph.json`` files in ``--dir``), prints the wall-clock time of the
finite-field check to the default bound (2^-40), of the float64 cross-check, the
number of trials and the verdict. Each graph is loaded before the clock starts.
"candidate only" is a second check of the same candidate by the same ``Verifier``: the
search's case, where the reference's outputs and the trials' inputs are cached.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.crosscheck import crosscheck


def pairs(root: Path, exts: tuple[str, ...] = (".mir", ".ugraph.json")
          ) -> list[tuple[str, Path, Path]]:
    """(name, program, fused µGraph) for every example with both files."""
    out = []
    for ext in exts:
        for prog in sorted(root.glob(f"*{ext}")):
            name = prog.name[: -len(ext)]
            if name.endswith("_fused"):
                continue
            for fused in (root / "mugraphs" / f"{name}_fused{ext}",
                          root / f"{name}_fused{ext}"):
                if fused.exists():
                    out.append((name, prog, fused))
                    break
        if out:
            return out
    return out


def bench_pair(a: Graph, b: Graph, float64: bool) -> dict[str, object]:
    t0 = time.perf_counter()
    v = Verifier(a, seed=0)
    n = v.trial_bound(b).trials_for(v.bound)
    verdict = v.check(b, trials=n or 1)
    t1 = time.perf_counter()
    # The search's case: the reference's outputs and the trials' inputs are cached.
    again = v.check(b, trials=n or 1)
    t2 = time.perf_counter()
    assert again == verdict
    row: dict[str, object] = {"finite_field_s": round(t1 - t0, 3), "trials": verdict.trials,
                              "candidate_only_s": round(t2 - t1, 3),
                              "per_trial_bound": v.trial_bound(b).per_trial,
                              "finite_field": verdict.equivalent}
    t1 = t2
    if float64:
        cc = crosscheck(a, b, 0)
        row["float64_s"] = round(time.perf_counter() - t1, 3)
        row["float64_close"] = cc.close
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="examples")
    ap.add_argument("--no-float64", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ext", default=None, help="Only files with this extension "
                    "(.mir or .ugraph.json, e.g. with --dir golden).")
    args = ap.parse_args(argv)
    rows = {}
    exts = (args.ext,) if args.ext else (".mir", ".ugraph.json")
    for name, prog, fused in pairs(Path(args.dir), exts):
        a, b = load_graph(str(prog)), load_graph(str(fused))
        rows[name] = bench_pair(a, b, not args.no_float64)
        if not args.json:
            r = rows[name]
            extra = (f"  float64 {r['float64_s']:7.3f} s ({'close' if r['float64_close'] else 'FAR'})"
                     if "float64_s" in r else "")
            print(f"{name:24s} finite field {r['finite_field_s']:7.3f} s "
                  f"({r['trials']} trials, {'equivalent' if r['finite_field'] else r['finite_field']};"
                  f" candidate only {r['candidate_only_s']:.3f} s){extra}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
