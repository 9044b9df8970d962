"""Where the search's work runs: ``--executor local`` or ``--executor ray``.

- ``local`` (the default): worker processes on this machine. A whole layer's parts
  are searched in ``--jobs`` processes, one part each (:func:`.layer.local_mapper`);
  a single program's units in ``--jobs`` processes (:func:`.driver.search`).
- ``ray``: an existing Ray cluster (``--ray-address``), or a local one started on the
  loopback interface when no address is given. The search's *work units* (for each
  part, each first move: a block configuration, or "a pre-defined operator first")
  become Ray tasks (a few consecutive units per task, :func:`chunk_size`); their
  results are gathered in unit order, so the merge — and so
  the output — is the one of a local run. Ray re-runs the task of a lost worker
  (``max_retries``); a unit is a pure function of (program, options, unit), so a
  retried unit gives the same designs. A whole layer's searched parts are Ray tasks
  too, :func:`parts_in_flight` at a time: each runs its search's driver (tuning, ranking,
  verification) on a worker and sends its units out as tasks; the result cache
  (:mod:`.cache`) is consulted per part by its content hash before any unit is sent.

Ray is an optional extra (``pip install 'mirage-cli[ray]'``); asking for it without
it installed is a usage error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.search import layer
from mirage_cli.search.driver import SearchOptions, Unit, UnitMap, UnitResult, run_units_here

EXECUTORS = ("local", "ray")
# Times Ray re-runs a unit whose worker died before it finished.
RAY_RETRIES = 3


def part_mapper(executor: str, jobs: int, address: str | None) -> layer.PartMapper:
    """How the parts of a layer are searched."""
    if executor == "local":
        return layer.local_mapper(jobs)

    def run(tasks: Sequence[layer.PartTask]) -> list[layer.PartResult]:
        ray = start_ray(address, jobs)
        remote = ray.remote(max_retries=RAY_RETRIES)(_search_part_on_ray)
        window = parts_in_flight(int(ray.cluster_resources().get("CPU", jobs)))
        done: dict[int, layer.PartResult] = {}
        running: dict[Any, int] = {}
        for i, t in enumerate(tasks):
            if not t.plan.searched:
                done[i] = layer.search_part(t)
                continue
            while len(running) >= window:
                _collect(ray, running, done)
            running[remote.remote(t, address, jobs)] = i
        while running:
            _collect(ray, running, done)
        return [done[i] for i in range(len(tasks))]  # in part order
    return run


def parts_in_flight(cpus: int) -> int:
    """Parts searched at once on a cluster of ``cpus``: at least two CPUs per part for
    its units, so that a part's budget is not spent waiting for a CPU (a budget that
    runs out makes the result depend on timing)."""
    return max(1, cpus // 2)


def _collect(ray: Any, running: dict[Any, int], done: dict[int, layer.PartResult]) -> None:
    (ready,), _ = ray.wait(list(running), num_returns=1)
    done[running.pop(ready)] = ray.get(ready)


def _search_part_on_ray(task: layer.PartTask, address: str | None, workers: int
                        ) -> layer.PartResult:
    """One part's search, as a Ray task: its driver (tuning, ranking, verification)
    runs here, its units as further tasks (a task blocked on them gives its CPU back
    to the cluster while it waits)."""
    return layer.search_part(task, ray_unit_map(address, workers))


def unit_map(executor: str, jobs: int, address: str | None) -> UnitMap | None:
    """How the units of one program's search run (None: the driver's own pool)."""
    return None if executor == "local" else ray_unit_map(address, jobs)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MirageError("--executor ray needs Ray: pip install 'mirage-cli[ray]'") from None
    return ray


def start_ray(address: str | None, workers: int) -> Any:
    """Connect to the cluster at ``address``, or start a local one with ``workers``
    CPUs on 127.0.0.1 (nothing listens beyond the loopback interface)."""
    ray = _ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False, _node_ip_address="127.0.0.1")
    return ray


def ray_unit_map(address: str | None, workers: int,
                 unit_fn: Callable[..., list[UnitResult]] = run_units_here) -> UnitMap:
    """Units as Ray tasks, one task per unit, gathered in unit order (``unit_fn``: what
    a task runs, :func:`.driver.run_units_here`; a test wraps it in one that dies)."""
    def run(program: Graph, options: SearchOptions, deadline: float | None,
            todo: list[Unit]) -> Iterator[UnitResult]:
        ray = start_ray(address, workers)
        task = ray.remote(max_retries=RAY_RETRIES)(unit_fn)
        prog = ray.put(program)
        size = chunk_size(len(todo), int(ray.cluster_resources().get("CPU", workers)))
        refs = [task.remote(prog, options, deadline, todo[i:i + size])
                for i in range(0, len(todo), size)]
        for ref in refs:  # in unit order, whatever order they finish in
            yield from ray.get(ref)
    return run


def chunk_size(units: int, cpus: int) -> int:
    """Units per Ray task: about four tasks per CPU, so that the cost of a task (its
    scheduling, a Z3 context and the program's analysis, built once per task) is
    shared by several units while the load still balances."""
    return max(1, units // max(1, 4 * cpus))
