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
(:func:`.cost.grouped_us`). Which kernels share a launch is codegen's to say (its
lowering of the tunings found alone); a descent's end is kept only if codegen launches
it so too, and every retuned member is certified again against its own sub-program.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mirage_cli.ir import Graph
from mirage_cli.search.cost import TIE_REL, estimate, grouped_us, kernel_costs
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


def launches(g: Graph) -> list[list[int]]:
    """The op indices of each launch codegen forms for ``g`` (codegen/lower.py)."""
    from mirage_cli.codegen.lower import lower

    return [list(r) for r in lower(g).launch_ops]


def layout_us(g: Graph, runs: Sequence[Sequence[int]] | None = None) -> float:
    """The model's time of ``g`` with the kernels of each of ``runs`` (default: the
    launches codegen forms for ``g``) sharing one launch; infinite where a kernel
    cannot run as planned (as :func:`.cost.estimate` says it does not fit)."""
    if not estimate(g).fits:
        return math.inf
    rs = launches(g) if runs is None else runs
    alone = kernel_costs(g)
    co = {i: sum(alone[j].blocks for j in r) - alone[i].blocks for r in rs if len(r) > 1
          for i in r}
    shared = kernel_costs(g, co_blocks=co) if co else alone
    return sum(grouped_us([shared[i] for i in r]) for r in rs)


def _lighter_blocks(g: Graph, runs: Sequence[Sequence[int]], anchor: frozenset[int]
                    ) -> bool:
    """Whether, in each launch with a kernel of ``anchor`` (the member that keeps its
    tuning), every other kernel's blocks stream fewer bytes each than the anchor's
    blocks. The launch lasts as long as its longest blocks: in the Qwen layer's, key
    and value blocks of as many bytes as the query projection's ran it 15.1 us, of
    half or a quarter as many 13.2 and 13.1 (docs/perf-log.md v46), which the model's
    sum of the members' streaming does not tell apart."""
    ks = kernel_costs(g)

    def per_block(i: int) -> float:
        return ks[i].dram_bytes / max(ks[i].blocks, 1)

    for r in runs:
        heavy = [per_block(i) for i in r if i in anchor]
        if heavy and any(per_block(i) >= max(heavy) for i in r if i not in anchor):
            return False
    return True


def tune_together(ms: Sequence[Member], join: Join
                  ) -> tuple[list[Graph], float, float] | None:
    """The members' µGraphs retuned for their shared launches, with the model's time of
    the joined part before and after; None where nothing better is found, or codegen
    would not launch the result as the model priced it."""
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
    seen: dict[tuple[Tuning, ...], float | None] = {}
    built: dict[tuple[int, Tuning], Graph | None] = {}

    def graph(j: int, t: Tuning) -> Graph | None:
        m = ms[j]
        if m.design is None:
            return m.graph
        if (j, t) not in built:
            built[(j, t)] = m.graph if t == m.tuning else instantiate(m.cone, m.design, t)
        return built[(j, t)]

    def joined(state: tuple[Tuning, ...]) -> Graph | None:
        gs = [graph(j, t) for j, t in enumerate(state)]
        return None if any(g is None for g in gs) else join([g for g in gs if g])

    start = tuple(m.tuning for m in ms)
    first = joined(start)
    if first is None:
        return None
    # The launches codegen forms for the tunings found alone; every state is priced
    # with the same members sharing a launch, and its result kept only if codegen
    # launches it so too (a member of other tiles may not fit beside the others).
    runs = launches(first)
    if all(len(r) == 1 for r in runs):
        return None
    at = sum(len(ms[j].graph.ops) for j in range(anchor))  # a tuning keeps the ops
    anchor_ops = frozenset(range(at, at + len(ms[anchor].graph.ops)))

    def cost(state: tuple[Tuning, ...]) -> float | None:
        if state not in seen:
            g = joined(state)
            seen[state] = None if g is None or not _lighter_blocks(g, runs, anchor_ops) \
                else layout_us(g, runs)
        return seen[state]

    # The tunings found alone are the baseline, whatever their blocks.
    before = here = seen[start] = layout_us(first, runs)
    state = start
    for _ in range(MAX_STEPS):
        options = []
        for j, m in enumerate(ms):
            if m.design is None or j == anchor:
                continue
            types = m.cone.tensor_types()
            for t in neighbours(state[j], m.design, types):
                n = state[:j] + (t,) + state[j + 1:]
                if (c := cost(n)) is not None and c < here:
                    options.append((c, n))
        if not options:
            break
        here, state = min(options)
    # The best states visited are lowered, best first, and the first that codegen
    # launches as they were priced wins (codegen decides from shared memory and the
    # rings fit_residency shortens, which the model leaves to it). Within the tie
    # rule's 1% a tuning is no better (search/cost.py TIE_REL).
    ranked = sorted((c, s) for s, c in seen.items()
                    if c is not None and c < before * (1 - TIE_REL))
    for after, s in ranked[:MAX_LOWERED]:
        g = joined(s)
        if g is not None and launches(g) == runs:
            return [x for x in (graph(j, t) for j, t in enumerate(s)) if x is not None], \
                before, after
    return None
