"""NVRTC cubins of µGraphs, one at a time or on spawned worker processes (no GPU needed):
measured selection compiles its variants with them, and the bench its programs and
variants before it measures them."""

from __future__ import annotations

from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph


def compile_one(job: tuple[Graph, str]) -> bytes | str:
    """NVRTC cubin of one µGraph for ``arch``, or the error text (reported, not raised:
    one kernel that does not compile must not stop the others)."""
    g, arch = job
    try:
        prog = lower(g, arch)
        cu, _ = emit(prog)
        return compile_cuda(cu, f"{prog.name}.cu", arch).cubin
    except MirageError as e:
        return e.message
    except Exception as e:  # noqa: BLE001 - a compiler crash is a result to report
        return f"{type(e).__name__}: {e}"


def compile_all(jobs: list[tuple[Graph, str]], workers: int) -> list[bytes | str]:
    """:func:`compile_one` of every job, in order, on ``workers`` processes (spawned:
    forking a process that holds a CUDA context is unsafe)."""
    if workers <= 1 or len(jobs) <= 1:
        return [compile_one(j) for j in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        return list(pool.map(compile_one, jobs, chunksize=1))
