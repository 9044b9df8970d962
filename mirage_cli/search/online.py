"""Rescaled split reduction (FlashDecoding with the max kept): one kernel becomes two.

:mod:`.split` splits a kernel whose accumulators are plain sums. A max-subtracted
softmax cannot be split that way: ``exp(x - max x)`` needs the max of the whole row.
This move splits the reduced index ``L`` (attention's keys) over one more grid axis
anyway, and keeps every max subtraction, each block subtracting its own chunk's max:

- kernel 1 (one block per chunk ``j``) computes the chunk's max ``m_j``, every value
  ``exp(x - m_j)`` as the program's kernel does, and the reductions over ``L`` of those
  values (``s_j = sum exp(x - m_j)``, ``O_j = exp(x - m_j) @ V_j``): the partial
  results, concatenated along their last dimension, as :mod:`.split` stores them;
- kernel 2 rescales and adds them: ``M = max_j m_j``, ``s = sum_j s_j exp(m_j - M)``,
  ``O = sum_j O_j exp(m_j - M)``, then runs the kernel's epilogue (``O / s``).

This is exact because a partial reduction of ``exp(x - m_j) * y`` (linear in the
exponential, ``y`` free of the max) times ``exp(m_j - M)`` is the same reduction of
``exp(x - M) * y``: shift invariance, which the finite-field verifier certifies like
any other identity. Every exponent the candidate evaluates is at most 0 (``x - m_j``,
``m_j - M``), as in the program, so nothing overflows where the program does not.
The partial results are stored in f32, as the accumulators that hold them: ``O_j``
sums up to a chunk's worth of values, which in an f16 workspace tensor overflows
where the program's result (a weighted average of them) does not (the numerics check
holds each input constant to find that, docs/verification.md). Kernel 2 then reads
f32 tiles only and converts its result to the program output's dtype as it stores it.

A partial of width ``w > 1`` (``O_j``) is weighted in kernel 2 element by element, so
kernel 1 also stores its chunk max spread over ``w`` columns (``m_j + 0 * O_j``): no
block operator repeats a value along a dimension, and kernel 2 is then one weighted
``acc_sum_to``, whatever the number of chunks. That keeps the two kernels' tunings
independent (a kernel 2 looping over the chunks would need its forloop range equal to
kernel 1's chunk count, which the tuner, moving one size at a time, cannot keep).

The move applies to a one-kernel design whose grid has a free axis, whose maxima all
reduce one index ``L`` that the forloop does not walk (or walks with a running
maximum, :mod:`.runmax`: each block's maximum is then its chunk's over all its
iterations, and a per-iteration reduction over ``L`` is summed over them into the
partial), and in which every other reduction over ``L`` is of a value linear in
``exp(x - max)``; otherwise it returns None. Like every design, the result is re-checked by the builder at each tuning and
verified before it is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli import ops
from mirage_cli.check import online_reads
from mirage_cli.ir import DType, Graph
from mirage_cli.search.abstract import FORLOOP_KEY, UNIT, AVal, apply
from mirage_cli.search.analysis import UnionFind, analyze
from mirage_cli.search.design import CustomD, Design, LoadD, OpD, StoreD, Tuning, instantiate
from mirage_cli.search.split import _first_axes, _set

# How kernel 1's values relate to the chunk max m_j (see ``_classify``).
FREE = "free"          # does not depend on m_j (loads, Q·K, scaling)
CHUNK_MAX = "max"      # m_j itself (a max over L)
SCALED = "scaled"      # linear in exp(x - m_j): exp(x - m_j), times free values, ...
PARTIAL = "partial"    # a reduction over L of a scaled value: rescaled in kernel 2
LATE = "late"          # reads partials or m_j only: kernel 2's epilogue
SHIFTED = "shifted"    # x - m_j, the argument of an exp
STEP = "step"          # a reduction over one iteration's keys, summed by an accumulator


@dataclass(frozen=True)
class _Tiles:
    """The kernel's tiles (loads first, then operators) with their index labels."""

    vals: list[AVal]
    key: int  # the label L of the index the maxima reduce
    walked: bool = False  # the forloop walks L (the maxima are running ones)


def online_split(target: Graph, design: Design, tuning: Tuning, rows: bool = False
                 ) -> Design | None:
    """The two-kernel rescaled form of a one-kernel ``design`` (None where it does not
    apply); ``tuning`` is any valid tuning of ``design`` (it gives tile shapes).
    ``rows``: kernel 2 also splits the rows, which the kernel's grid does not, over
    one more grid axis (None where it has no such rows)."""
    if len(design.steps) != 1 or not isinstance(design.steps[0], CustomD):
        return None
    c = design.steps[0]
    if c.axes >= 3:
        return None
    tiles = _tiles(target, c, tuning)
    if tiles is None:
        return None
    kinds = _classify(c, tiles)
    if kinds is None or CHUNK_MAX not in kinds or PARTIAL not in kinds:
        return None
    dtypes = {n: t.dtype for n, t in target.tensor_types().items()}
    return _build(c, tiles, kinds, design.outputs, dtypes, rows)


def _tiles(target: Graph, c: CustomD, tuning: Tuning) -> _Tiles | None:
    """Labels of every tile, and the index the maxima reduce (None if not one)."""
    an = analyze(target)
    full = instantiate(target, Design((c,), tuple(s.name for s in c.stores)), tuning)
    if full is None:
        return None
    bg = full.ops[-1].block
    assert bg is not None
    uf = UnionFind()
    vals: list[AVal] = []
    for ld, bi in zip(c.loads, bg.inputs):
        src = an.values.get(ld.source)
        if src is None:
            return None
        vals.append(AVal(src.term, bi.value.type, src.labels))
    for o in c.ops:
        opdef = ops.get(o.op)
        attrs = dict(opdef.attr_values(o.attrs))
        if opdef.is_accumulator:
            attrs[FORLOOP_KEY] = bg.forloop
        try:
            v, unions = apply(o.op, [vals[a] for a in o.args], attrs)
        except (ops.ShapeError, KeyError):
            return None
        for a, b in unions:
            uf.union(a, b)
        vals.append(v)
    vals = [AVal(v.term, v.type, tuple(uf.find(x) for x in v.labels)) for v in vals]
    keys = {_reduced_label(o, vals) for o in c.ops if ops.is_maximum(o.op)}
    if len(keys) != 1 or None in keys or UNIT in keys:
        return None
    key = keys.pop()
    assert key is not None
    walked = {vals[i].labels[ld.fmap] for i, ld in enumerate(c.loads) if ld.fmap is not None}
    if key in walked and not online_reads(bg):
        return None  # the forloop walks L: a chunk's max is not known in the loop
    return _Tiles(vals, key, key in walked)


def _reduced_label(o: OpD, vals: list[AVal]) -> int | None:
    """The label of the index that ``o`` reduces, or None when it reduces none."""
    x = vals[o.args[0]]
    opdef = ops.get(o.op)
    if opdef.accum is not None:
        return x.labels[-1] if opdef.accum.reduce is ops.Reduce.LAST else None
    if opdef.cuda.kind == "reduce":  # sum, mean, max over ``dim``
        return x.labels[int(dict(o.attrs)["dim"])]
    if o.op == "matmul":
        return x.labels[-1]
    return None


def _classify(c: CustomD, t: _Tiles) -> list[str] | None:
    """Each tile's relation to the chunk max (module constants), or None when the
    kernel does something the rescaling cannot carry (e.g. exp of a value that still
    holds the max, or a reduction over L of a value not linear in exp(x - max))."""
    kinds = [FREE] * len(c.loads)
    for k, o in enumerate(c.ops):
        kind = _kind(o, [kinds[a] for a in o.args], _reduced_label(o, t.vals) == t.key,
                     [t.key in t.vals[a].labels for a in o.args], t.walked)
        if kind is None:
            return None
        kinds.append(kind)
    return kinds


def _kind(o: OpD, args: list[str], over_key: bool, has_key: list[bool], walked: bool
          ) -> str | None:
    """The rule for one operator (see ``_classify``). Where the forloop walks L
    (``walked``: a running maximum), a reduction over L inside one iteration is a
    ``STEP``, and its sum over the iterations the partial."""
    if STEP in args:
        return PARTIAL if args == [STEP] and ops.linear_in(o.op, [True]) \
            and ops.get(o.op).is_accumulator else None
    if all(a == FREE for a in args):
        if ops.is_maximum(o.op) and over_key:
            return CHUNK_MAX
        return FREE
    if any(a == LATE for a in args) or (all(a in (PARTIAL, CHUNK_MAX) for a in args)):
        # Kernel 2's epilogue: values of the whole row (rescaled partials, M).
        return LATE if not any(has_key) else None
    if o.op == "exp" and args == [SCALED]:
        return None
    if o.op == "sub" and args == [FREE, CHUNK_MAX]:
        return SHIFTED
    if o.op == "exp" and args == [SHIFTED]:
        return SCALED
    if SCALED in args:
        scaled = _linear(o, args)
        if scaled and over_key:
            return STEP if walked and not ops.get(o.op).is_accumulator else PARTIAL
        return SCALED if scaled else None
    return None


def _linear(o: OpD, args: list[str]) -> bool:
    """Is ``o`` linear in its one scaled operand (the others free of the max)?"""
    if any(a not in (FREE, SCALED) for a in args):
        return False
    return ops.linear_in(o.op, [a == SCALED for a in args])


def _build(c: CustomD, t: _Tiles, kinds: list[str], outputs: tuple[str, ...],
           dtypes: dict[str, DType], rows: bool = False) -> Design | None:
    """Kernel 1 (chunks over a new grid axis) and kernel 2 (rescale, add, epilogue)."""
    nl = len(c.loads)
    maxima = [i for i, k in enumerate(kinds) if k == CHUNK_MAX]
    late = [i for i, k in enumerate(kinds) if k == LATE]
    if len(maxima) != 1 or not late or any(s.tile < nl or kinds[s.tile] != LATE
                                            for s in c.stores):
        return None
    if any(kinds[x] == FREE for i in late for x in c.ops[i - nl].args):
        return None  # the epilogue reads a value kernel 2 does not have
    k1 = _kernel1(c, t, kinds, maxima[0])
    if k1 is None:
        return None
    kernel1, spread, names = k1
    partials = [i for i, k in enumerate(kinds) if k == PARTIAL]
    kernel2 = _combine(c, t, kinds, maxima[0], partials, spread, names, kernel1.stores,
                       dtypes, rows)
    if kernel2 is None:
        return None
    return Design((kernel1, kernel2), outputs)


def _kernel1(c: CustomD, t: _Tiles, kinds: list[str], mx: int
             ) -> tuple[CustomD, dict[int, int], dict[int, str]] | None:
    """Kernel 1: the loads split along L over grid axis ``c.axes``, every operator
    that is not kernel 2's, and per partial wider than one column m_j spread to its
    width; it stores m_j, the partials and the spread maxima (concatenated along their
    last dimension). Also returns the spread tiles and the stored names by tile (a
    spread max of partial p under key -p-1)."""
    nl, a = len(c.loads), c.axes
    loads1 = []
    for i, ld in enumerate(c.loads):
        labels = t.vals[i].labels
        dim = labels.index(t.key) if t.key in labels else None
        loads1.append(LoadD(ld.source, _set(ld.imap, a, dim), ld.fmap))
    ops1: list[OpD] = []
    remap1: dict[int, int] = {x: x for x in range(nl)}
    for k, o in enumerate(c.ops):
        if kinds[nl + k] != LATE:
            remap1[nl + k] = _append(ops1, nl, OpD(o.op, tuple(remap1[x] for x in o.args),
                                                   o.attrs))
    partials = [i for i, k in enumerate(kinds) if k == PARTIAL]
    spread: dict[int, int] = {}  # partial -> kernel 1 tile of m_j spread to its width
    for p in partials:
        if t.vals[p].type.shape[-1] > 1:
            src = _zero_source(t, kinds, mx, p)
            if src is None:
                return None
            x = remap1[src[0]]
            if src[1] is not None:
                x = _append(ops1, nl, OpD("max", (x,), (("dim", src[1]), ("keepdim", True))))
            zero = _append(ops1, nl, OpD("mul_scalar", (x,), (("scalar", 0.0),)))
            spread[p] = _append(ops1, nl, OpD("add", (remap1[mx], zero), ()))
    out_omap = c.stores[0].omap
    stores1: list[StoreD] = []
    names: dict[int, str] = {}
    stored = [(x, remap1[x], x) for x in [mx] + partials]
    stored += [(p, tile, -p - 1) for p, tile in spread.items()]
    for j, (orig, tile, key) in enumerate(stored):
        rank = t.vals[orig].type.rank
        omap = _set(tuple(out_omap[i] if i < a else None for i in range(3)), a, rank - 1)
        if list(omap[:a]).count(rank - 1):
            return None  # the last dimension is already split by the grid
        names[key] = f"{c.stores[0].name}_online{j}"
        stores1.append(StoreD(tile, names[key], omap, DType.F32))
    return (CustomD(tuple(loads1), tuple(ops1), tuple(stores1), a + 1, c.looped), spread,
            names)


def _zero_source(t: _Tiles, kinds: list[str], mx: int, p: int
                 ) -> tuple[int, int | None] | None:
    """A tile free of the max whose zero, added to m_j, has the shape of the partial
    ``p``: one without L (attention's query tile, when the loop does not split it), or
    else one whose max over L has the right shape (the value tile's column maxima: a
    max, unlike a sum, cannot overflow a finite tile, so times 0 it is exactly 0); as
    ``(tile, dim to reduce or None)``. It is a value of the exponent's domain (not a
    result of exp, such as ``p`` itself), so that kernel 2's exp(m_j - M) has a
    meaning in the finite field too (the verifier models exp as g^a over Z_Q and
    does not nest it)."""
    want = t.vals[p].type.shape
    found: list[tuple[int, int, int | None]] = []
    for i, kind in enumerate(kinds):
        v = t.vals[i]
        if kind != FREE or v.type.rank != len(want):
            continue
        dim = v.labels.index(t.key) if t.key in v.labels else None
        shape = list(v.type.shape)
        if dim is not None:
            shape[dim] = 1
        try:
            if ops.broadcast_shape(t.vals[mx].type.shape, tuple(shape)) == want:
                found.append((dim is not None, i, dim))
        except ops.ShapeError:
            continue
    return min(found)[1:] if found else None


def _append(ops_: list[OpD], nl: int, o: OpD) -> int:
    ops_.append(o)
    return nl + len(ops_) - 1


def _combine(c: CustomD, t: _Tiles, kinds: list[str], mx: int, partials: list[int],
             spread: dict[int, int], names: dict[int, str],
             stores1: tuple[StoreD, ...], dtypes: dict[str, DType],
             split_rows: bool = False) -> CustomD | None:
    """Kernel 2: M = max_j m_j; each partial weighted by exp(m_j - M) and added over
    the chunks (``acc_sum_ld`` for one column, ``acc_sum_to`` for wider ones); then
    the original epilogue on the rescaled sums (m_j read there becomes M). With
    ``split_rows`` (and always where the kernel's grid split nothing, which would
    leave the whole combine to one block), the rows, each combined on its own, go
    over one more grid axis; None where the grid splits them already."""
    nl, a = len(c.loads), c.axes
    omap_of = {s.name: s.omap for s in stores1}
    loads2: list[LoadD] = []
    slot: dict[str, int] = {}
    rank = t.vals[mx].type.rank
    free = rank >= 2 and rank - 2 not in _first_axes(stores1[0].omap, a)
    if split_rows and not free:
        return None
    rows = rank - 2 if free and (split_rows or a == 0) else None

    def load(name: str) -> int:
        if name not in slot:
            slot[name] = len(loads2)
            imap = _first_axes(omap_of[name], a)
            loads2.append(LoadD(name, imap if rows is None else _set(imap, a, rows), None))
        return slot[name]

    for key in [mx] + partials + [-p - 1 for p in spread]:
        load(names[key])
    ops2: list[OpD] = []

    def emit(o: OpD) -> int:
        ops2.append(o)
        return -(len(ops2))  # resolved once the number of loads is final

    rank = t.vals[mx].type.rank
    big = emit(OpD("max", (slot[names[mx]],), (("dim", rank - 1), ("keepdim", True))))
    weight = emit(OpD("exp", (emit(OpD("sub", (slot[names[mx]], big), ())),), ()))
    remap: dict[int, int] = {mx: big}
    for p in partials:
        width = t.vals[p].type.shape[-1]
        if p in spread:
            w = emit(OpD("exp", (emit(OpD("sub", (slot[names[-p - 1]], big), ())),), ()))
            prod = emit(OpD("mul", (slot[names[p]], w), ()))
            remap[p] = emit(OpD("acc_sum_to", (prod,), (("width", width),)))
        else:
            prod = emit(OpD("mul", (slot[names[p]], weight), ()))
            remap[p] = emit(OpD("acc_sum_ld", (prod,), ()))
    for k, o in enumerate(c.ops):
        if kinds[nl + k] == LATE:
            remap[nl + k] = emit(OpD(o.op, tuple(remap[x] for x in o.args), o.attrs))
    n2 = len(loads2)

    def fix(x: int) -> int:
        return n2 - x - 1 if x < 0 else x

    ops_final = tuple(OpD(o.op, tuple(fix(x) for x in o.args), o.attrs) for o in ops2)
    stores2 = tuple(StoreD(fix(remap[s.tile]), s.name,
                           s.omap if rows is None else _set(s.omap, a, rows),
                           dtypes.get(s.name)) for s in c.stores)
    return CustomD(tuple(loads2), ops_final, stores2, a if rows is None else a + 1, False)
