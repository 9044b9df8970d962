"""Verify every candidate of Mirage's published checkpoints against its program and
print a markdown table of verdicts (finite field and float64).

    python -m mirage_cli.verifier.mirage_table [--mugraphs ../shared/mirage-mugraphs]
        [--examples examples] [--imported DIR] [--programs DIR] [--no-float64]

Checkpoints are read through ``loading.load_graphs`` (the Mirage importer); with
``--imported DIR`` the candidates are read instead from ``DIR/<stem>.<i>.ugraph.json``
files written by ``mirage import-mirage``. Programs are ``examples/<prog>.mir`` with
the batch of the checkpoint (or ``--programs DIR/<prog>_bs<batch>.ugraph.json``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph, load_graphs
from mirage_cli.verifier.api import Verifier

# checkpoint stem -> (example program, batch), per the checkpoints' README.
PROGRAMS: dict[str, tuple[str, int]] = {
    "gated_mlp": ("gated_mlp", 8), "single_gated_mlp": ("gated_mlp", 8),
    "gqa_bs1": ("gqa", 1), "gqa_bs8": ("gqa", 8),
    "lora": ("lora", 8), "single_lora": ("lora", 8),
    "ntrans_bs1": ("ntrans", 1), "ntrans_bs8": ("ntrans", 8),
    "rmsnorm_bs1": ("rmsnorm_linear", 1), "rmsnorm_bs8": ("rmsnorm_linear", 8),
}


def program(stem: str, examples: Path, programs: Path | None) -> Graph:
    name, batch = PROGRAMS[stem]
    if programs is not None:
        for cand in (programs / f"{name}_bs{batch}.ugraph.json",
                     programs / f"{name}.ugraph.json"):
            if cand.exists():
                return load_graph(str(cand))
    return load_graph(str(examples / f"{name}.mir"), {"batch": batch})


def candidates(stem: str, mugraphs: Path, imported: Path | None) -> list[Graph]:
    if imported is None:
        return load_graphs(str(mugraphs / f"{stem}.json"))
    files = sorted(imported.glob(f"{stem}.*.ugraph.json"),
                   key=lambda p: int(p.name.split(".")[-3]))
    return [load_graph(str(f)) for f in files]


def verify_file(stem: str, ref: Graph, cands: list[Graph], float64: bool
                ) -> list[tuple[int, str, str, str, int, float, float]]:
    """(index, field verdict, float64 verdict, overall, trials, bound, seconds)."""
    v = Verifier(ref, seed=0)
    rows = []
    for i, c in enumerate(cands):
        t0 = time.perf_counter()
        try:
            cert = v.certify(c, crosscheck_float64=float64)
        except MirageError as e:
            rows.append((i, "bad input: " + e.message, "-", "error", 0, 1.0, 0.0))
            continue
        fv = cert.field_verdict
        ff = {True: "equivalent", False: "not equivalent", None: "undecided"}[fv.equivalent]
        fl = "-" if cert.crosscheck is None else ("close" if cert.crosscheck.close else "far")
        rows.append((i, ff, fl, cert.verdict, fv.trials, cert.final_bound,
                     time.perf_counter() - t0))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mugraphs", default="../shared/mirage-mugraphs")
    ap.add_argument("--examples", default="examples")
    ap.add_argument("--imported", default=None)
    ap.add_argument("--programs", default=None)
    ap.add_argument("--no-float64", action="store_true")
    ap.add_argument("--only", default=None, help="Comma-separated checkpoint stems.")
    args = ap.parse_args(argv)
    stems = args.only.split(",") if args.only else sorted(PROGRAMS)
    print("| file | candidates | finite field: equivalent | float64: close | "
          "disagreements | trials | bound | seconds (all candidates) |")
    print("|---|---|---|---|---|---|---|---|")
    for stem in stems:
        ref = program(stem, Path(args.examples), Path(args.programs) if args.programs else None)
        cands = candidates(stem, Path(args.mugraphs),
                           Path(args.imported) if args.imported else None)
        rows = verify_file(stem, ref, cands, not args.no_float64)
        eq = sum(r[1] == "equivalent" for r in rows)
        close = sum(r[2] == "close" for r in rows)
        dis = [r[0] for r in rows if r[3] == "undecided" or r[3] == "error"]
        trials = sorted({r[4] for r in rows})
        bound = max(r[5] for r in rows) if rows else 1.0
        secs = sum(r[6] for r in rows)
        print(f"| {stem}.json | {len(rows)} | {eq} | {close} | {dis or 'none'} | "
              f"{', '.join(map(str, trials))} | {bound:.2g} | {secs:.0f} |", flush=True)
        for r in rows:
            if r[1] != "equivalent" or (r[2] not in ("close", "-")):
                print(f"|   candidate {r[0]} | | {r[1]} | {r[2]} | {r[3]} | | | |", flush=True)


if __name__ == "__main__":
    main()
