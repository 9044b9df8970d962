"""The generator: enumerate designs of µGraphs equivalent to a target program.

Kernel level (as Mirage): a state is the set of device tensors available so far (the
program's inputs, then what earlier kernels produced); a move adds a pre-defined
operator or a custom kernel. A design is complete when every program output is
available; designs use at most ``max_kernel_ops`` kernels.

Block level (one custom kernel): a *config* chooses which index (see
:mod:`.analysis`) each grid axis splits and which one the forloop iterates; that fixes
every load's imap and fmap at once. Block operators are then added one at a time over
the tiles, in three phases (loop body, accumulators, epilogue), and every new tile is
kept only if

- its abstract expression may still be a subexpression of the target (the Z3 oracle of
  :mod:`.prune`; ``prune=False`` turns this off for ablation),
- it computes something no existing tile of the same phase computes (no redundant
  operator),
- the operator sequence is canonical (a new operator either uses the previous one's
  result or sorts after it; phases never go back; commutative operands sorted), and
  the set of tiles was not reached before (so each block graph is built once),
- the remaining operator budget can still consume every dangling tile (no dead code:
  a graph with a dead operator is a copy of a smaller one).

Enumeration runs at *representative sizes* (2 blocks per split axis, forloop 2): the
expressions depend on sizes only through sums, which the partial-sum axiom treats
uniformly, and the tuner (:mod:`.tune`) re-instantiates every design at real sizes
through the builder. A kernel stores either tiles equivalent to program outputs (Z3
equivalence) or, when more kernels may follow, its dangling accumulated tiles
(partial results, e.g. flash-decoding's per-split sums), which later kernels load.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from mirage_cli import ops
from mirage_cli.check import stored_type, tile_type
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Attrs, AttrValue, AxisMap, Graph, TensorType
from mirage_cli.search.abstract import FORLOOP_KEY, UNIT, AVal, Term, apply, op_symbols, symbols
from mirage_cli.search.analysis import Analysis, analyze
from mirage_cli.search.design import CustomD, Design, LoadD, OpD, PredefD, Step, StoreD
from mirage_cli.search.prune import Oracle

Phase = Literal["loop", "invariant", "epilogue"]
REP_SPLIT = 2  # representative number of blocks per split axis / forloop iterations
ALTERNATIVES = 3  # kernels extracted per config (different ways to compute an output)
INTERMEDIATE_OPS = 4  # operators of a kernel that can only store an intermediate
COMMUTATIVE = frozenset({"add", "mul"})


class OutOfTime(Exception):
    """The search budget (wall-clock time, a safety stop) ran out."""


class OutOfStates(Exception):
    """The unit built its ``Limits.max_states`` block-graph states: a deterministic
    stop (the same point on every machine, at any load)."""


@dataclass(frozen=True)
class Limits:
    max_kernel_ops: int = 2
    max_block_ops: int = 12
    max_grid_axes: int = 3
    max_stores: int = 2
    prune: bool = True
    max_tiles: int = 3000  # per kernel config: a safety net on saturation
    max_states: int | None = None  # per search (one work unit): the work limit


@dataclass
class Stats:
    explored: int = 0   # block graph states expanded
    pruned: int = 0     # candidate operators rejected by the Z3 oracle
    designs: int = 0    # complete designs found

    def add(self, other: Stats) -> None:
        self.explored += other.explored
        self.pruned += other.pruned
        self.designs += other.designs


@dataclass
class Target:
    """The program being optimised, with everything the generator needs about it."""

    graph: Graph
    analysis: Analysis
    oracle: Oracle
    kernel_vocab: tuple[str, ...]
    block_vocab: tuple[str, ...]
    attr_choices: dict[str, tuple[AttrValue, ...]]

    @property
    def out_terms(self) -> tuple[Term, ...]:
        return tuple(v.term for v in self.analysis.outputs)

    @property
    def out_types(self) -> tuple[TensorType, ...]:
        return tuple(v.type for v in self.analysis.outputs)


# Operators the generator never builds (a custom kernel is what it builds; concat has
# no abstract rule that splits over blocks). A whole layer is cut at them
# (:mod:`.layer`).
NEVER_BUILT = ("custom", "concat")


def _identity_once(name: str) -> bool:
    """An accumulator that sums its input element by element as is: over a loop of one
    iteration, the identity (acc_sum)."""
    spec = ops.get(name).accum
    return spec is not None and spec.is_plain_sum and spec.reduce is ops.Reduce.NONE


def make_target(g: Graph) -> Target:
    """Analyse ``g``: output expressions, the operator vocabulary its expressions
    allow (operators introducing a symbol the target never uses are not tried), and the
    attribute values it uses (scalars, eps, widths), which block operators may reuse."""
    an = analyze(g)
    syms: frozenset[str] = frozenset().union(*(symbols(v.term) for v in an.outputs))

    def allowed(name: str, level: str) -> bool:
        opdef = ops.get(name)
        return (level in opdef.levels and name not in NEVER_BUILT
                and op_symbols(name) <= syms)

    kernel = tuple(n for n in ops.names(ops.KERNEL) if allowed(n, ops.KERNEL))
    # The element-wise sum accumulator whatever the target: a kernel's stores follow an
    # accumulator (the µGraph contract), and over a loop of one iteration it is the
    # identity, so a kernel of element-wise operators alone (the layers' rotary
    # embedding: three kernels fused into one) needs it although its program sums
    # nothing. Over a longer loop it sums, and the oracle prunes it where the target
    # has no sum.
    block = tuple(n for n in ops.names(ops.BLOCK)
                  if allowed(n, ops.BLOCK) or _identity_once(n))
    choices: dict[str, set[AttrValue]] = {}
    for op in g.ops:
        for k, v in op.attrs:
            choices.setdefault(k, set()).add(v)
    widths = {t.shape[-1] for t in (v.type for v in an.outputs)}
    choices.setdefault("width", set()).update(widths)
    attr_choices = {k: tuple(sorted(v, key=repr)) for k, v in choices.items()}
    oracle = Oracle([v.term for v in an.outputs])
    return Target(g, an, oracle, kernel, block, attr_choices)

# ---------------------------------------------------------------------------
# Kernel level
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KState:
    """Device tensors available (name, abstract value), the steps taken, and which
    available tensor provides each program output."""

    tensors: tuple[tuple[str, AVal], ...]
    steps: tuple[Step, ...]
    matched: tuple[str | None, ...]

    @property
    def done(self) -> bool:
        return all(m is not None for m in self.matched)


@dataclass
class Search:
    """One generator run (one process); ``deadline`` is a ``time.monotonic`` value."""

    target: Target
    limits: Limits
    deadline: float | None = None
    stats: Stats = field(default_factory=Stats)
    # (op, attrs, operand values) -> result, None when ill-typed or pruned: the same
    # operator on the same tiles recurs below every node that has them.
    memo: dict[tuple[object, ...], list[tuple[Attrs, AVal, int]]] = field(
        default_factory=dict)
    _ids: dict[AVal, int] = field(default_factory=dict)
    _attr_cache: dict[tuple[object, ...], tuple[Attrs, ...]] = field(default_factory=dict)

    def intern(self, v: AVal) -> int:
        """A small integer standing for ``v`` (hashing terms once, not per use)."""
        return self._ids.setdefault(v, len(self._ids))

    def initial(self) -> KState:
        an = self.target.analysis
        tensors = tuple((i.value.name, an.values[i.value.name]) for i in self.target.graph.inputs)
        return KState(tensors, (), tuple(None for _ in self.target.graph.outputs))

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime()

    def count_state(self) -> None:
        """One more block-graph state built; past ``max_states`` the run stops (raised
        after the count, so a limit of N builds exactly N states)."""
        self.stats.explored += 1
        if self.limits.max_states is not None and \
                self.stats.explored >= self.limits.max_states:
            raise OutOfStates()

    # -- configs ---------------------------------------------------------------

    def configs(self, state: KState) -> list[tuple[tuple[int, ...], int | None]]:
        """Every (grid labels, forloop label) choice over the available tensors,
        most promising first: fewer grid axes last, output indices before others."""
        labels: list[int] = []
        for _, v in state.tensors:
            for lab, n in zip(v.labels, v.type.shape):
                if lab != UNIT and n > 1 and n % REP_SPLIT == 0 and lab not in labels:
                    labels.append(lab)
        out_labels = {lab for v in self.target.analysis.outputs for lab in v.labels}
        grids = [c for a in range(self.limits.max_grid_axes, -1, -1)
                 for c in itertools.combinations(labels, a)]
        grids.sort(key=lambda c: (-sum(lab in out_labels for lab in c), -len(c)))
        loops: list[int | None] = [lab for lab in labels if lab not in out_labels]
        loops += [None] + [lab for lab in labels if lab in out_labels]
        return [(g, f) for g in grids for f in loops]

    # -- kernel-level DFS --------------------------------------------------------

    def designs(self, state: KState, kernels_left: int,
                first: tuple[tuple[int, ...], int | None] | Literal["predef"] | None = None
                ) -> Iterator[Design]:
        """Complete designs reachable from ``state`` with at most ``kernels_left``
        more kernels. ``first`` restricts the first move (used to split the work)."""
        if state.done:
            yield Design(state.steps, tuple(m for m in state.matched if m is not None))
            return
        if kernels_left == 0:
            return
        if first is None or first == "predef":
            for nxt in self.predefined_moves(state):
                yield from self.designs(nxt, kernels_left - 1)
            if first == "predef":
                return
        configs = self.configs(state) if first is None else [first]
        for cfg in configs:
            # A grid that cannot store a pending output can still store an intermediate.
            if not self.completes(state, cfg[0]) and kernels_left < 2:
                continue
            for nxt, stores_intermediate in self.custom_moves(state, cfg, kernels_left > 1):
                if stores_intermediate:
                    # Followed by pre-defined operators only: a few designs per config.
                    yield from self.designs(nxt, kernels_left - 1, "predef")
                else:
                    # A unit that starts with a custom kernel (``first``) has it store
                    # outputs and end the design, or store an intermediate.
                    yield from self.designs(nxt, kernels_left - 1 if first is None else 0)

    def _fresh(self, state: KState) -> str:
        taken = {n for n, _ in state.tensors} | set(self.target.graph.outputs)
        i = len(state.steps)
        while f"t{i}" in taken:
            i += 1
        return f"t{i}"

    def completes(self, state: KState, grid_labels: tuple[int, ...]) -> bool:
        """Can a kernel splitting these indices over its grid store a program output?
        Stores concatenate blocks along output dims, so an index a pending output
        lacks (a reduction split over blocks) only ever yields partial results."""
        outs = [v for m, v in zip(state.matched, self.target.analysis.outputs) if m is None]
        return all(any(lab in v.labels for v in outs) for lab in grid_labels)

    def _match(self, state: KState, v: AVal) -> int | None:
        """The first pending program output that ``v`` computes, if any."""
        for i, (m, t) in enumerate(zip(state.matched, self.target.out_types)):
            if m is None and v.type == t and self.target.oracle.is_equiv(v.term, i):
                return i
        return None

    def predefined_moves(self, state: KState) -> Iterator[KState]:
        """Apply one pre-defined kernel operator (from the target's vocabulary)."""
        avail = dict(state.tensors)
        known = {v.term for v in avail.values()}
        names = list(avail)
        for op in self.target.kernel_vocab:
            opdef = ops.get(op)
            for args in self._operand_tuples(op, opdef.arity[0], len(names)):
                for attrs in self.attr_options(opdef, [avail[names[i]] for i in args]):
                    self.check_time()
                    try:
                        v, _ = apply(op, [avail[names[i]] for i in args], dict(attrs))
                    except ops.ShapeError:
                        continue
                    if v.term in known or not self._keep(v.term):
                        continue
                    i = self._match(state, v)
                    name = (self._fresh(state) if i is None
                            else self.target.graph.outputs[i])
                    matched = (state.matched if i is None else
                               state.matched[:i] + (name,) + state.matched[i + 1:])
                    step = PredefD(op, tuple(names[k] for k in args), attrs, name)
                    yield KState(state.tensors + ((name, v),), state.steps + (step,),
                                 matched)

    def custom_moves(self, state: KState, cfg: tuple[tuple[int, ...], int | None],
                     may_continue: bool) -> Iterator[tuple[KState, bool]]:
        """Every custom kernel of config ``cfg`` that stores pending outputs, and (when
        ``may_continue``) those that store an intermediate value for later kernels
        (flagged True)."""
        kernel = BlockSearch(self, state, cfg[0], cfg[1])
        if not kernel.loads:
            return
        yield from kernel.run(may_continue)

    # -- shared helpers --------------------------------------------------------

    def _keep(self, term: Term) -> bool:
        if not self.limits.prune:
            return True
        if self.target.oracle.is_subexpr(term):
            return True
        self.stats.pruned += 1
        return False

    @staticmethod
    def _operand_tuples(op: str, arity: int, n: int) -> Iterator[tuple[int, ...]]:
        if arity == 1:
            yield from ((i,) for i in range(n))
        elif op in COMMUTATIVE:
            yield from itertools.combinations_with_replacement(range(n), arity)
        else:
            yield from itertools.product(range(n), repeat=arity)

    def attr_options(self, opdef: ops.OpDef, xs: Sequence[AVal]) -> tuple[Attrs, ...]:
        key = (opdef.name, tuple(x.type.shape for x in xs))
        hit = self._attr_cache.get(key)
        if hit is None:
            hit = self._attr_cache[key] = tuple(self._attr_options(opdef, xs))
        return hit

    def _attr_options(self, opdef: ops.OpDef, xs: Sequence[AVal]) -> Iterator[Attrs]:
        """Attribute choices: dims of the operand, keepdim only where needed to keep
        the rank (block tiles keep their rank), other values as the target uses them."""
        per: list[list[tuple[str, AttrValue]]] = []
        for spec in opdef.attrs:
            if spec.name == "dim":
                vals: list[AttrValue] = [d for d in range(xs[0].type.rank)
                                         if xs[0].type.shape[d] > 1]
            elif spec.name == "keepdim":
                vals = [True]
            else:
                vals = list(self.target.attr_choices.get(spec.name, ()))
                if not vals:
                    if spec.required:
                        return
                    continue
            per.append([(spec.name, v) for v in vals])
        for combo in itertools.product(*per):
            yield opdef.normalize(tuple(combo))

# ---------------------------------------------------------------------------
# Block level
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    value: AVal
    phase: Phase
    vid: int = -1   # interned id of ``value`` (see Search.intern)


@dataclass(frozen=True)
class Cand:
    """An operator that could be added to a node: well typed, and kept by the oracle."""

    key: tuple[object, ...]
    op: OpD
    value: AVal
    vid: int
    phase: Phase
    rank: int   # 0 loop/invariant ops, 1 accumulators, 2 epilogue


class BlockSearch:
    """The block graphs of one custom kernel config over one kernel-level state."""

    def __init__(self, search: Search, state: KState, grid_labels: tuple[int, ...],
                 loop_label: int | None) -> None:
        self.s = search
        self.state = state
        self.grid_labels = grid_labels
        self.loop_label = loop_label
        self.grid = tuple([REP_SPLIT] * len(grid_labels) + [1] * (3 - len(grid_labels)))
        self.forloop = REP_SPLIT if loop_label is not None else 1
        self.loads: list[LoadD] = []
        self.tiles: list[Tile] = []
        self._make_loads()

    def _make_loads(self) -> None:
        mapped: set[int] = set()
        looped = False
        for name, v in self.state.tensors:
            imap = tuple(v.labels.index(lab) if lab in v.labels else None
                         for lab in self.grid_labels) + (None,) * (3 - len(self.grid_labels))
            fmap = (v.labels.index(self.loop_label)
                    if self.loop_label is not None and self.loop_label in v.labels else None)
            try:
                t = tile_type(v.type, self.grid, self.forloop, imap, fmap)  # type: ignore
            except MirageError:
                continue
            mapped.update(lab for lab, d in zip(self.grid_labels, imap) if d is not None)
            looped |= fmap is not None
            self.loads.append(LoadD(name, imap, fmap))  # type: ignore[arg-type]
            av = AVal(v.term, t, v.labels)
            self.tiles.append(Tile(av, "loop" if fmap is not None else "invariant",
                                   self.s.intern(av)))
        # Every split must split something, else the config duplicates a smaller one.
        if len(mapped) < len(self.grid_labels) or (self.loop_label is not None and not looped):
            self.loads, self.tiles = [], []

    # -- the DFS -----------------------------------------------------------------

    def run(self, may_continue: bool) -> Iterator[tuple[KState, bool]]:
        """Saturate, then extract one kernel per way of computing the outputs (and,
        when more kernels may follow, the kernels storing an intermediate)."""
        self._saturate()
        for k in self._extract():
            yield k, False
        if may_continue:
            for k in self._intermediates():
                yield k, True

    def _saturate(self) -> None:
        """Grow the set of tiles to a fixpoint: round r adds every kept operator over
        the tiles of earlier rounds (at least one operand from round r-1). A tile is
        identified by its value and whether it is computed after the loop, so each
        distinct tile exists once, with its first (fewest-rounds) derivation; its
        ancestor set gives the size of the block graph that computes it."""
        self.prod: list[OpD | None] = [None] * len(self.tiles)
        self.anc: list[frozenset[int]] = [frozenset() for _ in self.tiles]
        present = {(t.vid, t.phase == "epilogue"): i for i, t in enumerate(self.tiles)}
        frontier = list(range(len(self.tiles)))
        limit = self.s.limits.max_block_ops
        if not self.s.completes(self.state, self.grid_labels):
            # A grid that cannot store an output builds an intermediate only: a matmul
            # and its epilogue, a few operators (gqa's 108 such configs took 7.6 s of
            # enumeration at 12 operators, 1.6 s at 4; a GELU epilogue needs 3).
            limit = min(limit, INTERMEDIATE_OPS)
        for _ in range(limit):
            new: list[int] = []
            round_start = len(self.tiles)
            for newest in frontier:
                self.s.check_time()
                for c in list(self._new_cands(tuple(self.tiles), newest)):
                    old = present.get((c.vid, c.phase == "epilogue"))
                    if old is not None:
                        if old >= round_start:
                            self._prefer_carried(old, c)
                        continue
                    idx = len(self.tiles)
                    anc = frozenset().union(*(self.anc[a] for a in c.op.args)) | {idx}
                    if len(anc) > limit or idx >= self.s.limits.max_tiles:
                        continue
                    present[(c.vid, c.phase == "epilogue")] = idx
                    self.tiles.append(Tile(c.value, c.phase, c.vid))
                    self.prod.append(c.op)
                    self.anc.append(anc)
                    self.s.count_state()
                    new.append(idx)
            if not new:
                break
            frontier = new

    def _prefer_carried(self, old: int, c: Cand) -> None:
        """Common subexpressions across the loop: an epilogue value that a loop tile
        already holds (forloop 1, e.g. a residual sum X + R both stored and normalised)
        is better carried out of the loop by its accumulator than recomputed after it
        from other accumulators, so that derivation replaces an equally small one
        found in the same round (which has no descendants yet)."""
        if not self._carries(c.op, c.vid) or self._carries(self.prod[old], c.vid):
            return
        anc = frozenset().union(*(self.anc[a] for a in c.op.args)) | {old}
        if len(anc) <= len(self.anc[old]):
            self.prod[old] = c.op
            self.anc[old] = anc

    def _carries(self, op: OpD | None, vid: int) -> bool:
        """Is ``op`` an accumulator applied to a tile of value ``vid`` itself?"""
        return (op is not None and ops.get(op.op).is_accumulator
                and self.tiles[op.args[0]].vid == vid)

    def _extract(self) -> Iterator[KState]:
        """Kernels storing every pending output: for each output the epilogue tiles
        equivalent to it (Z3), smallest derivation first; one kernel per choice for
        the first pending output (at most ``ALTERNATIVES``); for each other output the
        derivation that adds fewest operators to those already chosen, so a value two
        outputs share (a residual sum stored and normalised) is computed once."""
        outputs = self.s.target.graph.outputs
        pending = [i for i, m in enumerate(self.state.matched) if m is None]
        options: dict[int, list[int]] = {}
        for i in pending:
            found = []
            for ti, t in enumerate(self.tiles):
                if t.phase != "epilogue":
                    continue
                st = self._stored(t.value, outputs[i])
                if (st is not None and st[1].type == self.s.target.out_types[i]
                        and self.s.target.oracle.is_equiv(t.value.term, i)):
                    found.append(ti)
            found.sort(key=lambda ti: (len(self.anc[ti]), ti))
            options[i] = found
        if not pending or any(not v for v in options.values()):
            return
        first, rest = pending[0], pending[1:]
        for choice in options[first][:ALTERNATIVES]:
            chosen = {first: choice}
            needed = self.anc[choice]
            for i in rest:  # the derivation sharing most with what is chosen (CSE)
                pick = min(options[i], key=lambda ti: (len(needed | self.anc[ti]), ti))
                chosen[i] = pick
                needed = needed | self.anc[pick]
            if len(set(chosen.values())) < len(chosen):
                continue
            if len(needed) > self.s.limits.max_block_ops:
                continue
            self.s.stats.designs += 1
            yield self._kstate_from(sorted(needed), [(ti, outputs[i])
                                                     for i, ti in sorted(chosen.items())],
                                    chosen)

    def _intermediates(self) -> Iterator[KState]:
        """Kernels storing one value that later kernels read: an epilogue tile that no
        available tensor holds and no pending output is, stored whole (no partial
        sums), from among the most complete such tiles (none of them is an operand of
        another), most operators first, at most ``ALTERNATIVES``. A GELU MLP's
        ``gelu(X @ W1)`` is one: the first matmul with GELU as its epilogue, then the
        second matmul as a pre-defined operator. Without them a custom kernel could
        only come last, and GELU was fused into the second matmul's loop, where every
        block along N recomputed it: 2.4x slower than three kernels on an H200."""
        known = {v.term for _, v in self.state.tensors}
        name = self.s._fresh(self.state)

        def whole(ti: int) -> bool:
            m = self._omap(self.tiles[ti].value)
            return (m is not None and not m[1]
                    and self._stored(self.tiles[ti].value, name) is not None)
        cands = [ti for ti, t in enumerate(self.tiles)
                 if t.phase == "epilogue" and self.prod[ti] is not None
                 and t.value.term not in known and whole(ti)]
        inner = set().union(*(self.anc[ti] - {ti} for ti in cands)) if cands else set()
        picked = 0
        for ti in sorted(cands, key=lambda ti: (-len(self.anc[ti]), ti)):
            if picked == ALTERNATIVES:
                return
            if ti in inner or self.s._match(self.state, self.tiles[ti].value) is not None:
                continue
            picked += 1
            self.s.stats.designs += 1
            yield self._kstate_from(sorted(self.anc[ti]), [(ti, name)], {})

    def _kstate_from(self, op_tiles: list[int], stores: list[tuple[int, str]],
                     chosen: dict[int, int]) -> KState:
        nl = len(self.loads)
        used_loads = sorted({a for t in op_tiles for a in self.prod[t].args  # type: ignore
                             if a < nl})
        remap = {old: new for new, old in enumerate(used_loads)}
        for k, t in enumerate(op_tiles):
            remap[t] = len(used_loads) + k
        block_ops = tuple(OpD(self.prod[t].op, tuple(remap[a] for a in self.prod[t].args),  # type: ignore
                              self.prod[t].attrs) for t in op_tiles)  # type: ignore
        store_ds: list[StoreD] = []
        new: list[tuple[str, AVal]] = []
        for ti, name in stores:
            st = self._stored(self.tiles[ti].value, name)
            assert st is not None
            store_ds.append(StoreD(remap[ti], name, st[0].omap))
            new.append((name, st[1]))
        step = CustomD(tuple(self.loads[i] for i in used_loads), block_ops, tuple(store_ds),
                       len(self.grid_labels), self.loop_label is not None)
        matched = list(self.state.matched)
        for i in chosen:
            matched[i] = self.s.target.graph.outputs[i]
        return KState(self.state.tensors + tuple(new), self.state.steps + (step,),
                      tuple(matched))

    def _new_cands(self, tiles: tuple[Tile, ...], newest: int) -> Iterator[Cand]:
        """Candidate operators whose operands include tile ``newest`` and otherwise
        only older tiles."""
        for op in self.s.target.block_vocab:
            opdef = ops.get(op)
            acc = opdef.is_accumulator
            for args in _tuples_with(op, opdef.arity[0], newest):
                phases = {tiles[i].phase for i in args}
                if acc:
                    if "epilogue" in phases:
                        continue
                    rank, phase = 1, "epilogue"
                elif "epilogue" in phases:
                    if "loop" in phases:
                        continue
                    rank, phase = 2, "epilogue"
                else:
                    rank, phase = 0, ("loop" if "loop" in phases else "invariant")
                for attrs, v, vid in self._results(op, opdef, tuple(tiles[i] for i in args)):
                    yield Cand((op, args, attrs), OpD(op, args, attrs), v, vid,
                               phase, rank)  # type: ignore[arg-type]

    def _results(self, op: str, opdef: ops.OpDef, operands: tuple[Tile, ...]
                 ) -> list[tuple[Attrs, AVal, int]]:
        """Kept results of ``op`` on these tiles, one per attribute choice (memoised
        by interned operand ids: the same operator on the same tiles recurs below
        every node that has them)."""
        key = (op, tuple(t.vid for t in operands))
        hit = self.s.memo.get(key)
        if hit is not None:
            return hit
        out: list[tuple[Attrs, AVal, int]] = []
        values = [t.value for t in operands]
        for attrs in self.s.attr_options(opdef, values):
            v = self._apply(op, values, attrs)
            if v is not None and self.s._keep(v.term):
                out.append((attrs, v, self.s.intern(v)))
        self.s.memo[key] = out
        return out

    def _apply(self, op: str, operands: list[AVal], attrs: Attrs) -> AVal | None:
        values = dict(attrs)
        if ops.get(op).is_accumulator:
            values[FORLOOP_KEY] = self.forloop
        try:
            return apply(op, operands, values)[0]
        except (ops.ShapeError, KeyError, ZeroDivisionError):
            return None

    # -- completing a kernel -------------------------------------------------------

    def _omap(self, v: AVal) -> tuple[AxisMap, tuple[int, ...]] | None:
        """omap of a stored tile (each split index to the tile dim carrying it; an
        index the tile lacks, e.g. a split reduction, concatenates partial results
        along the last free dim) and the dims so concatenated."""
        omap: list[int | None] = []
        extra: list[int] = []
        for lab in self.grid_labels:
            if lab in v.labels:
                omap.append(v.labels.index(lab))
        for i, lab in enumerate(self.grid_labels):
            if lab not in v.labels:
                free = [d for d in range(v.type.rank) if d not in omap]
                if not free:
                    return None
                omap.insert(i, free[-1])
                extra.append(free[-1])
        omap += [None] * (3 - len(omap))
        return (omap[0], omap[1], omap[2]), tuple(extra)

    def _stored(self, v: AVal, name: str) -> tuple[StoreD, AVal] | None:
        m = self._omap(v)
        if m is None:
            return None
        omap, extra = m
        try:
            t = stored_type(v.type, self.grid, omap)  # type: ignore[arg-type]
        except MirageError:
            return None
        labels = tuple(10_000 + 100 * len(self.state.tensors) + d if d in extra else lab
                       for d, lab in enumerate(v.labels))
        return StoreD(-1, name, omap), AVal(v.term, t, labels)

def _tuples_with(op: str, arity: int, newest: int) -> Iterator[tuple[int, ...]]:
    """Operand tuples over tiles 0..newest that use tile ``newest``."""
    if arity == 1:
        yield (newest,)
        return
    for i in range(newest + 1):
        yield (i, newest)
        if op not in COMMUTATIVE and i != newest:
            yield (newest, i)
