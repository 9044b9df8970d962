"""How much of a fused kernel's time is its loop's tensor-core work? A GPU probe.

    python tools/mma_probe.py OUT.json PROGRAM.mir:BATCH:GRAPH.ugraph.json[:KNOB=V,...] ...

Times each µGraph as generated (``base``), with the mma steps of its forloop removed
(``nomma``: the loads, waits and barriers stay) and with them run twice (``mma2x``),
by a text patch of the generated source; the patched kernels compute wrong results,
so nothing is checked. ``nomma`` against ``base`` says whether the mma is hidden under
the loop's memory time; ``mma2x`` against ``base`` what one more pass of it costs, so
how close it is to being exposed (on a card that streams faster, say). Optional knob
pins (``tools/plan_probe.py``'s ``pinned``) apply to every custom kernel. Timed as the
bench times (CUDA-graph replays over rotating input copies). Used for
docs/perf-log.md v31.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mirage_cli.codegen import bench
from mirage_cli.codegen.runner import Device
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_probe import pinned

MODES = ("base", "nomma", "mma2x")
K_LOOP = re.compile(r"^\s*for \(int s = 0; s < \d+; \+\+s\) \{\s*$")
IT_LOOP = re.compile(r"^\s*for \(int it = 0; it < \d+; \+\+it\) \{\s*$")


def block_end(lines: list[str], i: int) -> int:
    """The line that closes the block opened on line ``i``."""
    depth = 0
    for j in range(i, len(lines)):
        depth += lines[j].count("{") - lines[j].count("}")
        if depth == 0:
            return j
    raise ValueError("unbalanced braces")


def patch(cu: str, mode: str) -> tuple[str, int]:
    """``cu`` with every mma K-step loop inside a forloop removed or doubled, and how
    many there were."""
    if mode == "base":
        return cu, 0
    lines, out, n, i, it_end = cu.split("\n"), [], 0, 0, -1
    while i < len(lines):
        if IT_LOOP.match(lines[i]):
            it_end = block_end(lines, i)
        if i < it_end and K_LOOP.match(lines[i]):
            j = block_end(lines, i)
            body = lines[i:j + 1]
            if out and out[-1].strip().startswith("#pragma unroll"):
                body = [out.pop()] + body
            n += 1
            if mode == "mma2x":
                out += ["for (int mg_rep = 0; mg_rep < 2; ++mg_rep) {"] + body + ["}"]
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out), n


def main(argv: list[str]) -> int:
    out_path, specs = argv[0], argv[1:]
    dev = Device(0)
    rows = []
    compile_cuda = bench.compile_cuda
    for spec in specs:
        prog_path, batch, graph_path, *pins = spec.split(":")
        prog = load_graph(prog_path, {"batch": int(batch)})
        g = load_graph(graph_path, None)
        if pins:
            kv = dict(x.split("=") for x in pins[0].split(","))
            pg = pinned(g, Knobs(**{k: int(v) for k, v in kv.items()}))
            if pg is None:
                print(f"{spec}: the pins are legal nowhere", flush=True)
                continue
            g = pg
        scale = bench.input_scale(prog)
        for mode in MODES:
            loops = [0]

            def patched(cu: str, name: str, arch: str, mode: str = mode,
                        loops: list[int] = loops) -> object:
                cu, n = patch(cu, mode)
                loops[0] += n
                return compile_cuda(cu, name, arch)
            bench.compile_cuda = patched  # type: ignore[assignment]
            try:
                loaded = bench.build(dev, g)
                try:
                    us = bench.time_loaded(dev, loaded, g, 20, scale)
                finally:
                    loaded.unload()
            finally:
                bench.compile_cuda = compile_cuda
            rows.append({"spec": spec, "batch": int(batch), "mode": mode,
                         "loops": loops[0], "us": us})
            print(f"{spec}  {mode:6s} loops={loops[0]}  {us:7.2f} us", flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
