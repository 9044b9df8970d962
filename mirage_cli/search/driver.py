"""The search driver: options, work split over processes, budget, ranking, verification.

Work is split into *units*, each the first move of the kernel-level search (a block
config, or "a pre-defined operator first"), in two rounds: every unit with one kernel,
then (when ``max_kernel_ops > 1``) "a pre-defined operator, then up to
``max_kernel_ops - 1`` more kernels"; with ``max_kernel_ops > 1`` every one-kernel
design also yields its split-reduction two-kernel forms (:mod:`.split`, and
:mod:`.online` for a max-subtracted softmax).
Units run in ``jobs`` worker processes (each with its own Z3 oracle and caches) and are
merged in unit order.

**Work decides where a search ends, never the clock.** Its extent is fixed by the
program and the options: the units (one per first move), each building at most
``max_states`` block-graph states (a unit that reaches the limit stops there and keeps
the designs it completed: the same point on every machine, counted in
``Progress.limited``), each Z3 query at most ``prune.QUERY_RLIMIT`` resource units,
``tune_designs`` designs tuned, and verification down the ranking until ``top`` pass.
So the result does not depend on ``jobs``, the executor, the machine's speed or its
load. The budget (wall-clock seconds) is only a safety stop: when it, or a Z3 query's
wall-clock timeout, ends any phase first, the designs found so far are ranked and
verified as usual, but the result says it depends on timing (``complete: false``;
``Progress.clock`` says what stopped it), the commands warn, and it is not cached.
Ctrl-C stops every phase at once (the KeyboardInterrupt propagates; the command exits
130 and writes nothing).

Ranking: each design is tuned (:mod:`.tune`) and costed (:mod:`.cost`); candidates are
ordered by :func:`.cost.rank` (predicted time, then the stated tie rule
``cost.TIE_RULE``), verified best first (:mod:`.verify`), and only verified ones are
returned.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import z3

from mirage_cli import __version__, serialize
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.search import partition, runmax
from mirage_cli.search.cost import SMEM_BYTES, Cost, rank
from mirage_cli.search.design import Design, Tuning
from mirage_cli.search.enumerate import (
    Limits,
    OutOfStates,
    OutOfTime,
    Search,
    Stats,
    make_target,
)
from mirage_cli.search.online import online_split
from mirage_cli.search.partition import MAX_DEPTH
from mirage_cli.search.split import split_reduction
from mirage_cli.search.tune import first_fitting, tune
from mirage_cli.search.verify import Verdict, verify, verify_composed

Unit = tuple[int, Any]  # (max kernels, first move: a config or "predef")
# What a unit gives back: designs, stats, Z3 queries, what the clock stopped ("" when
# nothing), stopped by ``max_states``? (:func:`_run_unit`).
UnitResult = tuple[list[Design], Stats, int, str, bool]

# A way to certify a ranked candidate other than finite-field trials at its sizes (a
# certificate carried from other sizes, :mod:`.reuse`): called with the candidate's
# design, its µGraph and whether it is the one to ship if it passes (no candidate
# certified before it); answers a Verdict, or None to verify it with trials. Its
# verdict for the one to ship may hold the float64 and numerics records that come
# with its certificate; :func:`_check_chosen` then does not run them again.
Certify = Callable[[Design, Graph, bool], Verdict | None]

# Block-graph states one unit may build (``--max-states``). The largest unit of the
# examples (the Q/K/V part of the Llama layer, "pre-defined operator first") builds
# about 20 000, in about 40 s on this machine's loaded cores.
DEFAULT_MAX_STATES = 50_000

# Z3 catches Ctrl-C during a query and just cancels it; Python must see it (exit 130).
z3.set_param("ctrl_c", False)


@dataclass(frozen=True)
class SearchOptions:
    """Every option that changes the result (``jobs`` and ``budget`` do not, unless
    the budget, a safety stop, cuts the search short)."""

    max_kernel_ops: int = 2
    max_block_ops: int = 12
    max_grid_axes: int = 3
    prune: bool = True
    seed: int = 0
    top: int = 3            # verified candidates to return
    tune_designs: int = 24  # designs tuned fully (best by their first fitting tuning)
    max_states: int = DEFAULT_MAX_STATES  # per unit: the work limit

    def limits(self) -> Limits:
        return Limits(self.max_kernel_ops, self.max_block_ops, self.max_grid_axes,
                      prune=self.prune, max_states=self.max_states)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Progress:
    """What the progress display shows; updated as units finish."""

    phase: str = "enumerate"
    units_done: int = 0
    units_total: int = 0
    stats: Stats = field(default_factory=Stats)
    z3_queries: int = 0
    designs: int = 0
    verified: int = 0
    rejected: int = 0
    best_us: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # per phase
    # Why designs were excluded before verification (see ``explain_none``).
    no_tuning: int = 0          # no tuning instantiates (sizes do not divide)
    too_big: int = 0            # every tuning tried exceeds shared memory
    smallest_smem: int | None = None  # bytes, over the designs that do not fit
    mixed: str = ""             # what the cut-program (mixed design) search did
    reused: int = 0             # designs taken from known µGraphs (no enumeration)
    tuned: int = 0              # designs tuned fully (the ranking's, before verification)
    # Designs of candidates that verification (or the chosen one's float checks)
    # rejected: a reuse at other sizes does not bound its tuning by them (_walked).
    refused: set[Design] = field(default_factory=set)
    limited: int = 0            # units stopped by ``max_states`` (deterministic)
    clock: str = ""             # what the clock stopped, when it did (see ``clock_stop``)

    def clock_stop(self, what: str) -> None:
        """Record that the wall clock (the budget, or a Z3 query's timeout) ended
        ``what`` before its work was done: the result then depends on timing."""
        if what not in self.clock.split("; "):
            self.clock = f"{self.clock}; {what}" if self.clock else what


@dataclass(frozen=True)
class Candidate:
    graph: Graph
    design: Design
    tuning: Tuning
    cost: Cost
    verdict: dict[str, Any]

    def meta(self, rank: int) -> dict[str, Any]:
        grids = [{"grid": list(g), "forloop": f} for g, f in self.tuning]
        return {"rank": rank, "cost": self.cost.as_json(), "design": self.design.describe(),
                "tuning": grids, "kernels": self.design.num_kernels,
                "verification": self.verdict, "tool": f"mirage-cli {__version__}"}


@dataclass
class SearchResult:
    candidates: list[Candidate]
    progress: Progress
    complete: bool
    seconds: float
    # Every design enumerated (split forms included), when the candidates came from
    # them (not from a mixed design): what a shape reuse at other sizes starts from
    # (the cache's family entry keeps them, :mod:`.reuse`).
    pool: list[Design] | None = None
    # The best predicted µs of each pool design the search tuned fully, over its
    # tunings that fit (a design not tuned fully, or with no tuning that fits, has
    # none): where each ranked at these sizes, which bounds a reuse's tuning at larger
    # ones (:func:`reuse_designs`).
    tuned_us: dict[Design, float] | None = None


# -- worker side ------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(program: Graph, options: SearchOptions, deadline: float | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _WORKER["target"] = make_target(program)
    _WORKER["options"] = options
    _WORKER["deadline"] = deadline


def _run_unit(unit: Unit) -> UnitResult:
    """Designs of one unit (in generation order), stats, Z3 queries, what the clock
    stopped ("" when nothing: the unit's result is a function of the unit alone), and
    whether ``max_states`` stopped it."""
    target = _WORKER["target"]
    opts: SearchOptions = _WORKER["options"]
    deadline: float | None = _WORKER["deadline"]
    before = target.oracle.stats.queries
    timeouts = target.oracle.stats.unknown_timeout
    s = Search(target, opts.limits(), deadline=None if deadline is None
               else time.monotonic() + (deadline - time.time()))
    kernels, first = unit
    out: list[Design] = []
    clock, limited = "", False
    try:
        # One at a time, so the designs found before a stop are kept.
        for d in s.designs(s.initial(), kernels, first):
            out.append(d)  # noqa: PERF402
    except OutOfTime:
        clock = "enumeration (budget)"
    except OutOfStates:
        limited = True
    if target.oracle.stats.unknown_timeout > timeouts and not clock:
        clock = "a Z3 query (wall-clock timeout)"
    return out, s.stats, target.oracle.stats.queries - before, clock, limited


def units(program: Graph, options: SearchOptions) -> list[Unit]:
    target = make_target(program)
    s = Search(target, options.limits())
    cfgs = s.configs(s.initial())
    if options.max_kernel_ops == 1:
        return [(1, c) for c in cfgs if s.completes(s.initial(), c[0])]
    # With more kernels, a first custom kernel may store an intermediate (any grid).
    return [(options.max_kernel_ops, c) for c in cfgs] + [(options.max_kernel_ops, "predef")]


# Runs the units of one program elsewhere (``--executor ray``, :mod:`.executor`):
# (program, options, deadline, units) -> their results, in unit order.
UnitMap = Callable[[Graph, SearchOptions, float | None, list[Unit]], Iterator[UnitResult]]


def run_units_here(program: Graph, options: SearchOptions, deadline: float | None,
                   todo: list[Unit]) -> list[UnitResult]:
    """Units run in this process, in order (what a remote worker does with its
    share; ``deadline`` is wall-clock time as from ``time.time()``)."""
    _init_worker_inline(program, options, deadline)
    return [_run_unit(u) for u in todo]


def _map(jobs: int, program: Graph, options: SearchOptions, deadline: float | None,
         todo: list[Unit], unit_map: UnitMap | None = None) -> Iterator[UnitResult]:
    if unit_map is not None:
        yield from unit_map(program, options, deadline, todo)
        return
    if jobs <= 1:
        _init_worker_inline(program, options, deadline)
        for u in todo:
            yield _run_unit(u)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(jobs, _init_worker, (program, options, deadline)) as pool:
        yield from pool.imap(_run_unit, todo, chunksize=1)


# Designs below which the tuning stays in this process: forking and sending the
# tuned µGraphs back costs about 20 ms a worker, a few designs' tuning.
PARALLEL_TUNE_MIN = 8


def _tuned(jobs: int, program: Graph, what: Callable[[Graph, Design], Any],
           designs: list[Design]) -> Generator[Any, None, None]:
    """``what(program, d)`` for each design, in order: in ``jobs`` forked processes
    when there are enough designs (the tuning of gqa's 71 designs at batch 16 is 7.6 s
    in one process, most of a shape reuse's time), here otherwise. The results are
    the same either way (pure functions of the program and the design)."""
    if jobs <= 1 or len(designs) < PARALLEL_TUNE_MIN or mp.current_process().daemon or \
            "fork" not in mp.get_all_start_methods():
        for d in designs:
            yield what(program, d)
        return
    chunk = max(1, len(designs) // (4 * jobs))
    with mp.get_context("fork").Pool(jobs, _init_tune_worker, (program, what)) as pool:
        yield from pool.imap(_tune_one, designs, chunksize=chunk)


def _init_tune_worker(program: Graph, what: Callable[[Graph, Design], Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _WORKER["tune"] = (program, what)


def _tune_one(d: Design) -> Any:
    program, what = _WORKER["tune"]
    return what(program, d)


def _first_fitting(program: Graph, d: Design) -> tuple[Cost, Tuning, Graph] | None:
    first = first_fitting(program, d)
    return first[0] if first else None


def _best_two(program: Graph, d: Design) -> list[tuple[Cost, Tuning, Graph]]:
    return tune(program, d)[:2]


def _init_worker_inline(program: Graph, options: SearchOptions, deadline: float | None
                        ) -> None:
    _WORKER["target"] = make_target(program)
    _WORKER["options"] = options
    _WORKER["deadline"] = deadline

# -- parent side ------------------------------------------------------------------


def search(program: Graph, options: SearchOptions, budget: float | None = None,
           jobs: int = 1, on_progress: Callable[[Progress], None] | None = None,
           depth: int = 0, unit_map: UnitMap | None = None) -> SearchResult:
    """Enumerate, tune, rank and verify; see the module docstring. When nothing
    verifies, the program is cut into parts searched alone (``depth`` counts the
    cuts above this search, :mod:`.partition`). ``unit_map`` runs the units
    elsewhere (``--executor ray``); the merge is in unit order either way."""
    start = time.time()
    deadline = None if budget is None else start + budget
    prog = Progress()
    notify = on_progress or (lambda p: None)
    designs, complete = _enumerate(program, options, deadline, jobs, prog, notify, unit_map)
    pool: list[Design] | None = list(designs)
    todo = _ranked(program, list(designs), options, prog, notify, deadline, jobs=jobs)
    tuned_us: dict[Design, float] = {}
    for d, _, _, c in todo:
        tuned_us.setdefault(d, c.time_us)
    can_cut = depth < MAX_DEPTH and len(program.ops) > 1
    mixed: list[Candidate] | None = None
    if can_cut and _all_slower_than_unfused(program, todo):
        # No whole design can be an answer worth shipping (each is predicted slower
        # than the unfused program), so the cuts are searched before any whole one is
        # verified, and the whole ones only where one could still beat them:
        # qwen2_mlp at batch 16 spent 332 of its 300 s budget certifying three whole
        # designs of 1920 us predicted (the unfused program 190 us), and the budget
        # then ended the cut search that finds its 2-kernel answer (docs/perf-log.md
        # v48).
        mixed = _mixed(program, options, deadline, jobs, prog, depth, unit_map)
        if mixed:
            todo = [x for x in todo if x[3].time_us < mixed[0].cost.time_us]
    cands = _verify_ranked(program, todo, options, prog, notify, max(1, jobs), deadline)
    if mixed is None and cuts_too(program, cands) and can_cut:
        mixed = _mixed(program, options, deadline, jobs, prog, depth, unit_map)
    if mixed and (not cands or mixed[0].cost.time_us < cands[0].cost.time_us):
        cands = mixed + cands
        pool = None  # a mixed answer's designs are its parts', not this program's
    return SearchResult(cands, prog, _complete(complete, prog, deadline),
                        time.time() - start, pool, tuned_us)


def _all_slower_than_unfused(program: Graph, todo: Ranked) -> bool:
    """Whether every ranked whole design is predicted slower than the unfused program
    (and there is at least one: with none, verification has nothing to spend)."""
    return bool(todo) and _beyond_unfused(program, min(c.time_us for *_, c in todo))


def cuts_too(program: Graph, cands: list[Candidate]) -> bool:
    """Whether to search the program cut into parts as well: when nothing whole
    verified, or when the best whole answer is predicted slower than the unfused
    program (a fused answer slower than none is no answer: qwen2_mlp at batch 16
    shipped a 945 µs design, a pre-defined matmul then one custom kernel of 8 blocks,
    while the cut after the gated product gives 137 µs; docs/perf-log.md)."""
    return not cands or _beyond_unfused(program, cands[0].cost.time_us)


def slower_than_unfused(program: Graph, g: Graph) -> str | None:
    """Why ``g`` is not worth shipping for ``program``: the model predicts it slower
    than the program's own lowering (one pre-defined kernel per operator), which is
    exact and needs no certificate; None when it is not. A fused answer slower than
    none is no answer (qwen2_mlp at batch 16: a design of 8 blocks predicted 8544 µs,
    the unfused program 240 µs)."""
    from mirage_cli.search.cost import estimate

    fused = estimate(g).time_us
    if not _beyond_unfused(program, fused):
        return None
    return (f"the best verified µGraph is predicted slower than the unfused program "
            f"({fused:.1f} µs against {estimate(program).time_us:.1f} µs)")


def _beyond_unfused(program: Graph, us: float) -> bool:
    """Whether ``us`` is more than the model's time of ``program`` unfused (its own
    lowering, one pre-defined kernel per operator): the one test of the three above."""
    from mirage_cli.search.cost import estimate

    return us > estimate(program).time_us


def _complete(complete: bool, prog: Progress, deadline: float | None) -> bool:
    """Whether the search ended by its work alone: no unit, phase or Z3 query stopped
    by the clock, and the budget not spent (a phase it would have stopped next)."""
    if deadline is not None and time.time() >= deadline:
        prog.clock_stop("the search (its budget ran out)")
    return complete and not prog.clock


def _enumerate(program: Graph, options: SearchOptions, deadline: float | None, jobs: int,
               prog: Progress, notify: Callable[[Progress], None],
               unit_map: UnitMap | None = None) -> tuple[dict[Design, None], bool]:
    """Every design the search units find (and their splits), and whether every unit
    ran to its end."""
    start = time.time()
    stripped = runmax.strip(program)
    todo = units(program, options)
    more = [] if stripped is None else units(stripped, options)
    prog.units_total = len(todo) + len(more)
    designs: dict[Design, None] = {}

    def keep(d: Design | None) -> None:
        if d is not None:
            designs.setdefault(d, None)
            prog.designs = len(designs)

    complete = _units(program, todo, options, deadline, jobs, prog, notify, unit_map, keep)
    if stripped is not None:
        # The program without its maxima, each of its one-kernel designs given a
        # running maximum again (:mod:`.runmax`).
        def back(d: Design) -> None:
            fits = tune(stripped, d, max_steps=0)
            keep(runmax.with_running_max(program, d, fits[0][1]) if fits else None)

        complete &= _units(stripped, more, options, deadline, jobs, prog, notify, unit_map,
                           back)
    complete &= prog.units_done == prog.units_total
    prog.seconds["enumerate"] = round(time.time() - start, 2)
    if options.max_kernel_ops >= 2:
        for d in list(designs):
            for sd in _splits(program, d):
                designs[sd] = None
        prog.designs = len(designs)
    return designs, complete


def _units(program: Graph, todo: list[Unit], options: SearchOptions, deadline: float | None,
           jobs: int, prog: Progress, notify: Callable[[Progress], None],
           unit_map: UnitMap | None, keep: Callable[[Design], None]) -> bool:
    """Run the units, each design found to ``keep`` in unit order; whether no clock
    stopped any."""
    complete = True
    # Ctrl-C propagates (exit 130): the budget, not an interrupt, asks for the best so far.
    for found, stats, queries, clock, limited in _map(jobs, program, options, deadline,
                                                      todo, unit_map):
        prog.units_done += 1
        prog.stats.add(stats)
        prog.z3_queries += queries
        prog.limited += limited
        for d in found:
            keep(d)
        if clock:
            complete = False
            prog.clock_stop(clock)
        notify(prog)
    return complete


def reuse(program: Graph, known: list[Graph], options: SearchOptions,
          on_progress: Callable[[Progress], None] | None = None,
          need: int | None = None, enumerate_with: tuple[float | None, int] | None = None
          ) -> SearchResult:
    """:func:`reuse_designs` of the designs of ``known`` µGraphs (``--reuse FILE``);
    ``enumerate_with`` = (budget, jobs) enumerates at these sizes too."""
    from mirage_cli.search.design import design_of

    budget, jobs = enumerate_with if enumerate_with is not None else (None, 1)
    return reuse_designs(program, [design_of(g)[0] for g in known], options, on_progress,
                         need, budget, jobs, enumerate_here=enumerate_with is not None)


def reuse_designs(program: Graph, designs: list[Design], options: SearchOptions,
                  on_progress: Callable[[Progress], None] | None = None,
                  need: int | None = None, budget: float | None = None, jobs: int = 1,
                  enumerate_here: bool = False, certify: Certify | None = None,
                  bounds: dict[Design, float] | None = None,
                  refused: set[Design] | None = None) -> SearchResult:
    """Shape reuse: known ``designs`` (found at other sizes; a design is
    size-independent, :mod:`.design`) tuned, ranked and re-verified at ``program``'s
    sizes as a search ranks its own (``budget`` seconds, ``jobs`` workers). With
    ``enumerate_here``, the designs the search units find at these sizes join them:
    which designs exist depends on the sizes (at batch 1 a dimension of 1 is never
    split), so a reuse whose known designs are not the enumeration at these sizes
    (another size pattern, :func:`.family.size_pattern`) ranks both, and only the
    ranking decides, as in a search. Without it nothing is enumerated
    (``units_total == 0``).

    Only ``need`` candidates (default ``options.top``) are certified, in rank order,
    one at a time: verification at the new sizes is most of a search's time, and a
    caller that ships the first candidate (``mirage opt`` without ``--gpu``) needs
    one. The candidates returned are each certified at these sizes: by ``certify``
    where it answers (a certificate carried from the sizes the designs were certified
    at, :mod:`.reuse`), otherwise as a search's are.

    ``bounds``, the predicted µs of the designs a search tuned at sizes no larger than
    these in any parameter, ranks without enumerating by tuning those designs best
    first until no other can rank above the ones needed (:func:`_walked`; the
    ``refused`` designs, rejected by that search's verification, do not count among
    them); when that never happens, or verification here rejects candidates the walk
    counted on (a design left untuned could then rank above those certified), every
    design is ranked as without it."""
    start = time.time()
    deadline = None if budget is None else start + budget
    prog = Progress(phase="reuse")
    notify = on_progress or (lambda p: None)
    known = dict.fromkeys(designs)
    complete = True
    pool: dict[Design, None] = {}
    if enumerate_here:
        pool, complete = _enumerate(program, options, deadline, jobs, prog, notify)
    enumerated = list(pool)
    pool.update(known)
    prog.designs, prog.reused = len(pool), len(known)
    keep = options.top if need is None else max(1, min(need, options.top))
    # Each group gets its own tune_designs best: the pool's designs must not push out
    # of the tuning one that a search at these sizes would tune.
    groups = [enumerated, list(known)] if enumerate_here else None
    walk = None if bounds is None or enumerate_here else \
        _walked(program, {d: us for d, us in bounds.items() if d in known},
                refused or set(), keep, prog, notify, deadline, jobs)
    todo = walk[0] if walk is not None else \
        _ranked(program, list(pool), options, prog, notify, deadline, groups=groups,
                jobs=jobs)
    # One at a time: a candidate is verified only while one is still needed. (Running
    # the float64 checks in a forked worker beside the finite-field trials was tried:
    # both sides' float64 GEMMs then run multi-threaded OpenBLAS on the same two cores,
    # and qknorm_gqa's certificate took 117 s instead of 29 s.)
    cands = _verify_ranked(program, todo, replace(options, top=keep), prog, notify, 1,
                           deadline, certify)
    if walk is not None and (len(cands) < keep or cands[-1].cost.time_us >= walk[1]):
        # Candidates the walk's bound was set by were rejected here, and a design left
        # untuned could rank above those certified in their place: rank them all.
        return reuse_designs(program, designs, options, on_progress, need, budget, jobs,
                             enumerate_here, certify)
    return SearchResult(cands, prog, _complete(complete, prog, deadline),
                        time.time() - start)


def _mixed(program: Graph, options: SearchOptions, deadline: float | None, jobs: int,
           prog: Progress, depth: int, unit_map: UnitMap | None = None) -> list[Candidate]:
    """Nothing fused verified: cut the program at its own tensors (:mod:`.partition`),
    search the parts, join them, verify the whole; the first cut that works, latest
    cut first (the cheapest way to an answer)."""
    from mirage_cli.search.cost import estimate
    from mirage_cli.search.design import instantiate

    tried = 0
    for at in partition.cut_points(program):
        if deadline is not None and time.time() > deadline:
            prog.clock_stop("mixed designs (budget)")
            break
        parts = partition.split(program, at)
        if parts is None:
            continue
        tried += 1
        chosen = [_best_part(p.graph, options, deadline, jobs, depth, prog, unit_map)
                  for p in parts]
        if any(c is None for c in chosen):
            continue
        d, t = partition.join(program, [(c[0], c[1]) for c in chosen if c is not None])
        g = instantiate(program, d, t)
        if g is None:
            continue
        try:
            v = verify_composed(program, g, [c[2] for c in chosen if c is not None],
                                options.seed)
        except MirageError:  # the joined parts do not have the program's signature
            v = Verdict(False, "signature differs", options.seed)
        if not v.ok:
            prog.rejected += 1
            continue
        prog.verified += 1
        prog.mixed = (f"cut after '{program.ops[at - 1].outputs[0].name}': "
                      f"{len(d.steps)} kernel(s)")
        return _check_chosen(program, [Candidate(g, d, t, estimate(g), v.as_json())],
                             options.seed, prog)
    prog.mixed = prog.mixed or f"{tried} cut(s) tried, none gave a verified µGraph"
    return []


def _best_part(part: Graph, options: SearchOptions, deadline: float | None, jobs: int,
               depth: int, prog: Progress, unit_map: UnitMap | None = None
               ) -> tuple[Design, Tuning, dict[str, Any] | None] | None:
    """The best verified design of a part and its verdict, or the part's one operator
    itself (verdict None: it is the program's own operator). What stopped the part's
    search (units at ``max_states``, the clock) is the whole search's too."""
    budget = None if deadline is None else max(1.0, deadline - time.time())
    res = search(part, replace(options, top=1), budget, jobs, depth=depth + 1,
                 unit_map=unit_map)
    prog.limited += res.progress.limited
    for what in filter(None, res.progress.clock.split("; ")):
        prog.clock_stop(what)
    if res.candidates:
        c = res.candidates[0]
        return c.design, c.tuning, c.verdict
    pre = partition.predefined(part)
    return None if pre is None else (pre[0], pre[1], None)


def explain_none(prog: Progress) -> str:
    """Which constraint excluded the fused designs, for a search that found none."""
    parts = [f"{prog.designs} design(s) enumerated"]
    if prog.too_big:
        smem = "" if prog.smallest_smem is None else \
            f" (the smallest needs {prog.smallest_smem // 1024} KB)"
        parts.append(f"{prog.too_big} exceed the {SMEM_BYTES // 1024} KB of shared memory "
                     f"per block at every tuning tried{smem}")
    if prog.no_tuning:
        parts.append(f"{prog.no_tuning} have no tuning that divides the shapes")
    if prog.rejected:
        parts.append(f"{prog.rejected} rejected by verification")
    if prog.mixed:
        parts.append(f"mixed designs: {prog.mixed}")
    return "; ".join(parts)


def _splits(program: Graph, d: Design) -> list[Design]:
    """The split-reduction (two-kernel) forms of a one-kernel design: sums split
    (:mod:`.split`, partials in the program's dtype and in f32), or a max-subtracted
    softmax split with rescaling (:mod:`.online`)."""
    tuned = tune(program, d, max_steps=0)
    if not tuned:
        return []
    found = (split_reduction(program, d, tuned[0][1]),
             split_reduction(program, d, tuned[0][1], wide=True),
             online_split(program, d, tuned[0][1]),
             online_split(program, d, tuned[0][1], rows=True))
    return [sd for sd in found if sd is not None]


def _verify_all(program: Graph, batch: Ranked, seed: int, first: bool,
                certify: Certify | None = None) -> list[Verdict]:
    """Verdicts of a batch, best first: ``certify``'s where it answers, finite-field
    trials otherwise (``first``: nothing was certified before the batch). In this
    process, so the verifier's cached reference outputs serve every candidate; the
    chosen candidate's float64 check is :func:`_check_chosen`."""
    verdicts: list[Verdict] = []
    for d, _, g, _ in batch:
        v = None if certify is None else \
            certify(d, g, first and not any(w.ok for w in verdicts))
        verdicts.append(_verify_one(program, g, seed) if v is None else v)
    return verdicts


def _verify_one(program: Graph, g: Graph, seed: int) -> Verdict:
    """:func:`.verify.verify`, with a candidate whose signature differs from the
    program's (an input or output of another type) rejected, not raised."""
    try:
        return verify(program, g, seed)
    except MirageError as e:
        return Verdict(False, f"signature differs: {e.message}", seed, {})


def _check_chosen(program: Graph, out: list[Candidate], seed: int, prog: Progress
                  ) -> list[Candidate]:
    """The chosen (first) candidate must also pass the float64 cross-check and be no
    less safe numerically than the program (:mod:`mirage_cli.verifier.numerics`); one
    that fails either is dropped and the next takes its place. Done on the final
    ranking, so the result does not depend on how verification was batched over
    ``--jobs``. A verdict that already holds both records (they came with a carried
    certificate, :data:`Certify`) keeps them."""
    while out:
        verdict = out[0].verdict
        record = {} if "float64" in verdict and "numerics" in verdict else \
            float_checks(program, out[0].graph, seed)
        if record is not None:
            out[0] = replace(out[0], verdict={**verdict, **record})
            prog.best_us = out[0].cost.time_us  # what ships, after any rejection
            return out
        prog.verified -= 1
        prog.rejected += 1
        prog.refused.add(out.pop(0).design)
    return out


def float_checks(program: Graph, g: Graph, seed: int) -> dict[str, Any] | None:
    """The records of the float64 cross-check and the numerics safety check of ``g``
    (to join its verdict), or None when it fails either."""
    from mirage_cli.verifier.crosscheck import crosscheck
    from mirage_cli.verifier.numerics import safety_check

    cc = crosscheck(program, g, seed)
    safety = safety_check(program, g, seed) if cc.close else None
    if not (cc.close and safety is not None and safety.safe):
        return None
    return {"float64": {"verdict": "close", "method": "float64 reference interpreter",
                        "seed": cc.seed, "rtol": cc.rtol, "atol": cc.atol,
                        "max_rel_err": cc.max_rel_err},
            "numerics": safety.as_json()}


def rank_and_verify(program: Graph, designs: list[Design], options: SearchOptions,
                    prog: Progress, notify: Callable[[Progress], None], jobs: int = 1,
                    deadline: float | None = None, tuned: list[Graph] | None = None
                    ) -> list[Candidate]:
    """Tune, cost and rank the designs, then verify best first until ``top`` pass or
    the ``deadline`` (the command's budget) is reached. ``tuned`` receives each
    design's first tuning (or its first that fits), in ranking order."""
    todo = _ranked(program, designs, options, prog, notify, deadline, tuned, jobs=jobs)
    return _verify_ranked(program, todo, options, prog, notify, max(1, jobs), deadline)


def _verify_ranked(program: Graph, todo: Ranked, options: SearchOptions, prog: Progress,
                   notify: Callable[[Progress], None], step: int,
                   deadline: float | None = None, certify: Certify | None = None
                   ) -> list[Candidate]:
    """Verify the ranked candidates best first, ``step`` at a time, until ``top`` pass
    (in this process, through ``certify`` where it answers: see _verify_all). When
    every one that passed then fails the chosen candidate's checks, go on down the
    ranking: the next certified candidate is still a verified answer."""
    t0 = time.time()
    out: list[Candidate] = []
    i = 0
    while True:
        while i < len(todo) and len(out) < options.top and \
                (deadline is None or time.time() <= deadline):
            batch = todo[i:i + step]
            i += step
            _verify_batch(program, batch, options, prog, out, certify)
            notify(prog)
        out = _check_chosen(program, out, options.seed, prog)
        if deadline is not None and time.time() > deadline and i < len(todo) and \
                len(out) < options.top:
            prog.clock_stop("verification (budget)")
        if out or i >= len(todo) or (deadline is not None and time.time() > deadline):
            break
    _done(prog, notify, t0)
    return out


Ranked = list[tuple[Design, Tuning, Graph, Cost]]
Tunings = list[tuple[str, Design, Tuning, Graph, Cost]]  # (µGraph text, design, ...)


def _ranked(program: Graph, designs: list[Design], options: SearchOptions, prog: Progress,
            notify: Callable[[Progress], None], deadline: float | None = None,
            tuned: list[Graph] | None = None, groups: list[list[Design]] | None = None,
            jobs: int = 1) -> Ranked:
    """The designs tuned and costed, as (design, tuning, µGraph, cost), best first:
    the fitting tunings of the ``tune_designs`` best designs (by their first tuning, or
    the first that fits: :func:`.tune.first_fitting`; with ``groups``, the
    ``tune_designs`` best of each group), each µGraph once; tuned in ``jobs``
    processes (:func:`_tuned`)."""
    prog.phase = "tune"
    notify(prog)
    t0 = time.time()
    firsts: list[tuple[tuple[bool, float, int, int], Design, Graph]] = []
    results = _tuned(jobs, program, _first_fitting, designs)
    for i, d in enumerate(designs):
        if deadline is not None and time.time() > deadline:
            prog.clock_stop("tuning (budget)")
            break  # the budget bounds tuning and verification too
        first = next(results)
        if first is not None:
            c, _, g0 = first
            firsts.append(((not c.fits, c.time_us, _size(d), i), d, g0))
        else:
            prog.no_tuning += 1
    results.close()  # a budget that ended the loop ends the workers too
    firsts.sort(key=lambda x: x[0])
    if tuned is not None:
        tuned.extend(g0 for _, _, g0 in firsts)
    tuned_all: Tunings = []
    best = _best_of(firsts, options.tune_designs, groups)
    for d, two in zip(best, _tuned(jobs, program, _best_two, best)):
        for c, t, g in two:
            tuned_all.append((serialize.dumps(g), d, t, g, c))
    prog.tuned = len(best)
    return _ranked_tunings(tuned_all, prog, notify, t0)


# What a design's predicted time at larger sizes is assumed never to fall below, as a
# fraction of its time at smaller ones (:func:`_walked`). Of the six examples' designs
# tuned at batch 8 and at 16 (and four examples' at 16 and at 32), one design's fell,
# by 1.5 % (lora, 5.31 -> 5.23 us: the descent at batch 8 stopped short); every other
# rose or stayed.
WALK_SLACK = 0.9


def _walked(program: Graph, bounds: dict[Design, float], refused: set[Design], keep: int,
            prog: Progress, notify: Callable[[Progress], None],
            deadline: float | None = None, jobs: int = 1) -> tuple[Ranked, float] | None:
    """A shape reuse's ranking at sizes no smaller than the family's in any parameter:
    the designs tuned fully in the order of their predicted µs there (``bounds``), and
    only until the next one's, times :data:`WALK_SLACK`, is above the ``keep``-th best
    µGraph found here (a design's predicted time does not fall as the tensors grow,
    so none after it can rank above those). lora at batch 16 tunes 3 of the 50 designs
    of its batch-8 pool. The µGraphs of ``refused`` designs (whose candidates the
    family's verification rejected) are tuned and ranked but do not count among those
    best: rmsnorm_linear's best design at batch 8 is rejected there and at 16.
    Returns the ranking and the floor of the designs left untuned (the first one's
    time there times the slack: none of them is predicted below it here), or None
    when that point is never reached: then every design is ranked as a search ranks
    them (:func:`_ranked`)."""
    prog.phase = "tune"
    notify(prog)
    t0 = time.time()
    order = sorted(bounds, key=bounds.__getitem__)  # stable: ties in the pool's order
    tuned_all: Tunings = []
    best: dict[Graph, float] = {}  # the fitting µGraphs found, by predicted µs
    results = _tuned_walk(jobs, program, order)
    floor = None
    for d in order:
        times = sorted(best.values())
        if len(times) >= keep and WALK_SLACK * bounds[d] > times[keep - 1]:
            floor = WALK_SLACK * bounds[d]
            break
        if deadline is not None and time.time() > deadline:
            prog.clock_stop("tuning (budget)")
            floor = float("inf")  # the result says it depends on timing
            break
        two = next(results)
        prog.tuned += 1
        prog.no_tuning += not two
        for c, t, g in two:
            tuned_all.append((serialize.dumps(g), d, t, g, c))
            if c.fits and d not in refused:
                best.setdefault(g, c.time_us)
    results.close()  # the designs after the bound are not waited for
    return None if floor is None else (_ranked_tunings(tuned_all, prog, notify, t0), floor)


def _tuned_walk(jobs: int, program: Graph, designs: list[Design]
                ) -> Generator[list[tuple[Cost, Tuning, Graph]], None, None]:
    """:func:`_best_two` of each design in order, the first :data:`PARALLEL_TUNE_MIN`
    in this process and the rest in ``jobs`` processes (:func:`_tuned`): a walk that
    ends within a few designs (lora at batch 16: 3, 0.05 s) does not wait for workers
    to start (0.15-0.2 s with them)."""
    yield from _tuned(1, program, _best_two, designs[:PARALLEL_TUNE_MIN])
    yield from _tuned(jobs, program, _best_two, designs[PARALLEL_TUNE_MIN:])


def _ranked_tunings(tuned_all: Tunings, prog: Progress, notify: Callable[[Progress], None],
                    t0: float) -> Ranked:
    """The designs' tunings (with their µGraphs' text, the tie rule's key) ranked, each
    µGraph once, those that fit; ``prog`` counts the designs none of whose tunings fit."""
    ranked = rank(tuned_all, lambda x: x[4], lambda x: x[0])  # the tie rule (cost.TIE_RULE)
    prog.phase = "verify"
    prog.seconds["tune"] = round(time.time() - t0, 2)
    notify(prog)
    todo: Ranked = []
    seen_graphs: set[Graph] = set()
    fitting: set[Design] = set()
    for _, d, t, g, c in ranked:
        if c.fits:
            fitting.add(d)
        elif prog.smallest_smem is None or c.smem_bytes < prog.smallest_smem:
            prog.smallest_smem = c.smem_bytes
        if g not in seen_graphs and c.fits:
            seen_graphs.add(g)
            todo.append((d, t, g, c))
    prog.too_big = len({d for _, d, _, _, _ in ranked} - fitting)
    return todo


def _best_of(firsts: list[tuple[Any, Design, Graph]], n: int,
             groups: list[list[Design]] | None) -> list[Design]:
    """The ``n`` best designs of ``firsts`` (ranked by their first fitting tuning), or with
    ``groups`` the ``n`` best of each group, in the ranking's order."""
    ranked = [d for _, d, _ in firsts]
    if groups is None:
        return ranked[:n]
    keep: set[Design] = set()
    for group in groups:
        members = set(group)
        keep.update([d for d in ranked if d in members][:n])
    return [d for d in ranked if d in keep]


def _done(prog: Progress, notify: Callable[[Progress], None], t0: float) -> None:
    prog.phase = "done"
    prog.seconds["verify"] = round(time.time() - t0, 2)
    notify(prog)


def _verify_batch(program: Graph, batch: Ranked, options: SearchOptions, prog: Progress,
                  out: list[Candidate], certify: Certify | None = None) -> None:
    """Verify one batch of ranked candidates; the certified ones join ``out`` (up to
    ``top``)."""
    verdicts = _verify_all(program, batch, options.seed, not out, certify)
    for (d, t, g, c), v in zip(batch, verdicts):
        if v.ok and len(out) < options.top:
            prog.verified += 1
            out.append(Candidate(g, d, t, c, v.as_json()))
            prog.best_us = out[0].cost.time_us
        elif not v.ok:
            prog.rejected += 1
            prog.refused.add(d)


def _size(d: Design) -> int:
    """Operators in a design (fewer first among equal costs)."""
    from mirage_cli.search.design import CustomD

    return sum(len(s.ops) if isinstance(s, CustomD) else 1 for s in d.steps)



@dataclass(frozen=True)
class Outcome:
    """What a search command writes: the candidates file text and its parsed form."""

    text: str
    candidates: list[tuple[Graph, dict[str, Any]]]
    cached: bool
    complete: bool
    progress: Progress | None


def cached_search(program: Graph, options: SearchOptions, budget: float | None, jobs: int,
                  use_cache: bool = True,
                  on_progress: Callable[[Progress], None] | None = None,
                  unit_map: UnitMap | None = None) -> Outcome:
    """:func:`search` behind the result cache (:mod:`.cache`). Every command that
    searches (`search`, `opt`, `explain`, a layer's parts) comes here, so a program
    with a tensor too large for the generated kernels' indexing is refused here (exit
    2), before a search and a verification at its sizes that would not end."""
    from mirage_cli.codegen.indexing import check_program_range
    from mirage_cli.search import cache

    check_program_range(program)
    k = cache.key(program, options.as_json())
    if use_cache:
        text = cache.get(k, program, options.as_json(), options.seed)
        if text is not None:
            try:
                return Outcome(text, serialize.loads_candidates(text), True, True, None)
            except MirageError:  # a damaged cache entry is just a miss
                pass
    res = search(program, options, budget, jobs, on_progress) if unit_map is None else \
        search(program, options, budget, jobs, on_progress, unit_map=unit_map)
    # ``complete: false``: the clock (a safety stop) ended the search, so these
    # candidates depend on timing (``Progress.clock`` says what it stopped).
    pairs = [(c.graph, {**c.meta(i), "complete": res.complete})
             for i, c in enumerate(res.candidates)]
    text = serialize.dumps_candidates(pairs)
    if use_cache and res.complete:
        from mirage_cli.search.family import design_to_json, size_pattern

        us = res.tuned_us or {}
        family = None if res.pool is None else \
            {"designs": [design_to_json(d) for d in res.pool],
             "pattern": size_pattern(program), "tuned_us": [us.get(d) for d in res.pool],
             "rejected": [i for i, d in enumerate(res.pool) if d in res.progress.refused]}
        cache.put(k, text, program, options.as_json(), family)
    return Outcome(text, pairs, False, res.complete, res.progress)


def reused_search(program: Graph, known_path: str, options: SearchOptions,
                  on_progress: Callable[[Progress], None] | None = None,
                  need: int | None = None) -> Outcome:
    """:func:`reuse` of the candidates in the file ``known_path`` (``--reuse``)."""
    from mirage_cli.loading import read_text

    known = [g for g, _ in serialize.loads_candidates(read_text(known_path), known_path)]
    res = reuse(program, known, options, on_progress, need)
    pairs = [(c.graph, {**c.meta(i), "reused_from": known_path})
             for i, c in enumerate(res.candidates)]
    return Outcome(serialize.dumps_candidates(pairs), pairs, False, True, res.progress)
