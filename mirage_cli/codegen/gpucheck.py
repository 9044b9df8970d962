"""`python -m mirage_cli.codegen.gpucheck [-D name=value] FILE...`: compile each µGraph
for GPU 0, run it once on random inputs with poisoned outputs, and compare with the
float64 reference. Prints one line per graph; exit 1 if any check fails. Small enough
to run under ``compute-sanitizer``."""

from __future__ import annotations

import sys

from mirage_cli.codegen.bench import check_graph
from mirage_cli.codegen.runner import Device
from mirage_cli.commands.common import parse_defines
from mirage_cli.loading import load_graphs


def main(argv: list[str]) -> int:
    defines: list[str] = []
    files: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "-D":
            defines.append(next(it))
        else:
            files.append(a)
    dev = Device(0)
    failed = 0
    for f in files:
        for i, g in enumerate(load_graphs(f, parse_defines(tuple(defines)) or None)):
            try:
                loaded, chk = check_graph(dev, g)
                loaded.unload()
            except Exception as e:  # noqa: BLE001 - reported per graph
                print(f"FAIL {f}[{i}] {type(e).__name__}: {e}")
                failed += 1
                continue
            print(f"{'ok  ' if chk.ok else 'FAIL'} {f}[{i}] rel_err={chk.rel_err:.2e} {chk.reason}")
            failed += not chk.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
