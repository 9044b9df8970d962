"""The long fuzzing campaign (docs/reliability.md): N mutants of `.mir`, `.ugraph.json`
and Mirage checkpoints through `parse`, `fmt`, `run`, `verify`, `codegen` and
`import-mirage`, in-process, checked by :mod:`fuzzing`.

    PYTHONPATH=$PWD python tests/fuzz_campaign.py --mutants 5000 --seed 0 --jobs 2

Mutant ``i`` is drawn from ``random.Random(f"{seed}:{i}")``, so any single failure is
replayed with ``--only i``. Prints the figures and writes them as JSON (``--report``).
Exit 1 if any run broke a promise (codegen's own faults are counted apart).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fuzzing

_SEEDS: dict[str, list[str]] = {}


def _init() -> None:
    mirs = fuzzing.mir_seeds()
    _SEEDS["mir"] = mirs
    _SEEDS["json"] = fuzzing.json_seeds(mirs)
    _SEEDS["checkpoint"] = fuzzing.checkpoint_seeds()


def mutant(seed: int, i: int) -> tuple[str, str, str]:
    """(kind, mutant text, seed text) of mutant ``i``."""
    rnd = random.Random(f"{seed}:{i}")
    kind = rnd.choices(["mir", "json", "checkpoint"], weights=[45, 40, 15])[0]
    base = rnd.choice(_SEEDS[kind])
    text = fuzzing.mutate_mir(base, rnd) if kind == "mir" else fuzzing.mutate_json(base, rnd)
    return kind, text, base


def _work(job: tuple[int, list[int]]) -> list[dict[str, Any]]:
    seed, indexes = job
    rows = []
    with tempfile.TemporaryDirectory(prefix="mirage-fuzz-") as tmp:
        for i in indexes:
            kind, text, base = mutant(seed, i)
            work = Path(tmp) / str(i)
            work.mkdir()
            for r in fuzzing.run_mutant(kind, text, base, work, i):
                rows.append({"mutant": i, "kind": kind, "command": r.command, "code": r.code,
                             "seconds": round(r.seconds, 3), "problems": r.problems,
                             "codegen_fault": r.codegen_fault})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=int, action="append", help="Run only mutant I.")
    ap.add_argument("--report", default=None, help="Write the figures as JSON here.")
    args = ap.parse_args()
    _init()
    indexes = args.only or list(range(args.mutants))
    chunks = [(args.seed, indexes[k:k + 25]) for k in range(0, len(indexes), 25)]
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("fork")
    with ctx.Pool(args.jobs, _init) as pool:
        for part in pool.imap_unordered(_work, chunks):
            rows += part
            print(f"\r{len({r['mutant'] for r in rows})}/{len(indexes)} mutants, "
                  f"{len(rows)} runs, {time.time() - t0:.0f}s", end="", file=sys.stderr)
    print(file=sys.stderr)
    figures = summarize(rows, args, time.time() - t0)
    print(json.dumps(figures, indent=2, sort_keys=True))
    if args.report:
        Path(args.report).write_text(json.dumps({"figures": figures, "failures": [
            r for r in rows if r["problems"] or r["codegen_fault"]]}, indent=1) + "\n")
    return 1 if figures["runs_with_problems"] else 0


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float
              ) -> dict[str, Any]:
    problems = Counter(p.split(":")[0] for r in rows for p in r["problems"])
    return {
        "command": f"PYTHONPATH=$PWD python tests/fuzz_campaign.py --mutants {args.mutants} "
                   f"--seed {args.seed} --jobs {args.jobs}",
        "mutants": len({r["mutant"] for r in rows}),
        "mutants_by_kind": dict(Counter(k for _, k in {(r["mutant"], r["kind"])
                                                        for r in rows})),
        "runs": len(rows),
        "runs_by_command": dict(Counter(r["command"] for r in rows)),
        "exit_codes": {c: dict(Counter(str(r["code"]) for r in rows if r["command"] == c))
                       for c in sorted({r["command"] for r in rows})},
        "exit_3": sum(r["code"] == 3 and not r["codegen_fault"] for r in rows),
        "codegen_faults": sum(r["codegen_fault"] for r in rows),
        "codegen_fault_mutants": sorted({r["mutant"] for r in rows if r["codegen_fault"]}),
        "tracebacks": sum(any("traceback" in p or "escaped" in p for p in r["problems"])
                          for r in rows),
        "partial_outputs": sum(any("outputs written" in p or "temporary" in p or
                                   "does not load" in p or "missing" in p
                                   for p in r["problems"]) for r in rows),
        "hangs_over_10s": sum(any(p.startswith(("hang", "took")) for p in r["problems"])
                              for r in rows),
        "slowest_run_s": max((r["seconds"] for r in rows), default=0.0),
        "runs_with_problems": sum(bool(r["problems"]) for r in rows),
        "problem_kinds": dict(problems),
        "wall_seconds": round(seconds, 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())
