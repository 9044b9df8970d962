"""Measured selection: the fastest correct kernel among the top designs' tunings.

Steps (``mirage tune --gpu N``, ``mirage opt --gpu N``):

1. :func:`variants`: for each of the first ``top`` distinct designs of a ranked
   candidate list, its tunings (the candidate's own, then the tuner's, best first by
   the cost model: :func:`mirage_cli.search.tune.tune`) times the kernel-plan knob
   settings (:func:`knob_sets`: the planner's defaults, then the single-knob
   deviations from them within :func:`~mirage_cli.codegen.planner.knob_space`, the
   knobs that have won measurements first, up to a bound), each with its plans
   attached. Deterministic: no randomness,
   the order depends only on the candidates.
2. :func:`~mirage_cli.codegen.cubins.compile_all`: NVRTC compilation in worker
   processes (``spawn``: safe even after a CUDA context exists; no GPU needed).
3. A :class:`Timer` runs each variant once on NaN-poisoned outputs, compares it with
   the float64 reference of the program (the bench's check), and times the correct
   ones with the bench's method (CUDA-graph replays over input copies larger than
   twice the L2 cache, median). :class:`GpuTimer` is the real one (the device in a
   child process, :mod:`.gpuproc`, so that a kernel that faults fails only itself);
   tests inject fakes.
4. :func:`select`: the fastest correct variant wins (ties: the earlier variant, i.e.
   the model's order). A variant whose output is wrong is a bug in the code generator:
   it is dropped and reported as an error line, never shipped.

Measured timings are cached beside the search cache (:mod:`.cache`, kind
``measure``), keyed by the reference program's hash, the options, the device name and
the tool version; one entry maps each variant (the SHA-256 of its canonical JSON, plans
included) to its timing, so a rerun times only what it has not timed before.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mirage_cli import serialize
from mirage_cli.codegen.aliasing import launched
from mirage_cli.codegen.cubins import compile_all
from mirage_cli.console import console, info
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.search.design import Design, Tuning, design_of, instantiate
from mirage_cli.util import write_atomic

TUNINGS_PER_DESIGN = 4   # grid/forloop tunings timed per design
KNOBS_PER_TUNING = 6     # plan-knob settings timed per tuning (defaults first)

# The order in which the tuner tries knob deviations: first the knobs whose other values
# have beaten the planner's on some kernel, then those that have only lost. Measured on
# an H100 (docs/perf-log.md v33): one warp per 16-row tile (kwarps=1) ran mqa_decode's
# split kernel at batch 8 in 12.6 us against 13.6; a shallower ring (stages=4) gqa's at
# batch 8 in 18.0 against 18.6; bulk copies (tma=1) mqa_decode at batch 1 in 8.0 against
# 9.0, and cp.async (tma=0) rmsnorm_linear at batch 1 on an H200 in 15.3 against 15.8
# (v32). Unpadded rows and scalar fragment loads lost everywhere (qknorm_gqa at batch
# 1: pad=0 15.4 us and ldmatrix=0 32.4 against 9.7). The cluster combine's push form
# (push=1) has not been measured yet: last.
KNOB_ORDER = ("kwarps", "stages", "tma", "threads", "ksplit", "wgmma", "chain", "stagger",
              "vec", "stage_once", "ldmatrix", "pad", "push")
REPLAYS = 30             # CUDA-graph replays per timing (the bench's default)
FORMAT = "mirage-cli/measure-cache"
VERSION = 1

Json = dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """One µGraph to time: a design, one of its tunings and one knob setting."""

    label: str            # "d0.t1.k2": design, tuning, knob setting
    design: int           # index among the designs measured
    graph: Graph          # with a plan on every custom kernel
    tuning: Tuning
    knobs: tuple[Knobs, ...]   # pins per custom kernel (empty Knobs: the planner's choice)
    predicted_us: float

    @property
    def key(self) -> str:
        """SHA-256 of the canonical JSON (plans included): the variant's identity."""
        return hashlib.sha256(serialize.dumps(self.graph).encode()).hexdigest()


@dataclass(frozen=True)
class Timing:
    """The measurement of one variant: ``us`` is None when it was not timed."""

    us: float | None
    ok: bool
    rel_err: float | None = None
    reason: str = ""

    def as_json(self) -> Json:
        return {"us": self.us, "ok": self.ok, "rel_err": self.rel_err, "reason": self.reason}

    @staticmethod
    def from_json(d: Any) -> Timing | None:
        if not isinstance(d, dict) or not isinstance(d.get("ok"), bool):
            return None
        us, err = d.get("us"), d.get("rel_err")
        if us is not None and (not isinstance(us, (int, float)) or us <= 0):
            return None
        if d["ok"] and us is None:
            return None
        return Timing(None if us is None else float(us), d["ok"],
                      None if not isinstance(err, (int, float)) else float(err),
                      str(d.get("reason", "")))


class Timer(Protocol):
    """The GPU seam: everything that touches a device."""

    device: str   # the device's name (part of the cache key)
    arch: str     # the target the variants are planned and compiled for

    def time(self, v: Variant, cubin: bytes, reference: Graph) -> Timing:
        """Check ``v`` (compiled to ``cubin``) against the float64 reference of
        ``reference`` and, when correct, time it."""
        ...


# -- variants ---------------------------------------------------------------------------


def knob_sets(g: Graph, arch: str, limit: int) -> list[tuple[Knobs, ...]]:
    """Knob pins for every custom kernel of ``g``: the planner's defaults first, then
    single-knob deviations (one kernel, one knob, one legal value other than the
    planner's) in rounds, up to ``limit`` settings in all. Round r holds each knob's
    r-th nearest value to the planner's, knobs in :data:`KNOB_ORDER`, kernels in turn:
    a few settings try several knobs rather than every depth of one ring (mqa_decode
    at batch 8 on an H200: its three stage deviations all ran within 1% of the
    default, while the bulk copies never tried there ran another design 14% faster;
    docs/perf-log.md v36)."""
    from mirage_cli.codegen.planner import knob_space, plan_kernel

    types = g.tensor_types()
    blocks = [op.block for op in g.ops if op.block is not None]
    default = tuple(Knobs() for _ in blocks)
    ranked: list[tuple[int, int, int, int, str]] = []  # (round, knob, kernel, value, name)
    for k, bg in enumerate(blocks):
        try:
            chosen = plan_kernel(bg, types, arch).knobs
        except MirageError:
            continue  # no default plan: the deviations would not fit either
        for name, values in knob_space(bg, types, arch).items():
            at = getattr(chosen, name)
            others = sorted((abs(v - at), v) for v in values if v != at)
            for rnd, (_, v) in enumerate(others):
                ranked.append((rnd, KNOB_ORDER.index(name), k, v, name))
    out: list[tuple[Knobs, ...]] = [default]
    for _, _, k, v, name in sorted(ranked)[:max(0, limit - 1)]:
        pins = list(default)
        pins[k] = Knobs(**{name: v})
        out.append(tuple(pins))
    return out


def _tunings(g: Graph, design: Design, own: Tuning, limit: int) -> list[tuple[Tuning, Graph]]:
    """``own`` then the tuner's tunings of ``design``, best first, at most ``limit``."""
    from mirage_cli.search.tune import tune

    out: dict[Tuning, Graph] = {own: g}
    for _, t, ng in tune(g, design):
        if len(out) >= limit:
            break
        out.setdefault(t, ng)
    return list(out.items())


def variants(cands: Sequence[Graph], top: int, arch: str,
             tunings: int = TUNINGS_PER_DESIGN, knobs: int = KNOBS_PER_TUNING,
             pinned: Sequence[Knobs] | None = None) -> tuple[list[Variant], int]:
    """The variants of the first ``top`` distinct designs of ``cands`` (ranked, best
    first), and how many knob settings were skipped because no plan fits.

    ``pinned`` (``mirage tune --pin ... --gpu``): the candidates are the tunings to
    time, as given (the first ``top`` of them, whatever their designs; no tuner), and
    the i-th knobs hold for the i-th custom kernel of every setting, over the
    deviations of the knobs they leave free."""
    from mirage_cli.commands.plan import planned
    from mirage_cli.search.cost import estimate

    entries = _as_given(cands, top) if pinned is not None else _by_design(cands, top,
                                                                          tunings)
    out: list[Variant] = []
    keys: set[Graph] = set()
    skipped = 0
    for di, ti, t, ng in entries:
        for ki, pins in enumerate(knob_sets(ng, arch, knobs)):
            if pinned is not None:  # a design with fewer kernels takes the first pins
                held = [*pinned, *[Knobs()] * len(pins)]
                pins = tuple(_merged(p, held[k]) for k, p in enumerate(pins))
            try:
                pg = planned(ng, arch, list(pins))
            except MirageError:
                skipped += 1
                continue
            if pg in keys:
                continue
            keys.add(pg)
            out.append(Variant(f"d{di}.t{ti}.k{ki}", di, pg, t, pins, estimate(pg).time_us))
    return out, skipped


Entry = tuple[int, int, Tuning, Graph]  # design index, tuning index, tuning, µGraph


def _by_design(cands: Sequence[Graph], top: int, tunings: int) -> list[Entry]:
    """The first ``top`` distinct designs, each at up to ``tunings`` tunings (its own,
    then the tuner's)."""
    seen: dict[Design, Graph] = {}
    for g in cands:
        d = design_of(g)[0]
        if d not in seen and len(seen) < top:
            seen[d] = g
    out: list[Entry] = []
    for di, (design, g) in enumerate(seen.items()):
        own = design_of(g)[1]
        base = instantiate(g, design, own) or g
        out += [(di, ti, t, ng)
                for ti, (t, ng) in enumerate(_tunings(base, design, own, tunings))]
    return out


def _as_given(cands: Sequence[Graph], top: int) -> list[Entry]:
    """The first ``top`` candidates, each its own tuning, numbered by design."""
    designs: dict[Design, int] = {}
    count: dict[Design, int] = {}
    out: list[Entry] = []
    for g in cands[:top]:
        d, t = design_of(g)
        di = designs.setdefault(d, len(designs))
        ti = count[d] = count.get(d, -1) + 1
        out.append((di, ti, t, instantiate(g, d, t) or g))
    return out


def _merged(setting: Knobs, pins: Knobs) -> Knobs:
    """``setting`` with every knob ``pins`` fixes set to its pinned value."""
    return dataclasses.replace(setting, **pins.as_json())


# -- compilation (worker processes, no GPU: codegen/cubins.py) -------------------------


Compiler = Callable[[list[tuple[Graph, str]], int], list["bytes | str"]]


# -- the GPU timer -----------------------------------------------------------------------


class GpuTimer:
    """:class:`Timer` on CUDA device ``ordinal``, with the bench's check and timing.

    The device is driven from a child process (:mod:`.gpuproc`): a variant that faults
    is reported as faulting and the next one runs in a fresh process, where in this one
    every later variant would fail with the fault too."""

    def __init__(self, ordinal: int, replays: int = REPLAYS) -> None:
        from mirage_cli.search.gpuproc import Worker

        try:
            self._worker = Worker(functools.partial(LocalTimer, ordinal, replays))
        except MirageError as e:
            raise MirageError(f"--gpu {ordinal}: {e.message}; measured selection needs a "
                              f"CUDA GPU (omit --gpu to rank by the cost model)") from None
        self.device = self._worker.device
        self.arch = self._worker.arch

    def time(self, v: Variant, cubin: bytes, reference: Graph) -> Timing:
        from mirage_cli.search.gpuproc import Fault

        try:
            return self._worker.run((v.graph, cubin, reference))
        except Fault as e:
            return Timing(None, False, None, f"the kernel faulted ({e})")

    def close(self) -> None:
        self._worker.close()


class LocalTimer:
    """The device opened in this process: :class:`GpuTimer`'s child side."""

    def __init__(self, ordinal: int, replays: int) -> None:
        from mirage_cli.codegen.runner import Device

        self.dev = Device(ordinal)
        self.device = self.dev.name
        self.arch = self.dev.arch
        self.replays = replays
        self._scales: dict[Graph, float] = {}

    def run(self, job: tuple[Graph, bytes, Graph]) -> Timing:
        """Check one µGraph (compiled to a cubin) against the float64 reference of a
        program and, when correct, time it."""
        from mirage_cli.codegen import bench
        from mirage_cli.codegen.lower import lower

        graph, cubin, reference = job
        if reference not in self._scales:
            self._scales[reference] = bench.input_scale(reference)
        scale = self._scales[reference]
        loaded = self.dev.load(lower(graph, self.arch), cubin)
        try:
            outs = loaded.run(bench.scaled_inputs(graph, 0, scale))
            chk = bench.compare(outs, bench.reference_outputs(reference, 0, scale),
                                list(graph.outputs))
            if not chk.ok:
                return Timing(None, False, chk.rel_err, chk.reason)
            us = bench.time_loaded(self.dev, loaded, graph, self.replays, scale)
            return Timing(us, True, chk.rel_err)
        finally:
            loaded.unload()


# -- the cache of measured timings ---------------------------------------------------------


def cache_key(reference: Graph, options: Json, device: str) -> str:
    from mirage_cli.search import cache

    return cache.key(reference, {**options, "device": device}, kind="measure")


def cache_load(k: str, device: str) -> dict[str, Timing]:
    """Timings cached under ``k`` for ``device`` (empty on any problem: a miss)."""
    from mirage_cli.search import cache

    try:
        doc = json.loads((cache.cache_dir() / f"{k}.measure.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            doc.get("version") != VERSION or doc.get("device") != device or \
            doc.get("tool") != cache.TOOL or not isinstance(doc.get("timings"), dict):
        return {}
    out = {}
    for vk, t in doc["timings"].items():
        parsed = Timing.from_json(t)
        if parsed is not None:
            out[vk] = parsed
    return out


def cache_store(k: str, device: str, timings: dict[str, Timing]) -> None:
    from mirage_cli.search import cache

    doc = {"format": FORMAT, "version": VERSION, "device": device, "tool": cache.TOOL,
           "timings": {vk: t.as_json() for vk, t in sorted(timings.items())}}
    try:
        write_atomic(cache.cache_dir() / f"{k}.measure.json",
                     json.dumps(doc, sort_keys=True) + "\n")
    except OSError:
        pass  # an unwritable cache is a miss next time, never an error


# -- selection ---------------------------------------------------------------------------


@dataclass
class Result:
    """The variants measured, their timings (same order) and the index of the winner."""

    variants: list[Variant]
    timings: list[Timing]
    best: int
    device: str
    seconds: float
    cached: int             # timings taken from the cache
    skipped: int            # knob settings with no plan that fits

    @property
    def wrong(self) -> list[int]:
        return [i for i, t in enumerate(self.timings) if not t.ok]

    def fastest_us(self) -> float:
        return min(t.us for t in self.timings if t.ok and t.us is not None)

    def candidates(self) -> list[tuple[Graph, Json]]:
        """Every variant as a candidate, the winner first, then correct ones by
        measured time, then the wrong ones; each with its measurement."""
        order = sorted(range(len(self.variants)),
                       key=lambda i: (i != self.best, not self.timings[i].ok,
                                      self.timings[i].us or 0.0, i))
        out = []
        for rank, i in enumerate(order):
            v, t = self.variants[i], self.timings[i]
            out.append((v.graph, {
                "rank": rank, "kernels": launched(v.graph),
                "cost": {"time_us": round(v.predicted_us, 3)},
                "tuning": [{"grid": list(g), "forloop": f} for g, f in v.tuning],
                "knobs": [k.as_json() for k in v.knobs],
                "measured_us": None if t.us is None else round(t.us, 3),
                "measured": {"device": self.device, "variant": v.label,
                             "design": v.design, "ok": t.ok, "rel_err": t.rel_err,
                             "reason": t.reason, "method": "median of CUDA-graph replays "
                             "over input copies > 2x L2"}}))
        return out

    def summary(self) -> Json:
        ok = [t for t in self.timings if t.ok]
        best = self.timings[self.best]
        return {"device": self.device, "variants": len(self.variants), "correct": len(ok),
                "wrong": [self.variants[i].label for i in self.wrong],
                "shipped": self.variants[self.best].label, "shipped_us": best.us,
                "fastest_us": self.fastest_us(),
                "model_pick": self.variants[0].label,
                "model_pick_us": self.timings[0].us, "seconds": round(self.seconds, 2),
                "cached": self.cached, "skipped_no_plan": self.skipped}


def measure(cands: Sequence[Graph], reference: Graph, timer: Timer, *, top: int = 3,
            tunings: int | None = None, knobs: int | None = None,
            workers: int = 1, use_cache: bool = True, compiler: Compiler | None = None,
            accept: Callable[[Graph], bool] = lambda g: True,
            pinned: Sequence[Knobs] | None = None) -> Result:
    """Measured selection over ``cands`` (ranked, best first). ``accept`` is the last
    check of the winner (the caller's re-verification); a winner it refuses is dropped
    for the next fastest. ``tunings`` and ``knobs`` default to the module's bounds;
    ``pinned``: see :func:`variants`."""
    start = time.monotonic()
    tunings = TUNINGS_PER_DESIGN if tunings is None else tunings
    knobs = KNOBS_PER_TUNING if knobs is None else knobs
    vs, skipped = variants(cands, top, timer.arch, tunings, knobs, pinned)
    if not vs:
        raise MirageError("measure: no variant of the candidates has a kernel plan that "
                          "fits (see mirage tune --space)")
    options = {"top": top, "tunings": tunings, "knobs": knobs, "arch": timer.arch}
    k = cache_key(reference, options, timer.device)
    known = cache_load(k, timer.device) if use_cache else {}
    todo = [i for i, v in enumerate(vs) if v.key not in known]
    info(f"measure: {len(vs)} variants of {len({v.design for v in vs})} design(s) on "
         f"{timer.device} ({len(vs) - len(todo)} cached); compiling {len(todo)} with "
         f"{workers} worker(s)")
    cubins = (compiler or compile_all)([(vs[i].graph, timer.arch) for i in todo], workers)
    timings: dict[int, Timing] = {i: known[v.key] for i, v in enumerate(vs) if v.key in known}
    _time_all(vs, todo, cubins, reference, timer, timings)
    ordered = [timings[i] for i in range(len(vs))]
    if use_cache:
        cache_store(k, timer.device, {**known, **{vs[i].key: timings[i] for i in todo}})
    for i, t in enumerate(ordered):
        if not t.ok:
            console.print(f"error: variant {vs[i].label} computes a wrong result "
                          f"({t.reason}); dropped. This is a bug in the code generator: "
                          f"please report it with the candidates file", style="red",
                          markup=False)
    best = _winner(vs, ordered, accept)
    res = Result(vs, ordered, best, timer.device, time.monotonic() - start,
                 len(vs) - len(todo), skipped)
    s = res.summary()
    info(f"measure: shipped {s['shipped']} at {s['shipped_us']:.2f} us (model's pick "
         f"{s['model_pick']}: {_us(s['model_pick_us'])}); {s['correct']}/{s['variants']} "
         f"correct, {res.seconds:.1f} s")
    return res


def _us(x: float | None) -> str:
    return "wrong" if x is None else f"{x:.2f} us"


def _time_all(vs: list[Variant], todo: list[int], cubins: list[bytes | str],
              reference: Graph, timer: Timer, timings: dict[int, Timing]) -> None:
    """Time each variant of ``todo`` (progress on stderr, a live bar on a terminal)."""
    from rich.progress import Progress

    with Progress(console=console, transient=True,
                  disable=not console.is_terminal or console.quiet) as bar:
        task = bar.add_task("timing", total=len(todo))
        for i, cubin in zip(todo, cubins):
            if isinstance(cubin, str):
                timings[i] = Timing(None, False, None, f"does not compile: {cubin[:300]}")
            else:
                try:
                    timings[i] = timer.time(vs[i], cubin, reference)
                except MirageError:
                    raise
                except Exception as e:  # noqa: BLE001 - a failed launch is a wrong variant
                    timings[i] = Timing(None, False, None, f"{type(e).__name__}: {e}")
            bar.advance(task)


def _winner(vs: list[Variant], timings: list[Timing], accept: Callable[[Graph], bool]
            ) -> int:
    order = sorted((t.us, i) for i, t in enumerate(timings) if t.ok and t.us is not None)
    for _, i in order:
        if accept(vs[i].graph):
            return i
        console.print(f"error: variant {vs[i].label} failed re-verification; dropped",
                      style="red", markup=False)
    raise RuntimeError("measured selection: no variant computes the right result on the "
                       "GPU (every one was dropped above); this is a bug")



def reverified(program: Graph, seed: int = 0) -> Callable[[Graph], bool]:
    """A finite-field trial of a winner against ``program`` (as the search cache
    re-checks its entries): a variant is a new tuning of a verified design."""
    from mirage_cli.verifier.api import Verifier

    v = Verifier(program, seed=seed)
    return lambda g: v.check(g, trials=1).equivalent is True
