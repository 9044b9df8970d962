"""`mirage bench --gpu N`: correctness and speed of what `mirage opt` ships, of the
examples' hand-written fused µGraphs, of the unfused lowering, PyTorch eager and
torch.compile (and PyTorch's fused attention, ``sdpa``, for programs that are plain
softmax attention), against the memory floor (DESIGN.md §7).

The candidates of each program and batch come from the very search `mirage opt` runs:
its stage functions, with its default options (read from its command-line options, so
the two cannot drift apart) and its result cache, so a bench after an `opt` (or a
second bench) does not search again. Only ``--jobs``, ``--budget`` and, when more than
`opt` keeps, ``--top`` differ.

``--mirage-ckpt DIR`` adds Mirage's own candidates for each example and batch
(``DIR/<example>_bs<batch>.json``, then ``DIR/<example>.json``), certified by the same
verification as the search's candidates, planned and priced as opt's, and timed as
``mirage#1``, ``mirage#2``, ... (:func:`mirage_cli.codegen.bench.mirage_variants`).

``--per-kernel`` also times each kernel of every correct variant alone and reports its
achieved TFLOP/s and GB/s (the cost model's FLOP and DRAM byte counts over that time):
one more timing per kernel, so it is off by default.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.bench import (
    Checkpoints,
    Row,
    Variant,
    Verify,
    checkpoint_files,
    discover,
    mirage_variants,
    opt_variants,
    run_bench,
)
from mirage_cli.codegen.benchreport import (
    bandwidth_line,
    csv_text,
    document,
    dumps,
    markdown,
    plot,
    require_matplotlib,
    table_cells,
)
from mirage_cli.codegen.copybw import Bandwidth
from mirage_cli.commands.plan import planned
from mirage_cli.console import info, warn
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.profiles import mismatch, target_option
from mirage_cli.search.cost import use_profile
from mirage_cli.util import write_atomic

# The options of `mirage opt` that choose its search (the rest are about its files).
SEARCH_KEYS = ("budget", "jobs", "max_kernel_ops", "max_block_ops", "seed", "top",
               "max_states", "no_prune", "no_cache")


def opt_settings(jobs: int | None = None, top: int = 1, budget: float | None = None
                 ) -> dict[str, Any]:
    """The keyword options `mirage opt` passes to its search stage when run without
    options, but for ``jobs``, ``budget`` and a ``top`` of at least ``top``. With
    ``top`` no larger than opt's default, the search (and its cache entry) is opt's."""
    from mirage_cli.commands import opt

    # get_default, not .default: newer click versions keep an UNSET sentinel (truthy)
    # in a flag's .default, which read as --no-prune and --no-cache.
    ctx = click.Context(opt.command)
    kw: dict[str, Any] = {p.name: p.get_default(ctx) for p in opt.command.params
                          if p.name in SEARCH_KEYS}
    if jobs is not None:
        kw["jobs"] = jobs
    if budget is not None:
        kw["budget"] = budget
    kw["top"] = max(int(kw["top"]), top)
    return kw


def opt_candidates(program: Graph, top: int, kw: dict[str, Any]) -> list[Variant]:
    """The first ``top`` candidates `mirage opt` keeps for ``program``, the shipped one
    marked (found by opt's own stages: search, then select). Only ``top`` need be
    certified: a search cached by a plain `mirage opt` (one certified) serves
    ``--top 1`` as it is, where asking for the search's own top re-verified designs
    at these sizes (mha_decode at batch 16: 139 s of a bench's device time)."""
    from mirage_cli.commands import opt

    try:
        return opt_variants(program, top,
                            lambda g: opt.stage_search(g, kw, kw["budget"], need=top),
                            lambda out: opt.stage_ship(program, out)[0],
                            lambda g: planned(g, DEFAULT_ARCH, []))
    except Exception as e:  # noqa: BLE001 - one program's failed search is a row, not the end
        return [Variant("opt", None, f"search failed: {type(e).__name__}: {e}", ok=False)]


def certify(seed: int) -> Verify:
    """A checkpoint candidate's verification: the one the search gives each of opt's
    candidates (finite-field trials to the default bound, :mod:`mirage_cli.search.verify`),
    with opt's seed; the verdict summarised as JSON data for the row."""
    from mirage_cli.search.verify import verify

    def run(program: Graph, candidate: Graph) -> tuple[bool, dict[str, Any]]:
        v = verify(program, candidate, seed)
        cert = v.detail.get("certificate") or {}
        return v.ok, {"equivalent": v.ok, "method": v.method, "seed": v.seed,
                      "trials": (cert.get("finite_field") or {}).get("trials"),
                      "bound": cert.get("bound")}
    return run


def checkpoint_candidates(ckpt_dir: Path, seed: int) -> Checkpoints:
    """``--mirage-ckpt DIR``: for an example and batch, every candidate of its Mirage
    checkpoints in DIR, certified against the program, planned and priced as opt's."""
    from mirage_cli.search.cost import estimate

    check = certify(seed)

    def variants(prog_path: Path, batch: int, program: Graph) -> list[Variant]:
        files = checkpoint_files(ckpt_dir, prog_path.stem, batch)
        if files:
            info(f"{program.name} batch={batch}: Mirage's candidates "
                 f"({', '.join(f.name for f in files)})")
        return mirage_variants(program, files, check,
                               lambda g: planned(g, DEFAULT_ARCH, []),
                               lambda g: estimate(g).time_us)
    return variants


def parse_batches(text: str) -> tuple[int, ...] | None:
    """``--batch 1,8,16``, or ``own`` (None: every program at its own sizes); anything
    else is a usage error (exit 2)."""
    if text == "own":
        return None
    try:
        bs = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise MirageError(f"--batch {text}: expected comma-separated integers, or 'own'"
                          ) from None
    if not bs or any(b < 1 for b in bs):
        raise MirageError(f"--batch {text}: batch sizes must be positive integers")
    return bs


def table(doc: dict[str, Any]) -> Table:
    head, body = table_cells(doc)
    t = Table(*head, title=f"mirage bench (median µs per call)\n{bandwidth_line(doc)}")
    for row in body:
        t.add_row(*row)
    return t


def _write(path: str, text: str | bytes) -> None:
    if path == "-" and isinstance(text, str):
        click.echo(text, nl=False)
    else:
        write_atomic(path, text)


@click.command()
@click.option("--gpu", "gpu", type=int, required=True, metavar="N", help="CUDA device ordinal.")
@click.option("--batch", "batches", default="1,8,16", show_default=True,
              help="Comma-separated batch sizes (-D batch=...), or 'own': each program at "
                   "its own sizes.")
@click.option("--only", multiple=True, metavar="NAME", help="Only these example programs.")
@click.option("--root", default=".", show_default=True,
              help="Directory holding examples/, or the programs themselves.")
@click.option("--replays", type=click.IntRange(min=1), default=30, show_default=True,
              help="CUDA-graph replays per measurement (the median is reported).")
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True,
              help="Candidates of `mirage opt`'s search to time per program and batch.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Search worker processes, and NVRTC compile processes once the "
                   "searches are done [default: mirage opt's; compiles: the CPU count].")
@click.option("--budget", type=click.FloatRange(min=0.1), default=None,
              help="Search seconds per program and batch [default: mirage opt's].")
@click.option("--no-search", is_flag=True,
              help="Skip opt's candidates (and its search); time the rest.")
@click.option("--mirage-ckpt", "mirage_ckpt", metavar="DIR",
              type=click.Path(exists=True, file_okay=False),
              help="Also time Mirage's own candidates: every candidate of "
                   "DIR/<example>_bs<batch>.json and DIR/<example>.json whose shapes are "
                   "the program's at the batch, as mirage#1, mirage#2, ...")
@click.option("--no-torch", is_flag=True, help="Skip the PyTorch baselines.")
@click.option("--no-compile", is_flag=True, help="Skip the torch.compile baseline.")
@click.option("--per-kernel", "per_kernel", is_flag=True,
              help="Also time each kernel of every variant alone and report its µs, "
                   "TFLOP/s and GB/s (FLOPs and DRAM bytes as the cost model counts them).")
@click.option("--json", "json_path", metavar="FILE", help="Write the rows as JSON ('-': stdout).")
@click.option("--csv", "csv_path", metavar="FILE", help="Write the rows as CSV ('-': stdout).")
@click.option("--markdown", "md_path", metavar="FILE", help="Write the table as Markdown.")
@click.option("--plot", "plot_path", metavar="FILE.png",
              help="Plot µs per benchmark and variant, floor marked (needs matplotlib).")
@target_option
def command(gpu: int, batches: str, only: tuple[str, ...], root: str, replays: int, top: int,
            jobs: int | None, budget: float | None, no_search: bool,
            mirage_ckpt: str | None, no_torch: bool,
            no_compile: bool, per_kernel: bool, json_path: str | None, csv_path: str | None,
            md_path: str | None, plot_path: str | None, target: str) -> None:
    """Check and time, on GPU N, every example: the µGraphs `mirage opt` keeps (the
    shipped one marked), the hand-written fused µGraphs, Mirage's own candidates
    (--mirage-ckpt) and the baselines (PyTorch's scaled_dot_product_attention too,
    for plain softmax attention)."""
    from mirage_cli.codegen.runner import Device

    prof = use_profile(target)  # as `mirage opt --target`: it ranks opt's candidates
    bs = parse_batches(batches)
    if plot_path:
        require_matplotlib(plot_path)
    pairs = [p for p in discover(Path(root)) if not only or p[0].stem in only]
    if not pairs:
        raise MirageError(f"no example programs under {root}/examples"
                          + (f" named {', '.join(only)}" if only else ""))
    kw = opt_settings(jobs, top, budget)
    opened: list[Device] = []

    def device() -> Device:  # opened after the searches (see run_bench)
        if not opened:
            opened.append(Device(gpu))
            if not no_search and (notice := mismatch(prof, opened[0].name)):
                warn(notice)
        return opened[0]
    command_line = "mirage bench " + " ".join(sys.argv[2:])

    def write_files(bw: Bandwidth, rows: list[Row], unfinished: str = "") -> None:
        """The report files (stdout and the plot only once the run is done)."""
        doc = document(device().name, device().arch, command_line, bw, rows, unfinished)
        for path, render in ((json_path, dumps), (csv_path, csv_text), (md_path, markdown)):
            if path and not (unfinished and path == "-"):
                _write(path, render(doc))

    def progress(bw: Bandwidth, rows: list[Row], done: int, total: int) -> None:
        write_files(bw, rows, f"{done} of {total} program and batch pairs measured")

    bw, rows = run_bench(device, pairs, bs, replays, not no_torch, not no_compile,
                         candidates=None if no_search else
                         (lambda g: opt_candidates(g, top, kw)),
                         checkpoints=None if mirage_ckpt is None else
                         checkpoint_candidates(Path(mirage_ckpt), int(kw["seed"])),
                         per_kernel=per_kernel, workers=jobs or os.cpu_count() or 1,
                         progress=progress)
    dev = device()
    doc = document(dev.name, dev.arch, command_line, bw, rows)
    # The table goes to stderr when stdout carries the rows.
    to_stderr = "-" in (json_path, csv_path, md_path)
    Console(highlight=False, width=220, stderr=to_stderr).print(table(doc))
    write_files(bw, rows)
    if plot_path:
        write_atomic(plot_path, plot(doc, plot_path))
    if not all(r.ok for r in rows):
        sys.exit(1)
