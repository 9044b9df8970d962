"""Fill the search cache with what `mirage opt` ships, so that a later `mirage bench`
(on a GPU machine, the cache carried there) times the shipped µGraphs without
searching again. No GPU needed.

    MIRAGE_CACHE_DIR=DIR PYTHONPATH=$PWD python tools/warm_cache.py [GROUP ...]
        [--batches 8,1,16] [--jobs 2]

GROUP is ``layers`` (the decoder layers, the longest searches: 2.5-8 minutes each on
2 cores), ``examples`` (the other example programs) or ``models``
(``examples/models/*.mir``, at their own sizes); all three, in that order, by default.
Each program runs as `mirage opt PROGRAM -D batch=B -o TMP.cu --jobs J` in a process
of its own (the bench's search is opt's: docs/perf.md), one line printed per run with
its exit status and seconds. The cache entries are keyed by the program, the search
revision and the device profile: after a change to either, warm again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("layers", "examples", "models")


def runs(groups: list[str], batches: list[int]) -> list[tuple[Path, int | None]]:
    """(program, batch) in the order they run; batch None: the program's own sizes."""
    examples = sorted((ROOT / "examples").glob("*.mir"))
    layers = [p for p in examples if p.stem.endswith("_layer")]
    out: list[tuple[Path, int | None]] = []
    for group in groups:
        if group == "layers":
            out += [(p, b) for b in batches for p in layers]
        elif group == "examples":
            out += [(p, b) for p in examples if p not in layers for b in batches]
        else:
            out += [(p, None) for p in sorted((ROOT / "examples" / "models").glob("*.mir"))]
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="*", metavar="GROUP", help=", ".join(GROUPS))
    ap.add_argument("--batches", default="8,1,16")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    if unknown := [g for g in args.groups if g not in GROUPS]:
        ap.error(f"unknown group(s) {', '.join(unknown)}: choose from {', '.join(GROUPS)}")
    batches = [int(b) for b in args.batches.split(",")]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for prog, batch in runs(args.groups or list(GROUPS), batches):
            cmd = [sys.executable, "-m", "mirage_cli", "opt", str(prog), "-o",
                   str(Path(tmp) / "out.cu"), "--jobs", str(args.jobs)]
            if batch is not None:
                cmd += ["-D", f"batch={batch}"]
            start = time.time()
            done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
            failed += done.returncode != 0
            where = prog.stem + ("" if batch is None else f" batch {batch}")
            print(f"{where}: exit {done.returncode}, {time.time() - start:.0f} s", flush=True)
            if done.returncode:  # opt's diagnostic: its last line
                print("  " + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
