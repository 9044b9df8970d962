"""`mirage tune CANDS.ugraph.json [--space] [--pin ...] [--widen ...] [-o out]`.

``--space`` prints the tuning space of each design in the file: per custom kernel, each
split grid axis and the forloop with the values the builder accepts (divisors of the
extent they split; at least 2, as the tuner requires), and each kernel-plan knob with
its legal values (:func:`mirage_cli.codegen.planner.knob_space`) and the constraint
bounding it. ``--pin grid=4x8x1,forloop=2`` fixes values and ``--widen forloop=2,8``
adds values to try; the tunings are then re-ranked by the cost model (ties by the
stated rule) and, with ``-o``, written as candidates, from the first that a finite-field
trial finds equivalent to the file's first candidate (``verified`` in its metadata; the
later ones are not checked); a design that cannot hold the pins is left out (an error only
when none can). Plan knobs (``stages=2``) are
checked against their legal range and attached as plans. A pin prefixed ``kN.``
(``k0.grid=8x32x1,k0.forloop=2,k1.threads=256``) holds for custom kernel N alone (the
numbering of ``--space``) and overrides an unprefixed pin there; unprefixed pins hold
for every custom kernel.

``--gpu N`` selects by measurement (:mod:`mirage_cli.search.measure`): the first
``--top`` designs of FILE, each at its best tunings and plan-knob settings, compiled in
``--jobs`` worker processes, checked on GPU N against the float64 reference of the first
candidate (every candidate of a search is verified equivalent to the program) and
timed; ``-o`` then writes every variant with its measured time, the fastest first.
With ``--pin`` or ``--widen`` it times the first ``--top`` tunings within them (the
cost model's order), each as it is, with the pinned knobs held in every knob setting.
Without a usable GPU it exits 2.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import click

from mirage_cli import serialize
from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.aliasing import launched
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import read_text
from mirage_cli.search.cost import estimate, rank, target_option, use_profile
from mirage_cli.search.design import Design, Tuning, custom_steps, design_of, instantiate
from mirage_cli.util import write_atomic

MAX_TUNINGS = 4096  # tunings costed per design (the product of the values tried)
GRID_KEYS = ("grid", "forloop")


def _legal(g: Graph, design: Design, tuning: Tuning, k: int, axis: int | None,
           extent: int) -> list[int]:
    """Values of grid ``axis`` (None: the forloop) of custom kernel ``k`` that the builder
    accepts, everything else as in ``tuning``."""
    out = []
    for n in range(2, min(extent, 4096) + 1):
        if extent % n:
            continue
        grid, f = tuning[k]
        if axis is None:
            t = tuning[:k] + ((grid, n),) + tuning[k + 1:]
        else:
            g3 = list(grid)
            g3[axis] = n
            t = tuning[:k] + (((g3[0], g3[1], g3[2]), f),) + tuning[k + 1:]
        if instantiate(g, design, t) is not None:
            out.append(n)
    return out


def space_lines(g: Graph, arch: str) -> list[str]:
    from mirage_cli.codegen.planner import knob_space
    from mirage_cli.codegen.smemplan import MAX_STAGES

    design, tuning = design_of(g)
    types = g.tensor_types()
    lines = []
    k = 0
    for op in g.ops:
        if op.block is None:
            continue
        bg, step = op.block, custom_steps(design)[k]
        lines.append(f"  kernel {k} ({' '.join(b.op for b in bg.ops)}):")
        for a in range(step.axes):
            dims = {(bi.source, dim) for bi in bg.inputs if (dim := bi.imap[a]) is not None}
            src, d = min(dims) if dims else ("?", 0)
            ext = types[src].shape[d] if src in types else 0
            vals = _legal(g, design, tuning, k, a, ext)
            lines.append(f"    grid.{'xyz'[a]} = {bg.grid[a]}  legal {vals}  "
                         f"(divides {src} dim {d} = {ext}; >= 2: a split axis)")
        if step.looped:
            loop = [(bi.source, bi.fmap) for bi in bg.inputs if bi.fmap is not None]
            src, d = loop[0]
            ext = types[src].shape[d] if src in types else 0
            vals = _legal(g, design, tuning, k, None, ext)
            lines.append(f"    forloop = {bg.forloop}  legal {vals}  "
                         f"(divides {src} dim {d} / its grid split; >= 2: a looped kernel)")
        bounds = {"stages": f"<= min({MAX_STAGES}, forloop) copies in flight",
                  "kwarps": "warps splitting the K dimension of accumulated mmas",
                  "pad": "0/1", "ldmatrix": "0/1", "stage_once": "0/1",
                  "vec": "16-byte vectors dividing the stored rows",
                  "threads": "threads per block",
                  "ksplit": "blocks of an sm_90 cluster splitting the forloop",
                  "stagger": "each block starts at its own iteration",
                  "chain": "a matmul chain's score in mma fragments",
                  "tma": "loop inputs by bulk tensor copies (sm_90)",
                  "wgmma": "a chain's matmuls as warpgroup wgmma (sm_90)"}
        for name, vals in knob_space(bg, types, arch).items():
            lines.append(f"    {name}  legal {vals}  ({bounds.get(name, '')})")
        k += 1
    return lines


def parse_assignments(text: str, flag: str) -> dict[str, list[str]]:
    """``grid=4x8x1,forloop=2`` (pins) or ``forloop=2,8`` (widen: one knob, values)."""
    out: dict[str, list[str]] = {}
    key = None
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if sep:
            key = name.strip()
            out.setdefault(key, []).append(value.strip())
        elif key is not None and flag == "--widen":
            out[key].append(item)
        else:
            raise MirageError(f"{flag} {item}: expected KNOB=VALUE")
    return out


def _grid(v: str, flag: str) -> tuple[int, int, int]:
    parts = v.lower().split("x")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        raise MirageError(f"{flag} grid={v}: expected AxBxC (positive integers)")
    g = [int(p) for p in parts] + [1] * (3 - len(parts))
    return g[0], g[1], g[2]


def _int(v: str, flag: str, name: str) -> int:
    if not v.isdigit():
        raise MirageError(f"{flag} {name}={v}: expected an integer")
    return int(v)


# A pin for one custom kernel: kN.KNOB.
_KERNEL_PIN = re.compile(r"k(\d+)\.(\w+)$")


def kernel_pins(pins: dict[str, list[str]], k: int) -> dict[str, list[str]]:
    """The pins that hold for custom kernel ``k``: the unprefixed ones, overridden by
    those prefixed ``k{k}.``."""
    out = {name: v for name, v in pins.items() if not _KERNEL_PIN.match(name)}
    for name, v in pins.items():
        if (m := _KERNEL_PIN.match(name)) and int(m.group(1)) == k:
            out[m.group(2)] = v
    return out


def check_kernel_pins(pins: dict[str, list[str]], kernels: int) -> None:
    """A ``kN.`` pin names a custom kernel the designs have (``kernels``: the most any
    design has)."""
    for name in pins:
        if name.startswith("k") and "." in name:
            m = _KERNEL_PIN.match(name)
            if m is None:
                raise MirageError(f"--pin {name}: expected kN.KNOB (N a custom kernel's "
                                  "number, as --space prints it)")
            if int(m.group(1)) >= kernels:
                raise MirageError(f"--pin {name}: the designs have custom kernels 0 to "
                                  f"{kernels - 1}")


def retune(g: Graph, pins: dict[str, list[str]], widen: dict[str, list[str]]
           ) -> list[tuple[Graph, Tuning]]:
    """The tunings of ``g``'s design allowed by pins and widening, best first (the
    cost model's order with the tie rule). Unprefixed grid and forloop pins apply to
    every custom kernel, ``kN.`` ones to kernel N (:func:`kernel_pins`)."""
    from mirage_cli.search.tune import tune

    design, tuning = design_of(g)
    per_kernel: list[list[tuple[tuple[int, int, int], int]]] = []
    for k, (grid, f) in enumerate(tuning):
        mine = kernel_pins(pins, k)
        grids = [_grid(v, "--pin") for v in mine.get("grid", [])] or \
            [grid] + [_grid(v, "--widen") for v in widen.get("grid", [])]
        loops = [_int(v, "--pin", "forloop") for v in mine.get("forloop", [])] or \
            [f] + [_int(v, "--widen", "forloop") for v in widen.get("forloop", [])]
        per_kernel.append(list(dict.fromkeys(itertools.product(grids, loops))))
    tried: list[Tuning] = list(itertools.islice(itertools.product(*per_kernel), MAX_TUNINGS))
    if not pins:  # also the tuner's own neighbourhood
        tried += [t for _, t, _ in tune(g, design)]
    out = {}
    for t in dict.fromkeys(tried):
        ng = instantiate(g, design, t)
        if ng is not None:
            out[t] = ng
    if not out:
        raise MirageError("tune: no tuning within the pins is legal for this design "
                          "(see --space)")
    return rank([(ng, t) for t, ng in out.items()], lambda x: estimate(x[0]),
                lambda x: serialize.dumps(x[0]))


def within_pins(firsts: list[Graph], pin: str, widen: tuple[str, ...], arch: str
                ) -> tuple[dict[str, list[str]], list[tuple[Graph, Tuning]]]:
    """``--pin`` and ``--widen`` parsed and checked, and the tunings within them of the
    designs ``firsts`` (one µGraph each), each with its pinned plan knobs for ``arch``
    attached, ranked together by the cost model (ties by the stated rule). A design or
    tuning that the pins do not allow is left out; an error only when nothing is left,
    naming the knob pin where one was the cause."""
    pins = parse_assignments(pin, "--pin")
    kernels = max(len(design_of(g)[1]) for g in firsts)
    check_kernel_pins(pins, kernels)
    pinned_knobs(pins, kernels)  # names and values checked before any design is tried
    wide: dict[str, list[str]] = {}
    for w in widen:
        wide.update(parse_assignments(w, "--widen"))
    for k in wide:
        if k not in GRID_KEYS:
            raise MirageError(f"--widen {k}: only grid and forloop are widened (plan knobs "
                              "are tried over their whole legal range by --space)")
    found: list[tuple[Graph, Tuning]] = []
    knob_error: MirageError | None = None
    for g in firsts:
        try:
            tunings = retune(g, pins, wide)
        except MirageError:
            continue
        # A plan-knob pin legal at one tuning may not be at another (ksplit=3 divides a
        # forloop of 24, not one of 32): such tunings are not within the pins. The
        # others are ranked with their pinned plans, which the cost model reads.
        for ng, t in tunings:
            try:
                found.append((with_knob_pins(ng, pins, arch), t))
            except MirageError as e:
                knob_error = knob_error or e
    if not found:
        if knob_error is not None:  # say which pin, and its legal values
            raise MirageError(f"{knob_error.message} at every tuning within the pins")
        raise MirageError(f"no tuning within the pins is legal for any of the {len(firsts)} "
                          "design(s) (see 'mirage tune CANDS.ugraph.json --space')")
    return pins, rank(found, lambda x: estimate(x[0]), lambda x: serialize.dumps(x[0]))


def _measured(cands: list[tuple[Graph, dict]], gpu: int, top: int,  # type: ignore[type-arg]
              jobs: int | None, use_cache: bool, output: str | None,
              pinned: list[Knobs] | None = None) -> None:
    """``--gpu``: measured selection; one line per variant on stdout, fastest first.
    ``pinned``: the candidates are the tunings within the pins, timed as given, with
    these knobs held per custom kernel (:func:`mirage_cli.search.measure.variants`)."""
    import os

    from mirage_cli.search.measure import GpuTimer, measure

    timer = GpuTimer(gpu)
    graphs = [g for g, _ in cands]
    res = measure(graphs, graphs[0], timer, top=top, workers=jobs or os.cpu_count() or 1,
                  use_cache=use_cache, pinned=pinned)
    pairs = res.candidates()
    for g, meta in pairs:
        m = meta["measured"]
        took = "wrong: " + m["reason"] if not m["ok"] else f"{meta['measured_us']:.3f} us"
        click.echo(f"#{meta['rank']}: {m['variant']} {took} measured, "
                   f"{meta['cost']['time_us']} us predicted, tuning {meta['tuning']} "
                   f"knobs {meta['knobs']}")
    if output:
        write_atomic(output, serialize.dumps_candidates(pairs))


def pinned_knobs(pins: dict[str, list[str]], kernels: int) -> list[Knobs]:
    """The plan knobs ``pins`` fix for each of ``kernels`` custom kernels."""
    out = []
    for k in range(kernels):
        knobs = {n: _int(v[0], "--pin", n) for n, v in kernel_pins(pins, k).items()
                 if n not in GRID_KEYS}
        unknown = set(knobs) - set(Knobs.names())
        if unknown:
            raise MirageError(f"--pin {min(unknown)}: not a knob (grid, forloop, "
                              f"{', '.join(Knobs.names())})")
        out.append(Knobs(**knobs))
    return out


def with_knob_pins(g: Graph, pins: dict[str, list[str]], arch: str) -> Graph:
    """``g`` with the pinned plan knobs attached (checked against their ranges)."""
    from mirage_cli.codegen.planner import plan_kernel

    types = g.tensor_types()
    knobs = iter(pinned_knobs(pins, sum(op.block is not None for op in g.ops)))
    ops = []
    for op in g.ops:
        if op.block is not None and (mine := next(knobs)).as_json():
            op = dataclasses.replace(op, plan=plan_kernel(op.block, types, arch, mine))
        ops.append(op)
    return dataclasses.replace(g, ops=tuple(ops))


@click.command("tune")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--space", is_flag=True, help="Print each design's tuning space.")
@click.option("--pin", default="", metavar="K=V,...", help="Fix grid=AxBxC, forloop=N, "
              "or plan knobs (stages=2,...); kN.K=V for custom kernel N alone.")
@click.option("--widen", "widen", multiple=True, metavar="K=V1,V2",
              help="Extra grid or forloop values to try (repeatable).")
@click.option("-o", "output", type=click.Path(dir_okay=False),
              help="Write the re-ranked candidates here.")
@click.option("--gpu", type=int, default=None, help="Select by measurement on GPU N.")
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True,
              help="Designs measured (with --gpu).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Compiler processes (with --gpu; default: the CPU count).")
@click.option("--no-cache", is_flag=True, help="Ignore and do not fill the measurement cache.")
@target_option
def command(file: str, space: bool, pin: str, widen: tuple[str, ...], output: str | None,
            gpu: int | None, top: int, jobs: int | None, no_cache: bool,
            target: str) -> None:
    """Show, pin or widen the tuning space of the designs in FILE and re-rank them."""
    use_profile(target)
    cands = serialize.loads_candidates(read_text(file), file)
    if not cands:
        raise MirageError("tune: the file holds no candidate µGraph")
    if gpu is not None and not pin and not widen:
        _measured(cands, gpu, top, jobs, not no_cache, output)
        return
    designs = list(dict.fromkeys(design_of(g)[0] for g, _ in cands))
    firsts = [next(g for g, _ in cands if design_of(g)[0] == d) for d in designs]
    if space:
        for i, g in enumerate(firsts):
            click.echo(f"design {i}:")
            for line in space_lines(g, DEFAULT_ARCH):
                click.echo(line)
        return
    pins, ranked = within_pins(firsts, pin, widen, DEFAULT_ARCH)
    if gpu is not None:
        # Measured within the pins: the first --top tunings of that ranking as they
        # are, the pinned knobs held (before, --gpu measured the file's own tunings
        # and ignored --pin and --widen).
        kernels = max(len(design_of(g)[1]) for g in firsts)
        _measured([(g, {}) for g, _ in ranked], gpu, top, jobs, not no_cache, output,
                  pinned_knobs(pins, kernels))
        return
    ranked = first_verified(ranked, cands[0][0], "the file's first candidate")
    pairs = []
    for i, (g, t) in enumerate(ranked):
        c = estimate(g)
        pairs.append((g,
                      {"rank": i, "cost": c.as_json(), "kernels": launched(g),
                       "tuning": [{"grid": list(gr), "forloop": f} for gr, f in t],
                       "pins": pin, "verified": i == 0}))
        click.echo(f"#{i}: {c.time_us:.3f} us predicted, tuning "
                   f"{[{'grid': list(gr), 'forloop': f} for gr, f in t]}")
    if output:
        write_atomic(output, serialize.dumps_candidates(pairs))


def first_verified(ranked: list[tuple[Graph, Tuning]], reference: Graph, against: str,
                   seed: int = 0, who: str = "tune") -> list[tuple[Graph, Tuning]]:
    """``ranked`` from its first tuning that a finite-field trial finds equivalent to
    ``reference`` (``against`` names it in messages): a new tuning of a verified design
    is checked again before anything compiles it. The ones before it are dropped, each
    with a warning; the later ones are not checked. None passing is an error."""
    from mirage_cli.console import warn
    from mirage_cli.search.measure import reverified

    accept = reverified(reference, seed)
    for i, (g, t) in enumerate(ranked):
        if accept(g):
            return ranked[i:]
        warn(f"{who}: tuning {[{'grid': list(gr), 'forloop': f} for gr, f in t]} is not "
             f"equivalent to {against} (finite-field trial): left out")
    raise MirageError(f"{who}: no tuning within the pins passed the finite-field check "
                      f"against {against}")
