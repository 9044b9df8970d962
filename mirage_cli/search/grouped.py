"""Tuning kernels that share a launch together.

A part of several outputs searched one output at a time (``layer._per_output``) gives
independent kernels that codegen launches as one grid (codegen/grouping.py): the
query, key and value projections of a decoder layer. Each was tuned alone, where a
projection of few columns fills the SMs only with many narrow blocks: the Qwen
layer's key and value projections ran 64 blocks of 8 columns each, split in 2, and
the three projections' launch 16.1 µs on an H200; beside the query projection's
blocks the SMs are full anyway, and with 16 or 32 blocks of 64 or 32 columns the
launch ran 13.1 to 13.7 (docs/perf-log.md v46).

So the members' tunings move together here: coordinate descent over the tuning moves
(the tuner's, :func:`.tune.neighbours`) of every member but the one that streams the
most bytes, which keeps its own, on the model's time of the
joined part, where each run of kernels that would share a launch is priced as one
(:func:`.cost.grouped_us`). Which kernels share a launch is decided as codegen does:
level by level, each kernel joining the run before it when the model sees them
compatible (:func:`.cost.groupable`); a descent's end is kept only if codegen's own
lowering groups it so, and every retuned member is certified again against its own
sub-program.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mirage_cli.ir import Graph
from mirage_cli.search.cost import (
    TIE_REL,
    KernelCost,
    estimate,
    groupable,
    grouped_us,
    kernel_costs,
)
from mirage_cli.search.design import Design, Tuning, design_of, instantiate
from mirage_cli.search.tune import neighbours

MAX_STEPS = 40
# The best tunings found that are lowered to see whether codegen launches them as the
# model priced them (each lowering plans every kernel of the part: about a tenth of a
# second).
MAX_LOWERED = 8

Join = Callable[[Sequence[Graph]], Graph]


@dataclass(frozen=True)
class Member:
    """One output's µGraph: its sub-program, design and tuning (None: not fused, kept
    as it is)."""

    cone: Graph
    graph: Graph
    design: Design | None
    tuning: Tuning


def members(cones: Sequence[Graph], graphs: Sequence[Graph], fused: Sequence[bool]
            ) -> list[Member]:
    out = []
    for cone, g, f in zip(cones, graphs, fused):
        d, t = design_of(g) if f else (None, ())
        out.append(Member(cone, g, d, t))
    return out


def runs(g: Graph, ks: Sequence[KernelCost]) -> list[list[int]]:
    """The launches of ``g``'s kernels as the model predicts codegen forms them: level
    by level in op order, a kernel joining the run before it (of its level) when the
    model sees the run and it compatible."""
    from mirage_cli.codegen.aliasing import aliasing
    from mirage_cli.codegen.grouping import levels

    free = frozenset(i for i, k in enumerate(ks) if not k.launched) | aliasing(g).free
    level = levels(g, frozenset(free))
    out: list[list[int]] = []
    for i in sorted(level, key=lambda i: (level[i], i)):
        if out and level[out[-1][0]] == level[i] and \
                groupable([ks[j] for j in out[-1]] + [ks[i]]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def layout_us(g: Graph) -> tuple[float, list[list[int]]]:
    """The model's time of ``g`` with its kernels launched as :func:`runs` predicts,
    and those runs; infinite where a kernel cannot run as planned (as
    :func:`.cost.estimate` says it does not fit)."""
    alone = kernel_costs(g)
    rs = runs(g, alone)
    if not estimate(g).fits:
        return math.inf, rs
    co = {i: sum(alone[j].blocks for j in r) - alone[i].blocks for r in rs if len(r) > 1
          for i in r}
    shared = kernel_costs(g, co_blocks=co) if co else alone
    return sum(grouped_us([shared[i] for i in r]) for r in rs), rs


def tune_together(ms: Sequence[Member], join: Join
                  ) -> tuple[list[Graph], float, float] | None:
    """The members' µGraphs retuned for their shared launches, with the model's time of
    the joined part before and after; None where nothing better is found, or codegen
    would not launch the result as the model priced it."""
    from mirage_cli.codegen.lower import lower

    tuned = [j for j, m in enumerate(ms) if m.design is not None]
    if len(tuned) < 2:
        return None
    # The member that streams the most bytes keeps its own tuning: its streaming is
    # most of the launch's time, and its tiling alone is what its blocks stream best
    # in (as codegen keeps its block size, grouping.fit_residency). Moved too, the
    # Qwen layer's query projection went from 56 blocks of 64 columns to 28 of 128
    # beside the key and value projections, which the model priced 2 us faster, and
    # the layer ran 148.5 us at batch 1 against 146.8 with it kept, and 215.3 against
    # 208.0 at batch 16 (docs/perf-log.md v46).
    anchor = max(tuned, key=lambda j: (sum(k.dram_bytes for k in kernel_costs(ms[j].graph)),
                                       -j))
    seen: dict[tuple[Tuning, ...], tuple[float, list[list[int]]] | None] = {}
    built: dict[tuple[int, Tuning], Graph | None] = {}

    def graph(j: int, t: Tuning) -> Graph | None:
        m = ms[j]
        if m.design is None:
            return m.graph
        if (j, t) not in built:
            built[(j, t)] = m.graph if t == m.tuning else instantiate(m.cone, m.design, t)
        return built[(j, t)]

    def cost(state: tuple[Tuning, ...]) -> tuple[float, list[list[int]]] | None:
        if state not in seen:
            gs = [graph(j, t) for j, t in enumerate(state)]
            seen[state] = None if any(g is None for g in gs) else \
                layout_us(join([g for g in gs if g is not None]))
        return seen[state]

    start = tuple(m.tuning for m in ms)
    here = cost(start)
    if here is None:
        return None
    before = here[0]
    state = start
    for _ in range(MAX_STEPS):
        options = []
        for j, m in enumerate(ms):
            if m.design is None or j == anchor:
                continue
            types = m.cone.tensor_types()
            for t in neighbours(state[j], m.design, types):
                n = state[:j] + (t,) + state[j + 1:]
                if (c := cost(n)) is not None and c[0] < here[0]:
                    options.append((c[0], n))
        if not options:
            break
        _, state = min(options)
        here = cost(state)
        assert here is not None
    # The model's launches are a guess at codegen's (it leaves shared memory and the
    # rings fit_residency shortens to codegen): the best states visited are lowered,
    # best first, and the first that codegen launches as the model priced it wins.
    # Within the tie rule's 1% a tuning is no better (search/cost.py TIE_REL).
    ranked = sorted((c[0], s) for s, c in seen.items()
                    if c is not None and c[0] < before * (1 - TIE_REL))
    for after, s in ranked[:MAX_LOWERED]:
        gs = [g for g in (graph(j, t) for j, t in enumerate(s)) if g is not None]
        if [list(r) for r in lower(join(gs)).launch_ops] == cost(s)[1]:  # type: ignore[index]
            return gs, before, after
    return None
