"""`mirage search PROG -o cands.ugraph.json`: find equivalent µGraphs with custom kernels.

Writes every verified candidate, best first (by the cost model), with its cost,
design decisions, tuning and verification record. Exit 1 when none is found.
The output file is checked and locked before the search (:class:`OutputSet`);
``-o -`` is stdout. ``--name`` names the candidate µGraphs (a later ``codegen``
derives its default entry point from it); ``--arch`` is the target GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import click

from mirage_cli.commands.common import codegen_options, defines_option, parse_defines
from mirage_cli.console import info, warn
from mirage_cli.loading import load_graph
from mirage_cli.profiles import target_option
from mirage_cli.search.cost import use_profile
from mirage_cli.search.display import progress_display
from mirage_cli.search.driver import (
    DEFAULT_MAX_STATES,
    Outcome,
    SearchOptions,
    cached_search,
    explain_none,
)

# Seconds; a safety stop only (docs/search.md, "Where a search ends"): the default
# covers the largest default search measured on this 2-core machine (the attention part
# of the Llama layer, about 2 to 3.5 minutes) with room to spare.
DEFAULT_BUDGET = 600.0
from mirage_cli.util import OutputSet


def search_options(f):  # type: ignore[no-untyped-def]
    """The options `search` and `opt` share."""
    for opt in reversed([
        click.option("--budget", type=click.FloatRange(min=0.1), default=DEFAULT_BUDGET,
                     show_default=True,
                     help="Safety stop, in seconds: work, not time, decides where a "
                          "search ends (--max-states); a search the budget stops keeps "
                          "the best so far, with a warning (its result depends on "
                          "timing and is not cached)."),
        click.option("--jobs", "-j", type=click.IntRange(min=1),
                     default=min(2, os.cpu_count() or 1), show_default=True,
                     help="Worker processes."),
        click.option("--max-kernel-ops", type=click.IntRange(1, 4), default=2,
                     show_default=True, help="Kernels per µGraph."),
        click.option("--max-block-ops", type=click.IntRange(1, 16), default=12,
                     show_default=True, help="Operators per custom kernel."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the verification inputs."),
        click.option("--top", type=click.IntRange(min=1), default=3, show_default=True,
                     help="Verified candidates to keep."),
        click.option("--max-states", type=click.IntRange(min=1), default=DEFAULT_MAX_STATES,
                     show_default=True,
                     help="Work limit: block-graph states each work unit may build "
                          "(the same stopping point on every machine and load)."),
        click.option("--no-prune", is_flag=True, help="Turn Z3 pruning off (ablation)."),
        click.option("--no-cache", is_flag=True, help="Ignore and do not fill the cache."),
    ]):
        f = opt(f)
    return f


def options_from(kw: dict) -> SearchOptions:  # type: ignore[type-arg]
    return SearchOptions(max_kernel_ops=kw["max_kernel_ops"], max_block_ops=kw["max_block_ops"],
                         prune=not kw["no_prune"], seed=kw["seed"], top=kw["top"],
                         max_states=int(kw.get("max_states", DEFAULT_MAX_STATES)))


def run(program_path: str, defines: tuple[str, ...], kw: dict) -> Outcome:  # type: ignore
    program = load_graph(program_path, parse_defines(defines))
    with progress_display() as show:
        return cached_search(program, options_from(kw), kw["budget"], kw["jobs"],
                             not kw["no_cache"], show)


@click.command("search")
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("-o", "output", type=click.Path(dir_okay=False), help="Candidates file.")
@defines_option
@search_options
@codegen_options
@click.option("--json", "as_json", is_flag=True, help="Summary as JSON on stdout.")
@target_option
def command(program: str, output: str | None, defines: tuple[str, ...], as_json: bool,
            name: str | None, arch: str, target: str, **kw: object) -> None:
    """Search for µGraphs equivalent to PROGRAM (with custom fused kernels)."""
    use_profile(target)
    if output == "-":
        output = None
    if name is not None:
        from mirage_cli.codegen.names import check_entry_name

        check_entry_name(name)
    outputs = OutputSet([output], inputs=[program]) if output else contextlib.nullcontext()
    with outputs as files:
        out = run(program, defines, kw)
        if name is not None:
            out = _renamed(out, name)
        if out.cached:
            info("search: cached result (MIRAGE_CACHE_DIR)")
        elif not out.complete:
            warn(clock_warning("search", out))
        if isinstance(files, OutputSet) and output:
            files.commit({output: out.text})
    if not output and not as_json:
        sys.stdout.write(out.text)
    if as_json:
        print(json.dumps(summary(out), indent=2, sort_keys=True))
    elif output:
        for g, meta in out.candidates:
            print(f"#{meta['rank']}: {meta['kernels']} kernel(s), "
                  f"{meta['cost']['time_us']} us predicted, tuning {meta['tuning']}")
    if not out.candidates:
        why = "" if out.progress is None else f": {explain_none(out.progress)}"
        info(f"search: no verified candidate found{why}")
        sys.exit(1)


def _renamed(out: Outcome, name: str) -> Outcome:
    """``out`` with every candidate µGraph named ``name``."""
    from mirage_cli import serialize

    pairs = [(dataclasses.replace(g, name=name), m) for g, m in out.candidates]
    return dataclasses.replace(out, text=serialize.dumps_candidates(pairs), candidates=pairs)


def summary(out: Outcome) -> dict:  # type: ignore[type-arg]
    p = out.progress
    return {"cached": out.cached, "complete": out.complete,
            "candidates": [m for _, m in out.candidates],
            "stats": None if p is None else {
                "states": p.stats.explored, "pruned": p.stats.pruned,
                "z3_queries": p.z3_queries, "designs": p.designs,
                "verified": p.verified, "rejected": p.rejected, "seconds": p.seconds,
                "limited_units": p.limited, "clock_stopped": p.clock}}


def clock_warning(command: str, out: Outcome) -> str:
    """The warning for a search the wall clock stopped (``complete: false``)."""
    what = out.progress.clock if out.progress is not None and out.progress.clock \
        else "the search"
    return (f"{command}: the --budget safety stop ended {what}: the result depends on "
            f"timing (complete: false; not cached); a larger --budget lets the search "
            f"end by its work limit (--max-states)")
