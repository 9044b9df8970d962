"""Work units per second of the search against workers: local processes and Ray.

    python tools/ray_scaling.py PROGRAM.mir [NAME=VALUE ...]

The enumeration units of PROGRAM (``driver.units``: each first move of the kernel-level
search) are run with ``--executor local`` at 1 and 2 jobs and with ``--executor ray`` on
a local Ray (127.0.0.1) of 1 and 2 workers. Each configuration runs the units once to
warm up (worker start, imports, Z3 contexts) and then once timed; the table gives
units per second of the timed round, and checks that every round found the same
designs in the same order. Used for docs/distributed.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.search import driver, executor
from mirage_cli.search.driver import SearchOptions

Run = Callable[[], list[driver.UnitResult]]


def _round(run: Run) -> tuple[float, list[object]]:
    t0 = time.perf_counter()
    found: list[object] = [d for ds, *_ in run() for d in ds]
    return time.perf_counter() - t0, found


def _local(prog: Graph, opts: SearchOptions, todo: list[driver.Unit], jobs: int) -> Run:
    return lambda: list(driver._map(jobs, prog, opts, None, todo))


def _ray(prog: Graph, opts: SearchOptions, todo: list[driver.Unit], workers: int) -> Run:
    import ray

    if ray.is_initialized():
        ray.shutdown()  # a fresh local Ray of ``workers`` CPUs
    umap = executor.ray_unit_map(None, workers)
    return lambda: list(umap(prog, opts, None, todo))


def main(path: str, defines: list[str]) -> None:
    prog = load_graph(path, {k: int(v) for k, v in (d.split("=") for d in defines)})
    opts = SearchOptions()
    todo = driver.units(prog, opts)
    rows = []
    reference = None
    for kind, workers in (("local", 1), ("local", 2), ("ray", 1), ("ray", 2)):
        run = _local(prog, opts, todo, workers) if kind == "local" else \
            _ray(prog, opts, todo, workers)
        _round(run)
        secs, found = _round(run)
        reference = found if reference is None else reference
        assert found == reference, f"{kind} x{workers}: different designs"
        rows.append((kind, workers, len(todo), secs))
    print(f"{path}: {len(todo)} units, {len(reference or [])} designs")
    print("executor  workers  units  seconds  units/s")
    for kind, workers, n, secs in rows:
        print(f"{kind:8}  {workers:7}  {n:5}  {secs:7.2f}  {n / secs:7.2f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
