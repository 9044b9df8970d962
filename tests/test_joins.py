"""Concatenations read in their parts (codegen/joins.py): which are joined, what the
planner, the lowering, the launch levels and the cost model make of them. On a GPU,
``codegen_cases.joined_concats`` is checked against the reference by
test_codegen_gpu."""

from __future__ import annotations

import numpy as np
from codegen_cases import joined_beside_bulk, joined_concats, shifted_key_join

from mirage_cli.builder import GraphBuilder
from mirage_cli.codegen.aliasing import launched
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.grouping import levels
from mirage_cli.codegen.joins import Join, candidate, joined_ops, joins
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.planner import plan_kernel
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.search.cost import NOT_LAUNCHED, kernel_costs


def _names(g: Graph) -> list[str]:
    return [op.outputs[0].name for op in g.ops]


def test_whole_chunk_parts_are_joined_and_a_misaligned_one_is_not() -> None:
    g = joined_concats()
    q, kk, v0, v, c = (_names(g)[i] for i in (0, 1, 2, 3, 4))
    found = joins(g)
    assert found == {
        q: Join(("QA", "QB"), 2 * 16 * 32, 16 * 32),      # along the batch
        kk: Join(("KC", "KN"), 128, 120),                 # along the last dimension
        v: Join(("VC", v0), 128 * 16, 127 * 16),          # one row appended
    }
    # 127 + 1 columns: its chunks would straddle the parts, and the first part's 254
    # elements are not whole chunks either (a row's covering chunks could read past it).
    assert candidate(g.ops[4], g.tensor_types()) is None
    assert c not in found
    assert joined_ops(g, found) == {0, 1, 3}
    assert launched(g) == 3  # the exp, the bias's copy and the custom kernel


def test_a_join_reads_every_element_where_the_concatenation_has_it() -> None:
    """``mg_join``'s arithmetic (the prelude), element by element, against numpy."""
    g = joined_concats()
    types = g.tensor_types()
    for name, j in joins(g).items():
        a, b = (np.arange(types[p].numel).reshape(types[p].shape) for p in j.parts)
        dim = next(int(dict(op.attrs)["dim"]) for op in g.ops if op.outputs[0].name == name)
        want = np.concatenate([a * 2, b * 2 + 1], axis=dim).reshape(-1)  # part, index
        for o, w in enumerate(want):
            q, r = divmod(o, j.period)
            got = 2 * (q * j.head + r) if r < j.head else \
                2 * (q * (j.period - j.head) + r - j.head) + 1
            assert got == w, (name, o)


def _concat_read_by(reader: str, output: bool = False) -> Graph:
    b = GraphBuilder("one_concat")
    x = b.input("X", (2, 64), "f16")
    y = b.input("Y", (2, 64), "f16")
    c = b.op("concat", x, y, dim=0, out="C" if output else None)
    if reader == "custom":
        k = b.custom((2, 1, 1), 128, 1)
        e = k.op("exp", k.load(c, (0, None, None)))
        (z,) = k.finish([(k.op("acc_sum", e), "Z", (0, None, None))])
    else:
        z = b.op("exp", c, out="Z")
    b.output(z)
    if output:
        b.output(c)
    return b.build()


def test_only_a_concatenation_read_by_custom_kernels_alone_is_joined() -> None:
    assert len(joins(_concat_read_by("custom"))) == 1
    assert not joins(_concat_read_by("exp"))                  # a pre-defined reader
    assert not joins(_concat_read_by("custom", output=True))  # the caller's buffer


def test_a_reader_that_cannot_stage_it_keeps_the_copy() -> None:
    """Read once, element by element, the tile is not staged: joined, it must be, and
    512 KB does not fit shared memory, so the concatenation stays a copy."""
    b = GraphBuilder("too_big")
    x = b.input("X", (64, 2048), "f16")
    y = b.input("Y", (64, 2048), "f16")
    c = b.op("concat", x, y, dim=1)
    k = b.custom((1, 1, 1), 128, 1)
    e = k.op("exp", k.load(c, (None, None, None)))
    (z,) = k.finish([(k.op("acc_sum", e), "Z", (None, None, None))])
    b.output(z)
    g = b.build()
    assert not joins(g)
    assert launched(g) == 2


def test_a_joined_tile_is_staged_by_cp_async_never_by_bulk_copies() -> None:
    g = joined_concats()
    kop = g.ops[-1]
    assert kop.block is not None
    types = g.tensor_types()
    v = _names(g)[3]
    vt = next(bi.value.name for bi in kop.block.inputs if bi.source == v)
    alone = {t.name: t for t in plan_kernel(kop.block, types, "sm_90", Knobs(tma=1)).tiles}
    joined = {t.name: t for t in plan_kernel(kop.block, types, "sm_90", Knobs(tma=1),
                                             joined=frozenset(joins(g))).tiles}
    assert alone[vt].swizzle  # by bulk copies when it is a tensor of its own
    assert not joined[vt].swizzle and joined[vt].pitch and joined[vt].home == "smem"
    assert "part of the concatenation" in joined[vt].owner


def test_a_key_cache_of_odd_rows_is_joined_shifted_and_gathered() -> None:
    g = shifted_key_join()
    ka = _names(g)[1]
    found = joins(g)
    assert found == {ka: Join(("KC", _names(g)[0]), 256, 255, 8)}
    kop = g.ops[-1]
    assert kop.block is not None
    by_source = {bi.source: bi.value.name for bi in kop.block.inputs}
    plan = plan_kernel(kop.block, g.tensor_types(), "sm_90", joined=frozenset(found),
                       shifted=frozenset(found))
    tile = {t.name: t for t in plan.tiles}[by_source[ka]]
    # 64 columns and the chunk its row starts in: 9 chunks, odd already.
    assert tile.home == "smem" and not tile.swizzle and tile.pitch == 72
    assert "rows at their own shifts" in tile.owner
    first = kop.block.ops[0].outputs[0].name
    assert [(m.output, m.b_path) for m in plan.mmas if m.b_path == "gather"] == [
        (first, "gather")]
    assert [i for i, c in enumerate(kernel_costs(g)) if c == NOT_LAUNCHED] == [1]


def test_a_chain_that_gathers_its_key_operand_gets_four_times_the_warps() -> None:
    # 1024 keys: tiles of 256 columns, which eight warps share; 256 keys: tiles of 64,
    # for which 256 threads are not legal, and the planner takes twice the warps.
    for keys, threads in ((1024, 256), (256, 128)):
        g = shifted_key_join(keys)
        found = frozenset(joins(g))
        kop = g.ops[-1]
        assert kop.block is not None
        types = g.tensor_types()
        copied = plan_kernel(kop.block, types, "sm_90")  # the keys a tensor of their own
        assert copied.threads == 64
        assert {m.b_path for m in copied.mmas} == {"ldmatrix.trans"}
        gathers = plan_kernel(kop.block, types, "sm_90", joined=found, shifted=found)
        assert gathers.threads == gathers.knobs.threads == threads, keys
        assert {(m.b_path, m.kwarps) for m in gathers.mmas} == {
            ("gather", threads // 32), ("ldmatrix.trans", threads // 32)}
        # Pinned threads are the user's: kept.
        pinned = plan_kernel(kop.block, types, "sm_90", Knobs(threads=64), found, found)
        assert pinned.threads == 64 and "gather" in {m.b_path for m in pinned.mmas}


def test_a_shifted_tile_is_copied_by_covering_chunks_and_read_at_its_shifts() -> None:
    prog = lower(shifted_key_join())
    assert len(prog.kernels) == 2  # the exp and the chain: no copy
    cu, _ = emit(prog)
    # the ring's 3 first stages and the loop's: each row's 8 chunks and one more
    assert cu.count("mg_cp_shifted<256, 255, 8>(") == 4
    assert cu.count(" < 576; ") == 4
    assert cu.count("mg_shifted16<256, 255, 8>(") > 0
    assert "mg_ldsm_x4_t" in cu  # the values: ldmatrix, as before


def test_a_shifted_join_needs_a_chain_reading_it_as_its_key_operand() -> None:
    from mirage_cli.codegen.planner import plan_kernel as plan
    from mirage_cli.diagnostics import MirageError

    g = joined_concats()
    kop = g.ops[-1]
    assert kop.block is not None
    c = _names(g)[4]
    try:
        plan(kop.block, g.tensor_types(), "sm_90", joined=frozenset({c}),
             shifted=frozenset({c}))
    except MirageError as e:
        assert "only as a matmul chain's key operand" in e.message
    else:
        raise AssertionError("a shifted tile added element by element was planned")


def test_a_reader_that_refuses_a_shifted_join_keeps_its_other_joins() -> None:
    # A bias of 255 + 1 columns (a shifted join's candidate) added to the scores
    # element by element: the chain cannot gather it, but still reads its values joined.
    b = GraphBuilder("shifted_bias")
    q, kk = b.input("Q", (8, 16, 64), "f16"), b.input("K", (8, 64, 256), "f16")
    v = b.op("concat", b.input("VC", (8, 255, 64), "f16"), b.input("V0", (8, 1, 64), "f16"),
             dim=1)
    c = b.op("concat", b.input("CA", (8, 1, 255), "f16"), b.input("CB", (8, 1, 1), "f16"),
             dim=2)
    k = b.custom((8, 1, 1), 64, 4)
    qt, kt = k.load(q, (0, None, None)), k.load(kk, (0, None, None), 2)
    vt, ct = k.load(v, (0, None, None), 1), k.load(c, (0, None, None), 2)
    x = k.op("add", k.op("matmul", qt, kt), ct)
    e = k.op("exp", k.op("sub", x, k.op("acc_max_ld", x)))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, None, None))])
    b.output(r)
    g = b.build()
    assert candidate(g.ops[1], g.tensor_types()) == Join(("CA", "CB"), 256, 255, 8)
    assert set(joins(g)) == {v}


def test_a_chains_other_loop_inputs_still_come_by_bulk_copies() -> None:
    g = joined_beside_bulk()
    kop = g.ops[-1]
    assert kop.block is not None
    found = frozenset(joins(g))
    assert found == {_names(g)[1]}
    by_source = {bi.source: bi.value.name for bi in kop.block.inputs}
    plan = plan_kernel(kop.block, g.tensor_types(), "sm_90", joined=found)
    tiles = {t.name: t for t in plan.tiles}
    assert plan.knobs.tma == 1
    assert tiles[by_source["K"]].swizzle          # a tensor of its own: bulk copies
    assert not tiles[by_source[_names(g)[1]]].swizzle  # the joined values: cp.async


def test_the_lowering_launches_no_copy_and_passes_the_parts() -> None:
    g = joined_concats()
    names = _names(g)
    prog = lower(g)
    assert prog.launch_ops == ((2, 4), (5,))  # the exp and the bias's copy, then the kernel
    assert {t.name for t in prog.temps} == {names[2], names[4]}  # no buffer for a join
    custom = prog.kernels[-1]
    assert [p.arg for p in custom.params] == ["QA", "QB", "KC", "KN", "VC", names[2],
                                              names[4], "O"]
    cu, _ = emit(prog)
    assert cu.count("mg_join<1024, 512>(") == 1              # the queries: once
    assert cu.count("mg_join<128, 120>(") == cu.count("mg_join<2048, 2032>(") == 4  # 3 + loop


def test_a_joined_concatenations_readers_follow_both_parts_writers() -> None:
    g = joined_concats()
    free = joined_ops(g, joins(g))
    # the exp writes the values' new row: the custom kernel (op 5) reads it in place
    assert levels(g, free) == {2: 0, 4: 0, 5: 1}


def test_the_model_prices_no_copy() -> None:
    g = joined_concats()
    costs = kernel_costs(g)
    assert [i for i, c in enumerate(costs) if c == NOT_LAUNCHED] == [0, 1, 3]
    assert costs[4].launched and costs[5].launched


def test_the_plan_attached_is_the_one_the_code_is_generated_from() -> None:
    """``mirage plan`` / ``opt`` attach plans made with the joins, as the lowering
    makes them: the values' tile staged by cp.async even with bulk copies pinned."""
    from mirage_cli.commands.plan import planned

    g = planned(joined_concats(), "sm_90", [Knobs(tma=1)])
    kop = g.ops[-1]
    assert kop.block is not None and kop.plan is not None
    v = _names(g)[3]
    vt = next(bi.value.name for bi in kop.block.inputs if bi.source == v)
    tile = next(t for t in kop.plan.tiles if t.name == vt)
    assert not tile.swizzle and "part of the concatenation" in tile.owner
    assert lower(g).kernels[-1].plan == kop.plan.as_json()
