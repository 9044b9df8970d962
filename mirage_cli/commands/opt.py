"""`mirage opt PROG.mir -o prog.cu`: the whole pipeline (DESIGN.md §2, §6).

Stages, each a function from the previous stage's file to the next (named by file
extension, as in the design's pipeline)::

    prog.mir --parse--> prog.ugraph.json --search--> prog.cands.ugraph.json
             --select--> prog.best.ugraph.json --codegen--> prog.cu + prog.h

The search ends where its work limit says (``--max-states``, docs/search.md "Where a
search ends"), so the output is a function of the program and the options. ``--budget
S`` is a safety stop on the wall time of the whole command: the search gets what is
left after parsing, less a reserve for code generation; when it is what ends a search,
``opt`` warns that the output depends on timing. A program larger than
``--max-part-ops`` operators, or with a barrier, is cut into parts searched apart
(:mod:`mirage_cli.search.layer`); ``--budget`` is then each part's.
``--executor ray [--ray-address ADDR]`` runs the search's work units as Ray tasks
(:mod:`mirage_cli.search.executor`); the output is the same as with the default
``--executor local``. When it finds no verified
µGraph in time, ``opt`` ships the program's own (unfused) lowering with a warning
and exit 0 — a build never breaks for want of search time — unless
``--require-fused`` asks for exit 1 instead.

Outputs (:class:`~mirage_cli.util.OutputSet`): ``prog.cu``, ``prog.h`` beside it,
``prog.hpp`` with ``--hpp``, and with ``-MD`` the depfile ``prog.mir.d`` (``-MF``
names it; the ``.mir.d`` suffix keeps it apart from the ``prog.d`` that nvcc -MMD
writes) and the stamp ``prog.mir.stamp``. They are checked and locked before the
search, written together, left untouched when unchanged (the stamp excepted: it is
touched on every successful run, as the Make target that records it), and never
written over the program. ``-o -`` writes the ``.cu`` alone to stdout.

``--gpu N`` selects among the verified candidates by measurement on GPU N
(:mod:`mirage_cli.search.measure`): the shipped µGraph is the fastest correct variant
(design x tuning x plan knobs), with its measured plan knobs; ``--save-temps`` keeps
every timed variant in ``prog.measured.ugraph.json``. ``--target`` picks the cost
model's device profile (:mod:`mirage_cli.profiles`). ``--pin`` and ``--widen`` (the
syntax of ``mirage tune``) restrict or extend the tuning of the searched designs: the
ranking within them (or, with ``--gpu``, the measurement) chooses, and a finite-field
trial against the program checks the tuning shipped (``--save-temps`` keeps what was
ranked in ``prog.pinned.ugraph.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from mirage_cli import __version__, serialize
from mirage_cli.codegen.aliasing import launched
from mirage_cli.commands.common import (
    codegen_options,
    defines_option,
    parse_defines,
    plan_option,
)
from mirage_cli.commands.plan import pins_file, planned, recorded_pins
from mirage_cli.commands.search import clock_warning, options_from, search_options
from mirage_cli.console import info, warn
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.profiles import mismatch, target_option
from mirage_cli.search.cost import use_profile
from mirage_cli.search.display import progress_display
from mirage_cli.search.driver import Outcome, cached_search, explain_none, slower_than_unfused
from mirage_cli.search.layer import DEFAULT_MAX_OPS, LayerResult
from mirage_cli.util import OutputSet, write_files

# Seconds of the budget kept for code generation and writing (at most a quarter).
CODEGEN_RESERVE = 0.3


def stage_parse(path: str, defines: dict[str, int]) -> Graph:
    return load_graph(path, defines)


def stage_search(program: Graph, kw: dict, budget: float,  # type: ignore[type-arg]
                 need: int | None = None) -> Outcome:
    """The candidates: searched, or (shape reuse) the known designs re-verified at these
    sizes, of which only ``need`` (default ``--top``) are certified: `opt` ships the
    first unless ``--gpu`` measures the top ones. A program with a tensor too large
    for the generated kernels' indexing is refused first (exit 2), as
    ``cached_search`` refuses it: the shape reuse below verifies known designs at the
    program's sizes without searching (``mirage bench`` comes here too)."""
    from mirage_cli.codegen.indexing import check_program_range

    check_program_range(program)
    if _layered(program, kw):  # a whole layer: its parts searched, --budget each
        return stage_layer(program, kw)[0]
    if kw.get("reuse"):  # --reuse: the known designs at this program's sizes, no search
        from mirage_cli.search.driver import reused_search

        with progress_display() as show:
            return reused_search(program, str(kw["reuse"]), options_from(kw), show, need)
    if not kw["no_cache"]:  # the same program searched at other sizes: reuse its designs
        from mirage_cli.search.reuse import reused

        with progress_display() as show:
            out = reused(program, options_from(kw), show, need, budget, int(kw["jobs"]))
        if out is not None:
            return out
    with progress_display() as show:
        from mirage_cli.search.executor import unit_map

        return cached_search(program, options_from(kw), budget, kw["jobs"],
                             not kw["no_cache"], show,
                             unit_map(str(kw.get("executor", "local")), int(kw["jobs"]),
                                      kw.get("ray_address")))


def _layered(program: Graph, kw: dict) -> bool:  # type: ignore[type-arg]
    from mirage_cli.search.layer import needs_layering

    return needs_layering(program) and not kw.get("reuse")


def stage_layer(program: Graph, kw: dict) -> tuple[Outcome, LayerResult]:  # type: ignore[type-arg]
    """A program too large for one search (:mod:`mirage_cli.search.layer`): its parts
    searched (``--budget`` seconds each), stitched and verified whole; as an
    :class:`Outcome` of one candidate (none when the whole did not verify), and the
    parts."""
    from mirage_cli.search import layer
    from mirage_cli.search.executor import part_mapper

    max_ops = int(kw.get("max_part_ops", DEFAULT_MAX_OPS))
    executor = str(kw.get("executor", "local"))
    mapper = part_mapper(executor, int(kw["jobs"]), kw.get("ray_address"))
    info(f"opt: {len(program.ops)} operators: searching "
         f"{len(layer.plan_parts(program, max_ops))} parts "
         f"(at most {max_ops} operators each; --executor {executor})")
    res = layer.optimise_layer(program, options_from(kw), float(kw["budget"]), mapper,
                               max_ops, not kw["no_cache"])
    for line in layer.render_parts(res.as_json()):
        info("opt: " + line)
    stopped = [r for r in res.parts if not r.complete]
    if stopped:
        warn("opt: the --budget safety stop ended the search of part(s) "
             + ", ".join(str(r.plan.index) for r in stopped)
             + f" (--budget {kw['budget']} s each): the output depends on timing "
               "(complete: false); a larger --budget lets every part end by its work "
               "limit (--max-states)")
    cands = [] if res.graph is None else [
        (res.graph, {"rank": 0, "layer": res.as_json(), "verification": res.verdict,
                     "kernels": launched(res.graph), "tool": f"mirage-cli {__version__}"})]
    return Outcome(serialize.dumps_candidates(cands), cands, res.cached, res.complete,
                   None), res


def _part_temps(program: Graph, res: LayerResult, stem: str) -> list[tuple[str, str]]:
    """``--save-temps``: each part's program and what it ships."""
    from mirage_cli.search.layer import part_program

    out = []
    for r in res.parts:
        out.append((f"{stem}.part{r.plan.index}.ugraph.json",
                    serialize.dumps(part_program(program, r.plan))))
        out.append((f"{stem}.part{r.plan.index}.best.ugraph.json", serialize.dumps(r.graph)))
    return out


def stage_select(out: Outcome) -> Graph | None:
    """The best verified candidate, or None."""
    return out.candidates[0][0] if out.candidates else None


def stage_ship(program: Graph, out: Outcome, require_fused: bool = False
               ) -> tuple[Graph | None, str | None]:
    """What `mirage opt` (without ``--gpu``) ships from ``out``, and why it is the
    unfused lowering when it is: the best verified candidate, unless the model predicts
    it slower than ``program`` itself (:func:`~mirage_cli.search.driver.slower_than_unfused`)
    and ``require_fused`` is off. ``mirage bench`` marks the same choice as shipped."""
    best = stage_select(out)
    if best is None or require_fused:
        return best, None
    slower = slower_than_unfused(program, best)
    return (best, None) if slower is None else (program, slower)


def stage_codegen(best: Graph, name: str, arch: str, header: str | None
                  ) -> tuple[str, str, str | None, int]:
    """CUDA source, header and (when ``header`` is given) typed C++ interface of
    ``best``, with entry point ``name``, and how many launches the entry point makes
    (kernels that run alike share one: codegen/grouping.py)."""
    from mirage_cli.codegen.emit import emit, emit_hpp
    from mirage_cli.codegen.lower import lower

    prog = lower(best, name=name, arch=arch)
    cu, h = emit(prog)
    return cu, h, None if header is None else emit_hpp(prog, header), len(prog.kernels)


class NoCandidate(Exception):
    """The search found no verified µGraph and ``--require-fused`` was given (exit 1)."""


def output_paths(output: str, make_deps: bool, dep_file: str | None, hpp: bool
                 ) -> dict[str, str]:
    """Every file ``opt`` writes, by role (cu, h, hpp, d, stamp)."""
    if output == "-":
        if make_deps or dep_file or hpp:
            raise MirageError("-o -: the .cu goes to stdout alone; -MD, -MF and --hpp need "
                              "a file name")
        return {}
    if not output.endswith(".cu"):
        raise MirageError(f"-o {output}: the output file must end in .cu")
    stem = output[:-len(".cu")]
    paths = {"cu": output, "h": stem + ".h"}
    if hpp:
        paths["hpp"] = stem + ".hpp"
    if make_deps or dep_file:
        paths["d"] = dep_file or stem + ".mir.d"
        paths["stamp"] = stem + ".mir.stamp"
    return paths


@contextlib.contextmanager
def _locked(paths: dict[str, str], program: str) -> Iterator[OutputSet | None]:
    if not paths:
        yield None
        return
    with OutputSet(list(paths.values()), inputs=[program]) as out:
        yield out


@click.command("opt")
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("-o", "output", required=True,
              help="The .cu file to write (its .h is written beside it); - for stdout.")
@defines_option
@search_options
@codegen_options
@click.option("--require-fused", is_flag=True,
              help="Exit 1 when no verified fused µGraph is found (default: ship the "
                   "unfused lowering with a warning).")
@plan_option
@click.option("--reuse", type=click.Path(dir_okay=False), metavar="CANDS.ugraph.json",
              help="Re-tune and re-verify the designs of these candidates (found at "
                   "other sizes) instead of searching.")
@click.option("--gpu", type=int, default=None, metavar="N",
              help="Select the fastest verified variant by measurement on GPU N.")
@click.option("--pin", default="", metavar="K=V,...",
              help="Ship a tuning with these values: grid=AxBxC, forloop=N or plan knobs "
                   "(stages=2,...); kN.K=V for custom kernel N alone (as 'mirage tune').")
@click.option("--widen", multiple=True, metavar="K=V1,V2",
              help="Extra grid or forloop values the tuning may take (repeatable).")
@target_option
@click.option("--hpp", is_flag=True, help="Also write the typed C++ interface (.hpp).")
@click.option("--save-temps", "save_temps", type=click.Path(file_okay=False),
              help="Keep every intermediate file in this directory.")
@click.option("--max-part-ops", type=click.IntRange(1, 12), default=DEFAULT_MAX_OPS,
              show_default=True,
              help="A program of more than 12 operators, or with a reshape, rotate_half or "
                   "concat, is cut into parts of at most this many operators, searched "
                   "apart (docs/search.md, Whole layers); --budget is then per part.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="Where the search runs: worker processes here, or "
                                      "tasks on a Ray cluster (docs/distributed.md).")
@click.option("--ray-address", metavar="ADDR",
              help="The Ray cluster to use (default: start one on 127.0.0.1).")
@click.option("-MD", "make_deps", is_flag=True,
              help="Write a depfile (prog.mir.d) and a stamp (prog.mir.stamp).")
@click.option("-MF", "dep_file", type=click.Path(dir_okay=False),
              help="Name of the depfile (implies -MD).")
def command(program: str, output: str, defines: tuple[str, ...], save_temps: str | None,
            make_deps: bool, dep_file: str | None, name: str | None, arch: str,
            require_fused: bool, hpp: bool, plan_pins: str | None, gpu: int | None,
            pin: str, widen: tuple[str, ...], target: str, **kw: object) -> None:
    """Optimise PROGRAM end to end: parse, search, verify, rank, generate CUDA."""
    if plan_pins and pin:
        raise MirageError("opt: --plan and --pin both pin the tuning: give one of them")
    prof = use_profile(target)
    timer = _open_gpu(gpu)  # before the search: no GPU is exit 2 at once
    if timer is not None and (notice := mismatch(prof, timer.device)):
        warn(notice + " (it chooses which designs are measured)")
    # From the command's start: Python's own start-up (0.5-1.5 s) comes before it, and
    # a process age would be wrong for in-process callers (tests, bench).
    deadline = time.monotonic() + float(kw["budget"])  # type: ignore[arg-type]
    paths = output_paths(output, make_deps, dep_file, hpp)
    with _locked(paths, program) as out:
        g = stage_parse(program, parse_defines(defines))
        from mirage_cli.codegen.lower import entry_name

        entry = entry_name(g, name)  # from the program: the same whichever µGraph wins
        pins = pins_file(plan_pins) if plan_pins else []
        within = (pin, widen, arch) if pin or widen else None
        best, fused = _optimise(g, program, kw, deadline, save_temps, require_fused,
                                lambda b: planned(b, arch, pins or recorded_pins(b)), timer,
                                within)
        header = Path(paths["h"]).name if "hpp" in paths else None
        cu, h, hpp_text, launches = stage_codegen(best, entry, arch, header)
        if out is None:
            click.echo(cu, nl=False)
            return
        files: dict[str, str | bytes] = {paths["cu"]: cu, paths["h"]: h}
        if hpp_text is not None:
            files[paths["hpp"]] = hpp_text
        if "d" in paths:
            files[paths["stamp"]] = _stamp(program, defines, name, arch, fused,
                                           {**kw, "gpu": gpu, "target": target,
                                            **({"pin": pin, "widen": list(widen)}
                                               if pin or widen else {})})
            files[paths["d"]] = depfile([paths["stamp"], paths["cu"], paths["h"]]
                                        + ([paths["hpp"]] if "hpp" in paths else []),
                                        [program, *tool_files()])
        changed = out.commit(files)
        if "stamp" in paths:
            os.utime(paths["stamp"])  # the Make target: newer than its prerequisites
    kept = [p for p in files if p not in changed]
    info(f"opt: wrote {', '.join(changed) or 'nothing'}"
         + (f" ({', '.join(kept)} unchanged)" if kept else "")
         + f"; entry point {entry}, {launched(best)} kernel(s) in {launches} launch(es)")


def _open_gpu(gpu: int | None) -> Any:
    """The measuring timer on GPU ``gpu`` (None without ``--gpu``)."""
    if gpu is None:
        return None
    from mirage_cli.search import measure

    return measure.GpuTimer(gpu)


def stage_measure(g: Graph, res: Outcome, timer: Any, kw: dict  # type: ignore[type-arg]
                  ) -> tuple[Graph, str]:
    """``--gpu``: the fastest correct variant of the candidates, and every timed variant
    as a candidates file."""
    from mirage_cli.search import measure

    r = measure.measure([c for c, _ in res.candidates], g, timer, top=int(kw["top"]),
                        workers=max(int(kw["jobs"]), os.cpu_count() or 1),
                        use_cache=not kw["no_cache"],
                        accept=measure.reverified(g, int(kw["seed"])))
    pairs = r.candidates()
    return pairs[0][0], serialize.dumps_candidates(pairs)


def stage_pinned(g: Graph, res: Outcome, pin: str, widen: tuple[str, ...], arch: str,
                 timer: Any, kw: dict  # type: ignore[type-arg]
                 ) -> tuple[Graph, str]:
    """``--pin`` / ``--widen``: the tunings within them of the searched designs (the first
    candidate of each), ranked by the cost model as ``mirage tune`` ranks them, with the
    pinned plan knobs; with ``--gpu``, the first ``--top`` of them measured as they are,
    the pinned knobs held. A new tuning of a verified design ships only once a
    finite-field trial against the program accepts it (the first one that does). Also
    the candidates file of what was ranked or timed."""
    from mirage_cli.commands.tune import first_verified, pinned_knobs, within_pins
    from mirage_cli.search import measure
    from mirage_cli.search.design import design_of

    cands = [c for c, _ in res.candidates]
    designs = list(dict.fromkeys(design_of(c)[0] for c in cands))
    firsts = [next(c for c in cands if design_of(c)[0] == d) for d in designs]
    pins, ranked = within_pins(firsts, pin, widen, arch)
    seed = int(kw["seed"])
    if timer is not None:
        kernels = max(len(design_of(c)[1]) for c in firsts)
        r = measure.measure([c for c, _ in ranked], g, timer, top=int(kw["top"]),
                            workers=max(int(kw["jobs"]), os.cpu_count() or 1),
                            use_cache=not kw["no_cache"], pinned=pinned_knobs(pins, kernels),
                            accept=measure.reverified(g, seed))
        pairs = r.candidates()
        return pairs[0][0], serialize.dumps_candidates(pairs)
    ranked = first_verified(ranked, g, "the program", seed, "opt")
    text = serialize.dumps_candidates(
        [(c, {"rank": i, "tuning": [{"grid": list(gr), "forloop": f} for gr, f in t],
              "pins": pin, "verified": i == 0}) for i, (c, t) in enumerate(ranked)])
    return ranked[0][0], text


def _optimise(g: Graph, program: str, kw: dict, deadline: float,  # type: ignore[type-arg]
              save_temps: str | None, require_fused: bool,
              plan: Callable[[Graph], Graph], timer: Any = None,
              within: tuple[str, tuple[str, ...], str] | None = None) -> tuple[Graph, bool]:
    """The µGraph to ship, with its kernel plans, and whether it came from the search.
    ``within``: ``--pin``, ``--widen`` and the arch, when the tuning is pinned or
    widened (:func:`stage_pinned`)."""
    base = Path(program).name.split(".")[0]
    temps: list[tuple[str, str]] = []
    if save_temps:
        temps.append((os.path.join(save_temps, f"{base}.ugraph.json"), serialize.dumps(g)))
    left = deadline - time.monotonic()
    reserve = min(CODEGEN_RESERVE, left / 4)
    best = None
    why = "no time left in the budget for a search"
    if _layered(g, kw):
        if within is not None:
            raise MirageError("opt: --pin and --widen tune one program's designs; this "
                              "program is searched in parts (see --max-part-ops)")
        res, parts = stage_layer(g, kw)
        if save_temps:
            stem = os.path.join(save_temps, base)
            temps.extend(_part_temps(g, parts, stem))
            temps.append((stem + ".cands.ugraph.json", res.text))
        best = stage_select(res)
        why = "the stitched parts did not verify as a whole"
    elif left - reserve > 0.05:
        # Without --gpu or pins only the first candidate ships: a shape reuse
        # certifies just it.
        every = timer is not None or within is not None
        res = stage_search(g, kw, left - reserve, None if every else 1)
        if not res.complete and not res.cached:
            warn(clock_warning("opt", res))
        if save_temps:
            temps.append((os.path.join(save_temps, f"{base}.cands.ugraph.json"), res.text))
        if within is not None and res.candidates:
            best, ranked = stage_pinned(g, res, *within, timer, kw)
            if save_temps:
                temps.append((os.path.join(save_temps, f"{base}.pinned.ugraph.json"), ranked))
        elif timer is not None and res.candidates:
            best, measured = stage_measure(g, res, timer, kw)
            if save_temps:
                temps.append((os.path.join(save_temps, f"{base}.measured.ugraph.json"),
                              measured))
        else:
            best, slower = stage_ship(g, res, require_fused)
            if slower is not None:
                info(f"opt: {slower}: shipping the unfused lowering")
        why = explain_none(res.progress) if res.progress else "search interrupted"
    fused = best is not None and best is not g
    if best is None:
        if require_fused:
            _write_temps(temps, program)
            info(f"opt: the search found no verified µGraph (--require-fused): {why}")
            raise SystemExit(1)
        warn(f"opt: no verified fused µGraph within --budget {kw['budget']} s ({why}); "
             f"shipping the unfused lowering of the program (exact, but slower)")
        best = g
    best = plan(best)  # the thread level, recorded in best.ugraph.json and followed by codegen
    if save_temps:
        temps.append((os.path.join(save_temps, f"{base}.best.ugraph.json"),
                      serialize.dumps(best)))
    _write_temps(temps, program)
    return best, fused


def _write_temps(temps: list[tuple[str, str]], program: str) -> None:
    if temps:
        write_files(temps, inputs=[program])


def _stamp(program: str, defines: tuple[str, ...], name: str | None, arch: str, fused: bool,
           kw: dict) -> str:  # type: ignore[type-arg]
    """What the outputs were built from: tool version, program, options, -D values."""
    doc = {"tool": f"mirage-cli {__version__}", "program": os.path.normpath(program),
           "defines": sorted(defines), "name": name, "arch": arch, "fused": fused,
           "options": {k: kw[k] for k in sorted(kw)
                       if k not in ("jobs", "executor", "ray_address")}}
    return json.dumps(doc, sort_keys=True, indent=1) + "\n"


def _esc(path: str) -> str:
    """A path as a Make word (spaces, '#' and '$' escaped)."""
    return path.replace("\\", "\\\\").replace(" ", "\\ ").replace("#", "\\#").replace("$", "$$")


def depfile(targets: list[str], deps: list[str]) -> str:
    """One rule ``targets: deps`` and an empty rule per dependency (as ``-MP``), so a
    deleted or renamed dependency does not stop the build."""
    lines = [" ".join(_esc(t) for t in targets) + ":"
             + "".join(f" \\\n  {_esc(d)}" for d in deps)]
    lines += [f"{_esc(d)}:" for d in deps]
    return "\n".join(lines) + "\n"


def tool_files() -> list[str]:
    """The files of this tool that shape its output (sources, templates, grammar)."""
    import mirage_cli

    root = Path(mirage_cli.__file__).resolve().parent
    found = [p for p in root.rglob("*") if p.suffix in (".py", ".j2", ".cuh", ".lark")
             and "__pycache__" not in p.parts]
    grammar = root.parent / "grammar" / "mir.lark"
    if grammar.is_file():
        found.append(grammar)
    return sorted(str(p) for p in found)
