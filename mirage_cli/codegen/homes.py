"""Where each tile of a fused kernel lives: the tile homes of a plan.

An input is staged in shared memory (padded rows, 16-byte ``cp.async`` chunks) unless
one reader reads each element once and the knobs say not to stage it; an accumulator
lives in registers up to ``ACC_REGS_MAX`` elements per thread; a computed tensor is
computed where it is read (``inline``) when it has one reader in its own phase
(:func:`inlinable`), else in a pass of its own into a shared-memory f32 tile, or a
16-bit one with padded rows when only ``ldmatrix`` reads it. The planner
(:mod:`planner`) takes these homes and lays the tiles out.
"""

from __future__ import annotations

from collections.abc import Mapping

from mirage_cli import ops
from mirage_cli.codegen.blockfacts import (
    Analysis,
    acc_row_reduction,
    packed,
    reads_once,
    row_reduction,
    scaled_operand,
)
from mirage_cli.codegen.knobranges import VEC_BYTES, vec_elems
from mirage_cli.codegen.smemplan import TileDraft, pitch_of
from mirage_cli.ir import TensorType
from mirage_cli.kplan import Home, Knobs

ACC_REGS_MAX = 32     # accumulator elements per thread kept in registers


def homes(a: Analysis, dev: Mapping[str, TensorType], k: Knobs,
          joined: frozenset[str] = frozenset(), shifted: frozenset[str] = frozenset()
          ) -> dict[str, TileDraft]:
    """Each tile's home under knobs ``k``, the packed ones with their row pitch; the
    ``joined`` inputs (concatenations read in place) always staged: only the staging
    copies pick each chunk's part; the ``shifted`` ones among them in rows of one chunk
    more (joins.py)."""
    bg, T = a.bg, a.bg.threads
    tiles: dict[str, TileDraft] = {}
    for bi in bg.inputs:
        name, t = bi.value.name, bi.value.type
        users = a.uses[name]
        once = all(u is None or reads_once(u, t, a.types) for u in users) and len(users) <= 1
        vec = vec_elems(t, dev[bi.source].shape[-1])
        staged = not once or (k.stage_once == 1 and vec > 1) or name in joined
        tile = TileDraft(name, t, a.phases[name], "smem" if staged else "global", vec=vec,
                         joined=name in joined)
        if staged:
            tile.pitch = pitch_of(t, k.pad == 1) if vec > 1 else t.shape[-1]
        if name in shifted:
            tile.shifted, tile.vec = True, VEC_BYTES // t.dtype.nbytes
            tile.pitch = shifted_pitch(t, k.pad == 1)
        tiles[name] = tile
    for op in bg.ops:
        v = op.outputs[0]
        home: Home
        if ops.get(op.op).is_accumulator:
            n = -(-v.type.numel // T)
            home = "acc_regs" if n <= ACC_REGS_MAX or acc_row_reduction(op, a) else "acc_smem"
        else:
            # A scaled mma operand is read from its tile's fragments (layout.mma_plans).
            home = "inline" if _scaled(v.name, a, tiles, k) or inlinable(v.name, a) else "smem"
        tiles[v.name] = TileDraft(v.name, v.type, a.phases[v.name], home)
        if home == "smem" and k.ldmatrix != 0 and packed(v.name, a):
            tile = tiles[v.name]
            tile.pitch, tile.vec = pitch_of(v.type, k.pad == 1), VEC_BYTES // v.type.dtype.nbytes
            tile.owner = (f"{v.type.dtype.name.lower()} tile for ldmatrix, row pitch "
                          f"{tile.pitch}; element e written by thread e % {T}")
    return tiles


def shifted_pitch(t: TensorType, pad: bool) -> int:
    """Elements per shared-memory row of a shifted join's tile: the pitch of a row one
    chunk longer (the row starts anywhere in its first chunk)."""
    chunk = VEC_BYTES // t.dtype.nbytes
    return pitch_of(TensorType(t.shape[:-1] + (t.shape[-1] + chunk,), t.dtype), pad)


def _scaled(name: str, a: Analysis, tiles: Mapping[str, TileDraft], k: Knobs) -> bool:
    """Whether ``name`` is a scaled mma operand (:func:`blockfacts.scaled_operand`)
    whose tile and vector are both staged, the tile in rows ``ldmatrix`` can read."""
    pair = scaled_operand(name, a) if k.ldmatrix != 0 else None
    if pair is None:
        return False
    tile, vec = tiles[pair[0]], tiles[pair[1]]
    return tile.home == "smem" and tile.vec > 1 and tile.pitch > 0 and vec.home == "smem"


def inlinable(name: str, a: Analysis) -> bool:
    """Whether computed tensor ``name`` is computed where it is read (registers), not
    in a pass of its own into a shared-memory tile."""
    users = a.uses[name]
    if len(users) != 1:
        return False
    user = users[0]
    if user is None:
        return True
    if ops.get(user.op).is_accumulator:
        return a.phases[name] == "loop"
    if too_few_results(name, a):
        return False
    # An invariant element-wise value read only after the loop is computed where it is
    # read: its operands (tiles copied once, or global memory) are still there, and it
    # then needs no pass over its elements before the loop and no shared-memory tile. A
    # reduction keeps its pass: computed where read, each result is a serial fold by
    # one thread (mha_decode's spread maximum max(V) at batch 1: 128 folds of 512 by 16
    # threads after the loop, 81 us against 43).
    phase, read_in = a.phases[name], a.phases[user.outputs[0].name]
    late = (phase, read_in) == ("invariant", "epilogue") and _elementwise(name, a)
    return (phase == read_in or late) and reads_once(user, a.types[name], a.types)


def _elementwise(name: str, a: Analysis) -> bool:
    """Whether computing an element of ``name`` where it is read reads only a few
    elements: an element-wise operator whose operands are inputs, tiles of their own
    (a matmul's result) or such element-wise values, not a reduction computed where
    it is read."""
    op = a.producer.get(name)
    if op is None or ops.get(op.op).cuda.kind != "elementwise":
        return False
    return all(_read_cheaply(i, a) for i in op.inputs)


def _read_cheaply(name: str, a: Analysis) -> bool:
    """Whether an element of operand ``name`` is an input, an element of a tile of its
    own, or an element-wise value of such (see :func:`_elementwise`)."""
    op = a.producer.get(name)
    if op is None:
        return True
    kind = ops.get(op.op).cuda.kind
    if kind == "elementwise":
        return _elementwise(name, a)
    return kind not in ("reduce", "rms", "sum_to", "softmax") or not inlinable(name, a)


def too_few_results(name: str, a: Analysis) -> bool:
    """A reduction in the loop with fewer results than threads, each over a long row, is
    spread over lanes (``row_reduction``, ``lanes_per_result``) only into a shared-memory
    tile: computed where read, each of its few results would be folded by one thread
    while the others wait at the next barrier (qknorm_gqa's key norms: 64 threads of
    512, each a 64-long serial fold, every iteration). Before the loop likewise (the
    pass over an invariant reduction's results is a serial fold per element: mha_decode's
    spread maximum at batch 1); after the loop it keeps its form (not measured there)."""
    op = a.producer.get(name)
    return (op is not None and a.phases[name] in ("loop", "invariant")
            and a.types[name].numel < a.bg.threads and row_reduction(op, a, a.bg.threads))
